"""Small linear-algebra building blocks shared by the models (no inverted covariances)."""
import math

import jax
import jax.numpy as jnp
from jax.scipy.linalg import cho_solve
from jax.scipy.linalg import solve_triangular

from dpmm_jax import blocks
from dpmm_jax import precision


def default_rtol(dtype) -> float:
  """Relative eigenvalue floor: directions below ``rtol * max eigenvalue`` are noise.

  A symmetric eigensolver's absolute error is about ``eps * ||A||``, so an eigenvalue
  below ``100 eps lambda_max`` carries no reliable digits (1.2e-5 in float32, 2.2e-14
  in float64).
  """
  return 100.0 * float(jnp.finfo(dtype).eps)


def symmetrize(a):
  return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def floored_eigh(cov, rtol=None):
  """Eigendecomposition with eigenvalues floored at ``rtol * max eigenvalue``.

  Args:
    cov: (..., D, D) symmetric positive semi-definite matrix.
    rtol: relative floor (default ``default_rtol(cov.dtype)``).
  Returns:
    (eigenvalues (..., D) ascending and floored, eigenvectors (..., D, D) as columns).
  """
  rtol = default_rtol(cov.dtype) if rtol is None else rtol
  values, vectors = jnp.linalg.eigh(symmetrize(cov))
  floor = rtol * jnp.maximum(values[..., -1:], jnp.finfo(cov.dtype).tiny)
  return jnp.maximum(values, floor), vectors


def whitener(cov, rtol=None):
  """(D, D) matrix W with ``W W^T = cov^{-1}`` (floored), so ``|(x - m) W|^2`` is the
  squared Mahalanobis distance. Robust to near-singular covariances (raw features)."""
  values, vectors = floored_eigh(cov, rtol)
  return vectors * jnp.sqrt(1.0 / values)[..., None, :]


@precision.float32_matmuls
def mahalanobis_sq(x, loc, white, centre=None):
  """Squared Mahalanobis distances |(x - loc) W|^2, centred before squaring.

  The (M, K) case is expanded into matrix products, |a|^2 - 2 a.b + |b|^2 with a, b the
  whitened x and locations *after subtracting a common centre* (default: the mean of the
  locations). Expanding about the origin instead cancels terms of size |x W|^2: with
  features 1e3-1e4 spreads from the origin, float32 distances are then off by units to
  hundreds and the nearest class is often wrong. After centring, the terms are of the
  size of the distances between classes, and the clip at zero only removes round-off.

  Args:
    x: (M, D); loc: (K, D) or (D,); white: (D, D) whitener shared by all locations.
    centre: optional (D,) point subtracted from x and loc before whitening.
  Returns:
    (M, K) (or (M,) for a single location), computed as matrix products.
  """
  if loc.ndim == 1:
    d = (x - loc) @ white
    return jnp.sum(d * d, axis=-1)
  centre = jnp.mean(loc, axis=0) if centre is None else centre
  xw = (x - centre) @ white
  lw = (loc - centre) @ white
  return (jnp.sum(xw * xw, -1)[:, None] - 2.0 * xw @ lw.T
          + jnp.sum(lw * lw, -1)[None, :]).clip(min=0.0)


# Row blocks of the triangular products (more blocks skip more zeros).
_TRIANGLE_BLOCKS = 4
# The inverse's diagonal blocks are at most this size; they are inverted by forward
# substitution, and pairs of inverted blocks are merged, level by level, up to D.
_SUBSTITUTION_MAX = 128


@precision.float32_matmuls
def triangular_inverse(chol):
  """Inverse of lower-triangular matrices (..., D, D) in matrix products only.

  The triangle is padded with an identity block to b 2^L rows (b <= 128 the smallest block
  size that needs no more than L = ceil(log2(D / 128)) doublings). Its 2^L diagonal blocks
  are inverted by forward substitution (a loop of b steps over all of them at once), then
  pairs of neighbouring inverted blocks are merged, inv([[A, 0], [B, C]]) =
  [[A^-1, 0], [-C^-1 B A^-1, C^-1]], one batched level at a time: about D^3 / 3
  multiply-adds, all but the small diagonal blocks in matrix products. This inverts a
  Cholesky factor (condition number sqrt(cond(Sigma))), never a covariance, so applying
  it has the accuracy of a triangular solve.

  No LAPACK call (``solve_triangular`` on CPU calls the OpenBLAS bundled with scipy): the
  scorers that use it run on XLA's thread pool alone, so OpenBLAS threads that busy-wait
  after a call cannot slow them down (``threads``), inside the user's own ``jit`` too.
  """
  dim = chol.shape[-1]
  batch = chol.shape[:-2]
  levels = max(0, math.ceil(math.log2(dim / _SUBSTITUTION_MAX))) if dim else 0
  size = -(-dim // (1 << levels))
  padded = size << levels
  if padded > dim:
    widths = [(0, 0)] * len(batch) + [(0, padded - dim)] * 2
    pad_eye = jnp.diag((jnp.arange(padded) >= dim).astype(chol.dtype))
    chol = jnp.pad(chol, widths) + pad_eye
  inv = _substitution_inverse(_diagonal_blocks(chol, 1 << levels, 0))
  for level in range(levels):
    pairs = 1 << (levels - level - 1)
    inv = inv.reshape(batch + (pairs, 2) + inv.shape[-2:])
    a_inv, c_inv = inv[..., 0, :, :], inv[..., 1, :, :]
    lower_left = -(c_inv @ (_diagonal_blocks(chol, pairs, 1) @ a_inv))
    top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], -1)
    inv = jnp.concatenate([top, jnp.concatenate([lower_left, c_inv], -1)], -2)
  return inv[..., 0, :dim, :dim]


def _diagonal_blocks(matrix, num: int, below: int):
  """(..., num, s, s) blocks of (..., num s, num s) ``matrix``: the diagonal blocks
  (``below`` = 0), or for ``below`` = 1 the block under the diagonal of each of the num
  diagonal blocks of size 2s (rows [(2j + 1) s, (2j + 2) s), columns [2j s, (2j + 1) s)).
  Static slices (num <= 2^L is small), which compile faster than a gather."""
  n = matrix.shape[-1]
  s = n // (2 * num) if below else n // num
  step = 2 * s if below else s
  return jnp.stack([matrix[..., j * step + below * s:j * step + below * s + s,
                           j * step:j * step + s] for j in range(num)], -3)


@precision.float32_matmuls
def _substitution_inverse(tri):
  """Inverse of small lower-triangular matrices (..., b, b) by forward substitution: row i
  of the inverse is (e_i - tri[i, :i] inv[:i]) / tri[i, i], for all matrices at once."""
  b = tri.shape[-1]
  eye = jnp.eye(b, dtype=tri.dtype)
  diag = jnp.diagonal(tri, axis1=-2, axis2=-1)

  def row(i, inv):
    tri_i = jax.lax.dynamic_index_in_dim(tri, i, axis=-2, keepdims=False)     # (..., b)
    done = jnp.einsum("...j,...jk->...k", tri_i, inv)    # rows i.. of inv are still 0
    new = ((jax.lax.dynamic_index_in_dim(eye, i, 0, keepdims=False) - done)
           / jax.lax.dynamic_index_in_dim(diag, i, -1))
    return jax.lax.dynamic_update_index_in_dim(inv, new, i, axis=-2)

  return jax.lax.fori_loop(0, b, row, jnp.zeros_like(tri))


def triangle_row_blocks(dim: int):
  """[(lo, hi)] row blocks of a D x D lower triangle used by the triangular products."""
  edges = [round(dim * j / _TRIANGLE_BLOCKS) for j in range(_TRIANGLE_BLOCKS + 1)]
  return [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]


# XLA:CPU runs ``triangular_mahalanobis_sq`` 15-40 % slower per row when the number of
# rows is a multiple of 1024, less clearly of 512 (benchmarks/RESULTS.md, session 22;
# 2-core AVX-512 EPYC, jax 0.9.2, D = 768: 3.68 against 3.03-3.33 us per (point, class)
# at 2048 rows and its neighbours; the full model's scorer at K = 100: 2.96 against
# 2.15-2.28 us). Its products reduce along a stride of M floats, and a stride of a large
# power of two maps them onto few cache sets. Callers pad such row counts with a few
# zero rows (``pad_aliased_rows``).
_ALIASED_ROWS = 512
_PAD_ROWS = 8


def pad_aliased_rows(x):
  """(x, or x with 8 zero rows appended when its row count is a multiple of 512; the
  original row count m). Results of the padded rows are cut off with ``[:m]``."""
  m = x.shape[0]
  if m and m % _ALIASED_ROWS == 0:
    x = jnp.concatenate([x, jnp.zeros((_PAD_ROWS,) + x.shape[1:], x.dtype)])
  return x, m


@precision.float32_matmuls
def triangular_mahalanobis_sq(x, loc, inv):
  """(kb, M) squared norms |inv_k (x_m - loc_k)|^2 with lower-triangular inv_k (kb, D, D).

  Row block [lo, hi) of inv_k (x - loc_k) only involves columns [0, hi): with 4 row blocks
  the products do 5/8 of the dense work, as (M, hi) x (hi, hi - lo) matrix products.
  Centre x and loc on a common reference first: the two products are subtracted.
  """
  total = 0.0
  for lo, hi in triangle_row_blocks(x.shape[-1]):
    w = inv[:, lo:hi, :hi]                                          # (kb, b, hi)
    z = jnp.einsum("md,ked->kme", x[:, :hi], w)
    z = z - jnp.einsum("kd,ked->ke", loc[:, :hi], w)[:, None, :]
    total = total + jnp.sum(z * z, -1)
  return total


# Below this dimension class_mahalanobis_sq inverts the factors and runs matrix products;
# from it on, a triangular solve per class. Measured on a 2-core CPU, jax 0.9.2, float32,
# medians of 5-7 calls: M = 20,000, K = 10, D = 2 and 3: products 0.6-0.9 ms, solves
# 0.8-1.1 ms (one run: 5.7 ms at D = 2); M = 4,096, K = 20: D = 16 solves 2.2 ms vs
# products 8.4 ms, D = 64 14.5 vs 55.6 ms.
_SOLVE_MIN_DIM = 4


def class_mahalanobis_sq(x, loc, factor, inverted: bool = False):
  """(M, K) squared Mahalanobis distances |L_k^-1 (x_m - loc_k)|^2.

  Points and locations are centred on the points' mean first (large common offsets
  cancel exactly). For D >= 4 each class is a triangular solve with M right-hand sides in
  a ``lax.map`` (no (M, K, D) temporary); below that, or when the caller passes inverse
  factors, the distances are matrix products over blocks of classes
  (``triangular_mahalanobis_sq``), which XLA's CPU backend runs faster at tiny D.

  Args:
    x: (M, D) points.
    loc: (K, D) class locations.
    factor: (K, D, D) lower Cholesky factors L_k (or L_k^-1 when ``inverted``).
    inverted: whether ``factor`` holds the (lower-triangular) inverse factors.
  Returns:
    (M, K) squared distances.
  """
  centre = jnp.mean(x, 0) if x.shape[0] else jnp.zeros(x.shape[1:], x.dtype)
  xc, lc = x - centre, loc - centre
  if inverted or x.shape[-1] < _SOLVE_MIN_DIM:
    inv = factor if inverted else triangular_inverse(factor)
    size = blocks.class_block_size(x.shape[0], loc.shape[0], x.shape[1])
    xp, m = pad_aliased_rows(xc)
    return blocks.map_class_blocks(
        lambda block: triangular_mahalanobis_sq(xp, *block).T, (lc, inv), size)[:m]

  def one_class(args):
    factor_k, loc_k = args
    z = solve_triangular(factor_k, (xc - loc_k).T, lower=True)     # (D, M)
    return jnp.sum(z * z, axis=0)

  return jax.lax.map(one_class, (factor, lc)).T                    # (M, K)


def chol_log_det(chol):
  """log|A| from the lower Cholesky factor of A; batched over leading axes."""
  return 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), axis=-1)


def chol_trace_solve(chol, b):
  """tr(A^{-1} B) for SPD A = L L^T given L; batched over leading axes."""
  return jnp.trace(cho_solve((chol, True), b), axis1=-2, axis2=-1)
