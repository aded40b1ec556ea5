"""Normal-inverse-chi-squared family, one independent copy per dimension (appendix 14).

Prior:  sigma^2 ~ scaled-inv-chi^2(nu0, s0^2) = InvGamma(nu0/2, nu0 s0^2/2),
        mu | sigma^2 ~ N(mu0, sigma^2 / kappa0).
Symbols: nu = ``df``, s^2 = ``scale_sq``, kappa = ``mean_concentration``, mu = ``loc``.
Every field has shape (..., D) and all functions are elementwise with broadcasting, which
is how the coupled model adds a quadrature axis. ``niw`` has the same function names.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy import special as jsp

from dpmm_jax import precision
from dpmm_jax import special
from dpmm_jax import student_t
from dpmm_jax.conjugate import gamma


class NIX(NamedTuple):
  """loc, mean_concentration, df, scale_sq: broadcastable arrays (..., D)."""
  loc: jax.Array
  mean_concentration: jax.Array
  df: jax.Array
  scale_sq: jax.Array


class Expectations(NamedTuple):
  """inv_var: E[sigma^-2] = 1/s^2; log_var: E[log sigma^2] = log(nu s^2/2) - psi(nu/2);
  mahalanobis: E[(mu - mu0)^2 / sigma^2] = 1/kappa + (mu - mu0)^2 / s^2."""
  inv_var: jax.Array
  log_var: jax.Array
  mahalanobis: jax.Array


def prior(loc, var, df, mean_concentration) -> NIX:
  """NIX prior with scale s0^2 = ``var`` per dimension."""
  dtype = jnp.asarray(loc).dtype
  return NIX(jnp.asarray(loc), jnp.asarray(mean_concentration, dtype),
             jnp.asarray(df, dtype), jnp.asarray(var, dtype))


def posterior(prior_: NIX, count, mean, sq_dev) -> NIX:
  """Conjugate update from centred statistics.

  nu' s'^2 = nu0 s0^2 + sum (x - xbar)^2 + kappa0 N / (kappa0 + N) (xbar - mu0)^2.

  Args:
    prior_: NIX prior (fields broadcastable against ``mean``).
    count: N_k with shape broadcastable to ``mean`` minus its last axis, e.g. (K,).
    mean, sq_dev: (..., D) class means and centred squared deviations.
  """
  n = jnp.asarray(count)[..., None]
  kappa0, nu0 = prior_.mean_concentration, prior_.df
  kappa = kappa0 + n
  nu = nu0 + n
  diff = mean - prior_.loc
  loc = (kappa0 * prior_.loc + n * mean) / kappa
  scale_sq = (nu0 * prior_.scale_sq + sq_dev + kappa0 * n / kappa * diff * diff) / nu
  return NIX(loc, kappa, nu, scale_sq)


def log_normalizer(nix: NIX):
  """Elementwise log Z = -1/2 log kappa + lgamma(nu/2) - nu/2 log(nu s^2 / 2)."""
  return (-0.5 * jnp.log(nix.mean_concentration) + jsp.gammaln(0.5 * nix.df)
          - 0.5 * nix.df * jnp.log(0.5 * nix.df * nix.scale_sq))


def log_marginal_likelihood(prior_: NIX, posterior_: NIX, count):
  """Elementwise (..., D) log p(X_{k,d}) = log Z' - log Z0 - N_k/2 log(2 pi)."""
  n = jnp.asarray(count)[..., None]
  return log_normalizer(posterior_) - log_normalizer(prior_) - 0.5 * n * special.LOG_2PI


def log_evidence(prior_: NIX, count, mean, sq_dev):
  """Elementwise (..., D) log p(X_{k,d}) from the prior and the statistics, stable for any nu0.

  Equal to ``log_marginal_likelihood(prior_, posterior(prior_, ...), count)`` but grouped
  so that nothing large cancels: with R = sum (x - xbar)^2 + kappa0 N / (kappa0 + N)
  (xbar - mu0)^2 (so that nu' s'^2 = nu0 s0^2 + R),

    log p = -1/2 log1p(N / kappa0) + [lgamma(nu'/2) - lgamma(nu0/2) - N/2 log(nu0/2)]
            - nu'/2 log1p(R / (nu0 s0^2)) - N/2 log(2 pi s0^2).

  The direct difference of log normalisers cancels terms of size nu0 log(nu0) and in
  float32 is noise once nu0 ~ 1e4, exactly where EM approaches the tied limit; here the
  bracket is ``special.log_gamma_ratio_excess`` and the nu0 -> inf limit (a Gaussian with
  variance s0^2) is reached smoothly.

  Args:
    prior_: NIX prior (fields broadcastable against ``mean``).
    count: N_k, broadcastable to ``mean`` without its last axis.
    mean, sq_dev: (..., D) class means and centred squared deviations.
  """
  n = jnp.asarray(count)[..., None]
  kappa0, nu0, var0 = prior_.mean_concentration, prior_.df, prior_.scale_sq
  diff = mean - prior_.loc
  data = sq_dev + kappa0 * n / (kappa0 + n) * diff * diff
  return (-0.5 * jnp.log1p(n / kappa0)
          + special.log_gamma_ratio_excess(0.5 * nu0, 0.5 * n)
          - 0.5 * (nu0 + n) * jnp.log1p(data / (nu0 * var0))
          - 0.5 * n * (special.LOG_2PI + jnp.log(var0)))


def expectations(nix: NIX, ref_loc) -> Expectations:
  d = nix.loc - ref_loc
  inv_var = 1.0 / nix.scale_sq
  return Expectations(inv_var,
                      jnp.log(0.5 * nix.df * nix.scale_sq) - jsp.digamma(0.5 * nix.df),
                      1.0 / nix.mean_concentration + d * d * inv_var)


# ------------------------------------------------- variational (mean-field) building blocks
@precision.float32_matmuls
def expected_log_likelihood(nix: NIX, x):
  """(M, K) E_q[sum_d log N(x_md | mu_kd, sigma_kd^2)] under NIX factors (leading axis K).

  Per dimension: -1/2 [log(2 pi) + E log sigma^2 + 1/kappa + (x - m)^2 / s^2]; the sum
  over D is written as matrix products, so the cost is O(M K D) with no (M, K, D)
  temporary.

  Args:
    nix: NIX with fields of shape (K, D).
    x: (M, D) points.
  """
  exp = expectations(nix, nix.loc)          # mahalanobis at the own mean = 1/kappa
  inv_var = exp.inv_var                      # (K, D)
  const = jnp.sum(special.LOG_2PI + exp.log_var + exp.mahalanobis + nix.loc ** 2 * inv_var, -1)
  quad = (x * x) @ inv_var.T - 2.0 * x @ (nix.loc * inv_var).T     # (M, K)
  return -0.5 * (quad + const[None, :])


def kl_divergence(q: NIX, p: NIX):
  """Elementwise (..., D) KL(q || p) between NIX distributions.

  The precision tau = 1/sigma^2 is Gamma(nu/2, rate nu s^2/2), so
  KL = KL_Gamma(q_tau || p_tau) + 1/2 [kappa_p/kappa_q - 1 + log(kappa_q/kappa_p)
                                       + kappa_p (m_q - m_p)^2 / s_q^2].
  """
  ratio = p.mean_concentration / q.mean_concentration
  mean_part = 0.5 * (ratio - 1.0 - jnp.log(ratio)
                     + p.mean_concentration * (q.loc - p.loc) ** 2 / q.scale_sq)
  prec_part = gamma.kl_divergence(0.5 * q.df, 0.5 * q.df * q.scale_sq,
                                  0.5 * p.df, 0.5 * p.df * p.scale_sq)
  return mean_part + prec_part


# --------------------------------------------------------------- M-step for nu0 (df)
def df_statistic(posterior_: NIX, prior_scale_sq):
  """Elementwise term t = c + 1 of the nu0 objective, cancellation-free.

  c = log s0^2 - E log sigma^2 - s0^2 E[sigma^-2] (paper, app. 14.1) equals
  (log r - r) - (log(nu'/2) - psi(nu'/2)) with r = s0^2 / s'^2, so
  t = [log1p(r - 1) - (r - 1)] - g(nu'/2), g = log - digamma; both parts vanish in the
  tied limit. The coupled model passes ``prior_scale_sq = gamma s0^2`` (then c gains its
  E[log gamma] term automatically).
  """
  r_minus_1 = prior_scale_sq / posterior_.scale_sq - 1.0
  return (jnp.log1p(r_minus_1) - r_minus_1) - special.log_minus_digamma(0.5 * posterior_.df)


def df_objective(df, stat_sum, num_classes):
  """L(nu0) = K [nu0/2 log(nu0/2) - lgamma(nu0/2)] + nu0/2 sum_k (t_k - 1) (direct form)."""
  return (num_classes * (0.5 * df * jnp.log(0.5 * df) - jsp.gammaln(0.5 * df))
          + 0.5 * df * (stat_sum - num_classes))


def df_derivatives(df, stat_sum, num_classes):
  """L' = K/2 g(nu0/2) + sum_k t_k / 2 ;  L'' = K/4 h(nu0/2)  (g = log - digamma,
  h = 1/z - trigamma). Elementwise over dimensions."""
  return (0.5 * num_classes * special.log_minus_digamma(0.5 * df) + 0.5 * stat_sum,
          0.25 * num_classes * special.inv_minus_trigamma(0.5 * df))


# ------------------------------------------------------------------------ predictive
def predictive(nix: NIX):
  """Per-dimension Student-t (df, loc, scale_sq) = (nu, mu, (kappa + 1)/kappa s^2)."""
  return nix.df, nix.loc, (nix.mean_concentration + 1.0) / nix.mean_concentration * nix.scale_sq


def log_predictive(nix: NIX, x):
  """(M,) predictive log density (product over D) of one unbatched NIX at x (M, D)."""
  df, loc, scale_sq = predictive(nix)
  return student_t.product_t_log_density(x, df, loc, scale_sq)
