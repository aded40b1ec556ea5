"""Tests for dpmm_jax.special in float32 (the float64 pass is in test_math_f64.py).

References are scipy in float64. ``log(z) - digamma(z)`` and ``1/z - trigamma(z)`` are
checked against integral representations evaluated with ``scipy.integrate.quad``, which
involve no cancellation, so the reference is accurate for every z (scipy's own direct
difference loses digits like eps * z and is only used to check the reference itself).

Tolerances are stated in units of float32 epsilon times the condition number of the
computed expression: a function of float32 inputs that rounds each intermediate cannot
do better than ``eps * sum |intermediate terms| / |result|`` relative.
"""
import jax
import jax.numpy as jnp
from jax.scipy import special as jsp
import numpy as np
import pytest
from scipy import integrate
from scipy import special as sps

from dpmm_jax import special

EPS32 = float(np.finfo(np.float32).eps)
THRESHOLD = 10.0  # special._SERIES_THRESHOLD: series above, direct formula below.


# --------------------------------------------------------------- float64 references
def _binet_kernel(t):
  """f(t) = 1/(e^t - 1) - 1/t + 1/2 >= 0, with its Taylor series for small t."""
  t = np.asarray(t, np.float64)
  small = t < 1e-2
  ts = np.where(small, 1.0, t)
  with np.errstate(over="ignore"):
    direct = 1.0 / np.expm1(ts) - 1.0 / ts + 0.5
  series = t / 12 - t ** 3 / 720 + t ** 5 / 30240 - t ** 7 / 1209600
  return np.where(small, series, direct)


def ref_log_minus_digamma(z):
  """log z - psi(z) = 1/(2z) + int_0^inf f(t) e^{-zt} dt  (Binet), by quadrature in s = zt."""
  z = float(z)
  val, _ = integrate.quad(lambda s: _binet_kernel(s / z) * np.exp(-s), 0, np.inf,
                          epsabs=0, epsrel=1e-13, limit=200)
  return 1.0 / (2 * z) + val / z


def ref_inv_minus_trigamma(z):
  """1/z - psi'(z) = -1/(2z^2) - int_0^inf t f(t) e^{-zt} dt (derivative of Binet's)."""
  z = float(z)
  val, _ = integrate.quad(lambda s: (s / z) * _binet_kernel(s / z) * np.exp(-s), 0, np.inf,
                          epsabs=0, epsrel=1e-13, limit=200)
  return -1.0 / (2 * z * z) - val / z


ZS = np.array([0.05, 0.5, 1.0, 2.5, 7.0, 9.999, 10.0, 10.001, 30.0, 1e2, 1e3, 1e4, 1e5,
               1e6, 1e7], np.float32)


def test_references_agree_with_scipy_where_scipy_is_accurate():
  # The reference itself: scipy's direct float64 difference has relative error about
  # eps64 * (|log z| + |psi(z)|) / value ~ 4 eps64 z log z; check where that is < 1e-11.
  for z in [0.3, 1.0, 5.0, 9.99, 10.0, 10.01, 100.0, 1000.0]:
    direct1 = np.log(z) - sps.digamma(z)
    direct2 = 1.0 / z - sps.polygamma(1, z)
    bound = 1e-13 + 8 * np.finfo(np.float64).eps * z * max(1.0, np.log(z)) * 2
    assert abs(ref_log_minus_digamma(z) / direct1 - 1) < bound, z
    assert abs(ref_inv_minus_trigamma(z) / direct2 - 1) < bound, z


# --------------------------------------------------------------- multivariate gamma family
def _a_values(dim):
  # Arguments must exceed (dim - 1)/2; include values near the lgamma roots (a = 1, 2).
  return (np.array([0.7, 1.2, 3.0, 10.0, 55.5, 1e3, 1e5]) + (dim - 1) / 2).astype(np.float32)


@pytest.mark.parametrize("dim", [1, 2, 5, 64])
def test_multigammaln_matches_scipy(dim):
  a = _a_values(dim)
  got = np.asarray(jsp.multigammaln(jnp.asarray(a), dim))
  a64 = a.astype(np.float64)
  ref = np.array([sps.multigammaln(x, dim) for x in a64])
  terms = sps.gammaln(a64[:, None] - 0.5 * np.arange(dim))
  # lgamma's float32 error is absolute near its roots, hence the +1 per term.
  scale = np.sum(np.abs(terms) + 1.0, -1) + dim * (dim - 1) / 4 * np.log(np.pi)
  assert got.dtype == np.float32
  np.testing.assert_array_less(np.abs(got - ref), 8 * EPS32 * scale)


@pytest.mark.parametrize("dim", [1, 2, 5, 64])
def test_multidigamma_and_multitrigamma_match_scipy(dim):
  a = _a_values(dim)
  a64 = a.astype(np.float64)[:, None] - 0.5 * np.arange(dim)
  psi = sps.digamma(a64)
  got = np.asarray(special.multidigamma(jnp.asarray(a), dim))
  np.testing.assert_array_less(np.abs(got - psi.sum(-1)),
                               8 * EPS32 * np.sum(np.abs(psi) + 1.0, -1))
  tri = sps.polygamma(1, a64)
  got = np.asarray(special.multitrigamma(jnp.asarray(a), dim))
  np.testing.assert_array_less(np.abs(got / tri.sum(-1) - 1), 8 * EPS32)


def test_multidigamma_is_derivative_of_multigammaln():
  dim = 4
  a = jnp.asarray([2.1, 7.0, 300.0], jnp.float32)
  grad = jax.vmap(jax.grad(lambda x: jsp.multigammaln(x, dim)))(a)
  np.testing.assert_allclose(grad, special.multidigamma(a, dim), rtol=16 * EPS32)
  hess = jax.vmap(jax.grad(lambda x: special.multidigamma(x, dim)))(a)
  np.testing.assert_allclose(hess, special.multitrigamma(a, dim), rtol=16 * EPS32)


# ------------------------------------------------- stable log - digamma, 1/z - trigamma
def _cond_log_minus_digamma(z):
  """Relative condition of the float32 evaluation: |terms| / |result| (1 for the series)."""
  z = np.float64(z)
  if z >= THRESHOLD:
    return 1.0
  return (abs(np.log(z)) + abs(sps.digamma(z))) / (np.log(z) - sps.digamma(z))


def _cond_inv_minus_trigamma(z):
  z = np.float64(z)
  if z >= THRESHOLD:
    return 1.0
  return (1 / z + sps.polygamma(1, z)) / abs(1 / z - sps.polygamma(1, z))


@pytest.fixture(scope="module")
def references():
  return (np.array([ref_log_minus_digamma(z) for z in ZS]),
          np.array([ref_inv_minus_trigamma(z) for z in ZS]))


def test_log_minus_digamma_accurate_for_all_z(references):
  ref, _ = references
  got = np.asarray(special.log_minus_digamma(jnp.asarray(ZS)))
  assert got.dtype == np.float32
  assert np.all(got > 0)
  cond = np.array([_cond_log_minus_digamma(z) for z in ZS])
  np.testing.assert_array_less(np.abs(got / ref - 1), 8 * EPS32 * (1 + cond))


def test_inv_minus_trigamma_accurate_for_all_z(references):
  _, ref = references
  got = np.asarray(special.inv_minus_trigamma(jnp.asarray(ZS)))
  assert got.dtype == np.float32
  assert np.all(got < 0)
  cond = np.array([_cond_inv_minus_trigamma(z) for z in ZS])
  np.testing.assert_array_less(np.abs(got / ref - 1), 8 * EPS32 * (1 + cond))


def test_naive_float32_differences_are_garbage_at_large_z(references):
  """The reason these helpers exist: at z >= 1e6 the naive float32 difference is off by
  more than 5% (often 100%) while the stable form is within a few ulps."""
  ref1, ref2 = references
  big = ZS >= 1e6
  z = jnp.asarray(ZS[big])
  naive1 = np.asarray(jnp.log(z) - jax.scipy.special.digamma(z))
  naive2 = np.asarray(1.0 / z - jax.scipy.special.polygamma(1, z))
  assert np.all(np.abs(naive1 / ref1[big] - 1) > 0.05)
  assert np.all(np.abs(naive2 / ref2[big] - 1) > 0.05)
  stable1 = np.asarray(special.log_minus_digamma(z))
  stable2 = np.asarray(special.inv_minus_trigamma(z))
  np.testing.assert_array_less(np.abs(stable1 / ref1[big] - 1), 16 * EPS32)
  np.testing.assert_array_less(np.abs(stable2 / ref2[big] - 1), 16 * EPS32)


def test_continuous_across_the_series_threshold():
  # Neighbouring float32 values straddling z = 10: the true functions change by a
  # relative ~ulp there, so any jump is the mismatch of the two branches; it must stay
  # within the direct branch's float32 error (condition number ~ 90 at z = 10).
  below = np.nextafter(np.float32(THRESHOLD), np.float32(0))
  z = jnp.asarray([below, THRESHOLD], jnp.float32)
  for fn, cond in [(special.log_minus_digamma, _cond_log_minus_digamma(below)),
                   (special.inv_minus_trigamma, _cond_inv_minus_trigamma(below))]:
    lo, hi = np.asarray(fn(z))
    assert abs(lo / hi - 1) < 8 * EPS32 * (1 + cond)


def test_stable_helpers_are_jittable_and_broadcast():
  # Jitted code may fuse and round differently from eager code, so compare with the
  # float64 reference under the same conditioned tolerance rather than bitwise.
  zs = np.array([[0.5, 20.0], [1e4, 3.0]], np.float32)
  cases = [(special.log_minus_digamma, ref_log_minus_digamma, _cond_log_minus_digamma),
           (special.inv_minus_trigamma, ref_inv_minus_trigamma, _cond_inv_minus_trigamma)]
  for fn, ref_fn, cond_fn in cases:
    out = np.asarray(jax.jit(fn)(jnp.asarray(zs)))
    assert out.shape == zs.shape and out.dtype == np.float32
    ref = np.vectorize(ref_fn)(zs.astype(np.float64))
    cond = np.vectorize(cond_fn)(zs)
    np.testing.assert_array_less(np.abs(out / ref - 1), 8 * EPS32 * (1 + cond))
