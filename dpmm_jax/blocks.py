"""Bounded-memory evaluation over classes: map a per-class-block function with lax.map.

Scoring M points against K classes in D dimensions would naively build (M, K, D) (or
(M, K, P, D) with quadrature, (M, K, D, D) for full covariances). Instead the class axis
is cut into blocks small enough that one block's temporaries stay under a fixed element
budget, and blocks run sequentially inside one compiled loop.
"""
import jax
import jax.numpy as jnp

# Elements of the largest temporary one block may create (32 MiB in float32).
DEFAULT_BUDGET = 1 << 23


def class_block_size(num_points: int, num_classes: int, per_pair_elements: int,
                     budget: int = DEFAULT_BUDGET) -> int:
  """Classes per block so that num_points * block * per_pair_elements <= budget."""
  return int(max(1, min(num_classes, budget // max(1, num_points * per_pair_elements))))


def map_class_blocks(fn, per_class, block_size: int):
  """Applies ``fn`` to blocks of classes and concatenates along the class axis.

  Args:
    fn: pytree of per-class arrays with leading axis kb -> (M, kb) array.
    per_class: pytree whose leaves all have leading axis K.
    block_size: kb (static).
  Returns:
    (M, K) array.
  """
  num_classes = jax.tree_util.tree_leaves(per_class)[0].shape[0]
  num_blocks = -(-num_classes // block_size)
  pad = num_blocks * block_size - num_classes

  def to_blocks(leaf):
    # Edge padding repeats a real class, so padded lanes never produce NaN.
    leaf = jnp.pad(leaf, [(0, pad)] + [(0, 0)] * (leaf.ndim - 1), mode="edge")
    return leaf.reshape((num_blocks, block_size) + leaf.shape[1:])

  if num_blocks == 1 and pad == 0:
    return fn(per_class)
  out = jax.lax.map(fn, jax.tree_util.tree_map(to_blocks, per_class))  # (nb, M, kb)
  out = jnp.moveaxis(out, 0, 1).reshape(out.shape[1], num_blocks * block_size)
  return out[:, :num_classes]
