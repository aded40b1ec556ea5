"""Pure scoring of a fitted ``Detector``: jittable, vmappable and differentiable.

``dpmm_jax.score`` and friends validate on the host (numpy conversions, NaN checks,
chunking) and so cannot be traced by ``jax.jit``. The functions here are the same
computation without the host-side layer: JAX arrays in, JAX arrays out, no Python
control flow on values. Use them inside your own JAX code::

    det = dpmm_jax.fit_detector(X, y, model="full")          # host side, validated
    f = jax.jit(dpmm_jax.functional.score)
    s = f(det, X_test)                                        # (M,)
    s1 = jax.vmap(dpmm_jax.functional.score, (None, 0))(det, X_test)   # per point
    g = jax.grad(lambda x: dpmm_jax.functional.score(det, x))(x0)       # (D,) d score / dx

``x`` may be one point ``(D,)`` or a batch ``(M, D)`` in the detector's input space
(before the preprocessing, which is applied here). Nothing is checked: a wrong feature
dimension fails at trace time with a shape error, and NaN inputs give NaN outputs.
Validate at the boundary with ``dpmm_jax.score`` when the inputs are untrusted.
Scores are those of ``dpmm_jax.score`` / ``class_scores`` (same numbers up to float
rounding; for the coupled model the exact sum over the quadrature nodes replaces the
adaptive series expansion, whose value-dependent loop cannot be differentiated in
reverse mode, so it costs up to P times more here. Until 2026-12-06 the coupled model
here used the fixed grids for every point, which is off by up to hundreds of nats for
points far from a class, where ``dpmm_jax.score`` uses a per-point integral; it now takes
that path too).
"""
from typing import Tuple

import jax
import jax.numpy as jnp

from dpmm_jax import api
from dpmm_jax import preprocess as preprocess_lib
from dpmm_jax import scores as scores_lib
from dpmm_jax.models import coupled

__all__ = ["evaluate", "score", "class_scores", "outlier_probability"]


def evaluate(det: "api.Detector", x) -> Tuple[jax.Array, jax.Array]:
  """(class scores, OOD score) of ``x``.

  Args:
    det: a fitted ``dpmm_jax.Detector`` (a pytree: pass it through ``jax.jit``).
    x: ``(D,)`` or ``(M, D)`` features in the input space of the detector.

  Returns:
    ``(class_scores, score)`` of shapes ``(K,)`` and ``()`` for one point, ``(M, K)``
    and ``(M,)`` for a batch. Higher score = more in-distribution.
  """
  x = jnp.asarray(x)
  single = x.ndim == 1
  xb = x[None] if single else x
  if det.transform is not None:
    xb = preprocess_lib.apply(det.transform, xb)
  if det.model == "coupled":
    # The adaptive series of coupled.log_predictive runs a loop whose trip count depends
    # on the parameters, which reverse-mode differentiation cannot go through; the exact
    # sum over the quadrature nodes gives the same density and differentiates. Points
    # that tilt a class off its grid take the per-point path, as in dpmm_jax.score.
    p = det.params
    class_lp, prior_lp = coupled.log_predictive(p, xb, differentiable=True)
    class_scores_ = p.log_counts + class_lp
    score_ = jax.nn.logsumexp(class_scores_, -1) - prior_lp
  else:
    class_scores_, score_ = api._class_and_score(det, xb)  # pylint: disable=protected-access
  if single:
    return class_scores_[0], score_[0]
  return class_scores_, score_


def score(det: "api.Detector", x) -> jax.Array:
  """OOD score, shape ``()`` for ``x`` of shape ``(D,)``, ``(M,)`` for ``(M, D)``."""
  return evaluate(det, x)[1]


def class_scores(det: "api.Detector", x) -> jax.Array:
  """Per-class scores, shape ``(K,)`` or ``(M, K)`` (see ``dpmm_jax.class_scores``)."""
  return evaluate(det, x)[0]


def outlier_probability(det: "api.Detector", x, alpha=1.0) -> jax.Array:
  """``p(y = K+1 | x)`` under the DPMM with concentration ``alpha`` (DPMM models only).

  Raises:
    ValueError: if ``det`` is not a DPMM model (checked on the static model name, so it
      is raised at trace time).
  """
  if det.model not in api.DPMM_MODELS:
    raise ValueError(f"outlier_probability needs a DPMM model {api.DPMM_MODELS}, "
                     f"got {det.model!r}.")
  return scores_lib.outlier_probability(score(det, x), alpha)
