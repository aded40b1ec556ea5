"""Wishart distribution of a precision matrix, stored by its inverse scale.

R ~ W(W, nu) with density
  log p(R) = (nu - D - 1)/2 log|R| - 1/2 tr(W^-1 R) - nu D/2 log 2 + nu/2 log|W^-1|
             - log Gamma_D(nu/2),
E[R] = nu W. The inverse scale Psi = W^-1 is what conjugate updates produce
(Psi' = Psi + scatter), so it is stored instead of W: R ~ W(Psi^-1, nu) is equivalent to
R^-1 ~ IW(nu, Psi), the inverse-Wishart of ``niw``.
Symbols: nu = ``df``, Psi = ``inv_scale``. All functions broadcast over leading axes.

Mean-field building blocks (same verbs as ``niw``/``nix``/``gamma``/``dirichlet``): mean,
expected log-determinant, log density, entropy, KL divergence. Used by the independent
Normal x Wishart factors of ``normal_wishart`` (the LDDP's clusters).
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy import special as jsp
from jax.scipy.linalg import cho_solve
from jax.scipy.linalg import solve_triangular

from dpmm_jax import linalg
from dpmm_jax import special

_LOG2 = jnp.log(2.0)


class Wishart(NamedTuple):
  """df (...,) nu > D - 1; inv_scale (..., D, D) Psi = W^-1 (E[R] = nu Psi^-1)."""
  df: jax.Array
  inv_scale: jax.Array


def from_mean(mean_precision, df) -> Wishart:
  """The Wishart with E[R] = ``mean_precision`` and ``df`` degrees of freedom (W = E[R]/nu)."""
  mean_precision = jnp.asarray(mean_precision)
  df = jnp.asarray(df, mean_precision.dtype)
  dim = mean_precision.shape[-1]
  eye = jnp.broadcast_to(jnp.eye(dim, dtype=mean_precision.dtype), mean_precision.shape)
  chol = jnp.linalg.cholesky(mean_precision)
  return Wishart(df, linalg.symmetrize(df[..., None, None] * cho_solve((chol, True), eye)))


def mean(w: Wishart):
  """(..., D, D) E[R] = nu Psi^-1 (Cholesky solve, no explicit inverse of Psi)."""
  dim = w.inv_scale.shape[-1]
  chol = jnp.linalg.cholesky(w.inv_scale)
  eye = jnp.broadcast_to(jnp.eye(dim, dtype=w.inv_scale.dtype), w.inv_scale.shape)
  return linalg.symmetrize(w.df[..., None, None] * cho_solve((chol, True), eye))


def expected_log_det(w: Wishart, chol_inv_scale=None):
  """(...,) E[log|R|] = psi_D(nu/2) + D log 2 - log|Psi|."""
  dim = w.inv_scale.shape[-1]
  if chol_inv_scale is None:
    chol_inv_scale = jnp.linalg.cholesky(w.inv_scale)
  return (special.multidigamma(0.5 * w.df, dim) + dim * _LOG2
          - linalg.chol_log_det(chol_inv_scale))


def _log_normalizer(w: Wishart, chol_inv_scale):
  """log Z = nu D/2 log 2 - nu/2 log|Psi| + log Gamma_D(nu/2)."""
  dim = w.inv_scale.shape[-1]
  return (0.5 * w.df * dim * _LOG2 - 0.5 * w.df * linalg.chol_log_det(chol_inv_scale)
          + jsp.multigammaln(0.5 * w.df, dim))


def log_density(w: Wishart, precision):
  """(...,) log W(R | Psi^-1, nu) at SPD ``precision`` R (..., D, D)."""
  dim = w.inv_scale.shape[-1]
  chol_psi = jnp.linalg.cholesky(w.inv_scale)
  chol_r = jnp.linalg.cholesky(precision)
  trace = jnp.sum(w.inv_scale * precision, axis=(-2, -1))      # tr(Psi R), both symmetric
  return (0.5 * (w.df - dim - 1.0) * linalg.chol_log_det(chol_r) - 0.5 * trace
          - _log_normalizer(w, chol_psi))


def entropy(w: Wishart):
  """(...,) H = log Z - (nu - D - 1)/2 E[log|R|] + nu D/2."""
  dim = w.inv_scale.shape[-1]
  chol = jnp.linalg.cholesky(w.inv_scale)
  return (_log_normalizer(w, chol) - 0.5 * (w.df - dim - 1.0) * expected_log_det(w, chol)
          + 0.5 * w.df * dim)


def kl_divergence(q: Wishart, p: Wishart):
  """(...,) KL(q || p) = -H(q) - E_q[log p(R)].

  E_q[log p(R)] = (nu_p - D - 1)/2 E_q[log|R|] - nu_q/2 tr(Psi_p Psi_q^-1) - log Z_p, with
  the trace as ||L_q^-1 L_p||_F^2 (Cholesky factors, no inverse).
  """
  dim = q.inv_scale.shape[-1]
  chol_q = jnp.linalg.cholesky(q.inv_scale)
  chol_p = jnp.linalg.cholesky(jnp.broadcast_to(p.inv_scale, q.inv_scale.shape))
  p_df = jnp.broadcast_to(p.df, q.df.shape)
  e_log_det = expected_log_det(q, chol_q)
  m = solve_triangular(chol_q, chol_p, lower=True)
  trace = jnp.sum(m * m, axis=(-2, -1))
  neg_entropy = (-_log_normalizer(q, chol_q) + 0.5 * (q.df - dim - 1.0) * e_log_det
                 - 0.5 * q.df * dim)
  cross = (0.5 * (p_df - dim - 1.0) * e_log_det - 0.5 * q.df * trace
           - _log_normalizer(Wishart(p_df, p.inv_scale), chol_p))
  return neg_entropy - cross
