"""Small linear-algebra building blocks shared by the models (no explicit inverses)."""
import jax
import jax.numpy as jnp
from jax.scipy.linalg import cho_solve
from jax.scipy.linalg import solve_triangular


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


def class_mahalanobis_sq(x, loc, factor, inverted: bool = False):
  """(M, K) squared Mahalanobis distances |L_k^-1 (x_m - loc_k)|^2, one class at a time.

  A ``jax.lax.map`` over the K classes, so there is no (M, K, D) temporary beyond one
  class. With ``inverted=False`` each class is a triangular solve with M right-hand
  sides; with ``inverted=True`` the caller passes the inverse factors L_k^-1 and each
  class is one (M, D) x (D, D) product (XLA's CPU triangular solve inside the loop was
  ~30x slower than this product at M = 1024, D = 3).

  Args:
    x: (M, D) points.
    loc: (K, D) class locations.
    factor: (K, D, D) lower Cholesky factors L_k (or L_k^-1 when ``inverted``).
    inverted: whether ``factor`` holds the inverse factors.
  Returns:
    (M, K) squared distances.
  """
  def one_class(args):
    factor_k, loc_k = args
    if inverted:
      z = (x - loc_k) @ factor_k.T                                # (M, D)
      return jnp.sum(z * z, axis=-1)
    z = solve_triangular(factor_k, (x - loc_k).T, lower=True)     # (D, M)
    return jnp.sum(z * z, axis=0)

  return jax.lax.map(one_class, (factor, loc)).T                  # (M, K)


def chol_log_det(chol):
  """log|A| from the lower Cholesky factor of A; batched over leading axes."""
  return 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), axis=-1)


def chol_trace_solve(chol, b):
  """tr(A^{-1} B) for SPD A = L L^T given L; batched over leading axes."""
  return jnp.trace(cho_solve((chol, True), b), axis1=-2, axis2=-1)
