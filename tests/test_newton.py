"""Tests for dpmm_jax.newton (generalized Newton of Minka 2000) in float32.

The maximisers are compared with scipy.optimize on the direct float64 objective. The
float32 answer can be no closer than (float32 error of L') / |L''| plus the stopping
tolerance; tolerances below are that bound, computed per case.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize
from scipy import special as sps
from scipy import stats

from dpmm_jax import newton
from dpmm_jax import stats as stats_lib
from dpmm_jax.conjugate import niw
from dpmm_jax.conjugate import nix

EPS32 = float(np.finfo(np.float32).eps)
NEWTON_TOL = 1e-6  # newton.maximize's default relative stopping tolerance


def minka_form(theta, a, b):
  """Derivatives of L = a log(theta) + b theta + c: maximiser -a/b (a > 0 > b)."""
  return a / theta + b, -a / theta ** 2


def test_exact_for_the_minka_form_vectorised_over_different_optima():
  a = jnp.asarray([0.5, 3.0, 100.0, 2.0], jnp.float32)
  b = jnp.asarray([-1.0, -1e-3, -50.0, -2e-5], jnp.float32)
  theta, info = newton.maximize(functools.partial(minka_form, a=a, b=b),
                                jnp.ones(4, jnp.float32))
  expected = -np.asarray(a, np.float64) / np.asarray(b, np.float64)  # 0.5, 3e3, 2, 1e5
  np.testing.assert_allclose(theta, expected, rtol=NEWTON_TOL + 8 * EPS32)
  assert np.all(info.converged) and not np.any(info.at_upper)
  # The model is exact, so only the 16x step clip limits progress: from 1 to 1e5 takes
  # ceil(log16(1e5)) = 5 steps plus one to confirm.
  assert int(info.num_iters) <= 7


def _nix_stat_sums(rng, num_classes, n_per_class, true_dfs, s0_true):
  """Per-dimension sum_k t_k from an E-step on data whose class variances are drawn from
  scaled-inv-chi^2(true_df_d, s0_d^2)."""
  dim = len(true_dfs)
  var = s0_true * np.asarray(true_dfs) / rng.chisquare(true_dfs, size=(num_classes, dim))
  y = np.repeat(np.arange(num_classes), n_per_class).astype(np.int32)
  x = rng.normal(size=(y.size, dim)) * np.sqrt(var[y]) + rng.normal(size=(num_classes, dim))[y]
  st = stats_lib.from_labels(jnp.asarray(x, jnp.float32), jnp.asarray(y), num_classes,
                             full=False)
  s0 = stats_lib.pooled_variance(st)
  prior = nix.prior(stats_lib.global_mean(st), s0, jnp.full((dim,), 10.0),
                    jnp.full((dim,), 0.1))
  post = nix.posterior(prior, st.count, st.mean, st.sq_dev)
  return jnp.sum(nix.df_statistic(post, s0), axis=0), st


def _nix_objective64(nu, stat_sum, k):
  return k * (0.5 * nu * np.log(0.5 * nu) - sps.gammaln(0.5 * nu)) + 0.5 * nu * (stat_sum - k)


def _argmax64(objective, lo, hi):
  """scipy maximiser of a scalar objective over log(theta) in [log lo, log hi]."""
  res = optimize.minimize_scalar(lambda v: -objective(np.exp(v)), bounds=(np.log(lo), np.log(hi)),
                                 method="bounded", options={"xatol": 1e-10})
  return float(np.exp(res.x))


def test_nix_df_objective_from_data_matches_scipy():
  rng = np.random.default_rng(0)
  k = 40
  true_dfs = [3.0, 10.0, 40.0, 200.0]
  stat_sum, _ = _nix_stat_sums(rng, k, 30, true_dfs, np.ones(4))
  derivs = functools.partial(nix.df_derivatives, stat_sum=stat_sum, num_classes=k)
  theta, info = newton.maximize(derivs, jnp.full((4,), 10.0, jnp.float32))
  assert np.all(info.converged) and not np.any(info.at_upper)
  s64 = np.asarray(stat_sum, np.float64)
  ref = np.array([_argmax64(lambda v: _nix_objective64(v, s, k), 1e-2, 1e7) for s in s64])
  # Distinct optima per dimension, increasing with the true df.
  assert np.all(np.diff(ref) > 0)
  # float32 error of L' ~ 16 eps (K/2 g + |S|/2) (g from test_special); shift = that/|L''|.
  g = np.log(ref / 2) - sps.digamma(ref / 2)
  hess = k / 4 * (2 / ref - sps.polygamma(1, ref / 2))
  tol = 16 * EPS32 * (k / 2 * g + np.abs(s64) / 2) / np.abs(hess) + 2 * NEWTON_TOL * ref
  np.testing.assert_array_less(np.abs(np.asarray(theta, np.float64) - ref), tol)


def _niw_objective64(nu, stat_sum, k, dim):
  return (k * (0.5 * nu * dim * np.log(0.5 * (nu - dim - 1)) - sps.multigammaln(0.5 * nu, dim))
          + 0.5 * nu * (stat_sum - k * dim))


def test_niw_df_objective_from_data_matches_scipy_with_offset():
  rng = np.random.default_rng(1)
  k, dim, n = 30, 3, 25
  # Class covariances Sigma_k ~ IW(nu_true, (nu_true - D - 1) I).
  nu_true = 12.0
  covs = stats.invwishart.rvs(df=nu_true, scale=(nu_true - dim - 1) * np.eye(dim), size=k,
                              random_state=rng)
  y = np.repeat(np.arange(k), n).astype(np.int32)
  x = np.einsum("nij,nj->ni", np.linalg.cholesky(covs)[y], rng.normal(size=(y.size, dim)))
  st = stats_lib.from_labels(jnp.asarray(x, jnp.float32), jnp.asarray(y), k)
  sigma0 = stats_lib.pooled_covariance(st)
  prior = niw.prior(stats_lib.global_mean(st), sigma0, dim + 10.0, 0.1)
  post = niw.posterior(prior, st.count, st.mean, st.scatter)
  stat_sum = jnp.sum(niw.df_statistic(post, sigma0))
  derivs = functools.partial(niw.df_derivatives, stat_sum=stat_sum, num_classes=k, dim=dim)
  theta, info = newton.maximize(derivs, jnp.float32(dim + 10.0), offset=dim + 1.0)
  assert bool(info.converged) and not bool(info.at_upper)
  assert float(theta) > dim + 1
  s64 = float(stat_sum)
  ref = dim + 1 + _argmax64(lambda v: _niw_objective64(v + dim + 1, s64, k, dim), 1e-3, 1e7)
  i = np.arange(1, dim + 1)
  hess = (k / 4 * np.sum(2 / (ref - i + 1) - sps.polygamma(1, (ref - i + 1) / 2)
                         + 2 * (dim + 2 - i) / ((ref - dim - 1) * (ref - i + 1)))
          - k * dim * (dim + 1) / (2 * (ref - dim - 1) ** 2))
  grad_scale = k / 2 * (dim * (dim + 1) / (ref - dim - 1) + dim) + abs(s64) / 2
  tol = 16 * EPS32 * grad_scale / abs(hess) + 2 * NEWTON_TOL * ref
  assert abs(float(theta) - ref) < tol, (float(theta), ref, tol)


@pytest.mark.parametrize("family", ["nix", "niw"])
def test_tied_limit_stops_at_the_cap_and_reports_it(family):
  # stat_sum = 0 is the tied limit (every t_k = 0): L' > 0 for every nu, optimum at inf.
  upper, max_iter = 1e6, 50
  if family == "nix":
    derivs = functools.partial(nix.df_derivatives, stat_sum=jnp.zeros(3, jnp.float32),
                               num_classes=10)
    theta0, offset = jnp.asarray([1.0, 30.0, 5e5], jnp.float32), 0.0
  else:
    derivs = functools.partial(niw.df_derivatives, stat_sum=jnp.float32(0.0),
                               num_classes=10, dim=4)
    theta0, offset = jnp.asarray([6.0, 100.0, 9e5], jnp.float32), 5.0
  grad, _ = derivs(theta0)
  assert np.all(np.asarray(grad) > 0)
  theta, info = newton.maximize(derivs, theta0, offset=offset, upper=upper, max_iter=max_iter)
  assert np.all(np.isfinite(theta))
  np.testing.assert_allclose(theta, upper + offset, rtol=EPS32)
  assert np.all(info.at_upper) and np.all(info.converged)
  assert int(info.num_iters) < max_iter


def test_optimum_below_the_lower_bound_is_pinned_there():
  derivs = lambda t: (-jnp.ones_like(t), jnp.zeros_like(t))  # decreasing: optimum at 0
  theta, info = newton.maximize(derivs, jnp.asarray([5.0, 0.1], jnp.float32), lower=1e-3)
  np.testing.assert_allclose(theta, 1e-3, rtol=EPS32)
  assert np.all(info.converged) and not np.any(info.at_upper)


def test_converged_flag_is_false_when_iterations_run_out():
  a = jnp.asarray([2.0, 2.0], jnp.float32)
  b = jnp.asarray([-2.0, -2e-4], jnp.float32)  # optima 1 and 1e4, start at 1
  theta, info = newton.maximize(functools.partial(minka_form, a=a, b=b),
                                jnp.ones(2, jnp.float32), max_iter=2)
  assert int(info.num_iters) == 2
  np.testing.assert_array_equal(info.converged, [True, False])
  assert float(theta[1]) < 1e4  # still on its way (16x per step)


def test_non_concave_start_falls_back_and_converges():
  # L(x) = -(log x - m)^2 is convex for x > e^(m+1): a = -x^2 L'' < 0 there, so the
  # Minka model is invalid and the geometric fallback must bring x into range.
  m = jnp.float32(np.log(50.0))

  def derivs(x):
    r = jnp.log(x) - m
    return -2 * r / x, 2 * (r - 1) / x ** 2

  x0 = jnp.asarray([5e4, 1e6, 3.0], jnp.float32)
  _, hess0 = derivs(x0[:2])
  assert np.all(np.asarray(hess0) > 0)  # really starts in the non-concave region
  theta, info = newton.maximize(derivs, x0, upper=1e7)
  assert np.all(info.converged) and not np.any(info.at_upper)
  # L' error near the optimum ~ eps * |2 log x / x|, |L''| = 2/x^2: shift ~ eps x log x.
  np.testing.assert_allclose(theta, 50.0, rtol=2 * NEWTON_TOL + 8 * EPS32 * np.log(50.0) * 2)


def test_jitted_wrapper_traces_once_per_shape():
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def solve(a, b, theta0):
    return newton.maximize(functools.partial(minka_form, a=a, b=b), theta0)

  for scale in (1.0, 7.0):
    a = jnp.asarray([1.0, 2.0, 3.0], jnp.float32) * scale
    b = -jnp.asarray([0.5, 0.01, 4.0], jnp.float32)
    theta, _ = solve(a, b, jnp.ones(3, jnp.float32))
    np.testing.assert_allclose(theta, -np.asarray(a) / np.asarray(b), rtol=2e-6)
  with pytest.raises(AssertionError):  # a new shape retraces, and the guard notices
    solve(jnp.ones(2, jnp.float32), -jnp.ones(2, jnp.float32), jnp.ones(2, jnp.float32))
