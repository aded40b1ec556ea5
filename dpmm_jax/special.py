"""Special functions for the conjugate families, with numerically stable differences.

The generalized-Newton M-steps need differences such as ``log(z) - digamma(z)`` and
``1/z - trigamma(z)`` that vanish like ``1/z`` and ``1/z**2`` as the concentration grows.
Computed naively they cancel catastrophically (in float32 already at ``z ~ 1e4``), which
would make the tied limit (``nu0 -> infinity``) unreachable. The helpers below switch to
asymptotic series for large arguments.
"""
import math

import jax.numpy as jnp
from jax.scipy import special as jsp

# log(2 pi): the Gaussian normaliser's constant, shared by every density in the package.
LOG_2PI = math.log(2.0 * math.pi)

# Below this argument the direct formulas are accurate to a few ulps times their
# condition number (< 100 at z = 10); above it the asymptotic series (Bernoulli terms
# through B_16) is accurate to < 2e-15 relative, i.e. to float64 precision (through
# B_10 only, it was off by 1.5e-11 (log - digamma) and 1.5e-10 (1/z - trigamma) at z = 10).
_SERIES_THRESHOLD = 10.0


def multidigamma(a, dim: int):
  """psi_D(a) = sum_{i=1}^D digamma(a + (1 - i)/2), the derivative of
  ``jax.scipy.special.multigammaln(a, dim)`` (log Gamma_D, used directly)."""
  a = jnp.asarray(a)
  offsets = -0.5 * jnp.arange(dim, dtype=a.dtype)
  return jnp.sum(jsp.digamma(a[..., None] + offsets), axis=-1)


def multitrigamma(a, dim: int):
  """psi_D'(a) = sum_{i=1}^D trigamma(a + (1 - i)/2)."""
  a = jnp.asarray(a)
  offsets = -0.5 * jnp.arange(dim, dtype=a.dtype)
  return jnp.sum(jsp.polygamma(1, a[..., None] + offsets), axis=-1)


def _series_or_direct(z, series, direct):
  """Evaluates ``series(1/z)`` for z >= threshold and ``direct(z)`` below it, feeding
  each branch only arguments from its own range (no NaN leaks through ``where``)."""
  z = jnp.asarray(z)
  inv = 1.0 / jnp.maximum(z, _SERIES_THRESHOLD)
  return jnp.where(z >= _SERIES_THRESHOLD, series(inv),
                   direct(jnp.minimum(z, _SERIES_THRESHOLD)))


# The asymptotic series' coefficients, each a polynomial in 1/z^2 (Horner order, low first).
# log z - psi(z) = 1/(2z) + sum_k B_2k / (2k z^2k), k = 1..8: B_2k / (2k).
_DIGAMMA_SERIES = (1.0 / 12, -1.0 / 120, 1.0 / 252, -1.0 / 240, 1.0 / 132, -691.0 / 32760,
                   1.0 / 12, -3617.0 / 8160)
# 1/z - psi'(z) = -1/(2 z^2) - sum_k B_2k / z^(2k+1), k = 1..8: B_2k.
_TRIGAMMA_SERIES = (1.0 / 6, -1.0 / 30, 1.0 / 42, -1.0 / 30, 5.0 / 66, -691.0 / 2730,
                    7.0 / 6, -3617.0 / 510)
# Stirling: lgamma remainder r(z) = sum_k B_2k / (2k (2k - 1) z^(2k-1)), k = 1..4.
_STIRLING_SERIES = (1.0 / 12, -1.0 / 360, 1.0 / 1260, -1.0 / 1680)


def _horner(x, coeffs):
  """c_0 + x (c_1 + x (c_2 + ... + x c_n)) for coeffs = (c_0, ..., c_n)."""
  acc = coeffs[-1]
  for c in reversed(coeffs[:-1]):
    acc = c + x * acc
  return acc


def log_minus_digamma(z):
  """log(z) - digamma(z) > 0, stable for large z (it behaves like 1/(2z)).

  Args:
    z: positive array.
  Returns:
    Array of the same shape.
  """
  # log z - psi(z) = 1/(2z) + sum_k B_2k / (2k z^2k), through B_16.
  series = lambda inv: inv * (0.5 + inv * _horner(inv * inv, _DIGAMMA_SERIES))
  return _series_or_direct(z, series, lambda s: jnp.log(s) - jsp.digamma(s))


def inv_minus_trigamma(z):
  """1/z - trigamma(z) < 0, stable for large z (it behaves like -1/(2 z^2)).

  Args:
    z: positive array.
  Returns:
    Array of the same shape.
  """
  def series(inv):
    inv2 = inv * inv
    # 1/z - psi'(z) = -1/(2 z^2) - sum_k B_2k / z^(2k+1), through B_16.
    return -inv2 * (0.5 + inv * _horner(inv2, _TRIGAMMA_SERIES))
  return _series_or_direct(z, series, lambda s: 1.0 / s - jsp.polygamma(1, s))


def _stirling_remainder(z):
  """lgamma(z) - [(z - 1/2) log z - z + log(2 pi)/2] for z >= 10 (error < 1e-12)."""
  inv = 1.0 / z
  return inv * _horner(inv * inv, _STIRLING_SERIES)


def log_gamma_ratio_excess(z, h):
  """lgamma(z + h) - lgamma(z) - h log(z), accurate when z is large.

  The log marginal likelihoods need lgamma(nu'/2) - lgamma(nu0/2) with nu' = nu0 + N_k,
  whose leading part h log z cancels against the log|scale| terms. Formed naively the
  difference loses everything in float32 once z ~ 1e5 (each lgamma is ~1e6 with an ulp
  of ~0.1), which hides the likelihood's flat approach to the tied limit nu0 -> inf.
  For z >= 10 Stirling's series gives (z + h - 1/2) log1p(h/z) - h + r(z + h) - r(z)
  (r: the series remainder), whose first part is summed as a power series in h/z when
  h/z < 0.1; below z = 10 the direct formula has nothing large to cancel.

  Args:
    z: positive array; h: non-negative array (broadcastable).
  Returns:
    Array of the broadcast shape.
  """
  z, h = jnp.broadcast_arrays(jnp.asarray(z), jnp.asarray(h, jnp.result_type(z)))
  big = z >= _SERIES_THRESHOLD
  zb = jnp.where(big, z, _SERIES_THRESHOLD)
  x = h / zb
  # (z + h - 1/2) log1p(x) - h = z [(1 + x) log1p(x) - x] - log1p(x) / 2, and the bracket
  # is sum_{n>=2} (-x)^n / (n (n - 1)) (summed for x < 0.1, where it would cancel).
  xs = jnp.minimum(x, 0.1)
  bracket_series = xs * xs * (1.0 / 2 - xs * (1.0 / 6 - xs * (1.0 / 12 - xs * (
      1.0 / 20 - xs * (1.0 / 30 - xs * (1.0 / 42 - xs * (1.0 / 56 - xs / 72)))))))
  bracket = jnp.where(x < 0.1, bracket_series, (1.0 + x) * jnp.log1p(x) - x)
  series = (zb * bracket - 0.5 * jnp.log1p(x)
            + _stirling_remainder(zb + h) - _stirling_remainder(zb))
  zs = jnp.where(big, 1.0, z)
  direct = jsp.gammaln(zs + h) - jsp.gammaln(zs) - h * jnp.log(zs)
  return jnp.where(big, series, direct)


def log_gamma_normalizer_excess(a):
  """a log a - a - lgamma(a), the log normaliser of Gamma(shape a, rate a) less its
  linear part, accurate for large a (= log(a / (2 pi)) / 2 - r(a) by Stirling)."""
  a = jnp.asarray(a)
  big = a >= _SERIES_THRESHOLD
  ab = jnp.where(big, a, _SERIES_THRESHOLD)
  series = 0.5 * jnp.log(ab / (2.0 * jnp.pi)) - _stirling_remainder(ab)
  as_ = jnp.where(big, 1.0, a)
  direct = as_ * jnp.log(as_) - as_ - jsp.gammaln(as_)
  return jnp.where(big, series, direct)

