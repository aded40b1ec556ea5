"""Tests for dpmm_jax.student_t in float32 against scipy.stats in float64.

Tolerance: a float32 evaluation of log St = log_norm - (df + D)/2 log1p(m/df) rounds
every term, so its absolute error is a few ulps of the sum of the terms' magnitudes; the
Mahalanobis distance m comes from a triangular solve whose relative error grows with the
condition number of the scale's Cholesky factor (the scales here have cond(L) <= ~10).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special as sps
from scipy import stats

from dpmm_jax import student_t

EPS32 = float(np.finfo(np.float32).eps)


def _assert_within(got, ref, tol):
  """|got - ref| < tol elementwise (tol may be an array)."""
  np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - ref), tol)


def _spd(rng, dim, cond=50.0):
  """Random SPD matrix with eigenvalues spread log-uniformly over [1, cond]."""
  q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
  return (q * np.geomspace(1.0, cond, dim)) @ q.T * rng.uniform(0.5, 2.0)


def _log_gamma_ratio_magnitude(a, h):
  """Round-off scale of lgamma(a + h) - lgamma(a) evaluated without cancellation: ~h log a
  for large a (Stirling form); for small a the direct lgammas, which are then small."""
  direct = np.where(a < 20, np.abs(sps.gammaln(a + h)) + np.abs(sps.gammaln(a)), 0.0)
  return h * (np.abs(np.log(a)) + 2) + direct


def _magnitude(x, df, loc, scale):
  """Sum of |terms| of log St in float64 (the float32 round-off scale), per point."""
  dim = loc.shape[-1]
  chol = np.linalg.cholesky(scale)
  white = np.linalg.solve(chol, (x - loc).T)
  maha = np.sum(white ** 2, 0)
  cond_l = np.linalg.cond(chol)
  return (_log_gamma_ratio_magnitude(df / 2, dim / 2)
          + dim / 2 * abs(np.log(df * np.pi)) + np.sum(np.abs(np.log(np.diag(chol))))
          + (df + dim) / 2 * np.log1p(maha / df) * (1 + cond_l * maha / (df + maha)))


@pytest.mark.parametrize("dim,df", [(1, 0.7), (3, 2.5), (3, 30.0), (10, 4.0), (10, 1e4)])
def test_mvt_log_density_matches_scipy(dim, df):
  rng = np.random.default_rng([dim, int(df * 10)])
  loc = rng.normal(size=dim) * 3
  scale = _spd(rng, dim)
  x = loc + rng.standard_t(df, size=(50, dim)) @ np.linalg.cholesky(scale).T
  x, loc, scale = (a.astype(np.float32) for a in (x, loc, scale))
  chol = np.linalg.cholesky(scale.astype(np.float64)).astype(np.float32)
  got = np.asarray(student_t.mvt_log_density(jnp.asarray(x), jnp.float32(df),
                                             jnp.asarray(loc), jnp.asarray(chol)))
  assert got.shape == (50,) and got.dtype == np.float32
  chol64 = chol.astype(np.float64)
  ref = stats.multivariate_t(loc=loc.astype(np.float64), shape=chol64 @ chol64.T,
                             df=df).logpdf(x.astype(np.float64))
  tol = 16 * EPS32 * _magnitude(x.astype(np.float64), df, loc.astype(np.float64),
                                chol64 @ chol64.T)
  np.testing.assert_array_less(np.abs(got - ref), tol)


@pytest.mark.parametrize("df", [1e6, 1e7])
def test_huge_dof_keeps_an_accurate_normalizer(df):
  # The tied limit drives nu0 (and so the predictive dof) to its cap of 1e6. Formed as
  # lgamma((df + D)/2) - lgamma(df/2), the normaliser's float32 round-off is
  # eps * lgamma(df/2) ~ 0.1-1 nats; the density must stay good to a few ulps of its
  # own terms (~1e-4 nats here). Reference: log poch(df/2, D/2) (scipy, float64, exact
  # to ~1e-15 here, unlike a difference of lgammas).
  rng = np.random.default_rng(7)
  dim = 6
  scale = _spd(rng, dim, 10.0)
  chol = np.linalg.cholesky(scale)
  loc = rng.normal(size=dim)
  x = loc + rng.normal(size=(20, dim)) @ chol.T * 2
  got = np.asarray(student_t.mvt_log_density(
      jnp.asarray(x, jnp.float32), jnp.float32(df), jnp.asarray(loc, jnp.float32),
      jnp.asarray(chol, jnp.float32)), np.float64)
  x32, loc32, chol32 = (np.asarray(a, np.float32).astype(np.float64) for a in (x, loc, chol))
  white = np.linalg.solve(chol32, (x32 - loc32).T)
  maha = np.sum(white ** 2, 0)
  ref = (np.log(sps.poch(df / 2, dim / 2)) - dim / 2 * np.log(df * np.pi)
         - np.sum(np.log(np.diag(chol32))) - (df + dim) / 2 * np.log1p(maha / df))
  _assert_within(got, ref, 16 * EPS32 * _magnitude(x32, df, loc32, chol32 @ chol32.T))
  got_t = np.asarray(student_t.t_log_density(jnp.asarray(x32[:, 0], jnp.float32),
                                             jnp.float32(df), 0.0, 1.0), np.float64)
  ref_t = (np.log(sps.poch(df / 2, 0.5)) - 0.5 * np.log(df * np.pi)
           - (df + 1) / 2 * np.log1p(x32[:, 0] ** 2 / df))
  _assert_within(got_t, ref_t, 16 * EPS32 * _t_magnitude(x32[:, 0], df, 0.0, 1.0))


def test_mvt_log_normalizer_is_density_at_loc_and_batches():
  rng = np.random.default_rng(1)
  scales = np.stack([_spd(rng, 4) for _ in range(3)]).astype(np.float32)
  dfs = np.array([1.5, 8.0, 200.0], np.float32)
  chols = np.linalg.cholesky(scales.astype(np.float64))
  got = np.asarray(student_t.mvt_log_normalizer(jnp.asarray(dfs),
                                                jnp.asarray(chols.astype(np.float32))))
  assert got.shape == (3,)
  ref = [stats.multivariate_t(loc=np.zeros(4), shape=c @ c.T, df=d).logpdf(np.zeros(4))
         for c, d in zip(chols, dfs.astype(np.float64))]
  mag = [_magnitude(np.zeros((1, 4)), d, np.zeros(4), c @ c.T)[0]
         for c, d in zip(chols, dfs.astype(np.float64))]
  _assert_within(got, ref, 16 * EPS32 * np.asarray(mag))


def test_mahalanobis_form_equals_full_density():
  rng = np.random.default_rng(2)
  dim, df = 5, 6.0
  scale = _spd(rng, dim)
  chol = jnp.asarray(np.linalg.cholesky(scale), jnp.float32)
  loc = jnp.asarray(rng.normal(size=dim), jnp.float32)
  x = jnp.asarray(rng.normal(size=(7, dim)) * 2, jnp.float32)
  white = jax.scipy.linalg.solve_triangular(chol, (x - loc).T, lower=True)
  maha = jnp.sum(white ** 2, 0)
  lhs = student_t.mvt_log_density_from_mahalanobis(
      maha, df, student_t.mvt_log_normalizer(df, chol), dim)
  np.testing.assert_allclose(lhs, student_t.mvt_log_density(x, df, loc, chol),
                             rtol=0, atol=8 * EPS32 * float(jnp.max(jnp.abs(lhs))))


def _t_magnitude(x, df, loc, scale_sq):
  """Sum of |terms| of the univariate log St in float64, elementwise."""
  z = (x - loc) ** 2 / (df * scale_sq)
  return (_log_gamma_ratio_magnitude(df / 2, 0.5)
          + 0.5 * np.abs(np.log(df * np.pi * scale_sq)) + (df + 1) / 2 * np.log1p(z) * 2)


@pytest.mark.parametrize("df", [0.5, 3.0, 40.0, 1e5])
def test_t_log_density_matches_scipy(df):
  rng = np.random.default_rng(int(df * 10))
  loc = rng.normal(size=(1, 6)).astype(np.float32)
  scale_sq = rng.uniform(0.1, 10.0, size=(1, 6)).astype(np.float32)
  x = (loc + rng.normal(size=(40, 6)) * 5).astype(np.float32)
  got = np.asarray(student_t.t_log_density(jnp.asarray(x), jnp.float32(df),
                                           jnp.asarray(loc), jnp.asarray(scale_sq)))
  x64, loc64, s64 = (a.astype(np.float64) for a in (x, loc, scale_sq))
  ref = stats.t.logpdf(x64, df, loc64, np.sqrt(s64))
  np.testing.assert_array_less(np.abs(got - ref), 16 * EPS32 * _t_magnitude(x64, df, loc64, s64))


def test_product_t_log_density_sums_over_last_axis_with_per_dim_params():
  rng = np.random.default_rng(3)
  df = np.array([1.0, 4.0, 50.0], np.float32)
  loc = rng.normal(size=3).astype(np.float32)
  scale_sq = np.array([0.5, 2.0, 9.0], np.float32)
  x = rng.normal(size=(2, 5, 3)).astype(np.float32) * 3
  got = np.asarray(student_t.product_t_log_density(jnp.asarray(x), df, loc, scale_sq))
  assert got.shape == (2, 5)
  x64 = x.astype(np.float64)
  ref = stats.t.logpdf(x64, df, loc, np.sqrt(scale_sq)).sum(-1)
  mag = _t_magnitude(x64, df.astype(np.float64), loc.astype(np.float64),
                     scale_sq.astype(np.float64)).sum(-1)
  _assert_within(got, ref, 16 * EPS32 * mag)


def test_far_away_points_have_finite_accurate_log_densities():
  # 1e6 away: m ~ 1e12, (m/df) would overflow nothing but 1 + m/df loses the 1; log1p
  # keeps it finite and right. The log density is ~ -(df + D)/2 log(m/df) ~ -1e2.
  dim, df = 4, 3.0
  rng = np.random.default_rng(4)
  scale = _spd(rng, dim, cond=10.0)
  chol = np.linalg.cholesky(scale)
  loc = rng.normal(size=dim)
  x = loc + np.array([[1e6, 0, 0, 0], [0, -1e6, 1e6, 0], [3e5, 3e5, 3e5, -3e5]])
  got = np.asarray(student_t.mvt_log_density(
      jnp.asarray(x, jnp.float32), jnp.float32(df), jnp.asarray(loc, jnp.float32),
      jnp.asarray(chol, jnp.float32)))
  ref = stats.multivariate_t(loc=loc, shape=chol @ chol.T, df=df).logpdf(x)
  assert np.all(np.isfinite(got))
  # Relative error of m is ~ eps32 * cond(L); the density depends on it through
  # (df + D)/2 log(m), so the absolute error is ~ (df + D)/2 * 8 eps32 * cond(L).
  np.testing.assert_allclose(got, ref, rtol=0,
                             atol=(df + dim) / 2 * 8 * EPS32 * np.linalg.cond(chol) + 1e-4)
  got_t = np.asarray(student_t.t_log_density(jnp.float32(1e6), 2.0, 0.0, 1.0))
  np.testing.assert_allclose(got_t, stats.t.logpdf(1e6, 2.0), rtol=1e-6)
  got_prod = student_t.product_t_log_density(jnp.full((1, 64), 1e6, jnp.float32), 1.0,
                                             0.0, 1e-3)
  assert np.isfinite(np.asarray(got_prod)).all()


def test_jit_and_vmap():
  rng = np.random.default_rng(5)
  scale = _spd(rng, 3)
  chols = jnp.asarray(np.stack([np.linalg.cholesky(scale), np.linalg.cholesky(2 * scale)]),
                      jnp.float32)
  locs = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
  fn = jax.jit(jax.vmap(student_t.mvt_log_density, in_axes=(None, None, 0, 0)))
  out = np.asarray(fn(x, 5.0, locs, chols))
  assert out.shape == (2, 6)
  for k in range(2):
    c = np.asarray(chols[k], np.float64)
    ref = stats.multivariate_t(loc=np.asarray(locs[k], np.float64), shape=c @ c.T,
                               df=5.0).logpdf(np.asarray(x, np.float64))
    mag = _magnitude(np.asarray(x, np.float64), 5.0, np.asarray(locs[k], np.float64), c @ c.T)
    _assert_within(out[k], ref, 16 * EPS32 * mag)
