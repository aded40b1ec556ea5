"""Per-class sufficient statistics: counts, means and centred scatter, exactly mergeable.

Everything downstream (preprocessing, empirical-Bayes priors, EM, every model's fit) reads
the data only through these statistics, so a dataset that does not fit in memory is
summarised chunk by chunk (``from_chunks``) and the parts are combined with the exact
pairwise update of Chan et al. (``merge``). Means and *centred* scatter are kept instead of
raw moments: ``sum x x^T - N xbar xbar^T`` loses all precision in float32 when the data
are far from the origin.
"""
from typing import Iterable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np


class SufficientStats(NamedTuple):
  """Per-class summaries of labelled data.

  Attributes:
    count: (K,) number of points per class.
    mean: (K, D) per-class means (zero for an empty class).
    sq_dev: (K, D) per-class sums of squared deviations from the class mean.
    scatter: (K, D, D) per-class centred scatter sum_n (x_n - m_k)(x_n - m_k)^T, or None
      when only diagonal statistics were requested (saves K D^2 memory).
    pooled_scatter: (D, D) within-class scatter summed over classes.
  """
  count: jax.Array
  mean: jax.Array
  sq_dev: jax.Array
  scatter: Optional[jax.Array]
  pooled_scatter: jax.Array

  @property
  def num_classes(self) -> int:
    return self.count.shape[0]

  @property
  def dim(self) -> int:
    return self.mean.shape[-1]


def _segment_sum(values, labels, num_classes):
  # Labels outside [0, K) (used for padding rows) are dropped by segment_sum.
  return jax.ops.segment_sum(values, labels, num_segments=num_classes)


def from_labels(x, y, num_classes: int, full: bool = True,
                block_size: int = 128) -> SufficientStats:
  """Sufficient statistics of one in-memory chunk (two-pass: means, then centred sums).

  Rows whose label lies outside ``[0, num_classes)`` are ignored; ``from_chunks`` uses
  label -1 to pad the last chunk so every chunk has one shape (one compilation).

  Args:
    x: (N, D) features.
    y: (N,) integer labels.
    num_classes: K (static).
    full: also accumulate the per-class (K, D, D) scatter (static).
    block_size: rows per block when accumulating outer products (bounds the (B, D, D)
      temporary; static).
  Returns:
    SufficientStats of the chunk.
  """
  x = jnp.asarray(x)
  y = jnp.asarray(y, jnp.int32)
  valid = ((y >= 0) & (y < num_classes)).astype(x.dtype)
  count = _segment_sum(valid, y, num_classes)
  mean = _segment_sum(x * valid[:, None], y, num_classes) / jnp.maximum(count, 1.0)[:, None]
  centred = (x - mean[jnp.clip(y, 0, num_classes - 1)]) * valid[:, None]
  sq_dev = _segment_sum(centred * centred, y, num_classes)
  pooled = centred.T @ centred
  scatter = None
  if full:
    n, dim = centred.shape
    num_blocks = -(-n // block_size)
    pad = num_blocks * block_size - n
    blocks_x = jnp.pad(centred, ((0, pad), (0, 0))).reshape(num_blocks, block_size, dim)
    blocks_y = jnp.pad(y, (0, pad), constant_values=-1).reshape(num_blocks, block_size)

    def add_block(acc, block):
      xb, yb = block
      outer = xb[:, :, None] * xb[:, None, :]
      return acc + _segment_sum(outer, yb, num_classes), None

    scatter, _ = jax.lax.scan(add_block, jnp.zeros((num_classes, dim, dim), x.dtype),
                              (blocks_x, blocks_y))
  return SufficientStats(count, mean, sq_dev, scatter, pooled)


_from_labels_jit = jax.jit(from_labels, static_argnames=("num_classes", "full", "block_size"))


def merge(a: SufficientStats, b: SufficientStats) -> SufficientStats:
  """Exact statistics of the union of two disjoint data sets (Chan et al. 1979).

  Args:
    a, b: statistics with the same K and D (both with or both without ``scatter``).
  Returns:
    SufficientStats of the concatenated data.
  """
  n = a.count + b.count
  safe_n = jnp.maximum(n, 1.0)
  delta = b.mean - a.mean                                     # (K, D)
  mean = a.mean + delta * (b.count / safe_n)[:, None]
  weight = a.count * b.count / safe_n                         # (K,)
  sq_dev = a.sq_dev + b.sq_dev + weight[:, None] * delta * delta
  pooled = a.pooled_scatter + b.pooled_scatter + (delta * weight[:, None]).T @ delta
  scatter = None
  if a.scatter is not None and b.scatter is not None:
    scatter = (a.scatter + b.scatter
               + weight[:, None, None] * delta[:, :, None] * delta[:, None, :])
  return SufficientStats(n, mean, sq_dev, scatter, pooled)


_merge_jit = jax.jit(merge)


def iterate_chunks(x, y, chunk_size: int) -> Iterable[Tuple[np.ndarray, np.ndarray]]:
  """Yields (x, y) row chunks of arrays that may be ``np.memmap`` (only one chunk in RAM)."""
  for start in range(0, x.shape[0], chunk_size):
    yield np.asarray(x[start:start + chunk_size]), np.asarray(y[start:start + chunk_size])


def from_chunks(chunks: Iterable[Tuple[np.ndarray, np.ndarray]], num_classes: int,
                full: bool = True, chunk_size: Optional[int] = None,
                dtype=None) -> SufficientStats:
  """Streams statistics over (x, y) chunks, merging exactly; pads chunks to one shape.

  Args:
    chunks: iterable of ((n_i, D) features, (n_i,) labels); e.g. ``iterate_chunks``.
    num_classes: K.
    full: accumulate per-class full scatter.
    chunk_size: pad every chunk to this many rows so that a single compilation serves
      all chunks (defaults to the first chunk's size).
    dtype: accumulation dtype (defaults to the first chunk's float dtype).
  Returns:
    SufficientStats of all chunks together.
  """
  total = None
  for xc, yc in chunks:
    xc = np.asarray(xc)
    if dtype is None:
      dtype = jnp.asarray(xc[:1]).dtype
    if chunk_size is None:
      chunk_size = xc.shape[0]
    for start in range(0, xc.shape[0], chunk_size):
      xs, ys = xc[start:start + chunk_size], np.asarray(yc[start:start + chunk_size])
      pad = chunk_size - xs.shape[0]
      if pad:
        xs = np.concatenate([xs, np.zeros((pad, xs.shape[1]), xs.dtype)])
        ys = np.concatenate([ys, -np.ones(pad, ys.dtype)])
      part = _from_labels_jit(jnp.asarray(xs, dtype), jnp.asarray(ys, jnp.int32),
                              num_classes=num_classes, full=full)
      total = part if total is None else _merge_jit(total, part)
  if total is None:
    raise ValueError("from_chunks received no data.")
  return total


def from_arrays(x, y, num_classes: int, full: bool = True,
                chunk_size: int = 65536, dtype=None) -> SufficientStats:
  """Statistics of (possibly memory-mapped) arrays, ``chunk_size`` rows at a time."""
  return from_chunks(iterate_chunks(x, y, chunk_size), num_classes, full=full,
                     chunk_size=min(chunk_size, x.shape[0]), dtype=dtype)


# ----------------------------------------------------------------------------- derived
def total_count(stats: SufficientStats):
  return jnp.sum(stats.count)


def global_mean(stats: SufficientStats):
  """(D,) mean of all points."""
  return stats.count @ stats.mean / total_count(stats)


def pooled_covariance(stats: SufficientStats):
  """(D, D) average within-class covariance  Sigma_hat = (1/N) sum_k scatter_k."""
  return stats.pooled_scatter / total_count(stats)


def pooled_variance(stats: SufficientStats):
  """(D,) average within-class variances (diagonal of ``pooled_covariance``)."""
  return jnp.sum(stats.sq_dev, axis=0) / total_count(stats)


def total_covariance(stats: SufficientStats):
  """(D, D) covariance of all points: within-class plus between-class scatter, over N."""
  centred_means = stats.mean - global_mean(stats)
  between = (centred_means * stats.count[:, None]).T @ centred_means
  return (stats.pooled_scatter + between) / total_count(stats)


def class_covariances(stats: SufficientStats):
  """(K, D, D) per-class maximum-likelihood covariances scatter_k / N_k."""
  if stats.scatter is None:
    raise ValueError("class_covariances needs full statistics (computed with full=True).")
  return stats.scatter / jnp.maximum(stats.count, 1.0)[:, None, None]
