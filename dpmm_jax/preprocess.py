"""The paper's section-8 preprocessing as a fitted linear transform.

Centre; whiten with the total covariance (dropping near-zero-variance directions and
optionally keeping only the top ``num_components``); rotate into the eigenbasis of the
average within-class covariance, eigenvalues ascending. Afterwards the data have zero
mean, identity covariance and a diagonal average within-class covariance, which suits
the diagonal models. RMDS is invariant to the transform.
"""
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from dpmm_jax import linalg
from dpmm_jax import precision
from dpmm_jax import stats as stats_lib


class Transform(NamedTuple):
  """z = (x - loc) @ projection.

  Attributes:
    loc: (D,) training mean.
    projection: (D, D') whitening-and-rotation matrix (D' <= D kept directions).
  """
  loc: jax.Array
  projection: jax.Array


@precision.float32_matmuls
def fit(stats: stats_lib.SufficientStats, num_components: Optional[int] = None,
        rtol: Optional[float] = None) -> Transform:
  """Fits the transform from training statistics (not jittable: D' is data dependent).

  Args:
    stats: training statistics (diagonal-only statistics suffice).
    num_components: keep at most this many top principal components.
    rtol: drop directions whose total variance is below ``rtol * max variance``
      (default ``linalg.default_rtol``: 1.2e-5 in float32).
  Returns:
    Transform with D' = min(num_components, number of non-degenerate directions).
  """
  cov = stats_lib.total_covariance(stats)
  rtol = linalg.default_rtol(cov.dtype) if rtol is None else rtol
  values, vectors = jnp.linalg.eigh(linalg.symmetrize(cov))
  values, vectors = values[::-1], vectors[:, ::-1]                # descending
  # A direction is noise if its variance is below rtol * the largest, or below the
  # rounding noise of the feature values themselves (a constant feature c computes a
  # variance of order (eps c)^2, not 0, in floating point).
  eps = jnp.finfo(cov.dtype).eps
  rounding = (8.0 * eps * jnp.max(jnp.abs(stats_lib.global_mean(stats)))) ** 2
  floor = jnp.maximum(rtol * values[0], jnp.maximum(rounding, jnp.finfo(cov.dtype).tiny))
  keep = int(jnp.sum(values > floor))
  if num_components is not None:
    keep = min(keep, int(num_components))
  if keep < 1:
    raise ValueError("preprocess.fit: the training features have no direction with "
                     "non-zero variance.")
  whiten = vectors[:, :keep] / jnp.sqrt(values[:keep])[None, :]   # (D, D')
  within = whiten.T @ stats_lib.pooled_covariance(stats) @ whiten
  _, rotation = jnp.linalg.eigh(linalg.symmetrize(within))        # ascending
  return Transform(stats_lib.global_mean(stats), whiten @ rotation)


@precision.float32_matmuls
def apply(transform: Transform, x):
  """(M, D) -> (M, D') transformed features."""
  return (jnp.asarray(x) - transform.loc) @ transform.projection
