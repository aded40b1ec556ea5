"""The EM driver (dpmm_jax.em) through the full, diag and coupled models.

Monotonicity slack: EM never decreases the log marginal likelihood L in exact arithmetic.
In float32, L (a few hundred nats here) is a sum over K classes of differences of log
normalisers, each of magnitude ~|L|/K with a handful of roundings, so consecutive values
can differ by round-off of order K * 10 * eps * |L| ~ 1e-5 |L| (eps = 1.2e-7). Observed
decreases are 1-2 ulps of L (~2e-7 relative); a real EM bug moves L by >= 1e-3 relative.
"""
import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import dpmm_jax
from dpmm_jax import em
from dpmm_jax import stats as stats_lib
from dpmm_jax import synthetic
from dpmm_jax.conjugate import nix
from dpmm_jax.models import coupled, diag, full, lowrank

MODELS = {"full": full, "diag": diag, "coupled": coupled}
REL_SLACK = 1e-5
K, D = 20, 3   # one shape for the whole file: the compiled fits are shared


@functools.lru_cache(maxsize=None)
def _synthetic_stats(seed, full_stats=True):
  # Diagonal models get diagonal-only statistics, as from fit_detector (same compiled fit).
  ds = synthetic.make_dataset(jax.random.PRNGKey(seed), num_classes=K, dim=D, nu0=6.0,
                              num_train_per_class=20)
  return stats_lib.from_labels(ds.x_train, ds.y_train, K, full=full_stats)


def _check_trace(info, tol, max_iter):
  """Monotone trace; num_iters / converged agree with the trace and the stopping rule."""
  trace = np.asarray(info.log_marginal_trace, np.float64)
  n = int(info.num_iters)
  assert trace.shape == (max_iter + 1,)
  assert 1 <= n <= max_iter
  assert np.all(np.isfinite(trace[:n + 1])), trace
  assert np.all(np.isnan(trace[n + 1:])), trace
  steps = np.diff(trace[:n + 1])
  assert np.all(steps >= -REL_SLACK * np.abs(trace[1:n + 1])), steps
  kinds = np.asarray(info.step_kind)
  assert kinds.shape == (max_iter + 1,) and kinds[0] == -1 and np.all(kinds[n + 1:] == -1)
  kinds = kinds[1:n + 1]
  assert np.all(np.isin(kinds, [em.PLAIN_STEP, em.EXTRAPOLATED_STEP, em.BOUNDARY_STEP,
                                em.REJECTED_STEP])), kinds
  # The SQUAREM safeguard is exact: an accepted extrapolation never lowers L, and a
  # rejected one keeps the plain iterate (a flat step).
  assert np.all(steps[kinds == em.EXTRAPOLATED_STEP] >= 0), steps
  assert np.all(steps[kinds == em.REJECTED_STEP] == 0), steps
  # The tolerance, or a plain step that lowered L within its round-off floor.
  eps = np.finfo(np.asarray(info.log_marginal_trace).dtype).eps
  floor = em.NOISE_FLOOR_ULPS * eps * np.asarray(info.magnitude_trace, np.float64)[1:n + 1]
  small = ((np.abs(steps) <= tol * np.maximum(1.0, np.abs(trace[1:n + 1])))
           | ((steps <= 0) & (-steps <= floor)))
  plain = kinds == em.PLAIN_STEP
  # EM stops at the first small plain step, unless a boundary candidate was proposed
  # there (evaluated by the next step: a boundary or a rejected step).
  early = np.flatnonzero((small & plain)[:-1])
  assert np.all(np.isin(kinds[early + 1], [em.BOUNDARY_STEP, em.REJECTED_STEP])), (
      steps, kinds)
  assert bool(info.converged) == bool(small[-1] & (kinds[-1] != em.EXTRAPOLATED_STEP))
  if not bool(info.converged):
    assert n == max_iter
  return trace[:n + 1]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_log_marginal_likelihood_never_decreases(name):
  module = MODELS[name]
  tol, max_iter = 1e-7, 100
  gains, cache_sizes = [], []
  for seed in range(3):
    params, info = module.fit(_synthetic_stats(seed, name == "full"), tol=tol,
                              max_iter=max_iter)
    cache_sizes.append(module._fit._cache_size())
    trace = _check_trace(info, tol, max_iter)
    assert bool(info.converged), (seed, int(info.num_iters))
    gains.append(trace[-1] - trace[0])
    assert np.all(np.isfinite(np.asarray(params.log_counts)))
  # EM from the paper's initialisation (nu0 ~ N_k, kappa0 = 1e-3) on nu0 = 6 data must
  # actually improve the fit (not a trivially flat trace).
  assert min(gains) > 1.0, gains
  # The jitted fit compiled once for the three same-shape calls.
  assert cache_sizes[1:] == cache_sizes[:1] * 2, cache_sizes


# The bookkeeping is em.run's, shared by all models. max_iter is traced (the traces have
# a static length, em.trace_length): the fit compiled for the default max_iter = 100
# serves max_iter = 2, and its first iterations are those of the longer run.
@pytest.mark.parametrize("name", sorted(MODELS))
def test_max_iter_reached_is_reported_as_not_converged(name):
  module = MODELS[name]
  st = _synthetic_stats(0, name == "full")
  _, long_run = module.fit(st, tol=1e-12)
  compiled = module._fit._cache_size()
  _, info = module.fit(st, tol=1e-12, max_iter=2)
  assert module._fit._cache_size() == compiled
  _check_trace(info, 1e-12, 2)
  assert int(info.num_iters) == 2
  assert not bool(info.converged)
  assert info.log_marginal_trace.shape == info.step_kind.shape == (3,)
  np.testing.assert_array_equal(info.log_marginal_trace, long_run.log_marginal_trace[:3])
  np.testing.assert_array_equal(info.step_kind, long_run.step_kind[:3])
  shortest = em.MIN_TRACE_LENGTH
  assert em.trace_length(2) == em.trace_length(shortest - 1) == shortest
  assert em.trace_length(shortest) == 2 * shortest
  # A trace too short for max_iter is refused, not silently cut.
  with pytest.raises(ValueError, match="trace_length must exceed max_iter"):
    module.fit_hyper(st, max_iter=5, trace_length=5)


def test_fit_hyper_traces_once_for_repeated_same_shape_calls():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def fit_hyper(stats):
    return full.fit_hyper(stats, tol=1e-6, max_iter=20)

  for seed in range(3):
    hyper, info = fit_hyper(_synthetic_stats(seed))
    assert np.isfinite(float(hyper.df)) and int(info.num_iters) >= 1
  # ... and the guard has teeth: a new shape needs a new trace, which it refuses.
  ds = synthetic.make_dataset(jax.random.PRNGKey(0), num_classes=K + 1, dim=D, nu0=6.0)
  with pytest.raises(AssertionError):
    fit_hyper(stats_lib.from_labels(ds.x_train, ds.y_train, K + 1))


def test_merge_newton_info():
  a = em.NewtonInfo(jnp.array(3), jnp.array([True, True]), jnp.array([False, True]))
  b = em.NewtonInfo(jnp.array(5), jnp.array(False), jnp.array(False))
  merged = em.merge_newton_info(a, b)
  assert int(merged.num_iters) == 5
  assert not bool(merged.converged)
  assert bool(merged.at_upper)


# ----------------------------------------------------------------- tied covariances
NK_TIED, K_TIED = 200, K


@functools.lru_cache(maxsize=None)
def _tied_data(seed):
  """Every class has the SAME covariance; the class means are spread with the same shape
  (their empirical covariance is exactly 25 x that covariance), so the hierarchical
  mean priors (Sigma / kappa0) and the tied model's (total covariance) agree."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(D, D))
  chol = np.linalg.cholesky(a @ a.T + 0.5 * np.eye(D))
  z = rng.normal(size=(K_TIED, D))
  z -= z.mean(0)
  z = z @ np.linalg.inv(np.linalg.cholesky(z.T @ z / K_TIED)).T
  means = 5.0 * z @ chol.T

  def draw(centres):
    return centres + rng.normal(size=centres.shape) @ chol.T

  y = np.repeat(np.arange(K_TIED), NK_TIED).astype(np.int32)
  x = draw(means[y])
  y_test = np.repeat(np.arange(K_TIED), 10)
  ood = 5.0 * rng.normal(size=(200, D)) @ chol.T       # fresh clusters from the same prior
  x_test = np.concatenate([draw(means[y_test]), draw(ood)])
  return x.astype(np.float32), y, x_test.astype(np.float32)


@pytest.mark.parametrize("seed", [0])
def test_tied_covariances_drive_nu0_up_and_scores_agree_with_tied_model(seed):
  x, y, x_test = _tied_data(seed)
  tied_scores = np.asarray(dpmm_jax.score(dpmm_jax.fit_detector(x, y, "tied"), x_test))
  for name in ("full", "diag", "coupled"):
    det, report = dpmm_jax.fit_detector_with_info(x, y, name)
    df = np.asarray(det.params.hyper.df)
    # EM starts at nu0 = mean N_k. With equal covariances the marginal likelihood keeps
    # increasing in nu0 (its optimum is at infinity) but flattens, so EM either hits the
    # cap or stops on the tolerance with nu0 several times N_k; on unequal covariances
    # (test below) nu0 stays near the generating value of 6.
    assert np.all(np.asarray(report.em.newton.at_upper) | (df > 3 * NK_TIED)), (name, df)
    s = np.asarray(dpmm_jax.score(det, x_test))
    rho = scipy.stats.spearmanr(s, tied_scores)[0]
    assert rho > 0.99, (name, rho)


def test_tied_covariances_reach_a_low_df_cap_and_report_it():
  x, y, _ = _tied_data(0)
  cap = 3.0 * NK_TIED
  det, report = dpmm_jax.fit_detector_with_info(x, y, "full", df_cap=cap)
  assert bool(report.em.newton.at_upper)
  # The cap bounds nu0 - D - 1 (the Newton variable is shifted by D + 1).
  np.testing.assert_allclose(float(det.params.hyper.df), cap + D + 1, rtol=1e-6)
  det, report = dpmm_jax.fit_detector_with_info(x, y, "diag", df_cap=cap)
  assert bool(np.all(report.em.newton.at_upper))
  np.testing.assert_allclose(np.asarray(det.params.hyper.df), cap, rtol=1e-6)


def test_unequal_covariances_keep_nu0_small():
  """The counterpart with teeth: data from nu0 = 6 with many points per class."""
  ds = synthetic.make_dataset(jax.random.PRNGKey(3), num_classes=K_TIED, dim=D, nu0=6.0,
                              num_train_per_class=NK_TIED)
  det, report = dpmm_jax.fit_detector_with_info(np.asarray(ds.x_train),
                                                np.asarray(ds.y_train), "full",
                                                df_cap=3.0 * NK_TIED)
  assert not bool(report.em.newton.at_upper)
  assert 4.5 < float(det.params.hyper.df) < 12.0, float(det.params.hyper.df)


class _Toy(NamedTuple):
  a: jax.Array     # (2,) Newton-like: the step clips at the cap
  b: jax.Array     # () closed-form: the step may pass the cap; target 2 = the cap
                   # (a step from the cap stays at it: strict, no move)
  c: jax.Array     # () not capped


_TOY_CAPS = {"a": (3.0, False), "b": (2.0, True)}


def _toy_step(h, target_a):
  """One 'EM step' towards (target_a, 2, 1); a[0] creeps (rate 0.02)."""
  a = jnp.minimum(h.a + jnp.array([0.02, 0.5]) * (target_a - h.a), _TOY_CAPS["a"][0])
  return _Toy(a, h.b + 0.5 * (2.0 - h.b), h.c + 0.5 * (1.0 - h.c)), jnp.zeros(())


def _toy_lml(h, target_a):
  return jnp.stack([-jnp.sum(jnp.square(h.a - target_a)), -jnp.square(h.b - 2.0),
                    -jnp.square(h.c - 1.0)])


def _reference_caps(hyper, stats):
  """The cap proposal as a separate computation (one EM step per field from the cap)."""
  updates = {}
  for field, (cap, strict) in _TOY_CAPS.items():
    at_cap = jnp.full_like(getattr(hyper, field), cap)
    new = getattr(_toy_step(hyper._replace(**{field: at_cap}), stats)[0], field)
    updates[field] = jnp.where(new > cap if strict else new >= cap, cap, getattr(hyper, field))
  return hyper._replace(**updates)


@pytest.mark.parametrize("max_iter", [5, 100])
@pytest.mark.parametrize("accelerate", [False, True])
@pytest.mark.parametrize("beyond_cap", [False, True])
def test_cap_probe_by_the_loop_step_equals_the_separate_proposal(beyond_cap, accelerate,
                                                                   max_iter):
  """em.run's ``caps`` probe (the loop's own step, one field per extra pass) makes the
  decisions of the proposal computed on the side, with the same trace, step kinds,
  iteration count and end point: also when the attempt falls on the last iteration
  (max_iter = 5: the probe finishes, a candidate is never evaluated) and when the
  attempt's iteration also proposes a SQUAREM extrapolation (iteration 5), which waits
  for the probe. Only elements whose target lies beyond their cap move there."""
  target = jnp.array([10.0 if beyond_cap else 2.0, 1.0])
  init = _Toy(jnp.zeros(2), jnp.array(1.5), jnp.array(0.0))
  kwargs = dict(tol=1e-9, max_iter=max_iter, accelerate=accelerate, boundary_every=5,
                extrapolate={"a": (-1.0, 3.0), "c": (-1.0, 10.0)})
  got, info = em.run(_toy_step, _toy_lml, init, target, caps=_TOY_CAPS, **kwargs)
  want, ref = em.run(_toy_step, _toy_lml, init, target, boundary=_reference_caps, **kwargs)
  assert int(info.num_iters) == int(ref.num_iters)
  assert bool(info.converged) == bool(ref.converged)
  np.testing.assert_array_equal(info.step_kind, ref.step_kind)
  np.testing.assert_array_equal(info.log_marginal_trace, ref.log_marginal_trace)
  for field in _Toy._fields:
    np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
  kinds = np.asarray(info.step_kind)
  if max_iter == 5:
    assert int(info.num_iters) == 5 and not bool(info.converged)
    assert float(got.a[0]) < 3.0        # a candidate at the cap was not evaluated
    return
  # Plain EM creeping towards a[0] = 2 (rate 0.02) is slow; the others converge.
  assert bool(info.converged) == (beyond_cap or accelerate)
  # Iteration 5 is an attempt; with SQUAREM it also proposes an extrapolation, which
  # iteration 6 evaluates unless the probe moved something (then 6 is a boundary step).
  if accelerate:
    assert kinds[5] == em.PLAIN_STEP
    assert kinds[6] == (em.BOUNDARY_STEP if beyond_cap else em.EXTRAPOLATED_STEP)
  assert (em.BOUNDARY_STEP in kinds) == beyond_cap
  if beyond_cap:
    assert float(got.a[0]) == 3.0
  else:
    assert float(got.a[0]) < 2.1      # near its target 2, never moved to the cap
  assert float(got.a[1]) < 3.0
  with pytest.raises(ValueError, match="caps or boundary"):
    em.run(_toy_step, _toy_lml, init, target, caps=_TOY_CAPS, boundary=_reference_caps)


# The toy model as a SharedEStep: the "E-step" passes the target on to the M-step and L.
_TOY_SHARED = em.SharedEStep(
    e_step=lambda h, target: jnp.asarray(target),
    m_step=lambda h, target, e: _toy_step(h, e),
    log_marginal_terms=lambda h, target, e: _toy_lml(h, e))


@pytest.mark.parametrize("max_iter", [0, 1, 5, 100])
@pytest.mark.parametrize("accelerate", [False, True])
def test_a_shared_e_step_runs_the_same_em_as_separate_functions(accelerate, max_iter):
  """em.run with a ``SharedEStep`` (one E-step for the M-step and L, the initial L from
  the loop's first pass) takes the path of em.run with the step and L as separate
  functions: same trace, step kinds, iteration count and end point, with caps probes
  and SQUAREM on, also for max_iter = 0 (L at the initial point only) and 1."""
  target = jnp.array([10.0, 1.0])
  init = _Toy(jnp.zeros(2), jnp.array(1.5), jnp.array(0.0))
  kwargs = dict(tol=1e-9, max_iter=max_iter, accelerate=accelerate, boundary_every=5,
                caps=_TOY_CAPS, extrapolate={"a": (-1.0, 3.0), "c": (-1.0, 10.0)})
  want, ref = em.run(_toy_step, _toy_lml, init, target, **kwargs)
  got, info = jax.jit(lambda t: em.run(_TOY_SHARED, None, init, t, **kwargs))(target)
  assert int(info.num_iters) == int(ref.num_iters)
  if max_iter == 0:
    assert int(info.num_iters) == 0 and not bool(info.converged)
  assert bool(info.converged) == bool(ref.converged)
  np.testing.assert_array_equal(info.step_kind, ref.step_kind)
  np.testing.assert_allclose(info.log_marginal_trace, ref.log_marginal_trace, rtol=1e-6)
  np.testing.assert_allclose(info.magnitude_trace, ref.magnitude_trace, rtol=1e-6)
  assert np.isfinite(float(info.log_marginal_trace[0]))
  for field in _Toy._fields:
    np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=1e-6)
  with pytest.raises(ValueError, match="SharedEStep"):
    em.run(_TOY_SHARED, _toy_lml, init, target)


def test_the_coupled_fit_shares_its_e_step_and_matches_the_separate_functions():
  """coupled.fit_hyper (a SharedEStep) against em.run over coupled.em_step and
  coupled.log_marginal_terms, the same E-step compiled in two places: the same number of
  iterations and step kinds, L within em.run's round-off floor of its terms (the two
  programs fuse the arithmetic differently; 1.1 eps sum|terms| seen) and alpha0 to 1e-5
  (2.5e-7 seen)."""
  st = _synthetic_stats(0, full_stats=False)
  init = coupled.init_hyper(st)
  got, info = coupled.fit_hyper(st, max_iter=50)
  want, ref = em.run(coupled.em_step, coupled.log_marginal_terms, init, st, max_iter=50,
                     caps=coupled.boundary_caps(),
                     extrapolate=coupled.extrapolation_bounds())
  n = int(ref.num_iters)
  assert bool(ref.converged) and int(info.num_iters) == n
  np.testing.assert_array_equal(info.step_kind, ref.step_kind)
  trace, ref_trace = (np.asarray(i.log_marginal_trace[:n + 1], np.float64) for i in (info, ref))
  round_off = (em.NOISE_FLOOR_ULPS * np.finfo(np.float32).eps
               * np.asarray(ref.magnitude_trace[:n + 1]))
  assert np.all(np.abs(trace - ref_trace) <= round_off), (trace - ref_trace, round_off)
  np.testing.assert_allclose(got.gamma_shape, want.gamma_shape, rtol=1e-5)


def test_rejected_boundary_candidates_leave_the_em_path_unchanged():
  """A boundary proposal whose candidate is worse (here: the prior location moved far
  away, which the M-step keeps) is evaluated by the next step and rejected: EM resumes
  from the plain iterate, records a flat step, keeps going after periodic attempts, and
  ends where EM without a boundary ends (in log marginal likelihood)."""
  st = _synthetic_stats(0, full_stats=False)
  step, lml = diag.em_step, diag.log_marginal_likelihood
  init = diag.init_hyper(st)
  tol, max_iter = 1e-7, 100
  _, plain_info = em.run(step, lml, init, st, tol=tol, max_iter=max_iter)

  def bad_boundary(hyper, stats):
    del stats
    return hyper._replace(loc=hyper.loc + 100.0)

  got, info = em.run(step, lml, init, st, tol=tol, max_iter=max_iter,
                     boundary=bad_boundary, boundary_every=3)
  n, n_plain = int(info.num_iters), int(plain_info.num_iters)
  assert bool(plain_info.converged) and bool(info.converged) and n_plain >= 3
  trace = np.asarray(info.log_marginal_trace[:n + 1], np.float64)
  plain_trace = np.asarray(plain_info.log_marginal_trace[:n_plain + 1], np.float64)
  assert np.all(np.diff(trace) >= -REL_SLACK * np.abs(trace[1:]))
  # Up to the first attempt (iteration 3) the paths are the plain EM path; iteration 3
  # proposes, iteration 4 evaluates and rejects the candidate: a flat step, exactly.
  np.testing.assert_allclose(trace[:4], plain_trace[:4], rtol=1e-6)
  assert trace[4] == trace[3]
  np.testing.assert_array_equal(got.loc, init.loc)        # the candidate never survived
  # Both runs stop on the same rule; near the optimum float32 EM moves along a flat
  # direction of L, so the end points agree in L to the stopping tolerance, not in nu0.
  assert abs(trace[-1] - plain_trace[-1]) <= 10 * tol * abs(plain_trace[-1])


# ------------------------------------------------- empty classes and padded class counts
PADDED_MODELS = dict(MODELS, lowrank=lowrank)


def _with_empty_class(st, at):
  """``st`` with an empty class (no points) inserted at index ``at``."""
  insert = lambda a: None if a is None else jnp.insert(a, at, 0.0, axis=0)
  return st._replace(count=insert(st.count), mean=insert(st.mean), sq_dev=insert(st.sq_dev),
                     scatter=insert(st.scatter))


def _class_rows(module, params, rows):
  return {f: jax.tree_util.tree_map(lambda a: np.asarray(a)[rows], getattr(params, f))
          for f in module.CLASS_FIELDS}


@pytest.mark.parametrize("name", sorted(PADDED_MODELS))
def test_an_empty_class_changes_nothing(name):
  """An empty class adds nothing to p(X | y, hyper): EM leaves it out of its sums, so the
  fit with an empty class inserted (K = 21, compiled for 24 classes) equals the fit
  without it (K = 20, compiled for 20) and the other classes' predictive parameters are
  unchanged. Without the weights the empty class would enter the M-step at its prior
  expectations (its raw E-step terms are not zero), which moved the EM end point."""
  module = PADDED_MODELS[name]
  st = _synthetic_stats(1, name in ("full", "lowrank"))
  at = 7
  st_empty = _with_empty_class(st, at)
  params, info = module.fit(st)
  params_e, info_e = module.fit(st_empty)
  assert int(info_e.num_iters) == int(info.num_iters) and bool(info_e.converged)
  for got, want in zip(params_e.hyper, params.hyper):
    np.testing.assert_allclose(got, want, rtol=1e-5)
  kept = [k for k in range(K + 1) if k != at]
  want_rows = _class_rows(module, params, np.arange(K))
  got_rows = _class_rows(module, params_e, np.array(kept))
  chex.assert_trees_all_close(got_rows, want_rows, rtol=1e-5, atol=1e-6)
  assert np.isneginf(float(params_e.log_counts[at]))
  if name == "diag":   # unmasked: every term of an empty class is exactly 0
    assert np.all(np.asarray(diag.log_marginal_terms(params.hyper, st_empty))[at] == 0.0)
  # The marginal likelihood ignores the empty class at every iterate; its raw E-step
  # terms do not vanish.
  n = int(info.num_iters) + 1
  np.testing.assert_allclose(info_e.log_marginal_trace[:n], info.log_marginal_trace[:n],
                             rtol=1e-6)
  if name in ("full", "lowrank"):
    maha = full._class_terms(params.hyper, st_empty)[0]
  else:
    hyper = coupled._as_diag(params.hyper) if name == "coupled" else params.hyper
    maha = nix.expectations(diag._posterior(hyper, st_empty), hyper.loc).mahalanobis
  assert float(jnp.min(jnp.abs(maha[at]))) > 0.0


@pytest.mark.parametrize("name", sorted(PADDED_MODELS))
def test_nearby_class_counts_share_one_compiled_fit(name):
  """K = 17..20 are fitted by one program compiled for 20 classes; K = 16 needs another
  (16). Each fit returns K classes."""
  module = PADDED_MODELS[name]
  st = _synthetic_stats(2, name in ("full", "lowrank"))
  take = lambda a, k: None if a is None else a[:k]
  sizes = []
  for k in (17, 19, 20, 16):
    sub = st._replace(count=st.count[:k], mean=st.mean[:k], sq_dev=st.sq_dev[:k],
                      scatter=take(st.scatter, k))
    params, info = module.fit(sub)
    sizes.append(module._fit._cache_size())
    assert bool(info.converged)
    assert params.log_counts.shape == (k,)
    for field in module.CLASS_FIELDS:
      for leaf in jax.tree_util.tree_leaves(getattr(params, field)):
        assert leaf.shape[0] == k, (field, leaf.shape)
  # A fit is one program; lowrank's is two (the full model's EM, then its predictives).
  programs = 2 if name == "lowrank" else 1
  assert sizes[1] == sizes[2] == sizes[0] and sizes[3] == sizes[0] + programs, sizes


def test_padded_class_counts():
  padded = lambda k: em.padded_num_classes(k, 1)
  assert [padded(k) for k in (1, 2, 8, 9, 10, 11, 16, 17, 20, 21, 33, 100, 1000)] == [
      8, 8, 8, 10, 10, 12, 16, 20, 20, 24, 40, 112, 1024]
  # Less than 1/4 extra above 8 classes; never padded past the element budget.
  for k in range(9, 3000):
    assert k <= padded(k) < k * 5 / 4
  big = em.PADDED_STATS_MAX_ELEMENTS // 100
  assert em.padded_num_classes(100, big) == 100
  assert em.padded_num_classes(100, em.PADDED_STATS_MAX_ELEMENTS // 112) == 112


def test_padded_fit_inside_jit_equals_the_eager_call():
  """Inside jit the statistics are tracers: they are padded with jnp.pad and the class
  fields cut by a jitted slice (outside, both happen on the host); same fit either way."""
  st = _synthetic_stats(3, full_stats=False)
  sub = st._replace(count=st.count[:18], mean=st.mean[:18], sq_dev=st.sq_dev[:18])
  params, info = diag.fit(sub)
  params_jit, info_jit = jax.jit(diag.fit)(sub)
  assert params_jit.log_counts.shape == (18,) and int(info_jit.num_iters) == int(info.num_iters)
  chex.assert_trees_all_close(params_jit, params, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(PADDED_MODELS))
def test_statistics_without_points_are_rejected(name):
  """With every class empty there is nothing to fit (before, the diagonal fit returned
  NaN hyperparameters without an error); the model's fit says so."""
  st = stats_lib.empty(3, 2, full=name in ("full", "lowrank"))
  with pytest.raises(ValueError, match="hold no points"):
    PADDED_MODELS[name].fit(st)
