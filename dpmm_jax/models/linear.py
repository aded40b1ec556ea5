"""Linear softmax head for the MSP / temperature-scaled MSP baselines.

Section 6.2 of the paper compares the hierarchical DPMMs against the maximum
softmax probability (MSP) score and its temperature-scaled variant with
``T = 1000``, both computed from *a single linear layer trained with gradient
descent and a supervised cross-entropy loss* on the (already preprocessed)
embeddings. This module provides exactly that head:

* :func:`fit` -- multinomial logistic regression trained with ``optax.adamw``
  inside a ``jax.lax.scan`` (full batch, or minibatches drawn with the key).
* :func:`logits`, :func:`predict` -- the linear map and its argmax.
* :func:`log_msp_score`, :func:`msp_score` -- the (log) maximum softmax
  probability of ``logits / T``; higher means more in-distribution.

Numerics of the MSP score
-------------------------
The max softmax probability of ``z = logits / T`` is
``p_max = 1 / sum_k exp(d_k)`` with ``d_k = (logit_k - max_logit) / T <= 0``.
We compute ``log p_max = -log1p(sum_{k != argmax} exp(d_k))``:

* the offsets ``logit_k - max_logit`` are formed *before* dividing by ``T``,
  so a large common offset in the logits costs no precision;
* for confident points (``p_max`` close to 1, e.g. ``T = 1`` on separable
  data, or very large logits even at ``T = 1000``) the sum over the other
  classes is tiny and ``log1p`` returns it with full relative precision, while
  ``p_max`` itself rounds to exactly ``1.0`` in float32 once
  ``1 - p_max < 2**-25`` -- the naive probability then collapses all such
  points into ties, the log score does not;
* for ``T = 1000`` all probabilities are ``~1/K`` and the log score is
  ``~-log K`` with float32 resolution ``~ulp(log K)`` (a few ``1e-7``); the
  ranking is preserved as long as logit spreads differ by more than
  ``~T * 1e-7`` between points, which holds for any realistic head.

Detectors should therefore rank by :func:`log_msp_score` (monotone in
:func:`msp_score`, so AUROC is unchanged); :func:`msp_score` is only its
``exp``, provided for reporting.
"""
from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmm_jax import compiler
from dpmm_jax import precision

__all__ = [
    "LinearHeadParams",
    "LinearFitInfo",
    "fit",
    "logits",
    "predict",
    "log_max_softmax",
    "log_msp_score",
    "msp_score",
]


class LinearHeadParams(NamedTuple):
    """Parameters of the linear head ``logits = x @ weights + bias``.

    Attributes:
      weights: ``(D, K)`` weight matrix.
      bias: ``(K,)`` bias vector.
    """

    weights: jax.Array
    bias: jax.Array


class LinearFitInfo(NamedTuple):
    """Diagnostics returned by :func:`fit`.

    Attributes:
      loss_trace: ``(num_steps,)`` mean cross-entropy of the batch used at each
        step, evaluated *before* that step's update (the full training set when
        ``batch_size`` is None). Weight decay is decoupled (AdamW) and is not
        part of this loss.
      final_loss: scalar mean cross-entropy of the final parameters on the full
        training set.
      train_accuracy: scalar fraction of training points whose argmax logit is
        the true label, under the final parameters.
    """

    loss_trace: jax.Array
    final_loss: jax.Array
    train_accuracy: jax.Array


# ----------------------------------------------------------------------------
# validation helpers (eager; they skip only what is unknowable under tracing)
# ----------------------------------------------------------------------------

def _check_static_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a Python int, got {value!r} "
                         f"(type {type(value).__name__}); it is a static argument.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return operator.index(value)


def _check_scalar(name: str, value, *, positive: bool) -> None:
    """Checks a (possibly traced) float hyperparameter when it is concrete."""
    if compiler.is_traced(value):
        return
    arr = np.asarray(value)
    if arr.ndim != 0:
        raise ValueError(f"{name} must be a scalar, got shape {arr.shape}.")
    v = float(arr)
    if not np.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}.")
    if positive and v <= 0:
        raise ValueError(f"{name} must be > 0, got {v}.")
    if not positive and v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}.")


def _as_float_array(x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    return x


def _validate_fit_inputs(x, y, num_classes, num_steps, batch_size,
                         learning_rate, weight_decay):
    num_classes = _check_static_int("num_classes", num_classes, 2)
    num_steps = _check_static_int("num_steps", num_steps, 1)
    if batch_size is not None:
        batch_size = _check_static_int("batch_size", batch_size, 1)
    _check_scalar("learning_rate", learning_rate, positive=True)
    _check_scalar("weight_decay", weight_decay, positive=False)

    x_shape, y_shape = jnp.shape(x), jnp.shape(y)
    if len(x_shape) != 2:
        raise ValueError(f"x must be 2-D with shape (N, D), got ndim={len(x_shape)} "
                         f"(shape {x_shape}).")
    if len(y_shape) != 1:
        raise ValueError(f"y must be 1-D with shape (N,), got ndim={len(y_shape)} "
                         f"(shape {y_shape}).")
    n, d = x_shape
    if y_shape[0] != n:
        raise ValueError(f"x and y disagree on the number of points: x has {n} rows, "
                         f"y has {y_shape[0]} labels.")
    if n < 1 or d < 1:
        raise ValueError(f"x must have at least one point and one feature, got shape "
                         f"{x_shape}.")
    y_dtype = jnp.result_type(y)
    if y_dtype == jnp.bool_ or not jnp.issubdtype(y_dtype, jnp.integer):
        raise ValueError(f"y must hold integer class labels, got dtype {y_dtype}.")

    if not compiler.is_traced(y):
        y_np = np.asarray(y)
        lo, hi = int(y_np.min()), int(y_np.max())
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"labels must lie in [0, num_classes={num_classes}), got "
                             f"labels in [{lo}, {hi}].")
    if not compiler.is_traced(x):
        x_np = np.asarray(x)
        if jnp.issubdtype(x_np.dtype, jnp.floating) and not np.all(np.isfinite(x_np)):
            raise ValueError("x contains non-finite values (nan or inf).")
    return num_classes, num_steps, batch_size


# ----------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------

@precision.float32_matmuls
def _mean_ce(params: LinearHeadParams, x: jax.Array, y: jax.Array) -> jax.Array:
    z = x @ params.weights + params.bias
    return optax.softmax_cross_entropy_with_integer_labels(z, y).mean()


@functools.partial(jax.jit, static_argnames=("num_classes", "num_steps", "batch_size"))
@precision.float32_matmuls
def _fit_impl(x, y, key, learning_rate, weight_decay, *, num_classes, num_steps,
              batch_size):
    n, d = x.shape
    dtype = x.dtype
    y = y.astype(jnp.int32)
    # Zero init: the objective is convex, so no symmetry breaking is needed and
    # the result is independent of the key in the full-batch case.
    params = LinearHeadParams(weights=jnp.zeros((d, num_classes), dtype),
                              bias=jnp.zeros((num_classes,), dtype))
    # Decoupled weight decay on the weights only (the bias is not shrunk).
    optimizer = optax.adamw(learning_rate=learning_rate, weight_decay=weight_decay,
                            mask=LinearHeadParams(weights=True, bias=False))
    opt_state = optimizer.init(params)
    loss_and_grad = jax.value_and_grad(_mean_ce)

    def step(carry, step_key):
        params, opt_state = carry
        if batch_size is None:
            xb, yb = x, y
        else:
            # Sampling with replacement: O(batch_size) per step, valid for any
            # batch_size (even > N), no O(N) permutation per step.
            idx = jax.random.randint(step_key, (batch_size,), 0, n)
            xb, yb = x[idx], y[idx]
        loss, grads = loss_and_grad(params, xb, yb)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), loss

    if batch_size is None:
        xs = None
    else:
        xs = jax.random.split(key, num_steps)
    (params, _), loss_trace = jax.lax.scan(step, (params, opt_state), xs,
                                           length=num_steps)

    z = x @ params.weights + params.bias
    final_loss = optax.softmax_cross_entropy_with_integer_labels(z, y).mean()
    train_accuracy = jnp.mean(jnp.argmax(z, axis=-1) == y)
    info = LinearFitInfo(loss_trace=loss_trace, final_loss=final_loss,
                         train_accuracy=train_accuracy)
    return params, info


def fit(x, y, num_classes: int, *, key, num_steps: int = 500,
        learning_rate: float = 1e-2, weight_decay: float = 1e-4,
        batch_size: int | None = None) -> tuple[LinearHeadParams, LinearFitInfo]:
    """Trains a linear softmax classifier (multinomial logistic regression).

    Minimises the mean cross-entropy of ``x @ W + b`` against ``y`` with
    ``optax.adamw`` (decoupled weight decay applied to ``W`` only) for
    ``num_steps`` steps inside a ``jax.lax.scan``. Parameters start at zero.
    Nothing is standardised here: the caller is expected to preprocess ``x``.

    The function is jittable with
    ``jax.jit(fit, static_argnames=("num_classes", "num_steps", "batch_size"))``;
    input validation runs eagerly (shape/dtype checks always, value checks such
    as the label range whenever the inputs are concrete) and raises
    ``ValueError`` naming the problem.

    Args:
      x: ``(N, D)`` float features.
      y: ``(N,)`` integer labels in ``[0, num_classes)``.
      num_classes: number of classes ``K >= 2`` (static).
      key: PRNG key; used only to draw minibatches when ``batch_size`` is set.
      num_steps: number of optimiser steps (static).
      learning_rate: Adam step size.
      weight_decay: AdamW decoupled weight-decay coefficient (per-step shrink
        factor is ``learning_rate * weight_decay``).
      batch_size: None for full-batch gradient descent, otherwise the size of
        the minibatch drawn (with replacement) from the training set at every
        step (static).

    Returns:
      ``(params, info)`` -- the trained :class:`LinearHeadParams` and a
      :class:`LinearFitInfo`.
    """
    num_classes, num_steps, batch_size = _validate_fit_inputs(
        x, y, num_classes, num_steps, batch_size, learning_rate, weight_decay)
    x = _as_float_array(x)
    y = jnp.asarray(y)
    lr = jnp.asarray(learning_rate, x.dtype)
    wd = jnp.asarray(weight_decay, x.dtype)
    return _fit_impl(x, y, key, lr, wd, num_classes=num_classes,
                     num_steps=num_steps, batch_size=batch_size)


# ----------------------------------------------------------------------------
# inference
# ----------------------------------------------------------------------------

def _check_features(params: LinearHeadParams, x) -> jax.Array:
    x = _as_float_array(x)
    d = params.weights.shape[0]
    if x.ndim < 1 or x.shape[-1] != d:
        raise ValueError(f"x must have shape (M, {d}) to match the head's weights "
                         f"{params.weights.shape}, got shape {x.shape}.")
    return x


@precision.float32_matmuls
def logits(params: LinearHeadParams, x) -> jax.Array:
    """Returns the ``(M, K)`` logits ``x @ weights + bias`` for ``x`` of shape ``(M, D)``."""
    x = _check_features(params, x)
    return x @ params.weights + params.bias


def predict(params: LinearHeadParams, x) -> jax.Array:
    """Returns the ``(M,)`` argmax class of the logits."""
    return jnp.argmax(logits(params, x), axis=-1)


@jax.jit
def _log_max_softmax_impl(z: jax.Array, temperature: jax.Array) -> jax.Array:
    k = z.shape[-1]
    idx = jnp.argmax(z, axis=-1)
    z_max = jnp.take_along_axis(z, idx[..., None], axis=-1)
    # Offsets before dividing by T: exact-ish even for large common offsets.
    d = (z - z_max) / temperature
    is_max = jnp.arange(k) == idx[..., None]
    # Sum over the non-argmax classes only; log p_max = -log1p(that sum).
    others = jnp.sum(jnp.where(is_max, 0.0, jnp.exp(d)), axis=-1)
    return -jnp.log1p(others)


def log_max_softmax(z, temperature=1.0) -> jax.Array:
    """``max_k z_k / T - logsumexp(z / T)`` over the last axis, computed stably.

    Equal to ``-log1p(sum_{k != argmax} exp((z_k - z_max) / T))``; see the module
    docstring for why this form keeps the ranking of points in float32.

    Args:
      z: ``(..., K)`` logits.
      temperature: positive scalar ``T``.

    Returns:
      ``(...)`` log max-softmax probabilities (all ``<= 0``).
    """
    z = _as_float_array(z)
    if z.ndim < 1 or z.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty last axis, got shape {z.shape}.")
    _check_scalar("temperature", temperature, positive=True)
    return _log_max_softmax_impl(z, jnp.asarray(temperature, z.dtype))


def log_msp_score(params: LinearHeadParams, x, temperature=1.0) -> jax.Array:
    """Log maximum softmax probability of ``logits(params, x) / temperature``.

    ``max_k logit_k / T - logsumexp(logit / T)``, shape ``(M,)``; higher means
    more in-distribution. Use this (not :func:`msp_score`) for ranking: at
    ``T = 1000`` the probabilities are all ``~1/K`` and for confident points at
    small ``T`` they round to exactly 1 in float32, whereas the log form keeps
    the points distinguishable (see module docstring).
    """
    return log_max_softmax(logits(params, x), temperature)


def msp_score(params: LinearHeadParams, x, temperature=1.0) -> jax.Array:
    """Maximum softmax probability of ``logits / temperature``, shape ``(M,)``.

    This is ``exp(log_msp_score(...))``; it can tie in float32 where the log
    score does not, so prefer :func:`log_msp_score` for ranking / AUROC.
    """
    return jnp.exp(log_msp_score(params, x, temperature))
