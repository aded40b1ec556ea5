"""Per-class sufficient statistics: counts, means and centred scatter, exactly mergeable.

Everything downstream (preprocessing, empirical-Bayes priors, EM, every model's fit) reads
the data only through these statistics, so a dataset that does not fit in memory is
summarised chunk by chunk (``from_chunks``) and the parts are combined with the exact
pairwise update of Chan et al. (``merge``). Means and *centred* scatter are kept instead of
raw moments: ``sum x x^T - N xbar xbar^T`` loses all precision in float32 when the data
are far from the origin.

Streaming (``update``) adds a chunk to running statistics with the batched form of
Welford's update, which is Chan's merge written per row: with ``m`` the class mean before
and ``m'`` after the chunk (both from segment sums),

    S' = S + sum_{n in chunk, y_n = k} (x_n - m)(x_n - m')^T,

and the same elementwise for the squared deviations. Both factors are centred on the
class, so nothing cancels in float32. The per-class products are matrix products: the
row indices of the chunk are sorted by label, each class's rows are cut into windows of at
most ``block_size`` rows (the last window of a class is rounded up to a power of two, at
least 8, and its surplus rows are masked), each window's rows are gathered and one
(D, W) x (W, D) product per window is added in place into that class's (D, D) block (its
diagonal into the squared deviations). The work is 2 N D^2 flops in GEMMs; no (B, D, D)
temporary and no sorted copy of the chunk is formed.
"""
import functools
import itertools
import mmap
from typing import Iterable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import blocks
from dpmm_jax import compiler
from dpmm_jax import precision
from dpmm_jax import validation


class SufficientStats(NamedTuple):
  """Per-class summaries of labelled data.

  Attributes:
    count: (K,) number of points per class.
    mean: (K, D) per-class means (zero for an empty class).
    sq_dev: (K, D) per-class sums of squared deviations from the class mean.
    scatter: (K, D, D) per-class centred scatter sum_n (x_n - m_k)(x_n - m_k)^T, or None
      when only diagonal statistics were requested (saves K D^2 memory).
    pooled_scatter: (D, D) within-class scatter summed over classes, or None when it was
      not requested (``pooled=False``: the diagonal models need only ``sq_dev``, whose
      sum over classes is its diagonal; skipping it saves an (N, D) x (N, D) product).
  """
  count: jax.Array
  mean: jax.Array
  sq_dev: jax.Array
  scatter: Optional[jax.Array]
  pooled_scatter: Optional[jax.Array]

  @property
  def num_classes(self) -> int:
    return self.count.shape[0]

  @property
  def dim(self) -> int:
    return self.mean.shape[-1]


def _segment_sum(values, labels, num_classes):
  # Labels outside [0, K) (used for padding rows) are dropped by segment_sum.
  return jax.ops.segment_sum(values, labels, num_segments=num_classes)


# Smallest window (rows) of the per-class scatter products.
_MIN_WINDOW = 8
# Rows per block of the pooled scatter's product when there is no per-class scatter.
_POOLED_ROW_BLOCK = 4096


def empty(num_classes: int, dim: int, full: bool = True, dtype=jnp.float32,
          pooled: bool = True) -> SufficientStats:
  """Statistics of no data (the identity of ``merge`` and the start of ``update``).
  ``pooled=False`` (only with ``full=False``): no ``pooled_scatter`` is accumulated."""
  if full and not pooled:
    raise ValueError("pooled=False needs full=False (the per-class scatter gives the "
                     "pooled one at no cost).")
  zeros = functools.partial(jnp.zeros, dtype=dtype)
  return SufficientStats(zeros((num_classes,)), zeros((num_classes, dim)),
                         zeros((num_classes, dim)),
                         zeros((num_classes, dim, dim)) if full else None,
                         zeros((dim, dim)) if pooled else None)


def _window_sizes(block_size: int):
  """Static window lengths: powers of two from _MIN_WINDOW below block_size, then it."""
  sizes, w = [], min(_MIN_WINDOW, block_size)
  while w < block_size:
    sizes.append(w)
    w *= 2
  return tuple(sizes) + (block_size,)


def stable_key_order(key, num_keys: int):
  """(n,) int32 stable sorting order of (n,) integer keys in [0, num_keys): equals
  ``jnp.argsort(key, stable=True)``.

  Sorts the single uint32 ``key * n + row`` when it cannot overflow (num_keys * n <=
  2^32, static), a one-operand sort instead of argsort's sort of (key, row) pairs: 65,536
  rows took 2.0-2.1 ms against 9.7-10.6 ms on the 2-core CPU (K = 100 and 1000,
  benchmarks/RESULTS.md, session 23). Larger problems use argsort.
  """
  n = key.shape[0]
  if num_keys * n > 2 ** 32:
    return jnp.argsort(key, stable=True).astype(jnp.int32)
  rows = jnp.arange(n, dtype=jnp.uint32)
  packed = key.astype(jnp.uint32) * jnp.uint32(n) + rows
  return (jnp.sort(packed) % jnp.uint32(n)).astype(jnp.int32)


def _class_windows(counts, block_size: int, max_items: int):
  """Work list over class-sorted rows: one item per window of at most block_size rows.

  Args:
    counts: (K,) int rows per class (rows sorted by class, classes in order).
    block_size: window length W (static).
    max_items: static bound on the number of items (N // W + K).
  Returns:
    (class (I,), start (I,), length (I,), branch (I,) index into ``_window_sizes``,
    number of items ()). Entries past the number of items are unused.
  """
  num_classes = counts.shape[0]
  sizes = jnp.asarray(_window_sizes(block_size), jnp.int32)
  full_windows = counts // block_size
  per_class = full_windows + (counts > full_windows * block_size).astype(counts.dtype)
  ends = jnp.cumsum(per_class)
  offsets = jnp.cumsum(counts) - counts
  item = jnp.arange(max_items, dtype=counts.dtype)
  k = jnp.minimum(jnp.searchsorted(ends, item, side="right"), num_classes - 1)
  j = item - (ends[k] - per_class[k])
  length = jnp.minimum(block_size, counts[k] - j * block_size)
  branch = jnp.searchsorted(sizes, length, side="left")
  return k, offsets[k] + j * block_size, length, branch, ends[-1]


@precision.float32_matmuls
def _add_class_products(stats: SufficientStats, x, order, counts, ref_old, mean,
                        block_size: int):
  """scatter[k] += a_k^T c_k, sq_dev[k] += diag(a_k^T c_k), pooled += sum_k a_k^T c_k,
  with a = x - ref_old[k] and c = x - mean[k] over the rows of class k.

  Args:
    stats: running statistics with ``scatter`` (updated in place inside the loop).
    x: (B, D) chunk rows in their original order.
    order: (B,) row indices sorted by class (``counts[0]`` rows of class 0 first, ...).
    counts: (K,) int rows per class among the first sum(counts) entries of ``order``.
    ref_old, mean: (K, D) the two centres of the Welford update.
    block_size: maximal window (static).
  Returns:
    (scatter, sq_dev, pooled).
  """
  n = x.shape[0]
  block_size = max(1, min(block_size, n))
  sizes = _window_sizes(block_size)
  k, start, length, branch, num_items = _class_windows(
      counts, block_size, n // block_size + counts.shape[0])

  def window(size, s, ln, kk):
    # dynamic_slice clamps the start to n - size; mask rows outside [s, s + ln). The rows
    # are gathered per window, so the chunk is never copied in sorted order.
    s0 = jnp.clip(s, 0, n - size)
    pos = s0 + jnp.arange(size, dtype=s.dtype)
    keep = ((pos >= s) & (pos < s + ln))[:, None]
    rows = x[jax.lax.dynamic_slice_in_dim(order, s0, size)]
    aw = jnp.where(keep, rows - ref_old[kk], 0.0)
    return aw.T @ (rows - mean[kk])

  branches = [functools.partial(window, size) for size in sizes]

  def body(i, carry):
    acc, sq, pool = carry
    u = jax.lax.switch(branch[i], branches, start[i], length[i], k[i])
    cur = jax.lax.dynamic_index_in_dim(acc, k[i], keepdims=False)
    acc = jax.lax.dynamic_update_index_in_dim(acc, cur + u, k[i], 0)
    cur_sq = jax.lax.dynamic_index_in_dim(sq, k[i], keepdims=False)
    sq = jax.lax.dynamic_update_index_in_dim(sq, cur_sq + jnp.diagonal(u), k[i], 0)
    return acc, sq, pool + u

  return jax.lax.fori_loop(0, num_items, body,
                           (stats.scatter, stats.sq_dev, stats.pooled_scatter))


@precision.float32_matmuls
def _update(stats: SufficientStats, x, y, block_size: int, axis_name=None):
  """``update``; with ``axis_name`` (inside shard_map / pmap over the rows) the counts and
  means are summed over the axis, while sq_dev, scatter and pooled_scatter stay
  per-device partial sums (the caller sums them once at the end)."""
  num_classes = stats.num_classes
  dtype = stats.mean.dtype
  x = jnp.asarray(x, dtype)
  y = jnp.asarray(y, jnp.int32)
  valid = (y >= 0) & (y < num_classes)
  key = jnp.where(valid, y, num_classes)                     # invalid rows sort last
  local_counts = jnp.bincount(key, length=num_classes + 1)[:num_classes]
  chunk_counts = local_counts.astype(dtype)
  mean_old = stats.mean
  sums = _segment_sum(x, key, num_classes)                    # drops key == K
  if axis_name is not None:
    chunk_counts = jax.lax.psum(chunk_counts, axis_name)
    sums = jax.lax.psum(sums, axis_name)
  count = stats.count + chunk_counts
  # m' = m + (sum_chunk (x - m)) / N'  (m = 0 for a class not seen before).
  mean = mean_old + (sums - chunk_counts[:, None] * mean_old) / jnp.maximum(count, 1.0)[:, None]
  # A class seen for the first time is centred on its new mean in both factors.
  ref_old = jnp.where((stats.count > 0)[:, None], mean_old, mean)
  if stats.scatter is not None:
    order = stable_key_order(key, num_classes + 1)
    scatter, sq_dev, pooled = _add_class_products(stats, x, order, local_counts, ref_old,
                                                  mean, block_size)
    return SufficientStats(count, mean, sq_dev, scatter, pooled)
  safe_key = jnp.minimum(key, num_classes - 1)
  a = jnp.where(valid[:, None], x - ref_old[safe_key], 0.0)
  c = x - mean[safe_key]
  sq_dev = stats.sq_dev + _segment_sum(a * c, key, num_classes)
  pooled = stats.pooled_scatter
  if pooled is not None:
    # a^T c again, in row blocks whose centred operands stay in cache: one update of a
    # 65,536 x 768 chunk took 290-306 ms against 396-404 ms as one product over the
    # materialised operands (K = 1000, 2-core CPU, session 22).
    def block_product(rows, keep):
      xb, kb, vb = rows
      ab = jnp.where((vb & keep)[:, None], xb - ref_old[kb], 0.0)
      return ab.T @ (xb - mean[kb])
    pooled = pooled + blocks.sum_row_blocks(block_product, (x, safe_key, valid),
                                            _POOLED_ROW_BLOCK)
  return SufficientStats(count, mean, sq_dev, None, pooled)


@functools.partial(compiler.jit, static_argnames=("block_size",))
def update(stats: SufficientStats, x, y, block_size: int = 128) -> SufficientStats:
  """Adds one chunk to running statistics (exact: equals ``merge(stats, from_labels(x, y))``).

  Rows whose label lies outside ``[0, K)`` are ignored. The scatter blocks may be
  asymmetric at round-off level until ``finalize``.

  Args:
    stats: running statistics (``empty(...)`` to start); with or without ``scatter``.
    x: (B, D) features; y: (B,) integer labels.
    block_size: maximal rows per per-class product window (static).
  Returns:
    SufficientStats of the union.
  """
  return _update(stats, x, y, block_size)


def finalize(stats: SufficientStats) -> SufficientStats:
  """Symmetrises the (K, D, D) and (D, D) scatters (removes round-off asymmetry).

  The per-class blocks are symmetrised one class at a time in place, so a donated
  (K, D, D) scatter is not copied (2.4 GB at K = 1000, D = 768).
  """
  scatter = None
  if stats.scatter is not None:
    def one_class(k, acc):
      block = jax.lax.dynamic_index_in_dim(acc, k, keepdims=False)
      return jax.lax.dynamic_update_index_in_dim(acc, 0.5 * (block + block.T), k, 0)
    scatter = jax.lax.fori_loop(0, stats.num_classes, one_class, stats.scatter)
  pooled = stats.pooled_scatter
  if pooled is not None:
    pooled = 0.5 * (pooled + pooled.T)
  return stats._replace(scatter=scatter, pooled_scatter=pooled)


@functools.partial(compiler.jit, static_argnames=("num_classes", "full", "block_size",
                                                   "pooled"))
def from_labels(x, y, num_classes: int, full: bool = True,
                block_size: int = 128, pooled: bool = True) -> SufficientStats:
  """Sufficient statistics of one in-memory chunk (means first, then centred sums).

  Rows whose label lies outside ``[0, num_classes)`` are ignored; ``from_chunks`` uses
  label -1 to pad the last chunk so every chunk has one shape (one compilation).

  Args:
    x: (N, D) features.
    y: (N,) integer labels.
    num_classes: K (static).
    full: also accumulate the per-class (K, D, D) scatter (static).
    block_size: maximal rows per per-class product window (static; see module doc).
    pooled: accumulate the (D, D) ``pooled_scatter`` (static; False only with
      ``full=False``).
  Returns:
    SufficientStats of the chunk.
  """
  # Jitted as a whole: eagerly, the window loop would compile op by op.
  x = jnp.asarray(x)
  dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
  start = empty(num_classes, x.shape[-1], full, dtype, pooled)
  return finalize(_update(start, x, y, block_size))


_from_labels_jit = from_labels
_update_jit = compiler.jit(_update, static_argnames=("block_size", "axis_name"), donate_argnums=(0,))
_finalize_jit = compiler.jit(finalize, donate_argnums=(0,))
# One compiled program instead of one per zeros array (eager jnp.zeros compiles each).
_empty_jit = compiler.jit(empty, static_argnums=(0, 1, 2, 3, 4))


@precision.float32_matmuls
def from_responsibilities(x, resp, full: bool = True) -> SufficientStats:
  """Soft-assignment (weighted) sufficient statistics, centred and exact in float32.

  count_k = sum_m r_mk, mean_k = sum_m r_mk x_m / count_k and the scatter
  sum_m r_mk (x_m - mean_k)(x_m - mean_k)^T, formed one class at a time from deviations
  about the class mean (no raw moments, no (M, K, D) temporary). A class with zero total
  weight gets the global mean and zero scatter, so conjugate updates return its prior.
  With one-hot ``resp`` this equals ``from_labels``. Used by the variational (CAVI)
  modules, whose M-steps are conjugate updates from these statistics.

  Args:
    x: (M, D) points.
    resp: (M, K) non-negative weights (responsibilities).
    full: also form the (K, D, D) scatter (static).
  Returns:
    SufficientStats with real-valued counts.
  """
  x = jnp.asarray(x)
  resp = jnp.asarray(resp, x.dtype)
  centre = jnp.mean(x, axis=0)
  xc = x - centre
  count = jnp.sum(resp, axis=0)
  safe = jnp.where(count > 0, count, 1.0)
  mean = (resp.T @ xc) / safe[:, None]

  def one_class(pooled, args):
    r_k, m_k = args
    d = xc - m_k
    wd = d * r_k[:, None]
    s_k = wd.T @ d
    return pooled + s_k, (jnp.sum(wd * d, axis=0), s_k if full else None)

  dim = x.shape[-1]
  pooled, (sq_dev, scatter) = jax.lax.scan(one_class, jnp.zeros((dim, dim), x.dtype),
                                           (resp.T, mean))
  pooled = 0.5 * (pooled + pooled.T)
  if full:
    scatter = 0.5 * (scatter + jnp.swapaxes(scatter, -1, -2))
  return SufficientStats(count, mean + centre, sq_dev, scatter, pooled)


@precision.float32_matmuls
def merge(a: SufficientStats, b: SufficientStats) -> SufficientStats:
  """Exact statistics of the union of two disjoint data sets (Chan et al. 1979).

  Args:
    a, b: statistics with the same K and D (``scatter`` and ``pooled_scatter`` are kept
      where both have them).
  Returns:
    SufficientStats of the concatenated data.
  """
  n = a.count + b.count
  safe_n = jnp.maximum(n, 1.0)
  delta = b.mean - a.mean                                     # (K, D)
  mean = a.mean + delta * (b.count / safe_n)[:, None]
  weight = a.count * b.count / safe_n                         # (K,)
  sq_dev = a.sq_dev + b.sq_dev + weight[:, None] * delta * delta
  pooled = None
  if a.pooled_scatter is not None and b.pooled_scatter is not None:
    pooled = a.pooled_scatter + b.pooled_scatter + (delta * weight[:, None]).T @ delta
  scatter = None
  if a.scatter is not None and b.scatter is not None:
    scatter = (a.scatter + b.scatter
               + weight[:, None, None] * delta[:, :, None] * delta[:, None, :])
  return SufficientStats(n, mean, sq_dev, scatter, pooled)


_merge_jit = compiler.jit(merge)


def release_pages(view) -> None:
  """Drops the pages of a read-only ``np.memmap`` slice from this process's resident set.

  Reading a memory-mapped file maps its pages into the process: without this, streaming a
  4 GB feature file leaves 4 GB resident (they stay in the OS page cache, so a second
  pass is still fast). Only read-only maps (mode "r") are touched: their pages are clean
  and simply re-read on the next access. Any failure leaves the pages mapped.
  """
  mm = getattr(view, "_mmap", None)
  if mm is None or getattr(view, "mode", None) != "r" or not hasattr(mm, "madvise"):
    return
  try:
    base = np.frombuffer(mm, np.uint8).ctypes.data
    lo = view.ctypes.data - base
    hi = lo + view.nbytes
    page = mmap.PAGESIZE
    lo = -(-lo // page) * page
    hi = (hi // page) * page
    if hi > lo:
      mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
  except (AttributeError, OSError, ValueError, TypeError):
    pass


def read_chunk(view) -> np.ndarray:
  """A row chunk of an array that may be an ``np.memmap``, in memory; a memory-mapped
  chunk is copied and its pages released at once (``release_pages``).

  On the CPU a jax array made from a memory-mapped chunk aliases the file's pages (no
  copy), and the computations that read it run after the call returns: pages released
  while one of them still reads the chunk are mapped in again and stay resident (3.5 GB
  more at ImageNet size). A copy costs one memcpy of the chunk.
  """
  if getattr(view, "_mmap", None) is None:
    return np.asarray(view)
  chunk = np.array(view)
  release_pages(view)
  return chunk


def iterate_chunks(x, y, chunk_size: int) -> Iterable[Tuple[np.ndarray, np.ndarray]]:
  """Yields (x, y) row chunks of arrays that may be ``np.memmap`` (only one chunk in RAM:
  ``read_chunk``)."""
  for start in range(0, x.shape[0], chunk_size):
    yield (read_chunk(x[start:start + chunk_size]),
           read_chunk(y[start:start + chunk_size]))


def _pad_chunk(xs, ys, rows: int):
  pad = rows - xs.shape[0]
  if pad:
    xs = np.concatenate([xs, np.zeros((pad, xs.shape[1]), xs.dtype)])
    ys = np.concatenate([ys, -np.ones(pad, ys.dtype)])
  return xs, ys


def from_chunks(chunks: Iterable[Tuple[np.ndarray, np.ndarray]], num_classes: int,
                full: bool = True, chunk_size: Optional[int] = None,
                dtype=None, block_size: int = 128, pooled: bool = True,
                finite_checked: bool = False) -> SufficientStats:
  """Streams statistics over (x, y) chunks; pads chunks to one shape (one compilation).

  The running statistics are updated in place (``update`` with donated buffers), so the
  peak memory is one (K, D, D) scatter plus a few chunk-sized arrays.

  Args:
    chunks: iterable of ((n_i, D) features, (n_i,) labels in 0..K-1); e.g.
      ``iterate_chunks``. Each chunk is checked (``validation.stats_chunk``: shapes,
      integer labels in range, finite features; errors name the global row).
    num_classes: K.
    full: accumulate per-class full scatter.
    pooled: accumulate the (D, D) ``pooled_scatter`` (False only with ``full=False``).
    chunk_size: pad every chunk to this many rows so that a single compilation serves
      all chunks (defaults to the first chunk's size).
    dtype: accumulation dtype (defaults to the first chunk's float dtype).
    block_size: maximal rows per per-class product window.
    finite_checked: the caller has checked that the features are finite (the public
      API does, on the host, while it reads them): the chunks are not checked again,
      which for chunks on a device would wait for each one to be computed.
  Returns:
    SufficientStats of all chunks together.
  """
  chunks = iter(chunks)
  first = next(chunks, None)
  following = next(chunks, None) if first is not None else None
  if first is not None and following is None and (
      chunk_size is None or first[0].shape[0] <= chunk_size):
    # One chunk (every problem of up to ``chunk_size`` rows): one compiled program for
    # the zeros, the update and the symmetrisation (three otherwise; ~0.1 s of a cold fit).
    xc, yc = validation.stats_chunk(first[0], first[1], num_classes, 0, None,
                                    finite_checked=finite_checked)
    if dtype is None:
      dtype = jnp.asarray(xc[:1]).dtype
    xs, ys = _pad_chunk(xc, np.asarray(yc), chunk_size or xc.shape[0])
    return _from_labels_jit(jnp.asarray(xs, dtype), jnp.asarray(ys, jnp.int32), num_classes,
                            full=full, block_size=block_size, pooled=pooled)
  chunks = itertools.chain([] if first is None else [first],
                           [] if following is None else [following], chunks)
  total, offset = None, 0
  for xc, yc in chunks:
    # Labels must lie in 0..K-1 here (padding rows are added below), rows finite.
    xc, yc = validation.stats_chunk(xc, yc, num_classes, offset,
                                    None if total is None else total.dim,
                                    finite_checked=finite_checked)
    offset += xc.shape[0]
    if dtype is None:
      dtype = jnp.asarray(xc[:1]).dtype
    if chunk_size is None:
      chunk_size = xc.shape[0]
    if total is None:
      total = _empty_jit(num_classes, xc.shape[1], full, np.dtype(dtype), pooled)
    for start in range(0, xc.shape[0], chunk_size):
      xs, ys = _pad_chunk(xc[start:start + chunk_size],
                          np.asarray(yc[start:start + chunk_size]), chunk_size)
      # At most one update in flight: the next chunk is read (and, on a device, computed)
      # while this one is summed, but chunks that arrive faster than they are summed do
      # not pile up in memory.
      total = _update_jit(jax.block_until_ready(total), jnp.asarray(xs, dtype),
                          jnp.asarray(ys, jnp.int32), block_size=block_size)
  if total is None:
    raise ValueError("from_chunks received no data.")
  if total.scatter is None and total.pooled_scatter is None:
    return total                                   # nothing to symmetrise
  return _finalize_jit(total)


def from_arrays(x, y, num_classes: int, full: bool = True,
                chunk_size: int = 65536, dtype=None, block_size: int = 128) -> SufficientStats:
  """Statistics of (possibly memory-mapped) arrays, ``chunk_size`` rows at a time."""
  return from_chunks(iterate_chunks(x, y, chunk_size), num_classes, full=full,
                     chunk_size=min(chunk_size, x.shape[0]), dtype=dtype,
                     block_size=block_size)


# ----------------------------------------------------------------------------- derived
def nonempty_terms(count, terms):
  """``terms`` (K, ...) per class with the rows of empty classes (count 0) set to 0.

  An empty class adds nothing to the marginal likelihood p(X | y, hyper), so the EM
  M-steps leave it out of their sums over classes (it would otherwise enter them at its
  prior expectations: the same fixed points, reached more slowly). Empty classes are
  also how ``pad_classes`` pads K for shared compilations.
  """
  count = jnp.reshape(count, count.shape + (1,) * (jnp.ndim(terms) - count.ndim))
  return jnp.where(count > 0, terms, jnp.zeros_like(terms))


def num_nonempty(count):
  """() number of classes with points, in the dtype of ``count`` (K when none is empty)."""
  return jnp.sum(count > 0).astype(count.dtype)


def mean_class_count(stats: SufficientStats):
  """() mean N_k over the classes with points."""
  return total_count(stats) / num_nonempty(stats.count)


def pad_classes(stats: SufficientStats, num_classes: int) -> SufficientStats:
  """``stats`` with empty classes (count, mean, deviations and scatter 0) appended up to
  ``num_classes``; the pooled scatter is unchanged.

  Concrete arrays are padded on the host with numpy and put back on the device (no
  compilation, which for a first fit in a fresh process saved 0.15 s of compiling pad
  programs); traced ones (inside jit or vmap) with ``jnp.pad``.
  """
  extra = num_classes - stats.num_classes
  if extra < 0:
    raise ValueError(f"Cannot pad {stats.num_classes} classes down to {num_classes}.")
  if extra == 0:
    return stats

  def pad(a):
    if a is None:
      return None
    widths = [(0, extra)] + [(0, 0)] * (jnp.ndim(a) - 1)
    if compiler.is_traced(a):
      return jnp.pad(a, widths)
    return jnp.asarray(np.pad(np.asarray(a), widths))    # a transfer, not a program

  return stats._replace(count=pad(stats.count), mean=pad(stats.mean),
                        sq_dev=pad(stats.sq_dev), scatter=pad(stats.scatter))


def total_count(stats: SufficientStats):
  return jnp.sum(stats.count)


@precision.float32_matmuls
def global_mean(stats: SufficientStats):
  """(D,) mean of all points."""
  return stats.count @ stats.mean / total_count(stats)


def _pooled_scatter(stats: SufficientStats, what: str):
  if stats.pooled_scatter is None:
    raise ValueError(f"{what} needs the pooled scatter; these statistics were computed "
                     "without it (pooled=False).")
  return stats.pooled_scatter


def pooled_covariance(stats: SufficientStats):
  """(D, D) average within-class covariance  Sigma_hat = (1/N) sum_k scatter_k."""
  return _pooled_scatter(stats, "pooled_covariance") / total_count(stats)


def pooled_variance(stats: SufficientStats):
  """(D,) average within-class variances (diagonal of ``pooled_covariance``)."""
  return jnp.sum(stats.sq_dev, axis=0) / total_count(stats)


@precision.float32_matmuls
def total_covariance(stats: SufficientStats):
  """(D, D) covariance of all points: within-class plus between-class scatter, over N."""
  centred_means = stats.mean - global_mean(stats)
  between = (centred_means * stats.count[:, None]).T @ centred_means
  return (_pooled_scatter(stats, "total_covariance") + between) / total_count(stats)


def class_covariances(stats: SufficientStats):
  """(K, D, D) per-class maximum-likelihood covariances scatter_k / N_k."""
  if stats.scatter is None:
    raise ValueError("class_covariances needs full statistics (computed with full=True).")
  return stats.scatter / jnp.maximum(stats.count, 1.0)[:, None, None]


def identical_classes(stats: SufficientStats):
  """(K,) bool: classes of two or more points that are all identical (to float round-off).

  Such a class has zero scatter. The pooled baselines do not notice, but a model with a
  per-class covariance reads N_k identical points as N_k observations of a zero variance:
  the independent RMDS and the NIX/NIW posteriors shrink the class covariance by
  ~1/N_k, and the coupled model's posterior of the class scale gamma_k runs to its lower
  bound, after which no ordinary point can be scored. ``as_singletons`` gives every
  model the same, well-defined answer.

  The test is per dimension: the class's variance is below the round-off of its mean,
  sq_dev_kd / N_k <= (8 eps |mean_kd|)^2. One compiled program serves statistics with or
  without the (K, D, D) and (D, D) scatters: it reads only count, mean and sq_dev.
  """
  arrays = (stats.count, stats.mean, stats.sq_dev)
  if compiler.is_traced(arrays):
    return _identical_classes(*arrays)
  # Concrete statistics (K, D) are tested on the host: no program for a cold fit.
  return _identical_in(np, *(np.asarray(a) for a in arrays))


def _identical_in(xp, count, mean, sq_dev):
  """``identical_classes`` with the array module ``xp`` (numpy or jax.numpy)."""
  eps = xp.finfo(mean.dtype).eps
  bound = count[:, None] * (8.0 * eps * xp.abs(mean)) ** 2
  return (count > 1) & xp.all(sq_dev <= bound, axis=-1)


_identical_classes = compiler.jit(functools.partial(_identical_in, jnp))


@compiler.jit
def as_singletons(stats: SufficientStats, which) -> SufficientStats:
  """Statistics in which each class flagged by ``which`` (K,) is one point at its mean.

  A class of N_k identical points then is fitted exactly as the de-duplicated class of
  one point: its mean is the point, its covariance comes from the prior (hierarchical
  models) or the pooled covariance (baselines). Its scatter is zero either way; only the
  count changes (and with it the pooled and total covariances' normaliser N).
  """
  which = jnp.asarray(which, bool)
  count = jnp.where(which, jnp.ones_like(stats.count), stats.count)
  zero = jnp.zeros_like(stats.sq_dev)
  sq_dev = jnp.where(which[:, None], zero, stats.sq_dev)
  scatter = stats.scatter
  if scatter is not None:
    scatter = jnp.where(which[:, None, None], jnp.zeros_like(scatter), scatter)
  return stats._replace(count=count, sq_dev=sq_dev, scatter=scatter)
