"""Synthetic data from the paper's hierarchical normal-inverse-Wishart model (section 6.1).

Generative process, with the paper's parameterisation of the NIW prior::

    Sigma_k      ~ InvWishart(df=nu0, scale=(nu0 - D - 1) * Sigma0)   # E[Sigma_k] = Sigma0
    mu_k | Sigma_k ~ N(mu0, Sigma_k / kappa0)
    x | k        ~ N(mu_k, Sigma_k)

The mean ``E[Sigma_k] = Sigma0`` needs ``nu0 > D + 1``. Small ``nu0`` makes the class
covariances differ a lot (the regime where hierarchical models help); ``nu0 -> inf``
ties them to ``Sigma0``. Small ``kappa0`` spreads the class means far apart relative
to the within-class spread.

Out-of-distribution points are drawn one per *fresh* cluster: each OOD point has its
own ``(mu, Sigma)`` from the same prior, so the OOD set follows the prior predictive
(a multivariate Student-t with ``nu0 - D + 1`` degrees of freedom, mean ``mu0`` and
covariance ``(1 + 1/kappa0) Sigma0``).

All randomness comes from explicit ``jax.random`` keys; the samplers are exact for any
real degrees of freedom (Bartlett decomposition with chi-square diagonals drawn as
``2 * Gamma(df_i / 2)``).

Shape letters: K clusters/classes, D features, N training points, M test points.
"""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from dpmm_jax import compiler
from dpmm_jax import precision

__all__ = [
    "SyntheticDataset",
    "sample_bartlett_factor",
    "sample_wishart",
    "sample_inverse_wishart",
    "sample_niw",
    "make_dataset",
]


def _concrete_float(value, name: str) -> Optional[float]:
    """Returns ``float(value)`` if it is a concrete scalar, else None (traced values)."""
    try:
        arr = np.asarray(value)
    except (jax.errors.TracerArrayConversionError, TypeError):
        return None
    if arr.shape != ():
        raise ValueError(f"{name} must be a scalar, got shape {arr.shape}.")
    return float(arr)


def _check_df(df, dim: int, name: str = "df") -> None:
    value = _concrete_float(df, name)
    if value is not None and not value > dim - 1:
        raise ValueError(
            f"{name} must be > D - 1 = {dim - 1} for a non-singular Wishart, got {value}.")


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")
    return int(value)


def _check_square(matrix, name: str) -> int:
    shape = jnp.shape(matrix)
    if len(shape) != 2 or shape[0] != shape[1] or shape[0] < 1:
        raise ValueError(f"{name} must be a (D, D) matrix, got shape {shape}.")
    return shape[0]


# ---------------------------------------------------------------------------------
# Random variates, drawn in fixed-size chunks.
#
# Why: on CPU, XLA takes ~0.7 s to compile a `jax.random.normal` draw and ~1.5 s for
# `jax.random.gamma`, and it compiles them again for every array shape. Sweeps over
# dataset sizes (and the tests) were dominated by these compilations. All variates are
# therefore drawn in chunks, chunk `i` from `fold_in(key, i)`, by compiled functions
# whose shape takes one of a few fixed chunk sizes (`_chunk_size`); the
# shape-dependent programs below are pure linear algebra that take the variates as
# inputs. Under a trace (a caller's `jit`) the same chunks are drawn by `lax.map`, so
# jitted and eager calls return identical samples. The draws are exact either way.

_CHUNK_SIZES = tuple(8192 * 4 ** i for i in range(7))  # 8192 ... 33.5M numbers
_MAX_CHUNKS = 64


def _chunk_size(size: int) -> int:
    """Smallest chunk size that needs at most `_MAX_CHUNKS` chunks (else the largest)."""
    for chunk in _CHUNK_SIZES:
        if size <= _MAX_CHUNKS * chunk:
            return chunk
    return _CHUNK_SIZES[-1]


@functools.partial(jax.jit, static_argnames=("chunk", "dtype"))
def _normal_chunk(key, index, chunk, dtype):
    return jax.random.normal(jax.random.fold_in(key, index), (chunk,), dtype=dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _gamma_chunk(key, index, shape_params, dtype):
    return jax.random.gamma(jax.random.fold_in(key, index), shape_params, dtype=dtype)


def _standard_normal(key: jax.Array, size: int, dtype):
    """``size`` i.i.d. N(0, 1) variates, shape (size,); see the note above.

    Returns a numpy array when called eagerly (so that the glue compiles nothing) and a
    traced array under ``jit``.
    """
    dtype = jnp.dtype(dtype)
    chunk = _chunk_size(size)
    num_chunks = max(1, -(-size // chunk))
    if compiler.is_traced(key):
        draws = jax.lax.map(lambda i: _normal_chunk(key, i, chunk=chunk, dtype=dtype),
                            jnp.arange(num_chunks))
        return draws.ravel()[:size]
    draws = [np.asarray(_normal_chunk(key, i, chunk=chunk, dtype=dtype))
             for i in range(num_chunks)]
    return np.concatenate(draws)[:size]


def _standard_gamma(key: jax.Array, shape_params, dtype):
    """Gamma(shape_params, rate=1) variates shaped like ``shape_params``.

    See the note above; the last chunk is padded with shape parameter 1. Returns a
    numpy array when called eagerly and a traced array under ``jit``.
    """
    dtype = jnp.dtype(dtype)
    shape = jnp.shape(shape_params)
    size = int(np.prod(shape, dtype=np.int64))
    chunk = _chunk_size(size)
    num_chunks = max(1, -(-size // chunk))
    if compiler.is_traced(key, shape_params):
        padded = jnp.ones((num_chunks * chunk,), dtype)
        padded = padded.at[:size].set(jnp.asarray(shape_params, dtype).ravel())
        draws = jax.lax.map(lambda args: _gamma_chunk(key, *args, dtype=dtype),
                            (jnp.arange(num_chunks), padded.reshape(num_chunks, chunk)))
        return draws.ravel()[:size].reshape(shape)
    padded = np.ones((num_chunks * chunk,), dtype)
    padded[:size] = np.asarray(shape_params, dtype).ravel()
    draws = [np.asarray(_gamma_chunk(key, i, padded[i * chunk:(i + 1) * chunk],
                                     dtype=dtype))
             for i in range(num_chunks)]
    return np.concatenate(draws)[:size].reshape(shape)


def _bartlett_chi_square(key: jax.Array, df, dim: int, num_samples: int, dtype):
    """Draws ``c[s, i] ~ chi^2(df - i)`` = 2 Gamma((df - i) / 2), shape (S, D)."""
    dtype = jnp.dtype(dtype)
    if _concrete_float(df, "df") is None:
        shapes = (jnp.asarray(df, dtype) - jnp.arange(dim, dtype=dtype)) / 2
        shapes = jnp.broadcast_to(shapes, (num_samples, dim))
    else:
        shapes = (np.asarray(df, dtype) - np.arange(dim, dtype=dtype)) / 2
        shapes = np.broadcast_to(shapes, (num_samples, dim))
    return 2 * _standard_gamma(key, shapes, dtype)


class _Normals:
    """Consumes a flat vector of N(0, 1) variates in pieces of given shapes."""

    def __init__(self, flat):
        self._flat, self._offset = flat, 0

    def take(self, *shape):
        size = int(np.prod(shape, dtype=np.int64))
        piece = self._flat[self._offset:self._offset + size].reshape(shape)
        self._offset += size
        return piece


# ---------------------------------------------------------------------------------
# Wishart, inverse Wishart and NIW samplers.


def _bartlett_from_variates(chi_square: jax.Array, normals: jax.Array) -> jax.Array:
    """Lower-triangular factors: diagonal sqrt(chi_square) (S, D), below it normals."""
    dim = chi_square.shape[-1]
    eye = jnp.eye(dim, dtype=chi_square.dtype)
    return jnp.tril(normals, k=-1) + jnp.sqrt(chi_square)[..., None] * eye


@precision.float32_matmuls
def _wishart_from_bartlett(scale: jax.Array, bartlett: jax.Array) -> jax.Array:
    factor = jnp.linalg.cholesky(scale) @ bartlett  # C A
    return factor @ jnp.swapaxes(factor, -1, -2)


@precision.float32_matmuls
def _inverse_wishart_from_bartlett(scale: jax.Array, bartlett: jax.Array) -> jax.Array:
    eye = jnp.broadcast_to(jnp.eye(scale.shape[-1], dtype=scale.dtype), bartlett.shape)
    bartlett_inv = solve_triangular(bartlett, eye, lower=True)  # A^{-1}, lower.
    factor = jnp.linalg.cholesky(scale) @ jnp.swapaxes(bartlett_inv, -1, -2)  # C A^{-T}
    return factor @ jnp.swapaxes(factor, -1, -2)


@precision.float32_matmuls
def _niw_from_variates(chi_square, normals: _Normals, mu0, sigma0, nu0, kappa0):
    num_clusters, dim = chi_square.shape
    psi0 = (nu0 - dim - 1) * sigma0
    bartlett = _bartlett_from_variates(chi_square, normals.take(num_clusters, dim, dim))
    covariances = _inverse_wishart_from_bartlett(psi0, bartlett)
    chol = jnp.linalg.cholesky(covariances)
    z = normals.take(num_clusters, dim)
    means = mu0 + jnp.einsum("kij,kj->ki", chol, z) / jnp.sqrt(kappa0)
    return means, covariances


@compiler.jit
def _bartlett_core(chi_square, normals):
    return _bartlett_from_variates(chi_square, normals.reshape(*chi_square.shape, -1))


@compiler.jit
def _wishart_core(chi_square, normals, scale):
    bartlett = _bartlett_from_variates(chi_square, normals.reshape(*chi_square.shape, -1))
    return _wishart_from_bartlett(scale, bartlett)


@compiler.jit
def _inverse_wishart_core(chi_square, normals, scale):
    bartlett = _bartlett_from_variates(chi_square, normals.reshape(*chi_square.shape, -1))
    return _inverse_wishart_from_bartlett(scale, bartlett)


@compiler.jit
def _niw_core(chi_square, normals, mu0, sigma0, nu0, kappa0):
    return _niw_from_variates(chi_square, _Normals(normals), mu0, sigma0, nu0, kappa0)


def _bartlett_variates(key, df, dim, num_samples, dtype):
    """Chi-square (S, D) and normal (S * D * D,) variates for Bartlett factors."""
    key_chi, key_normal = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    chi_square = _bartlett_chi_square(key_chi, df, dim, num_samples, dtype)
    normals = _standard_normal(key_normal, num_samples * dim * dim, dtype)
    return chi_square, normals


def _float_matrix(matrix, name: str):
    dim = _check_square(matrix, name)
    matrix = jnp.asarray(matrix)
    return dim, matrix.astype(jnp.result_type(matrix.dtype, jnp.float32))


def _scale_variates(key, df, scale, num_samples):
    """Checks (df, scale, num_samples) of a (D, D)-scale sampler and draws its Bartlett
    variates in the floating dtype of ``scale``: (chi_square (S, D), normals (S*D*D,),
    scale (D, D))."""
    dim, scale = _float_matrix(scale, "scale")
    num_samples = _check_count(num_samples, "num_samples")
    _check_df(df, dim)
    return _bartlett_variates(key, df, dim, num_samples, scale.dtype) + (scale,)


def sample_bartlett_factor(key: jax.Array, df, dim: int, num_samples: int,
                           dtype=jnp.float32) -> jax.Array:
    r"""Lower-triangular Bartlett factors ``A`` with ``A A^T ~ Wishart(df, I_D)``.

    Bartlett decomposition: ``A`` is lower triangular with independent entries,
    ``A_ii = sqrt(c_i)`` with ``c_i ~ chi^2(df - i)`` for ``i = 0, ..., D - 1`` (zero
    based) and ``A_ij ~ N(0, 1)`` for ``i > j``. The chi-square draws are
    ``2 * Gamma(shape=(df - i) / 2)``, which is exact for any real ``df > D - 1``.

    :func:`sample_wishart` and :func:`sample_inverse_wishart` build their samples from
    the factors this function returns for the same key.

    Args:
      key: a ``jax.random`` key.
      df: degrees of freedom, a scalar ``> D - 1`` (may be non-integer).
      dim: D, the matrix size.
      num_samples: S, the number of independent factors.
      dtype: floating dtype of the result.

    Returns:
      Lower-triangular factors of shape (S, D, D).

    Raises:
      ValueError: if a concrete ``df`` is ``<= D - 1`` or a count is < 1.
    """
    dim = _check_count(dim, "dim")
    num_samples = _check_count(num_samples, "num_samples")
    _check_df(df, dim)
    return _bartlett_core(*_bartlett_variates(key, df, dim, num_samples, dtype))


def sample_wishart(key: jax.Array, df, scale: jax.Array, num_samples: int) -> jax.Array:
    r"""Samples ``W ~ Wishart(df, scale)`` (mean ``df * scale``), exactly, for real df.

    With ``scale = C C^T`` (Cholesky) and Bartlett factors ``A``
    (:func:`sample_bartlett_factor`), ``W = (C A)(C A)^T``, which is symmetric positive
    definite by construction.

    Args:
      key: a ``jax.random`` key.
      df: degrees of freedom, scalar ``> D - 1`` (non-integer allowed).
      scale: scale matrix, shape (D, D), symmetric positive definite.
      num_samples: S.

    Returns:
      Samples of shape (S, D, D), in the floating dtype of ``scale`` (at least
      float32).

    Raises:
      ValueError: if ``scale`` is not square, a concrete ``df`` is ``<= D - 1`` or
        ``num_samples < 1``.
    """
    return _wishart_core(*_scale_variates(key, df, scale, num_samples))


def sample_inverse_wishart(key: jax.Array, df, scale: jax.Array,
                           num_samples: int) -> jax.Array:
    r"""Samples ``Sigma ~ InvWishart(df, scale)`` exactly, for real ``df > D - 1``.

    ``Sigma^{-1} ~ Wishart(df, scale^{-1})``. With ``scale = C C^T`` the matrix
    ``C^{-T}`` is a square root of ``scale^{-1}``, so ``Sigma^{-1} = C^{-T} A A^T C^{-1}``
    for Bartlett factors ``A`` (:func:`sample_bartlett_factor`) and hence

    .. math::  \Sigma = (C A^{-T}) (C A^{-T})^T,

    computed with one triangular solve and no explicit inverse of ``scale``. The mean is
    ``scale / (df - D - 1)`` when ``df > D + 1``.

    Args:
      key: a ``jax.random`` key.
      df: degrees of freedom, scalar ``> D - 1`` (non-integer allowed).
      scale: scale matrix Psi, shape (D, D), symmetric positive definite.
      num_samples: S.

    Returns:
      Samples of shape (S, D, D), in the floating dtype of ``scale`` (at least
      float32).

    Raises:
      ValueError: if ``scale`` is not square, a concrete ``df`` is ``<= D - 1`` or
        ``num_samples < 1``.
    """
    return _inverse_wishart_core(*_scale_variates(key, df, scale, num_samples))


def _check_niw_args(mu0, sigma0, nu0, kappa0) -> int:
    dim = _check_square(sigma0, "sigma0")
    if jnp.shape(mu0) != (dim,):
        raise ValueError(f"mu0 must have shape ({dim},), got {jnp.shape(mu0)}.")
    nu0_value = _concrete_float(nu0, "nu0")
    if nu0_value is not None and not nu0_value > dim + 1:
        raise ValueError(f"nu0 must be > D + 1 = {dim + 1} so that E[Sigma_k] = Sigma0, "
                         f"got {nu0_value}.")
    kappa0_value = _concrete_float(kappa0, "kappa0")
    if kappa0_value is not None and not kappa0_value > 0:
        raise ValueError(f"kappa0 must be > 0, got {kappa0_value}.")
    return dim


def sample_niw(key: jax.Array, num_clusters: int, mu0: jax.Array, sigma0: jax.Array,
               nu0, kappa0) -> tuple[jax.Array, jax.Array]:
    r"""Draws cluster parameters from the paper's normal-inverse-Wishart prior.

    .. math::
        \Sigma_k \sim \mathrm{IW}(\nu_0, (\nu_0 - D - 1)\Sigma_0), \qquad
        \mu_k \mid \Sigma_k \sim \mathcal{N}(\mu_0, \Sigma_k / \kappa_0),

    so that ``E[Sigma_k] = Sigma0`` and ``Cov(mu_k) = Sigma0 / kappa0``.

    Args:
      key: a ``jax.random`` key.
      num_clusters: K, the number of clusters to draw (static).
      mu0: prior mean ``mu0``, shape (D,).
      sigma0: prior mean covariance ``Sigma0``, shape (D, D), symmetric positive
        definite.
      nu0: degrees of freedom, scalar ``> D + 1`` (non-integer allowed).
      kappa0: mean concentration, scalar ``> 0``.

    Returns:
      ``(means, covariances)`` of shapes (K, D) and (K, D, D), in the floating dtype of
      ``mu0`` and ``sigma0`` (at least float32).

    Raises:
      ValueError: on bad shapes, ``nu0 <= D + 1``, ``kappa0 <= 0`` or
        ``num_clusters < 1`` (checks on ``nu0`` / ``kappa0`` run when they are
        concrete, not traced).
    """
    num_clusters = _check_count(num_clusters, "num_clusters")
    dim = _check_niw_args(mu0, sigma0, nu0, kappa0)
    dtype = jnp.result_type(jnp.asarray(sigma0).dtype, jnp.asarray(mu0).dtype,
                            jnp.float32)
    key_chi, key_normal = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    chi_square = _bartlett_chi_square(key_chi, nu0, dim, num_clusters, dtype)
    normals = _standard_normal(key_normal, num_clusters * dim * (dim + 1), dtype)
    return _niw_core(chi_square, normals, jnp.asarray(mu0, dtype),
                     jnp.asarray(sigma0, dtype), jnp.asarray(nu0, dtype),
                     jnp.asarray(kappa0, dtype))


# ---------------------------------------------------------------------------------
# Datasets.


class SyntheticDataset(NamedTuple):
    """A labelled synthetic dataset with an OOD set.

    Attributes:
      x_train: training points, shape (N, D), N = K * num_train_per_class, ordered by
        class.
      y_train: training labels in 0..K-1, int32, shape (N,).
      x_test: ID test points, shape (M, D), M = K * num_test_per_class.
      y_test: ID test labels, int32, shape (M,).
      x_ood: OOD points, shape (M_ood, D), each from its own fresh cluster.
      means: the K class means, shape (K, D).
      covariances: the K class covariances, shape (K, D, D).
    """
    x_train: jax.Array
    y_train: jax.Array
    x_test: jax.Array
    y_test: jax.Array
    x_ood: jax.Array
    means: jax.Array
    covariances: jax.Array


@precision.float32_matmuls
def _sample_points(means, covariances, z):
    """Draws from each ``N(means[k], covariances[k])`` given standard normals.

    Args:
      means: shape (K, D).
      covariances: shape (K, D, D).
      z: standard normal variates, shape (K, n, D).

    Returns:
      Points of shape (K * n, D), ordered cluster by cluster.
    """
    num_clusters, num_per_cluster, dim = z.shape
    chol = jnp.linalg.cholesky(covariances)
    x = means[:, None, :] + jnp.einsum("kij,knj->kni", chol, z)
    return x.reshape(num_clusters * num_per_cluster, dim)


@functools.partial(compiler.jit, static_argnames=("num_train_per_class", "num_test_per_class"))
def _make_dataset_core(chi_square_classes, chi_square_ood, normals, mu0, sigma0, nu0,
                       kappa0, num_train_per_class, num_test_per_class):
    """Everything in :func:`make_dataset` after the random variates, as one program."""
    num_classes, dim = chi_square_classes.shape
    num_ood = chi_square_ood.shape[0]
    normals = _Normals(normals)
    means, covariances = _niw_from_variates(chi_square_classes, normals, mu0, sigma0,
                                            nu0, kappa0)
    x_train = _sample_points(means, covariances,
                             normals.take(num_classes, num_train_per_class, dim))
    x_test = _sample_points(means, covariances,
                            normals.take(num_classes, num_test_per_class, dim))
    ood_means, ood_covariances = _niw_from_variates(chi_square_ood, normals, mu0,
                                                    sigma0, nu0, kappa0)
    x_ood = _sample_points(ood_means, ood_covariances, normals.take(num_ood, 1, dim))
    return x_train, x_test, x_ood, means, covariances


def make_dataset(key: jax.Array, *, num_classes: int = 10, dim: int = 2,
                 nu0: float = 4.0, kappa0: float = 1 / 25, num_train_per_class: int = 20,
                 num_test_per_class: int = 20, num_ood: Optional[int] = None,
                 mu0: Optional[jax.Array] = None, sigma0: Optional[jax.Array] = None,
                 dtype=jnp.float32) -> SyntheticDataset:
    """Samples a dataset from the section 6.1 hierarchical NIW model.

    K class clusters ``(mu_k, Sigma_k)`` are drawn from the NIW prior (as in
    :func:`sample_niw`); each class gets ``num_train_per_class`` training and
    ``num_test_per_class`` ID test points from ``N(mu_k, Sigma_k)``. The ``num_ood``
    OOD points are drawn one per fresh cluster from the same prior, so they are
    independent prior-predictive draws.

    Args:
      key: a ``jax.random`` key; the same key gives the same dataset.
      num_classes: K >= 1.
      dim: D >= 1.
      nu0: inverse-Wishart degrees of freedom, ``> D + 1``.
      kappa0: mean concentration ``> 0``; ``Cov(mu_k | Sigma_k) = Sigma_k / kappa0``.
      num_train_per_class: training points per class, >= 1.
      num_test_per_class: ID test points per class, >= 1.
      num_ood: number of OOD points (>= 1); defaults to the number of ID test points
        ``K * num_test_per_class``.
      mu0: prior mean, shape (D,); defaults to zeros.
      sigma0: prior mean covariance ``Sigma0``, shape (D, D); defaults to the identity.
      dtype: floating dtype of the arrays (float64 needs ``jax_enable_x64``).

    Returns:
      A :class:`SyntheticDataset`; rows are ordered by class, labels are int32.

    Raises:
      ValueError: on invalid counts, ``nu0 <= D + 1``, ``kappa0 <= 0`` or bad shapes.
    """
    num_classes = _check_count(num_classes, "num_classes")
    dim = _check_count(dim, "dim")
    num_train_per_class = _check_count(num_train_per_class, "num_train_per_class")
    num_test_per_class = _check_count(num_test_per_class, "num_test_per_class")
    num_test = num_classes * num_test_per_class
    num_ood = num_test if num_ood is None else _check_count(num_ood, "num_ood")
    mu0 = np.zeros((dim,)) if mu0 is None else mu0
    sigma0 = np.eye(dim) if sigma0 is None else sigma0
    if jnp.shape(sigma0) != (dim, dim):
        raise ValueError(f"sigma0 must have shape ({dim}, {dim}), got {jnp.shape(sigma0)}.")
    _check_niw_args(mu0, sigma0, nu0, kappa0)
    dtype = jnp.dtype(dtype)

    key_classes, key_ood, key_normal = (jax.random.fold_in(key, i) for i in range(3))
    chi_square_classes = _bartlett_chi_square(key_classes, nu0, dim, num_classes, dtype)
    chi_square_ood = _bartlett_chi_square(key_ood, nu0, dim, num_ood, dtype)
    num_normals = ((num_classes + num_ood) * dim * (dim + 1)
                   + (num_classes * (num_train_per_class + num_test_per_class)
                      + num_ood) * dim)
    normals = _standard_normal(key_normal, num_normals, dtype)
    x_train, x_test, x_ood, means, covariances = _make_dataset_core(
        chi_square_classes, chi_square_ood, normals, jnp.asarray(mu0, dtype),
        jnp.asarray(sigma0, dtype), jnp.asarray(nu0, dtype), jnp.asarray(kappa0, dtype),
        num_train_per_class=num_train_per_class, num_test_per_class=num_test_per_class)
    labels = np.arange(num_classes, dtype=np.int32)
    return SyntheticDataset(
        x_train=x_train, y_train=jnp.asarray(np.repeat(labels, num_train_per_class)),
        x_test=x_test, y_test=jnp.asarray(np.repeat(labels, num_test_per_class)),
        x_ood=x_ood, means=means, covariances=covariances)
