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

import numbers
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

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


def sample_bartlett_factor(key: jax.Array, df, dim: int, num_samples: int,
                           dtype=jnp.float32) -> jax.Array:
    r"""Lower-triangular Bartlett factors ``A`` with ``A A^T ~ Wishart(df, I_D)``.

    Bartlett decomposition: ``A`` is lower triangular with independent entries,
    ``A_ii = sqrt(c_i)`` with ``c_i ~ chi^2(df - i)`` for ``i = 0, ..., D - 1`` (zero
    based) and ``A_ij ~ N(0, 1)`` for ``i > j``. The chi-square draws are
    ``2 * Gamma(shape=(df - i) / 2)``, which is exact for any real ``df > D - 1``.

    Args:
      key: a ``jax.random`` key.
      df: degrees of freedom, a scalar ``> D - 1`` (may be non-integer).
      dim: D, the matrix size.
      num_samples: S, the number of independent factors.
      dtype: floating dtype of the result.

    Returns:
      Lower-triangular factors of shape (S, D, D).
    """
    _check_df(df, dim)
    key_diag, key_off = jax.random.split(key)
    shapes = (jnp.asarray(df, dtype) - jnp.arange(dim, dtype=dtype)) / 2
    gammas = jax.random.gamma(key_diag, jnp.broadcast_to(shapes, (num_samples, dim)),
                              dtype=dtype)
    diag = jnp.sqrt(2 * gammas)
    normals = jax.random.normal(key_off, (num_samples, dim, dim), dtype=dtype)
    strictly_lower = jnp.tril(normals, k=-1)
    return strictly_lower + jax.vmap(jnp.diag)(diag)


def sample_wishart(key: jax.Array, df, scale: jax.Array, num_samples: int) -> jax.Array:
    r"""Samples ``W ~ Wishart(df, scale)`` (mean ``df * scale``), exactly, for real df.

    With ``scale = C C^T`` (Cholesky) and Bartlett factors ``A``,
    ``W = (C A)(C A)^T``, which is symmetric positive definite by construction.

    Args:
      key: a ``jax.random`` key.
      df: degrees of freedom, scalar ``> D - 1`` (non-integer allowed).
      scale: scale matrix, shape (D, D), symmetric positive definite.
      num_samples: S.

    Returns:
      Samples of shape (S, D, D).
    """
    dim = _check_square(scale, "scale")
    scale = jnp.asarray(scale)
    dtype = jnp.result_type(scale.dtype, jnp.float32)
    chol = jnp.linalg.cholesky(scale.astype(dtype))
    factor = chol @ sample_bartlett_factor(key, df, dim, num_samples, dtype)
    return factor @ jnp.swapaxes(factor, -1, -2)


def sample_inverse_wishart(key: jax.Array, df, scale: jax.Array,
                           num_samples: int) -> jax.Array:
    r"""Samples ``Sigma ~ InvWishart(df, scale)`` exactly, for real ``df > D - 1``.

    ``Sigma^{-1} ~ Wishart(df, scale^{-1})``. With ``scale = C C^T`` the matrix
    ``C^{-T}`` is a square root of ``scale^{-1}``, so ``Sigma^{-1} = C^{-T} A A^T C^{-1}``
    for Bartlett factors ``A`` and hence

    .. math::  \Sigma = (C A^{-T}) (C A^{-T})^T,

    computed with one triangular solve and no explicit inverse of ``scale``. The mean is
    ``scale / (df - D - 1)`` when ``df > D + 1``.

    Args:
      key: a ``jax.random`` key.
      df: degrees of freedom, scalar ``> D - 1`` (non-integer allowed).
      scale: scale matrix Psi, shape (D, D), symmetric positive definite.
      num_samples: S.

    Returns:
      Samples of shape (S, D, D).
    """
    dim = _check_square(scale, "scale")
    scale = jnp.asarray(scale)
    dtype = jnp.result_type(scale.dtype, jnp.float32)
    chol = jnp.linalg.cholesky(scale.astype(dtype))
    bartlett = sample_bartlett_factor(key, df, dim, num_samples, dtype)
    eye = jnp.broadcast_to(jnp.eye(dim, dtype=dtype), bartlett.shape)
    bartlett_inv = solve_triangular(bartlett, eye, lower=True)  # A^{-1}, lower.
    factor = chol @ jnp.swapaxes(bartlett_inv, -1, -2)  # C A^{-T}
    return factor @ jnp.swapaxes(factor, -1, -2)


def sample_niw(key: jax.Array, num_clusters: int, mu0: jax.Array, sigma0: jax.Array,
               nu0, kappa0) -> tuple[jax.Array, jax.Array]:
    r"""Draws cluster parameters from the paper's normal-inverse-Wishart prior.

    .. math::
        \Sigma_k \sim \mathrm{IW}(\nu_0, (\nu_0 - D - 1)\Sigma_0), \qquad
        \mu_k \mid \Sigma_k \sim \mathcal{N}(\mu_0, \Sigma_k / \kappa_0),

    so that ``E[Sigma_k] = Sigma0`` and ``Cov(mu_k) = Sigma0 / kappa0``.

    Args:
      key: a ``jax.random`` key.
      num_clusters: K, the number of clusters to draw.
      mu0: prior mean ``mu0``, shape (D,).
      sigma0: prior mean covariance ``Sigma0``, shape (D, D), symmetric positive
        definite.
      nu0: degrees of freedom, scalar ``> D + 1`` (non-integer allowed).
      kappa0: mean concentration, scalar ``> 0``.

    Returns:
      ``(means, covariances)`` of shapes (K, D) and (K, D, D).

    Raises:
      ValueError: on bad shapes, ``nu0 <= D + 1``, ``kappa0 <= 0`` or
        ``num_clusters < 1`` (checks on ``nu0`` / ``kappa0`` run when they are
        concrete, not traced).
    """
    num_clusters = _check_count(num_clusters, "num_clusters")
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

    sigma0 = jnp.asarray(sigma0)
    dtype = jnp.result_type(sigma0.dtype, jnp.asarray(mu0).dtype, jnp.float32)
    sigma0 = sigma0.astype(dtype)
    mu0 = jnp.asarray(mu0, dtype)
    key_cov, key_mean = jax.random.split(key)
    psi0 = (jnp.asarray(nu0, dtype) - dim - 1) * sigma0
    covariances = sample_inverse_wishart(key_cov, nu0, psi0, num_clusters)
    chol = jnp.linalg.cholesky(covariances)
    z = jax.random.normal(key_mean, (num_clusters, dim), dtype=dtype)
    means = mu0 + jnp.einsum("kij,kj->ki", chol, z) / jnp.sqrt(jnp.asarray(kappa0, dtype))
    return means, covariances


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


def _sample_points(key, means, covariances, num_per_cluster):
    """``num_per_cluster`` draws from each ``N(means[k], covariances[k])``.

    Args:
      key: a ``jax.random`` key.
      means: shape (K, D).
      covariances: shape (K, D, D).
      num_per_cluster: n >= 1.

    Returns:
      Points of shape (K * n, D), ordered cluster by cluster.
    """
    num_clusters, dim = means.shape
    chol = jnp.linalg.cholesky(covariances)
    z = jax.random.normal(key, (num_clusters, num_per_cluster, dim), dtype=means.dtype)
    x = means[:, None, :] + jnp.einsum("kij,knj->kni", chol, z)
    return x.reshape(num_clusters * num_per_cluster, dim)


def make_dataset(key: jax.Array, *, num_classes: int = 10, dim: int = 2,
                 nu0: float = 4.0, kappa0: float = 1 / 25, num_train_per_class: int = 20,
                 num_test_per_class: int = 20, num_ood: Optional[int] = None,
                 mu0: Optional[jax.Array] = None, sigma0: Optional[jax.Array] = None,
                 dtype=jnp.float32) -> SyntheticDataset:
    """Samples a dataset from the section 6.1 hierarchical NIW model.

    K class clusters are drawn with :func:`sample_niw`; each class gets
    ``num_train_per_class`` training and ``num_test_per_class`` ID test points from
    ``N(mu_k, Sigma_k)``. The ``num_ood`` OOD points are drawn one per fresh cluster
    from the same prior (so they are prior-predictive draws).

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
      A :class:`SyntheticDataset`.

    Raises:
      ValueError: on invalid counts, ``nu0 <= D + 1``, ``kappa0 <= 0`` or bad shapes.
    """
    num_classes = _check_count(num_classes, "num_classes")
    dim = _check_count(dim, "dim")
    num_train_per_class = _check_count(num_train_per_class, "num_train_per_class")
    num_test_per_class = _check_count(num_test_per_class, "num_test_per_class")
    num_test = num_classes * num_test_per_class
    num_ood = num_test if num_ood is None else _check_count(num_ood, "num_ood")
    mu0 = jnp.zeros((dim,), dtype) if mu0 is None else jnp.asarray(mu0, dtype)
    sigma0 = jnp.eye(dim, dtype=dtype) if sigma0 is None else jnp.asarray(sigma0, dtype)
    if sigma0.shape != (dim, dim):
        raise ValueError(f"sigma0 must have shape ({dim}, {dim}), got {sigma0.shape}.")

    key_classes, key_train, key_test, key_ood_params, key_ood = jax.random.split(key, 5)
    means, covariances = sample_niw(key_classes, num_classes, mu0, sigma0, nu0, kappa0)
    y_train = jnp.repeat(jnp.arange(num_classes, dtype=jnp.int32), num_train_per_class)
    y_test = jnp.repeat(jnp.arange(num_classes, dtype=jnp.int32), num_test_per_class)
    x_train = _sample_points(key_train, means, covariances, num_train_per_class)
    x_test = _sample_points(key_test, means, covariances, num_test_per_class)
    ood_means, ood_covariances = sample_niw(key_ood_params, num_ood, mu0, sigma0, nu0,
                                            kappa0)
    x_ood = _sample_points(key_ood, ood_means, ood_covariances, 1)
    return SyntheticDataset(x_train=x_train, y_train=y_train, x_test=x_test,
                            y_test=y_test, x_ood=x_ood, means=means,
                            covariances=covariances)
