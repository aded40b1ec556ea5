"""Gamma distribution in the shape-rate parameterisation: Gamma(a, b), density
b^a x^(a-1) e^(-b x) / Gamma(a). Elementwise with broadcasting.

Mean-field building blocks (same verbs as ``niw``/``nix``/``dirichlet``): expectations,
KL divergence, log density. Used for precisions (``nix``) and for gamma-process weights.
"""
import jax.numpy as jnp
from jax.scipy import special as jsp


def mean(shape, rate):
  """E[x] = a / b."""
  return shape / rate


def expected_log(shape, rate):
  """E[log x] = psi(a) - log b."""
  return jsp.digamma(shape) - jnp.log(rate)


def log_density(x, shape, rate):
  """log Gamma(x | a, b)."""
  return shape * jnp.log(rate) + (shape - 1.0) * jnp.log(x) - rate * x - jsp.gammaln(shape)


def entropy(shape, rate):
  """H = a - log b + log Gamma(a) + (1 - a) psi(a)."""
  return shape - jnp.log(rate) + jsp.gammaln(shape) + (1.0 - shape) * jsp.digamma(shape)


def kl_divergence(shape_q, rate_q, shape_p, rate_p):
  """KL(Gamma(a_q, b_q) || Gamma(a_p, b_p))
  = (a_q - a_p) psi(a_q) - log Gamma(a_q) + log Gamma(a_p)
    + a_p (log b_q - log b_p) + a_q (b_p - b_q) / b_q."""
  return ((shape_q - shape_p) * jsp.digamma(shape_q) - jsp.gammaln(shape_q)
          + jsp.gammaln(shape_p) + shape_p * (jnp.log(rate_q) - jnp.log(rate_p))
          + shape_q * (rate_p / rate_q - 1.0))
