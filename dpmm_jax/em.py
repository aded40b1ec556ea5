"""The EM driver shared by the hierarchical models.

A model supplies two pure functions of (hyperparameters, statistics):
``step`` (E-step vmapped over classes + M-step, returning new hyperparameters and the
M-step's Newton info) and ``log_marginal_likelihood``. The driver iterates them in a
``lax.while_loop`` until the relative change of the log marginal likelihood falls below
``tol`` or ``max_iter`` is reached, and records the trace.
"""
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from dpmm_jax.newton import NewtonInfo


class EMInfo(NamedTuple):
  """Diagnostics of an EM run.

  log_marginal_trace: (max_iter + 1,) log p(data | hyper) after 0, 1, ... iterations
    (NaN after the last one run).
  num_iters: EM iterations run.
  converged: relative change of the log marginal likelihood fell below tol.
  newton: NewtonInfo of the last M-step (per-element convergence and cap flags).
  """
  log_marginal_trace: jax.Array
  num_iters: jax.Array
  converged: jax.Array
  newton: Any


def run(step: Callable, log_marginal_likelihood: Callable, init_hyper, stats, *,
        tol: float = 1e-6, max_iter: int = 100):
  """Runs EM to a relative tolerance on the log marginal likelihood.

  Args:
    step: (hyper, stats) -> (hyper, newton_info) ; one E-step and M-step.
    log_marginal_likelihood: (hyper, stats) -> scalar.
    init_hyper: initial hyperparameter pytree.
    stats: SufficientStats.
    tol: relative tolerance |L_t - L_{t-1}| <= tol * max(1, |L_t|).
    max_iter: iteration cap (static).
  Returns:
    (hyper, EMInfo).
  """
  lml0 = log_marginal_likelihood(init_hyper, stats)
  trace = jnp.full((max_iter + 1,), jnp.nan, lml0.dtype).at[0].set(lml0)
  _, newton0 = jax.eval_shape(step, init_hyper, stats)
  newton_init = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), newton0)

  def cond(carry):
    _, _, _, it, converged, _ = carry
    return (it < max_iter) & ~converged

  def body(carry):
    hyper, lml, trace, it, _, _ = carry
    new_hyper, newton = step(hyper, stats)
    new_lml = log_marginal_likelihood(new_hyper, stats)
    converged = jnp.abs(new_lml - lml) <= tol * jnp.maximum(1.0, jnp.abs(new_lml))
    return new_hyper, new_lml, trace.at[it + 1].set(new_lml), it + 1, converged, newton

  init = (init_hyper, lml0, trace, jnp.array(0, jnp.int32), jnp.array(False), newton_init)
  hyper, _, trace, it, converged, newton = jax.lax.while_loop(cond, body, init)
  return hyper, EMInfo(trace, it, converged, newton)


def merge_newton_info(*infos: NewtonInfo) -> NewtonInfo:
  """Combines the Newton reports of several concentration updates into one record."""
  return NewtonInfo(
      jnp.max(jnp.stack([jnp.max(i.num_iters) for i in infos])),
      jnp.all(jnp.stack([jnp.all(i.converged) for i in infos])),
      jnp.any(jnp.stack([jnp.any(i.at_upper) for i in infos])))
