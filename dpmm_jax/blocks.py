"""Bounded-memory evaluation over classes: one block of classes at a time in a loop.

Scoring M points against K classes in D dimensions would naively build (M, K, D) (or
(M, K, P, D) with quadrature, (M, K, D, D) for full covariances), and an E-step over
full-covariance classes would hold several (K, D, D) temporaries. Instead the class axis
is cut into blocks small enough that one block's temporaries stay under a fixed element
budget, and blocks run sequentially inside one compiled loop. Blocks are read with
dynamic slices and written with dynamic updates, so no padded copy of a (K, D, D) input
is ever made: when K is not a multiple of the block size, the last block starts at
K - kb and recomputes a few classes (their results are identical and overwrite
themselves).

The same loops serve long row axes: ``sum_row_blocks`` and ``preprocess.apply`` run a
chunk's (B, D) products in blocks of rows, which XLA:CPU runs faster than one product
over a tall operand.
"""
import jax
import jax.numpy as jnp

# Elements of the largest temporary one block may create (32 MiB in float32).
DEFAULT_BUDGET = 1 << 23


def class_block_size(num_points: int, num_classes: int, per_pair_elements: int,
                     budget: int = DEFAULT_BUDGET) -> int:
  """Classes per block so that num_points * block * per_pair_elements <= budget."""
  return int(max(1, min(num_classes, budget // max(1, num_points * per_pair_elements))))


def _leading_size(tree) -> int:
  return jax.tree_util.tree_leaves(tree)[0].shape[0]


def _zeros_like_varying(block_out, num_classes: int):
  """(K, ...) zeros for a loop carry that a block result of type ``block_out`` updates;
  inside ``shard_map`` they vary over the same mesh axes as the result."""
  zeros = jnp.zeros((num_classes,) + block_out.shape[1:], block_out.dtype)
  axes = tuple(getattr(block_out, "vma", None) or ())
  return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


def _block_loop(fn, per_class, block_size: int, init, write, first_block=0):
  num_classes = _leading_size(per_class)
  num_blocks = -(-num_classes // block_size)

  def body(i, acc):
    start = jnp.minimum(i * block_size, num_classes - block_size)
    block = jax.tree_util.tree_map(
        lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, start, block_size, 0), per_class)
    return write(acc, fn(block), start)

  return jax.lax.fori_loop(first_block, num_blocks, body, init)


def map_class_blocks(fn, per_class, block_size: int, first_block=0):
  """Applies ``fn`` to blocks of classes and concatenates along the class axis.

  Args:
    fn: pytree of per-class arrays with leading axis kb -> (M, kb) array.
    per_class: pytree whose leaves all have leading axis K.
    block_size: kb (static).
    first_block: () int, may be traced: blocks before it (classes [0, first_block kb))
      are skipped and their columns left at zero. Nonzero only with two or more blocks.
  Returns:
    (M, K) array.
  """
  return map_blocks(lambda block: fn(block).T, per_class, block_size, first_block).T


def map_blocks(fn, per_class, block_size: int, first_block=0):
  """Applies ``fn`` to blocks of classes; outputs keep a leading class axis.

  Unlike ``map_class_blocks`` (which returns (M, K) score matrices), ``fn`` may return any
  pytree whose leaves have leading axis kb (per-class results of an E-step, per-class
  Cholesky factors, ...). Only one block's temporaries are alive at a time.

  Args:
    fn: pytree of per-class arrays with leading axis kb -> pytree, leaves (kb, ...).
    per_class: pytree whose leaves all have leading axis K.
    block_size: kb (static).
    first_block: as in ``map_class_blocks`` (skipped blocks' rows are zero).
  Returns:
    pytree with leaves (K, ...).
  """
  num_classes = _leading_size(per_class)
  block_size = int(max(1, min(block_size, num_classes)))
  if block_size == num_classes:
    if not (isinstance(first_block, int) and first_block == 0):
      raise ValueError("first_block needs two or more blocks")
    return fn(per_class)
  shapes = jax.tree_util.tree_map(
      lambda leaf: jax.ShapeDtypeStruct((block_size,) + leaf.shape[1:], leaf.dtype),
      per_class)
  out = jax.eval_shape(fn, shapes)
  init = jax.tree_util.tree_map(lambda s: _zeros_like_varying(s, num_classes), out)

  def write(acc, res, start):
    return jax.tree_util.tree_map(
        lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, start, 0), acc, res)

  return _block_loop(fn, per_class, block_size, init, write, first_block)


def sum_row_blocks(fn, rows, block_size: int):
  """Sums ``fn`` over blocks of rows, one block's temporaries alive at a time.

  A product of two operands computed from the rows (centred copies, say) runs faster
  over blocks whose operands stay in cache than as one product over materialised (B, D)
  operands. As with the classes, the last block starts at B - b and overlaps the one
  before it; ``keep`` masks its rows that an earlier block summed.

  Args:
    fn: (pytree of (b, ...) row blocks, keep (b,) bool) -> pytree of sums.
    rows: pytree whose leaves all have leading axis B.
    block_size: b (static).
  Returns:
    pytree: the sum of ``fn`` over the blocks.
  """
  num_rows = _leading_size(rows)
  block_size = int(max(1, min(block_size, num_rows)))
  if block_size == num_rows:
    return fn(rows, jnp.ones((num_rows,), bool))
  shapes = jax.tree_util.tree_map(
      lambda leaf: jax.ShapeDtypeStruct((block_size,) + leaf.shape[1:], leaf.dtype), rows)
  out = jax.eval_shape(fn, shapes, jax.ShapeDtypeStruct((block_size,), bool))
  init = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out)

  def body(i, acc):
    start = jnp.minimum(i * block_size, num_rows - block_size)
    keep = start + jnp.arange(block_size) >= i * block_size
    block = jax.tree_util.tree_map(
        lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, start, block_size, 0), rows)
    return jax.tree_util.tree_map(jnp.add, acc, fn(block, keep))

  return jax.lax.fori_loop(0, -(-num_rows // block_size), body, init)
