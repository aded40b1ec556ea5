"""Hierarchical Gaussian DPMM with full covariances and an NIW prior (paper, app. 13).

Empirical Bayes sets mu0 = global mean and Sigma0 = pooled within-class covariance; EM
learns kappa0 (closed form) and nu0 (generalized Newton in nu0 - D - 1).
"""
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.scipy.linalg import cho_solve, solve_triangular

from dpmm_jax import blocks
from dpmm_jax import validation as checks
from dpmm_jax import em
from dpmm_jax import newton
from dpmm_jax import stats as stats_lib
from dpmm_jax import student_t
from dpmm_jax.conjugate import niw


class Hyper(NamedTuple):
  """loc (D,) mu0; mean_cov (D, D) Sigma0 = E[Sigma_k]; df () nu0 > D + 1;
  mean_concentration () kappa0."""
  loc: jax.Array
  mean_cov: jax.Array
  df: jax.Array
  mean_concentration: jax.Array


class Params(NamedTuple):
  """Fitted model: hyper; class predictive (K-batched niw.Predictive); prior predictive;
  log_counts (K,)."""
  hyper: Hyper
  class_pred: niw.Predictive
  prior_pred: niw.Predictive
  log_counts: jax.Array


def init_hyper(stats: stats_lib.SufficientStats, df=None, mean_concentration=None) -> Hyper:
  """The paper's initialisation: nu0 ~ mean N_k (kept above D + 1), kappa0 small."""
  dim = stats.dim
  dtype = stats.mean.dtype
  if df is None:
    df = jnp.maximum(jnp.mean(stats.count), dim + 2.0)
  if mean_concentration is None:
    mean_concentration = 1e-3
  return Hyper(stats_lib.global_mean(stats), stats_lib.pooled_covariance(stats),
               jnp.asarray(df, dtype), jnp.asarray(mean_concentration, dtype))


def _prior(hyper: Hyper) -> niw.NIW:
  return niw.prior(hyper.loc, hyper.mean_cov, hyper.df, hyper.mean_concentration)


def _posterior(hyper: Hyper, stats):
  return niw.posterior(_prior(hyper), stats.count, stats.mean, stats.scatter)


def em_step(hyper: Hyper, stats, *, df_cap=1e6, newton_tol=1e-6, newton_max_iter=100):
  """One EM iteration: E-step over classes, closed-form kappa0, Newton for nu0."""
  dim, num_classes = stats.dim, stats.num_classes
  post = _posterior(hyper, stats)
  chol = jnp.linalg.cholesky(post.scale)
  d = post.loc - hyper.loc
  maha = dim / post.mean_concentration + post.df * jnp.sum(
      d * cho_solve((chol, True), d[..., None])[..., 0], -1)
  kappa0 = num_classes * dim / jnp.sum(maha)                        # paper 13.2 (with D)
  stat_sum = jnp.sum(niw.df_statistic(post, hyper.mean_cov))
  derivs = functools.partial(niw.df_derivatives, stat_sum=stat_sum,
                             num_classes=num_classes, dim=dim)
  df, info = newton.maximize(derivs, hyper.df, offset=dim + 1.0, upper=df_cap,
                             tol=newton_tol, max_iter=newton_max_iter)
  return hyper._replace(df=df, mean_concentration=kappa0), info


def log_marginal_likelihood(hyper: Hyper, stats):
  """log p(X | y, hyper) summed over classes (paper 13.4)."""
  prior = _prior(hyper)
  return jnp.sum(niw.log_marginal_likelihood(prior, _posterior(hyper, stats), stats.count))


def fit_hyper(stats, *, df=None, mean_concentration=None, tol=1e-6, max_iter=100,
              df_cap=1e6):
  """Runs EM from the paper's initialisation; returns (Hyper, EMInfo)."""
  step = functools.partial(em_step, df_cap=df_cap)
  return em.run(step, log_marginal_likelihood, init_hyper(stats, df, mean_concentration),
                stats, tol=tol, max_iter=max_iter)


def params_from_hyper(hyper: Hyper, stats) -> Params:
  post = _posterior(hyper, stats)
  return Params(hyper, niw.predictive(post), niw.predictive(_prior(hyper)),
                jnp.log(stats.count))


@functools.partial(jax.jit, static_argnames=("max_iter",))
def _fit(stats, df, mean_concentration, tol, max_iter, df_cap):
  hyper, info = fit_hyper(stats, df=df, mean_concentration=mean_concentration, tol=tol,
                          max_iter=max_iter, df_cap=df_cap)
  return params_from_hyper(hyper, stats), info


def fit(stats, *, df=None, mean_concentration=None, tol=1e-6, max_iter=100, df_cap=1e6):
  """Fits hyperparameters by EM and precomputes the predictives: (Params, EMInfo).

  Raises:
    ValueError: missing full statistics, or an initial df <= D + 1 (the NIW prior with
      E[Sigma] = Sigma0 needs nu0 > D + 1).
  """
  if stats.scatter is None:
    raise ValueError("The full-covariance model needs full statistics (full=True).")
  checks.em_options(tol, max_iter)
  if df is not None and not float(df) > stats.dim + 1:
    raise ValueError(f"Initial df (nu0) must exceed D + 1 = {stats.dim + 1} for the NIW "
                     f"prior with E[Sigma] = Sigma0; got {df}.")
  checks.positive_or_none(mean_concentration, "mean_concentration")
  return _fit(stats, df, mean_concentration, tol, max_iter, df_cap)


def _mvt_block(x, pred: niw.Predictive):
  """(M, kb) multivariate-t log densities for a block of classes (triangular solves)."""
  dim = x.shape[-1]
  diff = x[None, :, :] - pred.loc[:, None, :]                      # (kb, M, D)
  white = solve_triangular(pred.chol_scale, jnp.swapaxes(diff, -1, -2), lower=True)
  maha = jnp.sum(white * white, axis=-2)                            # (kb, M)
  return student_t.mvt_log_density_from_mahalanobis(
      maha, pred.df[:, None], pred.log_normalizer[:, None], dim).T


def log_predictive(params: Params, x):
  """(class (M, K) log p(x | D_k), prior (M,) log p(x))."""
  num_classes, dim = params.class_pred.loc.shape
  size = blocks.class_block_size(x.shape[0], num_classes, dim)
  class_lp = blocks.map_class_blocks(functools.partial(_mvt_block, x), params.class_pred,
                                     size)
  prior = params.prior_pred
  prior_lp = _mvt_block(x, jax.tree_util.tree_map(lambda a: a[None], prior))[:, 0]
  return class_lp, prior_lp
