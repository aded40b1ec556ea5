"""Mahalanobis baselines: MDS (Lee et al. 2018), RMDS (Ren et al. 2021) and RMDS with
independent, regularised per-class covariances (the paper's "Independent RMDS").

Scores follow the library convention, higher = more in-distribution:
  MDS:   max_k -MD_k(x)
  RMDS:  max_k [MD_0(x) - MD_k(x)]     (paper, section 4)
where MD_k uses the pooled within-class covariance and MD_0 the total covariance.
Mahalanobis distances go through a whitener with an eigenvalue floor (``linalg``), so
raw, un-whitened features with near-degenerate directions do not blow up.
"""
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from dpmm_jax import blocks
from dpmm_jax import linalg
from dpmm_jax import precision
from dpmm_jax import stats as stats_lib


class Params(NamedTuple):
  """means (K, D); within_white (D, D); loc0 (D,); total_white (D, D);
  class_white (K, D, D) per-class whiteners (independent RMDS only, else None)."""
  means: jax.Array
  within_white: jax.Array
  loc0: jax.Array
  total_white: jax.Array
  class_white: Optional[jax.Array]


def regularised_class_covariances(stats: stats_lib.SufficientStats, pseudo_count=1.0):
  """(K, D, D) per-class covariances shrunk towards the pooled covariance.

  Sigma~_k = (S_k + tau_k Sigma_hat) / (N_k + tau_k),  tau_k = pseudo_count + max(0, D + 1 - N_k).

  A class with N_k <= D has a singular sample covariance; inverting it makes independent
  RMDS score below chance. tau_k adds just enough pooled pseudo-observations to make
  every class full rank (it is the posterior mean of an inverse-Wishart centred on the
  pooled covariance), and a small ``pseudo_count`` for all classes.
  """
  if stats.scatter is None:
    raise ValueError("Independent RMDS needs full per-class statistics (full=True).")
  dim = stats.dim
  tau = pseudo_count + jnp.maximum(0.0, dim + 1.0 - stats.count)
  pooled = stats_lib.pooled_covariance(stats)
  return ((stats.scatter + tau[:, None, None] * pooled)
          / (stats.count + tau)[:, None, None])


def fit(stats: stats_lib.SufficientStats, independent: bool = False, pseudo_count=1.0,
        rtol=None) -> Params:
  """Fits the class means and the (floored) whiteners."""
  class_white = None
  if independent:
    class_white = jax.vmap(lambda c: linalg.whitener(c, rtol))(
        regularised_class_covariances(stats, pseudo_count))
  return Params(stats.mean, linalg.whitener(stats_lib.pooled_covariance(stats), rtol),
                stats_lib.global_mean(stats),
                linalg.whitener(stats_lib.total_covariance(stats), rtol), class_white)


@precision.float32_matmuls
def class_distances(params: Params, x):
  """(M, K) squared Mahalanobis distances MD_k(x)."""
  if params.class_white is None:
    return linalg.mahalanobis_sq(x, params.means, params.within_white, params.loc0)

  # (x - m_k) W_k = x W_k - m_k W_k as (M, D) x (D, D) products, both sides centred on
  # the global mean first so that a large common offset does not cancel.
  xc = x - params.loc0

  def block(per_class):
    means, white = per_class
    dw = (jnp.einsum("md,kde->kme", xc, white)
          - jnp.einsum("kd,kde->ke", means - params.loc0, white)[:, None, :])
    return jnp.sum(dw * dw, -1).T

  size = blocks.class_block_size(x.shape[0], params.means.shape[0], x.shape[-1])
  return blocks.map_class_blocks(block, (params.means, params.class_white), size)


def background_distance(params: Params, x):
  """(M,) MD_0(x) under the total covariance."""
  return linalg.mahalanobis_sq(x, params.loc0, params.total_white)


def mds_class_scores(params: Params, x):
  return -class_distances(params, x)


def rmds_class_scores(params: Params, x):
  """(M, K) RMD_k(x) = MD_0(x) - MD_k(x)."""
  return background_distance(params, x)[:, None] - class_distances(params, x)
