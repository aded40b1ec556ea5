"""Float64 pass over the core math: special functions, Student-t, NIW/NIX, Newton and the
coupled model's quadrature, with tight tolerances.

Run in its own pytest process (tests/run_all.sh): x64 is switched on here, at import,
before anything else touches JAX, and never toggled inside a test.
"""
import jax

jax.config.update("jax_enable_x64", True)

import functools  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax.numpy as jnp
from jax.scipy import special as jsp
import numpy as np
import pytest
from scipy import special as sps
from scipy import stats

from dpmm_jax import newton
from dpmm_jax import quadrature
from dpmm_jax import special
from dpmm_jax import stats as stats_lib
from dpmm_jax import student_t
from dpmm_jax.conjugate import niw
from dpmm_jax.conjugate import nix
from dpmm_jax.models import coupled
from tests import test_niw
from tests import test_quadrature as tq
from tests.test_special import ref_inv_minus_trigamma
from tests.test_special import ref_log_minus_digamma

EPS64 = float(np.finfo(np.float64).eps)


def test_x64_is_on():
  assert jnp.asarray(1.0).dtype == jnp.float64


# ---------------------------------------------------------------------------- special
ZS = np.array([0.05, 0.5, 1.0, 2.5, 7.0, 9.999, np.nextafter(10.0, 0), 10.0, 10.001, 13.0,
               30.0, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7])


def _cond(z, direct_terms, value):
  return np.where(z >= 10.0, 1.0, direct_terms / np.abs(value))


def test_log_minus_digamma_and_inv_minus_trigamma_to_float64_precision():
  # Both branches to a few ulps times the direct formula's condition number; the
  # asymptotic series must be accurate right from the threshold (z = 10) on.
  ref1 = np.array([ref_log_minus_digamma(z) for z in ZS])
  ref2 = np.array([ref_inv_minus_trigamma(z) for z in ZS])
  got1 = np.asarray(special.log_minus_digamma(jnp.asarray(ZS)))
  got2 = np.asarray(special.inv_minus_trigamma(jnp.asarray(ZS)))
  cond1 = _cond(ZS, np.abs(np.log(ZS)) + np.abs(sps.digamma(ZS)), ref1)
  cond2 = _cond(ZS, 1 / ZS + sps.polygamma(1, ZS), ref2)
  np.testing.assert_array_less(np.abs(got1 / ref1 - 1), 16 * EPS64 * (1 + cond1))
  np.testing.assert_array_less(np.abs(got2 / ref2 - 1), 16 * EPS64 * (1 + cond2))


@pytest.mark.parametrize("dim", [1, 3, 64])
def test_multivariate_gamma_family_to_float64_precision(dim):
  a = np.array([0.8, 2.0, 17.0, 1e4]) + (dim - 1) / 2
  shifted = a[:, None] - 0.5 * np.arange(dim)
  mag = np.sum(np.abs(sps.gammaln(shifted)) + 1, -1) + dim * dim
  np.testing.assert_array_less(
      np.abs(np.asarray(jsp.multigammaln(jnp.asarray(a), dim))
             - [sps.multigammaln(v, dim) for v in a]), 16 * EPS64 * mag)
  np.testing.assert_allclose(special.multidigamma(jnp.asarray(a), dim),
                             sps.digamma(shifted).sum(-1), rtol=1e-13, atol=1e-13)
  np.testing.assert_allclose(special.multitrigamma(jnp.asarray(a), dim),
                             sps.polygamma(1, shifted).sum(-1), rtol=1e-13)


# -------------------------------------------------------------------------- Student-t
@pytest.mark.parametrize("dim,df", [(1, 0.7), (4, 3.0), (12, 1e5), (6, 1e6)])
def test_mvt_log_density_to_float64_precision(dim, df):
  # Reference: log poch(df/2, D/2) for the lgamma ratio (scipy's Pochhammer is exact
  # to ~1e-15 for large df, while scipy.stats' own difference of lgammas is off by
  # eps * lgamma(df/2) ~ 1e-10 at df = 1e5), then the density in float64 numpy;
  # scipy.stats.multivariate_t cross-checks it where df is moderate.
  rng = np.random.default_rng(dim)
  q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
  scale = (q * np.geomspace(1, 30, dim)) @ q.T
  loc = rng.normal(size=dim)
  x = loc + rng.normal(size=(30, dim)) * 4
  x[0] = loc + 1e6  # far away stays finite and exact
  chol = np.linalg.cholesky(scale)
  got = np.asarray(student_t.mvt_log_density(jnp.asarray(x), df, jnp.asarray(loc),
                                             jnp.asarray(chol)))
  maha = np.sum(np.linalg.solve(chol, (x - loc).T) ** 2, 0)
  ref = (np.log(sps.poch(df / 2, dim / 2)) - dim / 2 * np.log(df * np.pi)
         - np.sum(np.log(np.diag(chol))) - (df + dim) / 2 * np.log1p(maha / df))
  np.testing.assert_allclose(got, ref, rtol=1e-12)
  if df < 1e3:
    np.testing.assert_allclose(ref, stats.multivariate_t(loc=loc, shape=scale, df=df).logpdf(x),
                               rtol=1e-12)
  s2 = np.diag(scale)
  got_t = np.asarray(student_t.t_log_density(jnp.asarray(x), df, jnp.asarray(loc),
                                             jnp.asarray(s2)))
  ref_t = (np.log(sps.poch(df / 2, 0.5)) - 0.5 * np.log(df * np.pi * s2)
           - (df + 1) / 2 * np.log1p((x - loc) ** 2 / (df * s2)))
  np.testing.assert_allclose(got_t, ref_t, rtol=1e-12)
  if df < 1e3:
    np.testing.assert_allclose(ref_t, stats.t.logpdf(x, df, loc, np.sqrt(s2)), rtol=1e-12)


# ------------------------------------------------------------------------------- NIW
def _niw_prior(rng, dim):
  q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
  return niw.NIW(jnp.asarray(rng.normal(size=dim)), jnp.asarray(0.4), jnp.asarray(dim + 2.5),
                 jnp.asarray((q * np.geomspace(1, 10, dim)) @ q.T * (dim + 2.5)))


@jax.jit
def _niw_chain_step(current, xn):
  """log p(x_n | x_<n) and the posterior after x_n (a single-point conjugate update)."""
  lp = niw.log_predictive(current, xn[None])[0]
  batched = niw.posterior(jax.tree_util.tree_map(lambda a: a[None], current), jnp.ones(1),
                          xn[None], jnp.zeros((1,) + current.scale.shape))
  return jax.tree_util.tree_map(lambda a: a[0], batched), lp


def test_niw_posterior_marginal_and_predictive_to_float64_precision():
  rng = np.random.default_rng(0)
  dim = 3
  x, y = test_niw._labelled_data(rng, 2, dim, [15, 4])
  x = x.astype(np.float64)
  prior = _niw_prior(rng, dim)
  st = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), 2)
  post = niw.posterior(prior, st.count, st.mean, st.scatter)
  lml = np.asarray(niw.log_marginal_likelihood(prior, post, st.count))
  for k in range(2):
    xk = x[y == k]
    ref = test_niw.textbook_posterior(prior, xk)
    np.testing.assert_allclose(post.loc[k], ref[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(post.scale[k], ref[3], rtol=1e-11, atol=1e-11 * np.abs(ref[3]).max())
    # Chain rule: log p(X) = sum_n log p(x_n | x_<n), via single-point updates.
    _, terms = jax.lax.scan(_niw_chain_step, prior, jnp.asarray(xk))
    np.testing.assert_allclose(lml[k], float(jnp.sum(terms)), rtol=1e-11)
    # Predictive: St(nu - D + 1, mu, (kappa + 1)/(kappa (nu - D + 1)) Psi).
    p = jax.tree_util.tree_map(lambda a: np.asarray(a[k]), post)
    df = p.df - dim + 1
    pts = rng.normal(size=(5, dim)) * 3
    ref_lp = stats.multivariate_t(loc=p.loc, shape=(p.mean_concentration + 1)
                                  / (p.mean_concentration * df) * p.scale, df=df).logpdf(pts)
    got_lp = niw.log_predictive(jax.tree_util.tree_map(lambda a: a[k], post), jnp.asarray(pts))
    np.testing.assert_allclose(got_lp, ref_lp, rtol=1e-12)


def test_niw_log_normalizer_identity_to_float64_precision():
  rng = np.random.default_rng(1)
  dim = 4
  p = _niw_prior(rng, dim)
  p64 = jax.tree_util.tree_map(np.asarray, p)
  log_z = float(niw.log_normalizer(p))
  for mu, sigma in zip(*test_niw.sample_niw(rng, p64, 3)):
    ref = (stats.invwishart.logpdf(sigma, df=float(p64.df), scale=p64.scale)
           + stats.multivariate_normal.logpdf(mu, p64.loc, sigma / p64.mean_concentration))
    prec = np.linalg.inv(sigma)
    d = mu - p64.loc
    got = (-(p64.df + dim + 2) / 2 * np.linalg.slogdet(sigma)[1]
           - 0.5 * np.trace(p64.scale @ prec) - 0.5 * p64.mean_concentration * d @ prec @ d
           - log_z - dim / 2 * np.log(2 * np.pi))
    np.testing.assert_allclose(got, ref, rtol=1e-11)


def test_niw_df_statistic_to_float64_precision():
  rng = np.random.default_rng(2)
  dim = 3
  x, y = test_niw._labelled_data(rng, 3, dim, [50, 8, 200])
  st = stats_lib.from_labels(jnp.asarray(x, jnp.float64), jnp.asarray(y), 3)
  sigma0 = stats_lib.pooled_covariance(st)
  post = niw.posterior(niw.prior(jnp.zeros(dim), sigma0, dim + 4.0, 0.2),
                       st.count, st.mean, st.scatter)
  got = np.asarray(niw.df_statistic(post, sigma0))
  ref = test_niw._direct_df_statistic(jax.tree_util.tree_map(np.asarray, post),
                                      np.asarray(sigma0))
  np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)


# Jitted once per static (num_classes, dim): one compilation instead of op-by-op dispatch.
_niw_stable = jax.jit(niw.df_derivatives, static_argnums=(2, 3))
_niw_autodiff = jax.jit(lambda nu, s, k, d: (jax.grad(niw.df_objective)(nu, s, k, d),
                                             jax.hessian(niw.df_objective)(nu, s, k, d)),
                        static_argnums=(2, 3))
_nix_stable = jax.jit(nix.df_derivatives, static_argnums=(2,))
_nix_autodiff = jax.jit(lambda nu, s, k: (jax.grad(nix.df_objective)(nu, s, k),
                                          jax.hessian(nix.df_objective)(nu, s, k)),
                        static_argnums=(2,))


def _derivative_tolerance(terms_grad, terms_hess):
  return 64 * EPS64 * terms_grad, 64 * EPS64 * terms_hess


@pytest.mark.parametrize("nu_excess", [0.5, 3.0, 30.0, 1e3, 1e4, 1e6])
def test_niw_df_derivatives_equal_autodiff_of_the_objective(nu_excess):
  # The stable L', L'' against jax.grad / jax.hessian of the direct objective. The
  # direct form cancels terms of size ~K D/2 log(nu) (grad) and ~K D/nu (hess), so the
  # autodiff reference is only good to 64 eps64 times those; at nu = 1e6 that is still
  # ~1e-12 relative to L' ~ K D^2/nu, enough to check the stable form there.
  k, dim = 7, 4
  nu = dim + 1.0 + nu_excess
  stat_sum = -0.9 * 2 * k * dim * (dim + 1) / (4 * nu)  # optimum near nu
  grad, hess = _niw_stable(jnp.asarray(nu), jnp.asarray(stat_sum), k, dim)
  ad_grad, ad_hess = _niw_autodiff(jnp.asarray(nu), jnp.asarray(stat_sum), k, dim)
  psi = np.abs(sps.digamma(0.5 * (nu - np.arange(dim)))).sum()
  tri = sps.polygamma(1, 0.5 * (nu - np.arange(dim))).sum()
  excess = nu - dim - 1
  tol_g, tol_h = _derivative_tolerance(
      k * dim / 2 * (abs(np.log(excess / 2)) + nu / excess) + k / 2 * psi + abs(stat_sum),
      k * dim / 2 * (1 / excess + (dim + 1) / excess ** 2) + k / 4 * tri)
  assert abs(float(grad) - float(ad_grad)) < tol_g, (grad, ad_grad, tol_g)
  assert abs(float(hess) - float(ad_hess)) < tol_h, (hess, ad_hess, tol_h)
  # The comparison is meaningful: the tolerance is far below the values compared.
  assert tol_g < 1e-3 * abs(float(ad_grad)) + 1e-300
  assert tol_h < 1e-3 * abs(float(ad_hess))


# ------------------------------------------------------------------------------- NIX
@pytest.mark.parametrize("nu", [0.3, 2.0, 40.0, 1e4, 1e6])
def test_nix_df_derivatives_equal_autodiff_of_the_objective(nu):
  k = 5
  stat_sum = -0.8 * k * ref_log_minus_digamma(nu / 2)
  grad, hess = _nix_stable(jnp.asarray(nu), jnp.asarray(stat_sum), k)
  ad_grad, ad_hess = _nix_autodiff(jnp.asarray(nu), jnp.asarray(stat_sum), k)
  tol_g, tol_h = _derivative_tolerance(
      k / 2 * (abs(np.log(nu / 2)) + 1 + abs(sps.digamma(nu / 2))) + abs(stat_sum),
      k / 4 * (2 / nu + sps.polygamma(1, nu / 2)))
  assert abs(float(grad) - float(ad_grad)) < tol_g, (grad, ad_grad, tol_g)
  assert abs(float(hess) - float(ad_hess)) < tol_h, (hess, ad_hess, tol_h)
  assert tol_g < 1e-3 * abs(float(ad_grad))
  assert tol_h < 1e-3 * abs(float(ad_hess))
  # And against the cancellation-free float64 reference directly.
  np.testing.assert_allclose(float(grad),
                             0.5 * k * ref_log_minus_digamma(nu / 2) + 0.5 * stat_sum,
                             rtol=1e-12)
  np.testing.assert_allclose(float(hess), 0.25 * k * ref_inv_minus_trigamma(nu / 2),
                             rtol=1e-12)


def test_nix_equals_niw_in_one_dimension_to_float64_precision():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(17, 1)) * 2 + 1
  y = (np.arange(17) % 2).astype(np.int32)
  st = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), 2)
  loc, kappa, df, s2 = 0.2, 0.7, 2.6, 1.4
  p_nix = nix.NIX(*map(jnp.asarray, ([loc], [kappa], [df], [s2])))
  p_niw = niw.NIW(*map(jnp.asarray, ([loc], kappa, df, [[df * s2]])))
  q_nix = nix.posterior(p_nix, st.count, st.mean, st.sq_dev)
  q_niw = niw.posterior(p_niw, st.count, st.mean, st.scatter)
  np.testing.assert_allclose(nix.log_marginal_likelihood(p_nix, q_nix, st.count)[:, 0],
                             niw.log_marginal_likelihood(p_niw, q_niw, st.count), rtol=1e-13)
  np.testing.assert_allclose(nix.df_statistic(q_nix, jnp.asarray([s2]))[:, 0],
                             niw.df_statistic(q_niw, jnp.asarray([[s2]])), rtol=1e-12)
  pts = jnp.linspace(-5.0, 5.0, 11)[:, None]
  for k in range(2):
    a = jax.tree_util.tree_map(lambda v: v[k], q_nix)
    b = jax.tree_util.tree_map(lambda v: v[k], q_niw)
    np.testing.assert_allclose(nix.log_predictive(a, pts), niw.log_predictive(b, pts),
                               rtol=1e-13)


# ---------------------------------------------------------------------------- Newton
def test_newton_finds_nix_df_optimum_to_its_tolerance():
  k = 12
  stat_sum = jnp.asarray([-2.0, -0.3, -0.01, -1e-4])
  theta, info = newton.maximize(functools.partial(nix.df_derivatives, stat_sum=stat_sum,
                                                  num_classes=k), jnp.full((4,), 5.0),
                                tol=1e-10)
  assert np.all(info.converged)
  grad, _ = nix.df_derivatives(theta, stat_sum, k)
  hess = 0.25 * k * np.array([ref_inv_minus_trigamma(v / 2) for v in np.asarray(theta)])
  # |theta - theta*| = |L'| / |L''| at the optimum.
  np.testing.assert_array_less(np.abs(np.asarray(grad) / hess), 1e-9 * np.asarray(theta))


# ------------------------------------------------------------------------ quadrature
@jax.jit
def _coupled_quantities(hyper, st, u):
  """(log integral on the EM grid, on the scoring grid, log_marginal_likelihood,
  class_log_joint at u): one compilation per shape instead of op-by-op dispatch."""
  opts = coupled.QuadratureOptions()
  out = []
  for nodes, half_width in [(opts.em_nodes, opts.em_half_width),
                            (opts.score_nodes, opts.score_half_width)]:
    grid = coupled.class_grid(hyper, st, nodes, half_width)
    out.append(quadrature.log_integral(grid, coupled.class_log_joint(hyper, st, grid.nodes))[0])
  return (*out, coupled.log_marginal_likelihood(hyper, st),
          coupled.class_log_joint(hyper, st, u[None])[0])


@pytest.mark.parametrize("cfg", [tq.SMALL, tq.NARROW,
                                 dict(tq.SMALL, gamma_shape=0.5),
                                 dict(tq.NARROW, gamma_shape=1000.0, prior_df=2e4)],
                         ids=["small", "narrow", "small_shape0.5", "narrow_shape1000"])
def test_coupled_log_integral_relative_error_below_1e6(cfg):
  rng = np.random.default_rng(4)
  hyper, st = tq.make_class(rng, dtype=jnp.float64, **cfg)
  ref, _, _ = tq.ref_log_integral(hyper, st)
  u = np.linspace(-1, 1, 7)
  em_grid, score_grid, lml, integrand = _coupled_quantities(hyper, st, jnp.asarray(u))
  for name, got in [("em grid", em_grid), ("score grid", score_grid), ("lml", lml)]:
    assert abs(float(got) - ref) < 1e-6, (name, float(got), ref)
  # The integrand itself equals the independent reference implementation.
  np.testing.assert_allclose(integrand, tq.ref_class_log_joint(hyper, st, u), rtol=1e-12)


@pytest.mark.parametrize("cfg", [tq.SMALL, tq.NARROW], ids=["small", "narrow"])
def test_posterior_mode_is_a_stationary_point_of_the_integrand(cfg):
  rng = np.random.default_rng(5)
  hyper, st = tq.make_class(rng, dtype=jnp.float64, **cfg)
  mode, scale, converged = coupled.posterior_mode(hyper, st)
  assert bool(converged)
  m, s = float(mode[0]), float(scale[0])
  h = 0.01 * s
  f = np.asarray(coupled.class_log_joint(hyper, st, jnp.asarray([[m - h, m, m + h]]))[0])
  slope = (f[2] - f[0]) / (2 * h)
  curv = (f[2] - 2 * f[1] + f[0]) / h ** 2
  # The Newton iteration stops when its step is < 1e-6 (quadratic convergence leaves far
  # less): the mode's displacement |slope / curv| must be below that. Finite-difference
  # round-off is eps |f| / h, i.e. a displacement of eps |f| s^2 / h, far smaller.
  assert abs(slope / curv) < 1e-6, (slope, curv)
  # Laplace width: curvature by finite differences (relative truncation ~ (h/s)^2).
  np.testing.assert_allclose(-1.0 / curv, s ** 2, rtol=1e-4)


@pytest.mark.parametrize("shape", [0.5, 1.0, 10.0, 1000.0])
def test_prior_grid_moments_to_1e6(shape):
  a = jnp.asarray(shape)
  grid = quadrature.gamma_prior_grid(a, coupled.QuadratureOptions().prior_nodes)
  log_density = quadrature.log_gamma_density_of_log(grid.nodes, a)
  w = jnp.exp(quadrature.normalized_log_weights(grid, log_density))
  assert abs(float(jnp.sum(w * jnp.exp(grid.nodes))) - 1.0) < 1e-6
  assert abs(float(jnp.sum(w * grid.nodes)) - (sps.digamma(shape) - np.log(shape))) < 1e-6
  assert abs(float(quadrature.log_integral(grid, log_density))) < 1e-6
