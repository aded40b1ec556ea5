"""Tests for dpmm_jax.conjugate.nix (paper, appendix 14) in float32.

Scaled-inverse-chi^2(nu, s^2) is InvGamma(nu/2, scale = nu s^2 / 2) in scipy's terms.
References are float64 scipy (invgamma, norm, t) and Monte Carlo; Monte Carlo tolerances
are 5 standard errors, float32 tolerances a few ulps of the magnitudes of the rounded
terms. Also checks that NIX equals NIW at D = 1 (with Psi = nu s^2 and the same nu).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special as sps
from scipy import stats

from dpmm_jax import stats as stats_lib
from dpmm_jax.conjugate import niw
from dpmm_jax.conjugate import nix
from tests.test_niw import EPS32
from tests.test_niw import MC_SIGMAS
from tests.test_niw import _as64
from tests.test_niw import _f32
from tests.test_niw import _within_mc
from tests.test_special import ref_log_minus_digamma


def _labelled_data(rng, num_classes, dim, sizes):
  y = np.concatenate([np.full(n, k) for k, n in enumerate(sizes)]).astype(np.int32)
  centres = rng.normal(size=(num_classes, dim)) * 2
  x = centres[y] + rng.normal(size=(y.size, dim)) * rng.uniform(0.3, 3.0, size=dim)
  return x.astype(np.float32), y


def _prior(rng, dim, df=3.5, kappa=0.3):
  return nix.NIX(*_f32(rng.normal(size=dim), np.full(dim, kappa), np.full(dim, df),
                       rng.uniform(0.5, 4.0, size=dim)))


def textbook_posterior(prior, x):
  """Gelman et al. (BDA 3.3) with raw sums, float64, per dimension."""
  x = np.asarray(x, np.float64)
  mu0, k0, nu0, s0 = (np.asarray(a, np.float64) for a in prior)
  n = x.shape[0]
  kn, nun = k0 + n, nu0 + n
  mun = (k0 * mu0 + x.sum(0)) / kn
  nus = nu0 * s0 + (x ** 2).sum(0) + k0 * mu0 ** 2 - kn * mun ** 2
  return mun, kn, nun, nus / nun


def _log_normalizer_magnitude(p):
  """Elementwise sum of |terms| of log Z (float64), the round-off scale."""
  loc, kappa, df, s2 = p
  return (0.5 * np.abs(np.log(kappa)) + np.abs(sps.gammaln(df / 2)) + 1
          + df / 2 * np.abs(np.log(df * s2 / 2)))


def sample_nix(rng, p, size):
  """(mu (S, ...), sigma^2 (S, ...)) from NIX, float64."""
  loc, kappa, df, s2 = (np.asarray(a, np.float64) for a in p)
  var = stats.invgamma.rvs(df / 2, scale=df * s2 / 2, size=(size,) + np.shape(loc),
                           random_state=rng)
  mu = loc + np.sqrt(var / kappa) * rng.normal(size=var.shape)
  return mu, var


# --------------------------------------------------------------------- posterior update
def test_posterior_matches_textbook_raw_sum_update():
  rng = np.random.default_rng(0)
  dim, sizes = 4, [30, 6, 1]
  x, y = _labelled_data(rng, 3, dim, sizes)
  prior = _prior(rng, dim)
  st = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), 3, full=False)
  post = _as64(nix.posterior(prior, st.count, st.mean, st.sq_dev))
  assert post.loc.shape == (3, dim)
  for k in range(3):
    xk = x[y == k].astype(np.float64)
    mun, kn, nun, s2n = textbook_posterior(prior, xk)
    np.testing.assert_allclose(post.mean_concentration[k], kn, rtol=2 * EPS32)
    np.testing.assert_allclose(post.df[k], nun, rtol=2 * EPS32)
    # nu' s'^2 is a float32 sum of N + 2 nonnegative terms: a few ulps relative.
    np.testing.assert_allclose(post.scale_sq[k], s2n, rtol=16 * EPS32)
    loc_mag = np.abs(np.asarray(prior.loc)) + np.abs(xk).max(0)
    np.testing.assert_array_less(np.abs(post.loc[k] - mun), 16 * EPS32 * loc_mag)


def test_posterior_of_merged_stats_equals_sequential_updates():
  rng = np.random.default_rng(1)
  dim = 3
  xa, ya = _labelled_data(rng, 2, dim, [25, 4])
  xb, yb = _labelled_data(rng, 2, dim, [9, 40])
  prior = _prior(rng, dim)
  sa = stats_lib.from_labels(jnp.asarray(xa), jnp.asarray(ya), 2, full=False)
  sb = stats_lib.from_labels(jnp.asarray(xb), jnp.asarray(yb), 2, full=False)
  both = stats_lib.merge(sa, sb)
  joint = _as64(nix.posterior(prior, both.count, both.mean, both.sq_dev))
  after_a = nix.posterior(prior, sa.count, sa.mean, sa.sq_dev)
  seq = _as64(nix.posterior(after_a, sb.count, sb.mean, sb.sq_dev))
  for k in range(2):
    ref = textbook_posterior(prior, np.concatenate([xa[ya == k], xb[yb == k]]))
    for got in (joint, seq):
      np.testing.assert_allclose(got.loc[k], ref[0], rtol=0,
                                 atol=32 * EPS32 * (np.abs(ref[0]).max() + 10))
      np.testing.assert_allclose(got.mean_concentration[k], ref[1], rtol=2 * EPS32)
      np.testing.assert_allclose(got.df[k], ref[2], rtol=2 * EPS32)
      np.testing.assert_allclose(got.scale_sq[k], ref[3], rtol=32 * EPS32)


def test_empty_class_returns_the_prior():
  rng = np.random.default_rng(2)
  dim = 3
  x = rng.normal(size=(8, dim)).astype(np.float32)
  st = stats_lib.from_labels(jnp.asarray(x), jnp.ones(8, jnp.int32), 2, full=False)
  prior = _prior(rng, dim)
  post = nix.posterior(prior, st.count, st.mean, st.sq_dev)
  np.testing.assert_array_equal(post.mean_concentration[0], prior.mean_concentration)
  np.testing.assert_array_equal(post.df[0], prior.df)
  np.testing.assert_allclose(post.scale_sq[0], prior.scale_sq, rtol=2 * EPS32)
  np.testing.assert_allclose(post.loc[0], prior.loc, rtol=2 * EPS32)
  lml = np.asarray(nix.log_marginal_likelihood(prior, post, st.count))
  assert lml.shape == (2, dim)
  np.testing.assert_array_less(np.abs(lml[0]),
                               4 * EPS32 * _log_normalizer_magnitude(_as64(prior)))


# ---------------------------------------------------------------- normaliser and marginal
def test_log_normalizer_matches_invgamma_times_normal_density():
  # log NIX(mu, s) = -(nu + 3)/2 log s - nu s^2/(2 s) - kappa (mu - m)^2/(2 s)
  #                  - log Z - 1/2 log(2 pi),     s = sigma^2.
  rng = np.random.default_rng(3)
  p = nix.NIX(*_f32([0.3, -2.0, 5.0], [0.2, 1.0, 30.0], [0.7, 4.0, 300.0], [0.5, 2.0, 9.0]))
  log_z = np.asarray(nix.log_normalizer(p), np.float64)
  p64 = _as64(p)
  mu, var = sample_nix(rng, p64, 5)
  ref = (stats.invgamma.logpdf(var, p64.df / 2, scale=p64.df * p64.scale_sq / 2)
         + stats.norm.logpdf(mu, p64.loc, np.sqrt(var / p64.mean_concentration)))
  kernel = (-(p64.df + 3) / 2 * np.log(var) - p64.df * p64.scale_sq / (2 * var)
            - p64.mean_concentration * (mu - p64.loc) ** 2 / (2 * var))
  got = kernel - log_z - 0.5 * np.log(2 * np.pi)
  tol = 16 * EPS32 * (_log_normalizer_magnitude(p64) + 1)
  np.testing.assert_array_less(np.abs(got - ref), np.broadcast_to(tol, ref.shape))


def test_log_marginal_likelihood_equals_chain_rule_of_predictives():
  rng = np.random.default_rng(4)
  dim = 3
  x, y = _labelled_data(rng, 2, dim, [14, 2])
  prior = _prior(rng, dim)
  st = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), 2, full=False)
  post = nix.posterior(prior, st.count, st.mean, st.sq_dev)
  lml = np.asarray(nix.log_marginal_likelihood(prior, post, st.count)).sum(-1)
  post_k = _as64(post)
  zero = jnp.zeros((dim,), jnp.float32)
  for k in range(2):
    current, chain, mag = prior, 0.0, 0.0
    for xn in x[y == k]:
      lp = float(nix.log_predictive(current, jnp.asarray(xn[None]))[0])
      chain += lp
      mag += abs(lp) + 10 * dim
      current = nix.posterior(current, jnp.float32(1.0), jnp.asarray(xn), zero)
    mag += (_log_normalizer_magnitude(_as64(prior)).sum()
            + _log_normalizer_magnitude(tuple(a[k] for a in post_k)).sum())
    assert abs(lml[k] - chain) < 16 * EPS32 * mag, (lml[k], chain)


# ------------------------------------------------------------------------ predictive
def test_predictive_is_student_t_with_nu_dof_and_inflated_scale():
  rng = np.random.default_rng(5)
  p = nix.NIX(*_f32([0.3, -2.0], [0.5, 7.0], [3.0, 40.0], [2.0, 0.1]))
  pts = (rng.normal(size=(25, 2)) * 4).astype(np.float32)
  got = np.asarray(nix.log_predictive(p, jnp.asarray(pts)))
  p64 = _as64(p)
  scale = np.sqrt((p64.mean_concentration + 1) / p64.mean_concentration * p64.scale_sq)
  terms = stats.t.logpdf(pts.astype(np.float64), p64.df, p64.loc, scale)
  np.testing.assert_array_less(np.abs(got - terms.sum(-1)),
                               16 * EPS32 * (np.abs(terms).sum(-1) + 2 * 10))


def test_predictive_density_equals_monte_carlo_average_of_normal_densities():
  # p(x | D) = E[N(x | mu, sigma^2)] over the NIX; the df = nu + 1 or unit-kappa-inflation
  # variants would be rejected (checked for the first).
  rng = np.random.default_rng(6)
  p = nix.NIX(*_f32([1.0], [1.5], [4.0], [2.0]))
  p64 = _as64(p)
  mu, var = sample_nix(rng, p64, 400_000)
  pts = np.array([1.0, 4.0, -5.0, 9.0])
  got = np.exp(np.asarray(nix.log_predictive(p, jnp.asarray(pts[:, None], jnp.float32))))
  scale = np.sqrt((p64.mean_concentration + 1) / p64.mean_concentration * p64.scale_sq)
  for i, xp in enumerate(pts):
    dens = stats.norm.pdf(xp, mu[:, 0], np.sqrt(var[:, 0]))
    ok, mean, se = _within_mc(dens, got[i])
    assert ok, (xp, mean, se, got[i])
    wrong = stats.t.pdf(xp, p64.df[0] + 1, p64.loc[0], scale[0])
    if abs(xp - p64.loc[0]) > 5:  # the dof matter in the tails
      assert abs(mean - wrong) > MC_SIGMAS * se, (xp, mean, se, wrong)


def test_expectations_match_monte_carlo():
  rng = np.random.default_rng(7)
  p = nix.NIX(*_f32([0.5, -1.0, 2.0], [0.25, 2.0, 10.0], [5.0, 12.0, 80.0], [1.0, 3.0, 0.2]))
  ref_loc = np.array([0.0, 0.0, 2.5])
  ex = _as64(nix.expectations(p, jnp.asarray(ref_loc, jnp.float32)))
  mu, var = sample_nix(rng, _as64(p), 200_000)
  for samples, value in [(1.0 / var, ex.inv_var), (np.log(var), ex.log_var),
                         ((mu - ref_loc) ** 2 / var, ex.mahalanobis)]:
    ok, mean, se = _within_mc(samples, value)
    assert ok.all(), (mean, value, se)


# --------------------------------------------------------------- df statistic, derivatives
def test_df_statistic_equals_direct_definition():
  rng = np.random.default_rng(8)
  dim = 4
  x, y = _labelled_data(rng, 3, dim, [40, 5, 300])
  st = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), 3, full=False)
  s0 = np.asarray(stats_lib.pooled_variance(st), np.float64)
  prior = nix.prior(*_f32(np.zeros(dim), s0, np.full(dim, 6.0), np.full(dim, 0.1)))
  post = nix.posterior(prior, st.count, st.mean, st.sq_dev)
  got = np.asarray(nix.df_statistic(post, jnp.asarray(s0, jnp.float32)))
  p = _as64(post)
  e_log = np.log(p.df * p.scale_sq / 2) - sps.digamma(p.df / 2)
  ref = np.log(s0) - e_log - s0 / p.scale_sq + 1
  mag = np.abs(np.log(s0 / p.scale_sq)) + s0 / p.scale_sq + 1 + 1 / p.df
  np.testing.assert_array_less(np.abs(got - ref), 16 * EPS32 * mag)
  assert np.all(got <= 0)


@pytest.mark.parametrize("nu", [1e4, 1e6])
def test_df_statistic_is_cancellation_free_in_the_tied_limit(nu):
  # s'^2 = s0^2 (r = 1): t = -(log(nu'/2) - psi(nu'/2)) ~ -1/nu'.
  s0 = np.array([0.3, 1.0, 7.0], np.float32)
  post = nix.NIX(*_f32(np.zeros(3), np.full(3, nu), np.full(3, nu), s0))
  got = np.asarray(nix.df_statistic(post, jnp.asarray(s0)))
  ref = -ref_log_minus_digamma(nu / 2)
  np.testing.assert_allclose(got, ref, rtol=16 * EPS32)


def _ref_df_grad(nu, stat_sum, k):
  return 0.5 * k * ref_log_minus_digamma(nu / 2) + 0.5 * stat_sum


@pytest.mark.parametrize("optimum", [1e4, 1e6])
def test_df_gradient_keeps_its_sign_at_large_nu_in_float32(optimum):
  k = 7
  stat_sum = -2.0 * _ref_df_grad(optimum, 0.0, k)
  below, above = optimum / 3, optimum * 3
  ref = np.array([_ref_df_grad(v, stat_sum, k) for v in (below, above)])
  assert ref[0] > 0 > ref[1]
  grad, hess = nix.df_derivatives(jnp.asarray([below, above], jnp.float32),
                                  jnp.float32(stat_sum), k)
  grad = np.asarray(grad)
  assert grad[0] > 0 > grad[1]
  # g(nu/2) is good to ~16 eps (test_special); grad = K/2 (g(nu/2) - g(nu*/2)) where
  # the two differ by a factor of ~3, so the difference loses at most ~2 bits.
  np.testing.assert_allclose(grad, ref, rtol=64 * EPS32)
  assert np.all(np.asarray(hess) < 0)
  naive = np.asarray(jax.vmap(jax.grad(nix.df_objective), (0, None, None))(
      jnp.asarray([below, above], jnp.float32), jnp.float32(stat_sum), k))
  if optimum >= 1e6:
    assert np.max(np.abs(naive / ref - 1)) > 0.05, naive


# ------------------------------------------------------------------- NIX == NIW at D = 1
def test_nix_equals_niw_in_one_dimension():
  # IW(nu, Psi) in 1-D is InvGamma(nu/2, Psi/2) = scaled-inv-chi^2(nu, Psi/nu): the same
  # nu and s^2 = Psi/nu. (niw.prior parameterises by E[Sigma], so build NIW directly.)
  rng = np.random.default_rng(9)
  x = (rng.normal(size=(23, 1)) * 1.7 + 0.4).astype(np.float32)
  y = (np.arange(23) % 2).astype(np.int32)
  loc, kappa, df, s2 = 0.1, 0.6, 3.3, 1.9
  p_nix = nix.NIX(*_f32([loc], [kappa], [df], [s2]))
  p_niw = niw.NIW(*_f32([loc], kappa, df, [[df * s2]]))
  st = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), 2)
  q_nix = nix.posterior(p_nix, st.count, st.mean, st.sq_dev)
  q_niw = niw.posterior(p_niw, st.count, st.mean, st.scatter)
  tol = 16 * EPS32
  np.testing.assert_allclose(q_nix.loc, q_niw.loc, rtol=tol, atol=tol)
  np.testing.assert_allclose(q_nix.mean_concentration[:, 0], q_niw.mean_concentration,
                             rtol=tol)
  np.testing.assert_allclose(q_nix.df[:, 0], q_niw.df, rtol=tol)
  np.testing.assert_allclose(q_nix.df[:, 0] * q_nix.scale_sq[:, 0], q_niw.scale[:, 0, 0],
                             rtol=tol)
  lml_nix = np.asarray(nix.log_marginal_likelihood(p_nix, q_nix, st.count))[:, 0]
  lml_niw = np.asarray(niw.log_marginal_likelihood(p_niw, q_niw, st.count))
  mag = _log_normalizer_magnitude(_as64(q_nix))[:, 0] + _log_normalizer_magnitude(
      _as64(p_nix))[0]
  np.testing.assert_array_less(np.abs(lml_nix - lml_niw), 16 * EPS32 * mag)
  pts = jnp.asarray(np.linspace(-6, 6, 13)[:, None], jnp.float32)
  for k in range(2):
    a = jax.tree_util.tree_map(lambda v: v[k], q_nix)
    b = jax.tree_util.tree_map(lambda v: v[k], q_niw)
    lp_nix, lp_niw = nix.log_predictive(a, pts), niw.log_predictive(b, pts)
    np.testing.assert_allclose(lp_nix, lp_niw, rtol=0,
                               atol=16 * EPS32 * (float(jnp.max(jnp.abs(lp_nix))) + 10))
  ex_nix = nix.expectations(q_nix, jnp.asarray([loc], jnp.float32))
  ex_niw = niw.expectations(q_niw, jnp.asarray([loc], jnp.float32))
  np.testing.assert_allclose(ex_nix.inv_var[:, 0], ex_niw.precision[:, 0, 0], rtol=tol)
  np.testing.assert_allclose(ex_nix.log_var[:, 0], ex_niw.log_det_cov, rtol=tol, atol=tol)
  np.testing.assert_allclose(ex_nix.mahalanobis[:, 0], ex_niw.mahalanobis, rtol=tol)
  # Same nu0 data term: c + 1 with Sigma0 = s0^2.
  t_nix = nix.df_statistic(q_nix, jnp.asarray([s2], jnp.float32))[:, 0]
  t_niw = niw.df_statistic(q_niw, jnp.asarray([[s2]], jnp.float32))
  np.testing.assert_allclose(t_nix, t_niw, rtol=tol, atol=tol)
