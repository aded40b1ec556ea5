"""SQUAREM-accelerated EM (em.run with ``extrapolate``) against plain EM.

The problems share test_em.py's shapes (K = 20, D = 3), and ``accelerate`` is a traced
flag, so plain and accelerated EM run from the same compiled fit.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmm_jax import em
from dpmm_jax import preprocess
from dpmm_jax import stats as stats_lib
from dpmm_jax import synthetic
from dpmm_jax.models import coupled, diag, full

MODELS = {"full": full, "diag": diag, "coupled": coupled}
K, D = 20, 3
TOL = 1e-7


@functools.lru_cache(maxsize=None)
def _stats(seed, nu0, per_class, full_stats):
  ds = synthetic.make_dataset(jax.random.PRNGKey(seed), num_classes=K, dim=D, nu0=nu0,
                              num_train_per_class=per_class)
  return stats_lib.from_labels(ds.x_train, ds.y_train, K, full=full_stats)


# Jitted: called eagerly, each runs op by op and compiles every operation.
_LOG_MARGINAL_TERMS = {"full": jax.jit(lambda hyper, st: full._class_terms(hyper, st)[2]),
                       "diag": jax.jit(diag.log_marginal_terms),
                       "coupled": jax.jit(coupled.log_marginal_terms)}


def _magnitude(name, params, st):
  """sum |terms| of the fitted log marginal likelihood (em.run's round-off scale)."""
  return float(jnp.sum(jnp.abs(_LOG_MARGINAL_TERMS[name](params.hyper, st))))


def _checked(info, magnitude, max_iter=100, tol=TOL):
  """(trace, kinds) up to the last iteration, with the safeguard's invariants checked.
  ``magnitude``: sum |terms| of L (``_magnitude``)."""
  n = int(info.num_iters)
  trace = np.asarray(info.log_marginal_trace, np.float64)[:n + 1]
  kinds = np.asarray(info.step_kind)[1:n + 1]
  assert np.all(np.isfinite(trace)) and 1 <= n <= max_iter
  steps = np.diff(trace)
  # Extrapolations are kept only when L does not decrease (compared exactly, in the
  # same float32 values the trace holds); a rejection is an exactly flat step.
  assert np.all(steps[kinds == em.EXTRAPOLATED_STEP] >= 0.0), (steps, kinds)
  assert np.all(steps[kinds == em.REJECTED_STEP] == 0.0), (steps, kinds)
  # Plain EM steps are monotone up to float32 round-off of L (see test_em.py).
  assert np.all(steps >= -1e-5 * np.abs(trace[1:])), steps
  if bool(info.converged):   # the stopping rule is applied to plain steps only
    assert kinds[-1] != em.EXTRAPOLATED_STEP
    # The tolerance, or a plain step that lowered L within its round-off floor.
    floor = em.NOISE_FLOOR_ULPS * np.finfo(np.float32).eps * magnitude
    assert (abs(steps[-1]) <= tol * max(1.0, abs(trace[-1]))
            or -floor <= steps[-1] <= 0.0), (steps[-1], floor)
  return trace, kinds


@pytest.mark.parametrize("name", sorted(MODELS))
def test_accelerated_and_plain_em_reach_the_same_optimum(name):
  module = MODELS[name]
  for seed in (0, 1):
    st = _stats(seed, 6.0, 20, name == "full")
    plain_params, plain = module.fit(st, tol=TOL, accelerate=False)
    params, acc = module.fit(st, tol=TOL)                  # accelerated by default
    plain_trace, plain_kinds = _checked(plain, _magnitude(name, plain_params, st))
    trace, kinds = _checked(acc, _magnitude(name, params, st))
    assert bool(plain.converged) and bool(acc.converged)
    assert np.all(plain_kinds == em.PLAIN_STEP)
    assert np.sum(kinds == em.EXTRAPOLATED_STEP) >= 1, kinds   # it did extrapolate
    # Same starting point; both stop when an EM step changes L by <= tol |L|. On these
    # well-conditioned problems EM contracts fast, so the stopping points agree with
    # each other to a few times the tolerance.
    assert trace[0] == plain_trace[0]
    assert abs(trace[-1] - plain_trace[-1]) <= 10 * TOL * abs(plain_trace[-1]), (
        trace[-1], plain_trace[-1])
    # (No iteration-count claim here: on problems that plain EM solves in ~10 steps an
    # evaluated-and-rejected extrapolation can cost a few; the speed-up is tested where
    # it matters, below.)


@pytest.mark.parametrize("name", ["full", "diag"])
def test_acceleration_converges_where_plain_em_creeps(name):
  """nu0 = 300 with N_k = 5: the missing information is large and plain EM moves nu0 by
  a small fraction of the distance per iteration; it stops at max_iter (full) or creeps
  on. Accelerated EM converges in well under max_iter at a likelihood no lower."""
  module = MODELS[name]
  st = _stats(0, 300.0, 5, name == "full")
  plain_params, plain = module.fit(st, tol=TOL, accelerate=False)
  params, acc = module.fit(st, tol=TOL)
  plain_trace, _ = _checked(plain, _magnitude(name, plain_params, st))
  trace, _ = _checked(acc, _magnitude(name, params, st))
  assert int(plain.num_iters) >= 90, int(plain.num_iters)
  assert bool(acc.converged) and int(acc.num_iters) <= 50, int(acc.num_iters)
  assert trace[-1] >= plain_trace[-1] - 1e-6 * abs(plain_trace[-1])


def test_squarem_proposal_solves_a_linear_fixed_point_map_in_one_cycle():
  """For F linear in u = log(x - lower) with rate lam, x' = x0 - 2 a r + a^2 v with
  a = -|r|/|v| = -1/(1 - lam) is the fixed point exactly; each field has its own a
  (rates 0.9 and 0.5 here), clipped to step_max."""
  lower = jnp.array([4.0, 0.0])
  fixed = jnp.log(jnp.array([40.0, 2.5]))                   # u* of the two fields
  lam = jnp.array([0.9, 0.5])

  def point(u):
    x = lower + jnp.exp(u)
    return full.Hyper(jnp.zeros(2), jnp.eye(2), x[0], x[1])

  u0 = jnp.log(jnp.array([1.0, 0.1]))
  u1 = fixed + lam * (u0 - fixed)
  u2 = fixed + lam * (u1 - fixed)
  bounds = {"df": (4.0, 1e6), "mean_concentration": (0.0, 1e6)}
  x, at_max = em.squarem_proposal(point(u0), point(u1), point(u2), bounds, 100.0)
  np.testing.assert_allclose([x.df, x.mean_concentration], [44.0, 2.5], rtol=1e-4)
  assert not bool(at_max)
  # df's step length 1/(1 - 0.9) = 10 > step_max = 4: clipped, reported, and short of
  # u*; kappa0's (2) is not clipped and still exact.
  x, at_max = em.squarem_proposal(point(u0), point(u1), point(u2), bounds, 4.0)
  assert bool(at_max) and float(x.df) < 43.0
  np.testing.assert_allclose(x.mean_concentration, 2.5, rtol=1e-4)
  # step_max = 1 proposes x2 itself; an upper cap clips the proposal.
  x, _ = em.squarem_proposal(point(u0), point(u1), point(u2), bounds, 1.0)
  np.testing.assert_allclose(x.df, point(u2).df, rtol=1e-5)
  capped = {"df": (4.0, 20.0), "mean_concentration": (0.0, 1e6)}
  x, _ = em.squarem_proposal(point(u0), point(u1), point(u2), capped, 100.0)
  assert float(x.df) == 20.0
  # Unnamed fields are x2's.
  np.testing.assert_array_equal(x.mean_cov, point(u2).mean_cov)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_em_stops_at_the_float32_round_off_floor(name):
  """Section-6.1 data, seed 15 (tests/test_synthetic_benchmark.py), preprocessed as
  fit_detector does: L ~ 6.3 is a small sum of terms of total size ~1e2-1e3, so in
  float32 plain EM steps wobble by ~1e-5 around the maximum, above tol |L| = 6e-6.
  Before the round-off rule the diagonal fit ran to max_iter (1000 iterations did not
  converge either). EM must now stop as converged, within that floor of the best
  likelihood a 400-iteration plain run reaches."""
  ds = synthetic.make_dataset(jax.random.PRNGKey(15), num_classes=10, dim=2, nu0=4.0,
                              kappa0=1 / 25, num_train_per_class=20)
  # The default preprocessing (as fit_detector applies it) makes L small: ~6.3 for diag.
  transform = preprocess.fit(stats_lib.from_labels(ds.x_train, ds.y_train, 10, full=False))
  st = stats_lib.from_labels(preprocess.apply(transform, ds.x_train), ds.y_train, 10,
                             full=name == "full")
  module = MODELS[name]
  params, info = module.fit(st)
  trace, _ = _checked(info, _magnitude(name, params, st), tol=1e-6)   # fit's default
  assert bool(info.converged) and int(info.num_iters) < 100
  _, long_run = module.fit(st, tol=1e-30, max_iter=400, accelerate=False)
  best = float(np.nanmax(np.asarray(long_run.log_marginal_trace)))
  floor = em.NOISE_FLOOR_ULPS * np.finfo(np.float32).eps * _magnitude(name, params, st)
  assert trace[-1] >= best - floor, (trace[-1], best, floor)
