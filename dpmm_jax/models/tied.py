"""Gaussian DPMM with tied covariance (paper, eqs. 2-3), in closed form.

mu_k ~ N(mu0, Sigma0), x | k ~ N(mu_k, Sigma), with the empirical-Bayes choices of the
paper's Proposition 2: mu0 = global mean, Sigma0 = total covariance Sigma_hat_0,
Sigma = pooled within-class covariance Sigma_hat. Then

    p(x | D_k) = N(x | mu'_k, Sigma'_k + Sigma),  Sigma'_k = (Sigma0^-1 + N_k Sigma^-1)^-1,
    p(x)       = N(x | mu0, Sigma0 + Sigma).

Sigma and Sigma0 are diagonalised simultaneously (whiten Sigma, then rotate into the
eigenbasis of the whitened Sigma0 with eigenvalues lambda), after which every class is a
diagonal Gaussian with variances 1/(1/lambda + N_k) + 1: scoring costs O(M D^2 + M K D)
and runs as matrix products.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpmm_jax import linalg
from dpmm_jax import stats as stats_lib

_LOG_2PI = jnp.log(2.0 * jnp.pi)


class Params(NamedTuple):
  """basis: (D, D) map x -> z = (x - loc) @ basis in which Sigma = I, Sigma0 = diag;
  loc: (D,); log_jacobian: log|det basis|; class_mean (K, D), class_var (K, D) of the
  predictive in z; prior_var (D,) (prior predictive mean is 0 in z); log_counts (K,)."""
  basis: jax.Array
  loc: jax.Array
  log_jacobian: jax.Array
  class_mean: jax.Array
  class_var: jax.Array
  prior_var: jax.Array
  log_counts: jax.Array


def fit(stats: stats_lib.SufficientStats, rtol=None) -> Params:
  """Closed-form fit from statistics (diagonal-only statistics suffice)."""
  loc = stats_lib.global_mean(stats)
  within = stats_lib.pooled_covariance(stats)
  values_w, vectors_w = linalg.floored_eigh(within, rtol)
  white = vectors_w / jnp.sqrt(values_w)[None, :]                  # Sigma^-1/2
  prior_cov = white.T @ stats_lib.total_covariance(stats) @ white
  lam, rotation = linalg.floored_eigh(prior_cov, rtol)
  basis = white @ rotation
  log_jacobian = -0.5 * jnp.sum(jnp.log(values_w))
  n = stats.count[:, None]
  post_var = 1.0 / (1.0 / lam + n)                                  # (K, D)
  # mu'_k = Sigma'_k (Sigma0^-1 mu0 + N_k Sigma^-1 xbar_k); in z the prior mean is 0.
  zbar = (stats.mean - loc) @ basis
  class_mean = post_var * n * zbar
  return Params(basis, loc, log_jacobian, class_mean, post_var + 1.0, lam + 1.0,
                jnp.log(stats.count))


def _diag_gaussian_log_density(z, mean, var):
  """(M, K) log N(z | mean_k, diag var_k), expanded into matrix products."""
  inv = 1.0 / var
  quad = (z * z) @ inv.T - 2.0 * z @ (mean * inv).T + jnp.sum(mean * mean * inv, -1)
  return -0.5 * (quad + jnp.sum(jnp.log(var), -1) + z.shape[-1] * _LOG_2PI)


def log_predictive(params: Params, x):
  """(class (M, K) log p(x | D_k), prior (M,) log p(x))."""
  z = (x - params.loc) @ params.basis
  class_lp = _diag_gaussian_log_density(z, params.class_mean, params.class_var)
  prior_lp = _diag_gaussian_log_density(z, jnp.zeros_like(params.prior_var)[None],
                                        params.prior_var[None])[:, 0]
  return class_lp + params.log_jacobian, prior_lp + params.log_jacobian
