"""Generalized Newton maximiser for concentration parameters (Minka, 2000).

Around the current point the objective is matched (value, slope, curvature) by
``g(x) = k + a log x + b x`` with ``a = -x^2 L''`` and ``b = L' - a/x``; when ``a > 0``
and ``b < 0`` its maximiser ``x* = -a/b`` is the next iterate. Otherwise the local model
is useless and we step geometrically in the direction of the slope. The variable is
shifted, ``x = theta - offset``, so that a lower limit of the parameter becomes zero
(for the NIW ``nu0 > D + 1`` we use offset ``D + 1``, which also lets ``a log x`` capture
the ``log(nu0 - D - 1)`` singularity). Iterates are clipped to ``[lower, upper]``; an
upper-bound hit with positive slope means the optimum is at infinity (tied covariances)
and is reported, not looped on. Vectorised: every element is maximised independently.
"""
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

# Largest multiplicative change per iteration (guards against a poor local model).
_MAX_RATIO = 16.0
# A step below this relative size that reverses the previous step ends the iteration.
_BOUNCE_RTOL = 1e-4


class NewtonInfo(NamedTuple):
  """num_iters: iterations run; converged: (...,) per element; at_upper: (...,) optimum
  lies at or beyond the upper cap (slope still positive there)."""
  num_iters: jax.Array
  converged: jax.Array
  at_upper: jax.Array


def maximize(derivatives: Callable, theta0, *, offset=0.0, lower=1e-3, upper=1e6,
             tol=1e-6, max_iter: int = 100):
  """Maximises a concave-ish objective elementwise.

  Args:
    derivatives: theta -> (L'(theta), L''(theta)), arrays shaped like theta.
    theta0: initial values (...,).
    offset: theta = offset + x with x > 0.
    lower, upper: bounds on x = theta - offset.
    tol: relative change in x that counts as converged.
    max_iter: iteration cap.
  Returns:
    (theta (...,), NewtonInfo).
  """
  theta0 = jnp.asarray(theta0)
  x0 = jnp.clip(theta0 - offset, lower, upper)

  def body(carry):
    x, done, at_upper, it, last_step = carry
    grad, hess = derivatives(x + offset)
    a = -x * x * hess
    b = grad - a / x
    valid = (a > 0) & (b < 0)
    proposal = jnp.where(valid, -a / jnp.where(valid, b, -1.0),
                         jnp.where(grad > 0, _MAX_RATIO * x, x / _MAX_RATIO))
    proposal = jnp.clip(proposal, x / _MAX_RATIO, x * _MAX_RATIO)
    proposal = jnp.clip(proposal, lower, upper)
    pinned_up = (x >= upper) & (grad > 0)
    pinned_down = (x <= lower) & (grad < 0)
    step = proposal - x
    small = jnp.abs(step) <= tol * x
    # Bouncing: a small step that reverses the previous one. The slope is then rounding
    # noise (in float32 ~1e-7 of its terms, which moves nu0 by a few 1e-6 relative, more
    # than tol), and x is as good as the arithmetic allows.
    bounce = (step * last_step < 0) & (jnp.abs(step) <= _BOUNCE_RTOL * x)
    new_x = jnp.where(done, x, proposal)
    new_done = done | small | bounce | pinned_up | pinned_down
    return (new_x, new_done, jnp.where(done, at_upper, pinned_up), it + 1,
            jnp.where(done, last_step, step))

  def cond(carry):
    _, done, _, it, _ = carry
    return (it < max_iter) & ~jnp.all(done)

  init = (x0, jnp.zeros(x0.shape, bool), jnp.zeros(x0.shape, bool), jnp.array(0, jnp.int32),
          jnp.zeros_like(x0))
  x, done, at_upper, it, _ = jax.lax.while_loop(cond, body, init)
  return x + offset, NewtonInfo(it, done, at_upper)
