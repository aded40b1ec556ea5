"""The EM driver shared by the hierarchical models.

A model supplies two pure functions of (hyperparameters, statistics):
``step`` (E-step vmapped over classes + M-step, returning new hyperparameters and the
M-step's Newton info) and ``log_marginal_likelihood``. The driver iterates them in a
``lax.while_loop`` until the relative change of the log marginal likelihood falls below
``tol`` or ``max_iter`` is reached, and records the trace.

Concentrations whose optimum lies at infinity (``nu0`` when the class covariances are
truly tied, ``kappa0`` when the class means vary no more than their noise) are approached
by EM only linearly (``nu0`` grows by about ``N_k`` per iteration) while the log marginal
likelihood flattens, so EM stops on the tolerance at an arbitrary finite value or runs
into ``max_iter``. A model may therefore pass ``boundary``: at the first iteration that
meets the tolerance, and every ``boundary_every`` iterations, it proposes moving each
concentration onto its cap where the marginal likelihood still increases there (the KKT
condition at an upper bound; by Fisher's identity the slope of the log marginal
likelihood is the M-step's, which is computed without cancellation). If anything moves,
the next iteration's EM step starts from the candidate, and its result is kept when its
log marginal likelihood is not lower than the plain iterate's by more than the tolerance
(otherwise EM resumes from the plain iterate; the trace records a flat step). EM then
goes on from there: the other hyperparameters are re-estimated, and the Newton
M-step, which starts at the cap, confirms it (``NewtonInfo.at_upper``).
"""
from typing import Any, Callable, NamedTuple, Optional

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
        tol: float = 1e-6, max_iter: int = 100, boundary: Optional[Callable] = None,
        boundary_every: int = 10):
  """Runs EM to a relative tolerance on the log marginal likelihood.

  Args:
    step: (hyper, stats) -> (hyper, newton_info) ; one E-step and M-step.
    log_marginal_likelihood: (hyper, stats) -> scalar.
    init_hyper: initial hyperparameter pytree.
    stats: SufficientStats.
    tol: relative tolerance |L_t - L_{t-1}| <= tol * max(1, |L_t|).
    max_iter: iteration cap (static).
    boundary: optional (hyper, stats) -> hyper that moves concentrations whose log
      marginal likelihood still increases at their cap onto the cap (see module
      docstring); tried at the first iteration that meets ``tol`` and every
      ``boundary_every`` iterations (a slow climb towards a cap may never meet it). The
      trace records the likelihood after an accepted boundary step, and ``converged``
      still means that the last recorded change met ``tol``.
    boundary_every: period (iterations) of the boundary attempts (static).
  Returns:
    (hyper, EMInfo).
  """
  lml0 = log_marginal_likelihood(init_hyper, stats)
  trace = jnp.full((max_iter + 1,), jnp.nan, lml0.dtype).at[0].set(lml0)
  _, newton0 = jax.eval_shape(step, init_hyper, stats)
  newton_init = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), newton0)
  pick = lambda flag, a, b: jax.tree_util.tree_map(lambda u, v: jnp.where(flag, u, v), a, b)

  def small_change(new_lml, lml):
    return jnp.abs(new_lml - lml) <= tol * jnp.maximum(1.0, jnp.abs(new_lml))

  def cond(carry):
    return (carry["it"] < max_iter) & ~carry["converged"]

  def body(carry):
    # When a boundary candidate is pending, carry["hyper"] is that candidate and this
    # iteration's step evaluates it; carry["fallback"] holds the plain EM iterate it
    # competes with. Evaluating it here, instead of with a second step inside the
    # proposal, keeps one copy of the step in the compiled loop.
    lml, it, pending = carry["lml"], carry["it"], carry["pending"]
    new_hyper, newton = step(carry["hyper"], stats)
    new_lml = log_marginal_likelihood(new_hyper, stats)
    if boundary is None:
      converged = small_change(new_lml, lml)
      tried = carry["tried"]
    else:
      fb_hyper, fb_newton, fb_small = carry["fallback"]
      accept = jnp.isfinite(new_lml) & (new_lml >= lml - tol * jnp.maximum(1.0, jnp.abs(lml)))
      reject = pending & ~accept
      new_hyper = pick(reject, fb_hyper, new_hyper)
      newton = pick(reject, fb_newton, newton)
      new_lml = jnp.where(reject, lml, new_lml)
      small = jnp.where(reject, fb_small, small_change(new_lml, lml))
      attempt = ~pending & ((small & ~carry["tried"]) | ((it + 1) % boundary_every == 0))
      candidate = jax.lax.cond(attempt, lambda h: boundary(h, stats), lambda h: h, new_hyper)
      moved = attempt & jnp.any(jnp.stack([jnp.any(a != b) for a, b in zip(
          jax.tree_util.tree_leaves(candidate), jax.tree_util.tree_leaves(new_hyper))]))
      tried = carry["tried"] | (attempt & small)
      converged = small & ~moved
      carry = dict(carry, fallback=(new_hyper, newton, small), pending=moved)
      new_hyper = candidate
    return dict(carry, hyper=new_hyper, lml=new_lml, trace=carry["trace"].at[it + 1].set(new_lml),
                it=it + 1, converged=converged, newton=newton, tried=tried)

  init = dict(hyper=init_hyper, lml=lml0, trace=trace, it=jnp.array(0, jnp.int32),
              converged=jnp.array(False), newton=newton_init, tried=jnp.array(False),
              pending=jnp.array(False), fallback=(init_hyper, newton_init, jnp.array(False)))
  out = jax.lax.while_loop(cond, body, init)
  # A candidate still pending when max_iter is reached was never evaluated: keep the
  # plain iterate whose likelihood the trace records.
  hyper = pick(out["pending"], out["fallback"][0], out["hyper"])
  newton = out["newton"]
  return hyper, EMInfo(out["trace"], out["it"], out["converged"], newton)


def propose_caps(step: Callable, hyper, stats, caps):
  """Boundary proposal shared by the models (``boundary`` of :func:`run`).

  Moves each named concentration onto its cap where the log marginal likelihood still
  increases there: by Fisher's identity the slope at the cap is the M-step's, so a
  concentration updated by Newton stays at the cap exactly when its slope is positive
  (``strict=False``: new >= cap) and a closed-form one exceeds the cap
  (``strict=True``: new > cap). The candidate EM steps run as one vmapped step, so
  the compiled program holds one copy of it, not one per concentration.

  Args:
    step: (hyper, stats) -> (hyper, newton_info).
    hyper: current hyperparameters (a NamedTuple).
    stats: whatever ``step`` takes.
    caps: {field name: (cap value, strict)}.
  Returns:
    hyper with the fields that should move set to their caps.
  """
  fields = list(caps)
  candidates = [hyper._replace(**{f: jnp.full_like(getattr(hyper, f), caps[f][0])})
                for f in fields]
  stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *candidates)
  stepped = jax.vmap(lambda h: step(h, stats)[0])(stacked)
  updates = {}
  for i, field in enumerate(fields):
    cap_value, new = getattr(candidates[i], field), getattr(stepped, field)[i]
    up = new > cap_value if caps[field][1] else new >= cap_value
    updates[field] = jnp.where(up, cap_value, getattr(hyper, field))
  return hyper._replace(**updates)


def merge_newton_info(*infos: NewtonInfo) -> NewtonInfo:
  """Combines the Newton reports of several concentration updates into one record."""
  return NewtonInfo(
      jnp.max(jnp.stack([jnp.max(i.num_iters) for i in infos])),
      jnp.all(jnp.stack([jnp.all(i.converged) for i in infos])),
      jnp.any(jnp.stack([jnp.any(i.at_upper) for i in infos])))


def jit_fit(fit_hyper: Callable, params_from_hyper: Callable,
            static_argnames=("max_iter",)):
  """Jits a model's whole fit: EM for the hyperparameters, then its predictive parameters.

  Args:
    fit_hyper: ``(stats, **options) -> (hyper, EMInfo)``.
    params_from_hyper: ``(hyper, stats[, options]) -> Params``; it also receives
      ``options`` when the fit is called with that keyword (quadrature settings).
    static_argnames: keywords that are compile-time constants.
  Returns:
    ``fit(stats, **options) -> (Params, EMInfo)``, compiled once per shape and statics.
  """
  def fit(stats, **options):
    hyper, info = fit_hyper(stats, **options)
    extra = (options["options"],) if "options" in options else ()
    return params_from_hyper(hyper, stats, *extra), info

  return jax.jit(fit, static_argnames=static_argnames)
