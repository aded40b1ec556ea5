"""The paper's section-8 preprocessing as a fitted linear transform.

Centre; whiten with the total covariance (dropping near-zero-variance directions and
optionally keeping only the top ``num_components``); rotate into the eigenbasis of the
average within-class covariance, eigenvalues ascending. Afterwards the data have zero
mean, identity covariance and a diagonal average within-class covariance, which suits
the diagonal models. RMDS is invariant to the transform.

The rotation is made unique. Where the average within-class covariance has a repeated
eigenvalue, its eigenbasis is any orthonormal basis of that eigenspace, and an
eigensolver returns whichever its round-off leads to. That always happens when there
are fewer classes than dimensions (K - 1 < D': in total-whitened coordinates the
within-class covariance is I minus a between-class part of rank K - 1, so D' - K + 1
eigenvalues equal 1). The axis-aligned models (diag, coupled) are not invariant to such a
rotation: before this rule, permuting the training rows changed diag scores by 4.5 % of
their scale and 1.9 % of the predicted classes (K = 100, D = 128), and so did moving the
fit from the CPU to a GPU. ``canonical_basis`` picks one basis per eigenspace by a fixed
rule, so the transform depends on the data alone, up to round-off.
"""
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import blocks
from dpmm_jax import compiler
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


@compiler.jit
@precision.float32_matmuls
def _total_spectrum(stats: stats_lib.SufficientStats, rtol):
  """(values (D,) and vectors (D, D) of the total covariance, descending; the variance
  floor (); the global mean (D,)). One compiled program (eagerly, every op compiles)."""
  cov = stats_lib.total_covariance(stats)
  values, vectors = jnp.linalg.eigh(linalg.symmetrize(cov))
  values, vectors = values[::-1], vectors[:, ::-1]                # descending
  # A direction is noise if its variance is below rtol * the largest, or below the
  # rounding noise of the feature values themselves (a constant feature c computes a
  # variance of order (eps c)^2, not 0, in floating point).
  eps = jnp.finfo(cov.dtype).eps
  mean = stats_lib.global_mean(stats)
  rounding = (8.0 * eps * jnp.max(jnp.abs(mean))) ** 2
  floor = jnp.maximum(rtol * values[0], jnp.maximum(rounding, jnp.finfo(cov.dtype).tiny))
  return values, vectors, floor, mean


@functools.partial(compiler.jit, static_argnums=(3,))
@precision.float32_matmuls
def _within_spectrum(stats: stats_lib.SufficientStats, values, vectors, keep: int):
  """(eigenvalues (D',) ascending, input-space columns (D, D')) of the average
  within-class covariance after whitening with the top ``keep`` directions."""
  whiten = vectors[:, :keep] / jnp.sqrt(values[:keep])[None, :]   # (D, D')
  within = whiten.T @ stats_lib.pooled_covariance(stats) @ whiten
  within_values, rotation = jnp.linalg.eigh(linalg.symmetrize(within))   # ascending
  return within_values, whiten @ rotation


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
  dtype = stats.sq_dev.dtype
  rtol = linalg.default_rtol(dtype) if rtol is None else rtol
  values, vectors, floor, mean = _total_spectrum(stats, np.asarray(rtol, dtype))  # no eager op
  keep = int(np.sum(np.asarray(values) > np.asarray(floor)))
  if num_components is not None:
    keep = min(keep, int(num_components))
  if keep < 1:
    raise ValueError("preprocess.fit: the training features have no direction with "
                     "non-zero variance.")
  within_values, columns = _within_spectrum(stats, values, vectors, keep)
  projection = canonical_basis(np.asarray(within_values), np.asarray(columns))
  return Transform(mean, jnp.asarray(projection, dtype))


# Eigenvalues closer than this (times eps and the largest |eigenvalue|) share a basis.
EIGENSPACE_ULPS = 1000.0
# Rows per block of ``apply``: a 65,536 x 768 chunk took 229-235 ms in blocks of 2,048
# rows against 343-347 ms as one product (2-core CPU, session 22).
_APPLY_ROW_BLOCK = 2048


@precision.float32_matmuls   # numpy products here (host side); kept for the package rule
def canonical_basis(values: np.ndarray, vectors: np.ndarray, ulps: float = EIGENSPACE_ULPS):
  """One fixed basis per (near-)repeated eigenvalue, and fixed signs (host side).

  Args:
    values: (D',) eigenvalues, ascending.
    vectors: (D, D') the corresponding columns (here: input-space projection columns;
      any basis of a repeated eigenvalue's columns, ``vectors[:, c] @ R`` for orthogonal
      R, gives the same result).
    ulps: eigenvalues whose consecutive gaps are at most ``ulps * eps * max |values|``
      form one eigenspace.
  Returns:
    (D, D') columns in the same eigenspaces. Within an eigenspace with columns V_c the
    basis is the eigenvectors of ``V_c^T diag(1, 2, ..., D) V_c`` (a generic, fixed
    matrix: covariant under V_c -> V_c R, so the result does not depend on R); each
    column's sign makes its largest-magnitude entry positive.
  """
  dtype = vectors.dtype
  values = np.asarray(values, np.float64)
  vectors = np.array(vectors, np.float64)
  gap = ulps * np.finfo(dtype).eps * max(float(np.max(np.abs(values))), np.finfo(dtype).tiny)
  starts = np.flatnonzero(np.concatenate([[True], np.diff(values) > gap, [True]]))
  weights = np.arange(1.0, vectors.shape[0] + 1.0)
  for lo, hi in zip(starts[:-1], starts[1:]):
    if hi - lo > 1:
      block = vectors[:, lo:hi]
      _, turn = np.linalg.eigh(block.T @ (weights[:, None] * block))
      vectors[:, lo:hi] = block @ turn
  largest = vectors[np.argmax(np.abs(vectors), axis=0), np.arange(vectors.shape[1])]
  return (vectors * np.where(largest < 0, -1.0, 1.0)).astype(dtype)


@compiler.jit
@precision.float32_matmuls
def apply(transform: Transform, x):
  """(M, D) -> (M, D') transformed features (in blocks of rows: faster than one product
  over a tall chunk)."""
  return blocks.map_blocks(lambda rows: (rows - transform.loc) @ transform.projection,
                           jnp.asarray(x), _APPLY_ROW_BLOCK)
