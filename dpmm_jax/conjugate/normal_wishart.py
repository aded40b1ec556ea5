"""Independent Normal x Wishart factors of a Gaussian's mean and precision (mean field).

Prior (independent, not the conjugate NIW coupling of ``niw``):
  mu ~ N(mu0, R0^-1),   R ~ W(W0, nu0)    (R the precision, E[R] = nu0 W0),
and the mean-field factor q(mu) q(R) = N(mu | m, Lambda^-1) W(R | Psi^-1, nu).
Symbols: m = ``loc``, Lambda = ``loc_precision``, nu = ``df``, Psi = ``inv_scale`` (= W^-1).

For data x_n with weights r_n (count N = sum r_n, weighted mean xbar, centred weighted
scatter S) the coordinate-ascent updates of the evidence lower bound are, each the exact
maximiser over its factor with the other held fixed:
  q(mu):  Lambda = R0 + N E[R],   m = mu0 + Lambda^-1 N E[R] (xbar - mu0)
  q(R):   nu = nu0 + N,   Psi = Psi0 + S + N (xbar - m)(xbar - m)^T + N Lambda^-1
(the precision update uses E_q(mu)[(x - mu)(x - mu)^T] = (x - m)(x - m)^T + Lambda^-1).
Functions broadcast over a leading class axis K.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.linalg import cho_solve
from jax.scipy.linalg import solve_triangular

from dpmm_jax import linalg
from dpmm_jax import precision
from dpmm_jax import special
from dpmm_jax.conjugate import wishart


class NormalWishart(NamedTuple):
  """loc (..., D); loc_precision (..., D, D); df (...,); inv_scale (..., D, D)."""
  loc: jax.Array
  loc_precision: jax.Array
  df: jax.Array
  inv_scale: jax.Array


def precision_factor(nw: NormalWishart) -> wishart.Wishart:
  """q(R) as a ``wishart.Wishart``."""
  return wishart.Wishart(nw.df, nw.inv_scale)


def prior(loc, loc_precision, df, mean_precision) -> NormalWishart:
  """mu ~ N(loc, loc_precision^-1), R ~ W with E[R] = ``mean_precision`` and ``df``."""
  w = wishart.from_mean(mean_precision, df)
  return NormalWishart(jnp.asarray(loc), jnp.asarray(loc_precision), w.df, w.inv_scale)


def broadcast(nw: NormalWishart, num_classes: int) -> NormalWishart:
  """K copies of an unbatched factor (e.g. the prior as the initial q)."""
  return jax.tree_util.tree_map(
      lambda a: jnp.broadcast_to(a, (num_classes,) + a.shape), nw)


def _solve_spd(a, b):
  chol = jnp.linalg.cholesky(a)
  return cho_solve((chol, True), b)


@precision.float32_matmuls
def update_loc(prior_: NormalWishart, q: NormalWishart, count, mean) -> NormalWishart:
  """Optimal q(mu) given q(R): Lambda = R0 + N E[R], m = mu0 + Lambda^-1 N E[R](xbar - mu0).

  Args:
    prior_: unbatched prior.
    q: current factors with leading axis K (only df, inv_scale are read).
    count: (K,) weights N_k; mean: (K, D) weighted means.
  Returns:
    q with new loc and loc_precision.
  """
  e_prec = wishart.mean(precision_factor(q))                               # (K, D, D)
  lam = linalg.symmetrize(prior_.loc_precision + count[:, None, None] * e_prec)
  rhs = count[:, None] * jnp.einsum("kij,kj->ki", e_prec, mean - prior_.loc)
  loc = prior_.loc + _solve_spd(lam, rhs[..., None])[..., 0]
  return q._replace(loc=loc, loc_precision=lam)


def update_precision(prior_: NormalWishart, q: NormalWishart, count, mean,
                     scatter) -> NormalWishart:
  """Optimal q(R) given q(mu): nu = nu0 + N, Psi = Psi0 + S + N (xbar - m)(..)^T + N Lambda^-1.

  Args:
    prior_: unbatched prior.
    q: current factors with leading axis K (only loc, loc_precision are read).
    count: (K,); mean: (K, D); scatter: (K, D, D) centred weighted scatter.
  Returns:
    q with new df and inv_scale.
  """
  dim = mean.shape[-1]
  eye = jnp.broadcast_to(jnp.eye(dim, dtype=mean.dtype), q.loc_precision.shape)
  loc_cov = _solve_spd(q.loc_precision, eye)
  d = mean - q.loc
  psi = (prior_.inv_scale + scatter
         + count[:, None, None] * (d[:, :, None] * d[:, None, :] + loc_cov))
  return q._replace(df=prior_.df + count, inv_scale=linalg.symmetrize(psi))


def posterior(prior_: NormalWishart, q: NormalWishart, count, mean, scatter) -> NormalWishart:
  """One coordinate-ascent pass: ``update_loc`` then ``update_precision``."""
  q = update_loc(prior_, q, count, mean)
  return update_precision(prior_, q, count, mean, scatter)


@precision.float32_matmuls
def expected_log_likelihood(nw: NormalWishart, x):
  """(M, K) E_q[log N(x_m | mu_k, R_k^-1)] under factors q_k (leading axis K).

  = -D/2 log(2 pi) + 1/2 E[log|R_k|] - 1/2 [nu_k (x - m_k)^T Psi_k^-1 (x - m_k)
                                           + nu_k tr(Psi_k^-1 Lambda_k^-1)].
  Distances are ``linalg.class_mahalanobis_sq`` with the inverse factors of Psi_k.

  Args:
    nw: factors with leading axis K.
    x: (M, D) points.
  Returns:
    (M, K) expected log densities.
  """
  dim = nw.loc.shape[-1]
  chol_psi = jnp.linalg.cholesky(nw.inv_scale)
  chol_lam = jnp.linalg.cholesky(nw.loc_precision)
  e_log_det = wishart.expected_log_det(precision_factor(nw), chol_psi)
  chol_psi_inv = linalg.triangular_inverse(chol_psi)                  # (K, D, D)
  # tr(Psi^-1 Lambda^-1) = ||L_psi^-1 L_lam^-T||_F^2.
  m = chol_psi_inv @ jnp.swapaxes(linalg.triangular_inverse(chol_lam), -1, -2)
  trace = jnp.sum(m * m, axis=(-2, -1))
  # Distances with the inverse factors: matrix products over blocks of classes.
  dist = linalg.class_mahalanobis_sq(x, nw.loc, chol_psi_inv, inverted=True)   # (M, K)
  return 0.5 * (-dim * special.LOG_2PI + e_log_det - nw.df * (dist + trace))


@precision.float32_matmuls
def normal_kl_divergence(loc_q, precision_q, loc_p, precision_p):
  """(...,) KL(N(m_q, Lambda_q^-1) || N(m_p, Lambda_p^-1))
  = 1/2 [tr(Lambda_p Lambda_q^-1) + (m_q - m_p)^T Lambda_p (m_q - m_p) - D
         + log|Lambda_q| - log|Lambda_p|]."""
  dim = loc_q.shape[-1]
  precision_p = jnp.broadcast_to(precision_p, precision_q.shape)
  chol_q = jnp.linalg.cholesky(precision_q)
  chol_p = jnp.linalg.cholesky(precision_p)
  # tr(Lambda_p Lambda_q^-1) = ||L_q^-1 L_p||_F^2.
  m = solve_triangular(chol_q, chol_p, lower=True)
  trace = jnp.sum(m * m, axis=(-2, -1))
  d = loc_q - loc_p
  maha = jnp.sum(jnp.square(jnp.einsum("...ji,...j->...i", chol_p, d)), -1)   # |L_p^T d|^2
  return 0.5 * (trace + maha - dim + linalg.chol_log_det(chol_q)
                - linalg.chol_log_det(chol_p))


def kl_divergence(q: NormalWishart, p: NormalWishart):
  """(...,) KL(q(mu) q(R) || p(mu) p(R)): the Normal KL plus the Wishart KL."""
  return (normal_kl_divergence(q.loc, q.loc_precision, p.loc, p.loc_precision)
          + wishart.kl_divergence(precision_factor(q), precision_factor(p)))
