"""Normal-inverse-Wishart family in the paper's parameterisation (appendix 13).

Prior:  Sigma ~ IW(nu0, Psi0),  Psi0 = (nu0 - D - 1) Sigma0  (so E[Sigma] = Sigma0),
        mu | Sigma ~ N(mu0, Sigma / kappa0).
Symbols: nu = ``df``, Psi = ``scale``, kappa = ``mean_concentration``, mu = ``loc``.
All functions broadcast over leading (class) axes. ``nix`` has the same function names.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy import special as jsp
from jax.scipy.linalg import cho_solve
from jax.scipy.linalg import solve_triangular

from dpmm_jax import linalg
from dpmm_jax import precision
from dpmm_jax import special
from dpmm_jax import student_t


class NIW(NamedTuple):
  """loc (..., D); mean_concentration (...,); df (...,); scale (..., D, D) = Psi."""
  loc: jax.Array
  mean_concentration: jax.Array
  df: jax.Array
  scale: jax.Array


class Expectations(NamedTuple):
  """Posterior expectations needed by the E-step.

  precision: (..., D, D) E[Sigma^-1] = nu Psi^-1.
  log_det_cov: (...,) E[log|Sigma|] = log|Psi| - psi_D(nu/2) - D log 2.
  mahalanobis: (...,) E[(mu - mu0)^T Sigma^-1 (mu - mu0)] = D/kappa + nu d^T Psi^-1 d.
  """
  precision: jax.Array
  log_det_cov: jax.Array
  mahalanobis: jax.Array


def prior(loc, mean_cov, df, mean_concentration) -> NIW:
  """NIW prior with E[Sigma] = ``mean_cov`` (Sigma0); requires df > D + 1."""
  dim = loc.shape[-1]
  df = jnp.asarray(df, loc.dtype)
  return NIW(loc, jnp.asarray(mean_concentration, loc.dtype), df,
             (df - dim - 1.0)[..., None, None] * mean_cov)


def posterior_location(prior_: NIW, count, mean):
  """(loc (K, D), kappa (K,), nu (K,)) of the posterior: everything but its scale.

  kappa0 may be a scalar or (K,) (a posterior used as the prior of more data).
  """
  kappa0 = prior_.mean_concentration
  kappa = kappa0 + count
  loc = (jnp.asarray(kappa0)[..., None] * prior_.loc + count[:, None] * mean) / kappa[:, None]
  return loc, kappa, prior_.df + count


def evidence(prior_: NIW, count, mean, scatter):
  """(K, D, D) the data's part of the posterior scale, Psi' - Psi0 (rank <= N_k):
  S + kappa0 N / (kappa0 + N) (xbar - mu0)(xbar - mu0)^T, formed without Psi0."""
  kappa0 = prior_.mean_concentration
  diff = mean - prior_.loc
  shrink = kappa0 * count / (kappa0 + count)
  return scatter + shrink[:, None, None] * diff[:, :, None] * diff[:, None, :]


def posterior(prior_: NIW, count, mean, scatter) -> NIW:
  """Conjugate update from centred statistics (exact in float32).

  Psi' = Psi0 + S + kappa0 N / (kappa0 + N) (xbar - mu0)(xbar - mu0)^T.

  Args:
    prior_: NIW prior.
    count: (K,) N_k; mean: (K, D) class means; scatter: (K, D, D) centred scatter.
  Returns:
    NIW with leading axis K.
  """
  loc, kappa, df = posterior_location(prior_, count, mean)
  scale = prior_.scale + evidence(prior_, count, mean, scatter)
  return NIW(loc, kappa, df, linalg.symmetrize(scale))


def log_normalizer(niw: NIW, chol_scale=None):
  """log Z = -D/2 log kappa + log Gamma_D(nu/2) + nu D/2 log 2 - nu/2 log|Psi|."""
  dim = niw.loc.shape[-1]
  if chol_scale is None:
    chol_scale = jnp.linalg.cholesky(niw.scale)
  return (-0.5 * dim * jnp.log(niw.mean_concentration)
          + jsp.multigammaln(0.5 * niw.df, dim) + 0.5 * niw.df * dim * jnp.log(2.0)
          - 0.5 * niw.df * linalg.chol_log_det(chol_scale))


def log_marginal_likelihood(prior_: NIW, posterior_: NIW, count):
  """(K,) log p(X_k) = log Z(posterior) - log Z(prior) - N_k D/2 log(2 pi)."""
  dim = prior_.loc.shape[-1]
  return (log_normalizer(posterior_) - log_normalizer(prior_)
          - 0.5 * count * dim * special.LOG_2PI)


@precision.float32_matmuls
def expectations(niw: NIW, ref_loc) -> Expectations:
  """E[Sigma^-1], E[log|Sigma|], E[(mu - ref)^T Sigma^-1 (mu - ref)] (note the D/kappa)."""
  dim = niw.loc.shape[-1]
  chol = jnp.linalg.cholesky(niw.scale)
  eye = jnp.broadcast_to(jnp.eye(dim, dtype=niw.scale.dtype), niw.scale.shape)
  precision = niw.df[..., None, None] * cho_solve((chol, True), eye)
  log_det = (linalg.chol_log_det(chol) - special.multidigamma(0.5 * niw.df, dim)
             - dim * jnp.log(2.0))
  d = niw.loc - ref_loc
  maha = dim / niw.mean_concentration + jnp.einsum("...i,...ij,...j->...", d, precision, d)
  return Expectations(linalg.symmetrize(precision), log_det, maha)


# ------------------------------------------------- variational (mean-field) building blocks
def expected_log_likelihood(niw: NIW, x):
  """(M, K) E_q[log N(x_m | mu_k, Sigma_k)] under NIW factors q_k (leading axis K).

  = -D/2 log(2 pi) - 1/2 E[log|Sigma_k|] - 1/2 [D/kappa_k + nu_k (x - m_k)^T Psi_k^-1 (x - m_k)],
  the term every coordinate-ascent update of a Gaussian mixture with NIW factors needs.
  Distances are ``linalg.class_mahalanobis_sq`` (centred on the points' mean).

  Args:
    niw: NIW with leading axis K.
    x: (M, D) points.
  Returns:
    (M, K) expected log densities.
  """
  dim = niw.loc.shape[-1]
  chol = jnp.linalg.cholesky(niw.scale)
  e_log_det = (linalg.chol_log_det(chol) - special.multidigamma(0.5 * niw.df, dim)
               - dim * jnp.log(2.0))
  dist = linalg.class_mahalanobis_sq(x, niw.loc, chol)             # (M, K)
  return -0.5 * (dim * special.LOG_2PI + e_log_det + dim / niw.mean_concentration
                 + niw.df * dist)


def kl_divergence(q: NIW, p: NIW):
  """KL(q || p) between NIW distributions (broadcast over leading axes).

  KL = 1/2 [D kappa_p/kappa_q - D + D log(kappa_q/kappa_p)
            + kappa_p nu_q (m_q - m_p)^T Psi_q^-1 (m_q - m_p)]            (mean, given Sigma)
     + (nu_q - nu_p)/2 psi_D(nu_q/2) + log Gamma_D(nu_p/2) - log Gamma_D(nu_q/2)
     + nu_p/2 (log|Psi_q| - log|Psi_p|) + nu_q/2 (tr(Psi_p Psi_q^-1) - D)  (inverse-Wishart)

  The inverse-Wishart part is the Wishart KL of the precisions (KL is invariant under
  the reparameterisation Sigma -> Sigma^-1).
  """
  dim = q.loc.shape[-1]
  chol_q = jnp.linalg.cholesky(q.scale)
  chol_p = jnp.linalg.cholesky(jnp.broadcast_to(p.scale, q.scale.shape))
  ratio = p.mean_concentration / q.mean_concentration
  d = jnp.broadcast_to(q.loc - p.loc, q.loc.shape)
  zd = solve_triangular(chol_q, d[..., None], lower=True)[..., 0]
  mean_part = 0.5 * (dim * (ratio - 1.0 - jnp.log(ratio))
                     + p.mean_concentration * q.df * jnp.sum(zd * zd, -1))
  w = solve_triangular(chol_q, chol_p, lower=True)          # tr(Psi_p Psi_q^-1) = |w|_F^2
  trace = jnp.sum(w * w, axis=(-2, -1))
  wishart_part = (0.5 * (q.df - p.df) * special.multidigamma(0.5 * q.df, dim)
                  + jsp.multigammaln(0.5 * p.df, dim)
                  - jsp.multigammaln(0.5 * q.df, dim)
                  + 0.5 * p.df * (linalg.chol_log_det(chol_q) - linalg.chol_log_det(chol_p))
                  + 0.5 * q.df * (trace - dim))
  return mean_part + wishart_part


# --------------------------------------------------------------- M-step for nu0 (df)
def df_statistic(posterior_: NIW, mean_cov):
  """Per-class term t_k of the nu0 objective, in a cancellation-free form.

  With c_k = log|Sigma0| - E log|Sigma_k| - tr(Sigma0 E[Sigma_k^-1]) (paper, app. 13.1),
  t_k = c_k + D = [log|B_k| - tr B_k + D] - [D log(nu'/2) - psi_D(nu'/2)],
  B_k = nu'_k Sigma0 Psi'_k^-1. Both brackets vanish in the tied limit. The first is
  evaluated through the lower-triangular W = sqrt(nu') L'^-1 L0 (Psi' = L' L'^T,
  Sigma0 = L0 L0^T, so |B| = prod W_jj^2 and tr B = ||W||_F^2) as
  sum_j [log1p(W_jj^2 - 1) - (W_jj^2 - 1)] - sum_{i>j} W_ij^2: no term is large, so it
  stays accurate as B -> I (forming D log nu' + log|Sigma0| - log|Psi'| instead loses
  ~D log(nu') eps absolute, which swamps t_k ~ -D(D+1)/(2 nu') at nu' ~ 1e6 in float32).

  Args:
    posterior_: NIW with leading axis K.
    mean_cov: (D, D) Sigma0.
  Returns:
    (K,) t_k.
  """
  dim = mean_cov.shape[-1]
  nu = posterior_.df
  chol = jnp.linalg.cholesky(posterior_.scale)
  chol0 = jnp.broadcast_to(jnp.linalg.cholesky(mean_cov), chol.shape)
  w = (jnp.sqrt(nu)[..., None, None]
       * solve_triangular(chol, chol0, lower=True))                # (K, D, D) lower
  diag_sq = jnp.square(jnp.diagonal(w, axis1=-2, axis2=-1))
  strictly_lower = jnp.tril(jnp.ones((dim, dim), bool), -1)
  off_sq = jnp.sum(jnp.where(strictly_lower, jnp.square(w), 0.0), axis=(-2, -1))
  delta = diag_sq - 1.0
  first = jnp.sum(jnp.log1p(delta) - delta, -1) - off_sq
  i = jnp.arange(dim, dtype=nu.dtype)
  z = 0.5 * (nu[..., None] - i)
  digamma_gap = jnp.sum(special.log_minus_digamma(z) - jnp.log1p(-i / nu[..., None]), -1)
  return first - digamma_gap


def df_objective(df, stat_sum, num_classes, dim):
  """L(nu0) = K[nu0 D/2 log((nu0-D-1)/2) - log Gamma_D(nu0/2)] + nu0/2 sum_k (t_k - D).

  Direct (not cancellation-free) form of the paper's objective, used for checking the
  derivatives and for reporting.
  """
  return (num_classes * (0.5 * df * dim * jnp.log(0.5 * (df - dim - 1.0))
                         - jsp.multigammaln(0.5 * df, dim))
          + 0.5 * df * (stat_sum - num_classes * dim))


def df_derivatives(df, stat_sum, num_classes, dim):
  """First and second derivative of ``df_objective`` in the stable form.

  L'  = K/2 [sum_i (g(z_i) + log(1 - (D+2-i)/(nu-i+1))) + D(D+1)/(nu-D-1)] + sum_k t_k / 2
  L'' = K/4 sum_i [h(z_i) + 2(D+2-i)/((nu-D-1)(nu-i+1))] - K D (D+1) / (2 (nu-D-1)^2)
  with z_i = (nu - i + 1)/2, g = log - digamma, h = 1/z - trigamma, i = 1..D.
  """
  i = jnp.arange(1, dim + 1, dtype=jnp.result_type(df, float))
  nu = jnp.asarray(df)[..., None]
  z = 0.5 * (nu - i + 1.0)
  excess = nu[..., 0] - dim - 1.0
  grad = (0.5 * num_classes * (jnp.sum(special.log_minus_digamma(z)
                                       + jnp.log1p(-(dim + 2.0 - i) / (nu - i + 1.0)), -1)
                               + dim * (dim + 1.0) / excess)
          + 0.5 * stat_sum)
  hess = (0.25 * num_classes * jnp.sum(special.inv_minus_trigamma(z)
                                       + 2.0 * (dim + 2.0 - i) / ((nu - dim - 1.0)
                                                                  * (nu - i + 1.0)), -1)
          - 0.5 * num_classes * dim * (dim + 1.0) / excess ** 2)
  return grad, hess


# ------------------------------------------------------------------------ predictive
class Predictive(NamedTuple):
  """Multivariate Student-t: df (...,), loc (..., D), chol_scale (..., D, D), log_norm."""
  df: jax.Array
  loc: jax.Array
  chol_scale: jax.Array
  log_normalizer: jax.Array


def predictive_df_and_factor(mean_concentration, df, dim: int):
  """(nu - D + 1, (kappa + 1) / (kappa (nu - D + 1))): the predictive Student-t's degrees
  of freedom and the factor that turns Psi into its scale matrix."""
  pred_df = df - dim + 1.0
  return pred_df, (mean_concentration + 1.0) / (mean_concentration * pred_df)


def predictive(niw: NIW) -> Predictive:
  """St(nu - D + 1, mu, (kappa + 1) / (kappa (nu - D + 1)) Psi) (not nu dof: a known trap)."""
  df, factor = predictive_df_and_factor(niw.mean_concentration, niw.df, niw.loc.shape[-1])
  chol = jnp.linalg.cholesky(factor[..., None, None] * niw.scale)
  return Predictive(df, niw.loc, chol, student_t.mvt_log_normalizer(df, chol))


def log_predictive(niw: NIW, x):
  """(M,) predictive log density of one (unbatched) NIW at points x (M, D)."""
  pred = predictive(niw)
  return student_t.mvt_log_density(x, pred.df, pred.loc, pred.chol_scale)
