"""Hierarchical Gaussian DPMM with low-rank-plus-shared class covariances (beyond the paper).

The paper's closing section names ``Sigma_k = W_k W_k^T + diagonal`` as future work: class
covariances that keep correlations at O(D r) cost. This model builds it on the full
model's NIW prior (``full``): same prior, same EM for (mu0, Sigma0, nu0, kappa0), same
class posteriors ``IW(nu0 + N_k, Psi0 + B_k)`` with the class evidence

    B_k = S_k + kappa0 N_k / (kappa0 + N_k) (xbar_k - mu0)(xbar_k - mu0)^T   (rank <= N_k).

With fewer points than dimensions (N_k < D) most of B_k is sampling noise: the full
model's predictive then trusts a rank-N_k scatter in every direction, and loses accuracy
(CLINC150, N_k = 50, D = 381: 90.0 % against RMDS's 93.7 %; docs/results/lowrank_study.md).
Here each class keeps only the directions of B_k that stand above that noise. In
Sigma0-whitened coordinates (``L0 L0^T = Sigma0``) a class whose covariance is Sigma0
gives a scatter whose eigenvalues lie below the Marchenko-Pastur edge
``(sqrt(N_k - 1) + sqrt(D))^2``; the eigenpairs (w_j, v_j) of ``L0^-1 B_k L0^-T`` above
``edge_scale`` times that edge are kept, at most ``max_rank`` of them, and the rest of B_k
is dropped (the prior alone speaks there). The predictive is the NIW Student-t with

    Sigma_k = c_k L0 (a I + V_k W_k V_k^T) L0^T,   a = nu0 - D - 1,
    c_k = (kappa_k + 1) / (kappa_k (nu0 + N_k - D + 1)),

i.e. a shared part (diagonal after the default preprocessing, which makes Sigma0
diagonal) plus rank r_k <= max_rank. Scoring whitens each point once (O(D^2)) and then
costs O(K D (r + 1)) per point, against O(K D^2) for ``full``.

Limits: ``edge_scale = 0`` and ``max_rank = D`` give the full model's predictive exactly;
``max_rank = 0`` gives classes whose covariance comes from the prior alone (their means
and the mean-shrinkage still come from the data).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpmm_jax import blocks
from dpmm_jax import compiler
from dpmm_jax import em
from dpmm_jax import linalg
from dpmm_jax import precision
from dpmm_jax import student_t
from dpmm_jax import validation as checks
from dpmm_jax.conjugate import niw
from dpmm_jax.models import full

KAPPA_CAP = full.KAPPA_CAP
# Default cap on the kept directions per class (a static shape: (K, max_rank, D) factors).
DEFAULT_MAX_RANK = 32


class Params(NamedTuple):
  """Fitted model.

  Attributes:
    hyper: ``full.Hyper`` (mu0, Sigma0, nu0, kappa0) from the full model's EM.
    white: (D, D) ``L0^-T``: ``(x - mu0) @ white`` are Sigma0-whitened coordinates.
    loc: (K, D) class posterior means kappa-weighted between mu0 and the class means.
    factors: (K, R, D) rows ``v_j sqrt(w_j / (a + w_j))`` of the kept directions in
      whitened coordinates (zero rows for directions not kept), R = min(max_rank, D).
    scale: (K,) ``a c_k``: Sigma_k = scale_k L0 (I + V W V^T / a) L0^T.
    df: (K,) predictive degrees of freedom nu0 + N_k - D + 1.
    log_normalizer: (K,) Student-t log normaliser (log density at the class mean).
    num_spikes: (K,) int32 directions above the edge before the cap (kept: min(., R)).
    prior_scale, prior_df, prior_log_normalizer: () the prior predictive's terms.
    log_counts: (K,) log N_k.
  """
  hyper: full.Hyper
  white: jax.Array
  loc: jax.Array
  factors: jax.Array
  scale: jax.Array
  df: jax.Array
  log_normalizer: jax.Array
  num_spikes: jax.Array
  prior_scale: jax.Array
  prior_df: jax.Array
  prior_log_normalizer: jax.Array
  log_counts: jax.Array


# Params fields with a leading class axis (``em.run_jitted_fit`` cuts them to K).
CLASS_FIELDS = ("loc", "factors", "scale", "df", "log_normalizer", "num_spikes", "log_counts")


def noise_edge(count, dim: int):
  """(K,) Marchenko-Pastur upper edge of the scatter of N_k points drawn with identity
  covariance: ``(sqrt(N_k - 1) + sqrt(D))^2`` (the largest eigenvalue's limit)."""
  return (jnp.sqrt(jnp.maximum(count - 1.0, 0.0)) + jnp.sqrt(jnp.asarray(dim, count.dtype))) ** 2


@functools.partial(compiler.jit, static_argnames=("max_rank",))
@precision.float32_matmuls
def params_from_hyper(hyper: full.Hyper, stats, max_rank: int = DEFAULT_MAX_RANK,
                      edge_scale=1.0) -> Params:
  """Class predictives with the directions of B_k above ``edge_scale`` x the noise edge.

  Costs one (D, D) eigendecomposition per class (in class blocks, as ``full``).
  """
  dim = stats.dim
  rank = int(min(max_rank, dim))
  dtype = stats.mean.dtype
  prior = full._prior(hyper)
  a = hyper.df - dim - 1.0
  chol0 = jnp.linalg.cholesky(hyper.mean_cov)
  inv0 = linalg.triangular_inverse(chol0)                            # L0^-1
  log_det0 = linalg.chol_log_det(chol0)
  edge_scale = jnp.asarray(edge_scale, dtype)

  def block(per_class):
    count, mean, scatter = per_class
    evidence = inv0 @ niw.evidence(prior, count, mean, scatter) @ inv0.T
    values, vectors = jnp.linalg.eigh(linalg.symmetrize(evidence))  # ascending
    edge = edge_scale * noise_edge(count, dim)
    above = values > edge[:, None]
    top_values = values[:, dim - rank:][:, ::-1]                    # (kb, R) descending
    top_vectors = vectors[:, :, dim - rank:][:, :, ::-1]            # (kb, D, R)
    keep = top_values > jnp.maximum(edge, 0.0)[:, None]
    kept = jnp.where(keep, top_values, 0.0)
    factors = jnp.swapaxes(top_vectors * jnp.sqrt(kept / (a + kept))[:, None, :], 1, 2)
    log_det_low = jnp.sum(jnp.log1p(kept / a), -1)
    # With edge_scale = 0 the rank is fixed by the caller: nothing is "cut off".
    num_spikes = jnp.where(edge_scale > 0, jnp.sum(above, -1), jnp.sum(keep, -1))
    return factors, log_det_low, num_spikes.astype(jnp.int32)

  factors, log_det_low, num_spikes = blocks.map_blocks(
      block, (stats.count, stats.mean, stats.scatter),
      full._em_block_size(stats.num_classes, dim))
  loc, kappa, post_df = niw.posterior_location(prior, stats.count, stats.mean)
  df, factor = niw.predictive_df_and_factor(kappa, post_df, dim)
  scale = a * factor
  log_det = dim * jnp.log(scale) + log_det0 + log_det_low
  log_normalizer = student_t.t_log_normalizer(df, dim) - 0.5 * log_det
  prior_df, prior_factor = niw.predictive_df_and_factor(hyper.mean_concentration, hyper.df, dim)
  prior_scale = a * prior_factor
  prior_log_normalizer = (student_t.t_log_normalizer(prior_df, dim)
                          - 0.5 * (dim * jnp.log(prior_scale) + log_det0))
  return Params(hyper, inv0.T, loc, factors, scale, df, log_normalizer, num_spikes,
                prior_scale, prior_df, prior_log_normalizer, jnp.log(stats.count))


# Two programs: the full model's EM, which does not depend on the rank cap (one
# compilation serves every max_rank), and the low-rank predictives (``params_from_hyper``,
# jitted itself), one per max_rank.
_fit_hyper = compiler.jit(full.fit_hyper, static_argnames=("trace_length",))


def _fit(stats, *, df, mean_concentration, tol, max_iter, df_cap, accelerate, max_rank,
         edge_scale, trace_length):
  hyper, info = _fit_hyper(stats, df=df, mean_concentration=mean_concentration, tol=tol,
                           max_iter=max_iter, df_cap=df_cap, accelerate=accelerate,
                           trace_length=trace_length)
  return params_from_hyper(hyper, stats, max_rank, edge_scale), info


# Programs compiled so far, like a jitted fit's ``_cache_size`` (tests count them).
_fit._cache_size = lambda: (  # pylint: disable=protected-access
    _fit_hyper._cache_size() + params_from_hyper._cache_size())


def fit(stats, *, df=None, mean_concentration=None, tol=1e-6, max_iter=100, df_cap=1e6,
        accelerate=True, max_rank=DEFAULT_MAX_RANK, edge_scale=1.0):
  """Fits the hyperparameters by the full model's EM, then the low-rank predictives.

  Args:
    stats: full statistics (the (K, D, D) scatter is needed).
    df, mean_concentration, tol, max_iter, df_cap, accelerate: as ``full.fit``.
    max_rank: most directions kept per class (default 32; static for the predictives
      only: fits with other caps reuse the compiled EM).
    edge_scale: multiplies the noise edge (default 1; 0 keeps the top ``max_rank``
      directions of every class whatever their size).
  Returns:
    (Params, EMInfo).
  """
  full.check_fit_arguments(stats, tol, max_iter, df, mean_concentration, "lowrank")
  max_rank = checks.non_negative_int(max_rank, "max_rank")
  checks.non_negative(edge_scale, "edge_scale")
  return em.run_jitted_fit(_fit, stats, df=df, mean_concentration=mean_concentration,
                           tol=tol, max_iter=max_iter, df_cap=df_cap, accelerate=accelerate,
                           max_rank=max_rank, edge_scale=edge_scale,
                           class_fields=CLASS_FIELDS)


def scoring_flops(num_points: int, num_classes: int, dim: int, max_rank: int) -> float:
  """Multiply-add flops (2 per MAC) of ``log_predictive``'s matrix products."""
  return 2.0 * num_points * dim * (dim + num_classes * (1 + max_rank))


@compiler.jit
@precision.float32_matmuls
def log_predictive(params: Params, x):
  """(class (M, K) log p(x | D_k), prior (M,) log p(x)).

  ``e = (x - m_k) L0^-T`` in whitened coordinates; the squared distance under Sigma_k is
  ``(|e|^2 - |F_k e|^2) / scale_k`` (Woodbury), with both terms as matrix products over
  blocks of classes (temporaries (M, kb, R)).
  """
  num_classes, rank, dim = params.factors.shape
  xw = (x - params.hyper.loc) @ params.white                         # (M, D)
  lw = (params.loc - params.hyper.loc) @ params.white                # (K, D)
  x_sq = jnp.sum(xw * xw, -1)
  base = (x_sq[:, None] - 2.0 * xw @ lw.T + jnp.sum(lw * lw, -1)[None, :])

  def low_rank_block(block):
    factors, loc_w = block                                           # (kb, R, D), (kb, D)
    z = jnp.einsum("md,krd->mkr", xw, factors) - jnp.einsum("kd,krd->kr", loc_w, factors)
    return jnp.sum(z * z, -1)                                        # (M, kb)

  size = blocks.class_block_size(x.shape[0], num_classes, max(rank, 1))
  low = (blocks.map_class_blocks(low_rank_block, (params.factors, lw), size) if rank
         else jnp.zeros_like(base))
  maha = jnp.maximum(base - low, 0.0) / params.scale[None, :]
  class_lp = student_t.mvt_log_density_from_mahalanobis(
      maha, params.df[None, :], params.log_normalizer[None, :], dim)
  prior_lp = student_t.mvt_log_density_from_mahalanobis(
      x_sq / params.prior_scale, params.prior_df, params.prior_log_normalizer, dim)
  return class_lp, prior_lp
