"""From predictive log densities to the DPMM score, outlier probability and predictions.

Under a DPMM (paper, eq. 1) a new point joins class k with weight ``N_k p(x | D_k)`` and a
new class with weight ``alpha p(x)``. The DPMM score is

    C~(x) = logsumexp_k [log N_k + log p(x | D_k)] - log p(x),

higher = more in-distribution, and ``p(y = K+1 | x) = sigmoid(log alpha - C~(x))``.
"""
import jax
import jax.numpy as jnp


def dpmm_score(log_counts, class_log_pred, prior_log_pred):
  """C~(x).

  Args:
    log_counts: (K,) log N_k.
    class_log_pred: (M, K) log p(x | D_k).
    prior_log_pred: (M,) log p(x).
  Returns:
    (M,) DPMM score.
  """
  return jax.nn.logsumexp(log_counts + class_log_pred, axis=-1) - prior_log_pred


def outlier_probability(score, alpha):
  """p(y = K+1 | x) = sigmoid(log alpha - C~(x)) for concentration alpha > 0."""
  return jax.nn.sigmoid(jnp.log(alpha) - score)


def label_probabilities(log_counts, class_log_pred, prior_log_pred, alpha):
  """(M, K+1) posterior over the K known classes and a new class (last column). A row
  whose prior density is +inf (coupled model, ``prior_density_is_infinite``) is certain
  to be new: (0, ..., 0, 1)."""
  logits = jnp.concatenate([log_counts + class_log_pred,
                            (jnp.log(alpha) + prior_log_pred)[:, None]], axis=-1)
  certain = jnp.isposinf(logits)
  return jnp.where(jnp.any(certain, -1, keepdims=True), certain.astype(logits.dtype),
                   jax.nn.softmax(jnp.where(certain, 0.0, logits), axis=-1))


def predict(log_counts, class_log_pred):
  """(M,) most probable known class, argmax_k [log N_k + log p(x | D_k)]."""
  return jnp.argmax(log_counts + class_log_pred, axis=-1)
