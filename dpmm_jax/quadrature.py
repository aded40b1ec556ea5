"""One-dimensional quadrature over a positive scale gamma, done in u = log(gamma).

The coupled model integrates each class's scale factor gamma_k out numerically. Its
posterior, given N_k D observations, can be far narrower than any fixed grid's spacing
(ImageNet: ~10^6 observations per class) and a fixed grid that is too narrow truncates
the prior. So the grid adapts: it is centred on each class's posterior mode in u with a
spacing set by the Laplace width, and integrates with the trapezoid rule, which converges
exponentially fast for smooth, rapidly decaying integrands. For the prior predictive the
grid covers the Gamma prior's mass.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpmm_jax import special


class Grid(NamedTuple):
  """nodes: (..., P) values of u = log gamma; log_step: (...,) log of the node spacing
  (trapezoid weight; end-point halving is immaterial since the integrand is ~0 there)."""
  nodes: jax.Array
  log_step: jax.Array


def log_gamma_density_of_log(u, shape):
  """log density of u = log gamma for gamma ~ Gamma(shape, rate=shape) (mean 1).

  a log a - lgamma(a) + a u - a e^u, evaluated as [a log a - a - lgamma(a)]
  - a (e^u - 1 - u): the naive form cancels terms of size a log a, which in float32 is
  noise of order 1 once a ~ 1e6 (the tied limit of the coupled model).
  """
  shape = jnp.asarray(shape)
  # e^u - 1 - u, by its Taylor series where expm1(u) - u would cancel.
  us = jnp.clip(u, -0.1, 0.1)
  taylor = us * us * (1.0 / 2 + us * (1.0 / 6 + us * (1.0 / 24 + us * (
      1.0 / 120 + us * (1.0 / 720 + us / 5040)))))
  excess = jnp.where(jnp.abs(u) < 0.1, taylor, jnp.expm1(u) - u)
  return special.log_gamma_normalizer_excess(shape) - shape * excess


def centred_grid(mode, scale, num_nodes: int, half_width: float) -> Grid:
  """Equally spaced nodes mode + scale * linspace(-half_width, half_width, num_nodes)."""
  z = jnp.linspace(-half_width, half_width, num_nodes, dtype=mode.dtype)
  step = 2.0 * half_width / (num_nodes - 1)
  return Grid(mode[..., None] + scale[..., None] * z, jnp.log(scale * step))


def gamma_prior_grid(shape, num_nodes: int) -> Grid:
  """Grid covering the mass of u = log gamma, gamma ~ Gamma(shape, shape).

  The density of u peaks at 0 with Laplace width 1/sqrt(shape); its left tail decays
  like exp(shape u) and its right tail doubly exponentially, so the window is
  [-(8/sqrt(a) + 20/a), log(1 + 40/a) + 8/sqrt(a)]. The neglected prior mass is below
  e^-20 for a <~ 1; for large a the density is Gaussian to within O(1/sqrt(a)) and each
  end lies 8 widths out (neglected mass ~ 1e-15; the right end used to lie at 4 widths,
  1e-5 of the mass, for a >~ 1e3). A test point far out tilts this density towards
  larger gamma; the coupled model scores such points with a grid centred on the tilted
  density instead (``coupled.TailTerms``).
  """
  lo = -(8.0 / jnp.sqrt(shape) + 20.0 / shape)
  hi = jnp.log1p(40.0 / shape) + 8.0 / jnp.sqrt(shape)
  t = jnp.linspace(0.0, 1.0, num_nodes, dtype=jnp.result_type(shape, float))
  return Grid(lo + (hi - lo) * t, jnp.log((hi - lo) / (num_nodes - 1)))


def normalized_log_weights(grid: Grid, log_integrand):
  """log of normalised quadrature weights w_p ∝ step * f(u_p) over the last axis."""
  return jax.nn.log_softmax(log_integrand, axis=-1)


def log_integral(grid: Grid, log_integrand):
  """log ∫ f(u) du ≈ log sum_p step * f(u_p); over the last axis."""
  return jax.nn.logsumexp(log_integrand, axis=-1) + grid.log_step
