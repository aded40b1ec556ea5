"""Covariance analyses behind the paper's model choices (appendix 9 and section 5.3).

* :func:`forstner_moonen_distance` / :func:`pairwise_forstner_moonen`: how different
  the per-class covariance matrices are (Förstner and Moonen, 2003).
* :func:`wishart_null_covariances`: the null model in which every class shares the
  pooled covariance and the per-class estimates differ only by sampling error,
  ``Sigma_hat_k ~ W(N_bar, Sigma_hat / N_bar)``; FM distances between these samples give
  the null distribution to compare the real distances with.
* :func:`diagonal_scale_factors` / :func:`diagonal_scale_correlation`: whether a class's
  variances are jointly larger or smaller than the pooled ones, which motivates the
  per-class scale ``gamma_k`` of the coupled diagonal model.

No plotting here; experiments draw the histograms from these arrays.

Shape letters: K classes, D features, S samples.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from dpmm_jax import compiler
from dpmm_jax import synthetic
from dpmm_jax import validation

__all__ = [
    "forstner_moonen_distance",
    "pairwise_forstner_moonen",
    "wishart_null_covariances",
    "diagonal_scale_factors",
    "diagonal_scale_correlation",
]


def _as_float(x):
    x = jnp.asarray(x)
    return x.astype(jnp.result_type(x.dtype, jnp.float32))


def _check_covariances(x, name: str, batched: bool | None = None):
    shape = jnp.shape(x)
    if len(shape) < 2 or shape[-1] != shape[-2] or shape[-1] < 1:
        raise ValueError(f"{name} must have shape (..., D, D), got {shape}.")
    if batched is True and len(shape) != 3:
        raise ValueError(f"{name} must have shape (K, D, D), got {shape}.")


def _fm_from_cholesky(chol_a: jax.Array, cov_b: jax.Array) -> jax.Array:
    """FM distance given ``chol_a`` (lower Cholesky factor of A) and B; batched."""
    # Generalised eigenvalues of B v = lambda A v are those of the symmetric matrix
    # L^{-1} B L^{-T} (A = L L^T); the second solve uses B = B^T.
    half = solve_triangular(chol_a, cov_b, lower=True)  # L^{-1} B
    whitened = solve_triangular(chol_a, jnp.swapaxes(half, -1, -2), lower=True)
    whitened = 0.5 * (whitened + jnp.swapaxes(whitened, -1, -2))
    log_eigenvalues = jnp.log(jnp.linalg.eigvalsh(whitened))
    return jnp.sqrt(jnp.sum(log_eigenvalues ** 2, axis=-1))


@compiler.jit
def _forstner_moonen(cov_a, cov_b):
    cov_a, cov_b = jnp.broadcast_arrays(cov_a, cov_b)
    return _fm_from_cholesky(jnp.linalg.cholesky(cov_a), cov_b)


def forstner_moonen_distance(cov_a: jax.Array, cov_b: jax.Array) -> jax.Array:
    r"""Förstner-Moonen distance between symmetric positive-definite matrices.

    .. math::
        d(A, B) = \Big[\sum_{i=1}^D \log^2 \lambda_i(A^{-1} B)\Big]^{1/2},

    where ``lambda_i(A^{-1} B)`` are the generalised eigenvalues of ``B v = lambda A v``.
    They are computed without inverting ``A``: with ``A = L L^T`` (Cholesky) they are the
    eigenvalues of the symmetric matrix ``L^{-1} B L^{-T}`` (two triangular solves and
    ``eigvalsh``). ``d`` is a metric on SPD matrices: symmetric (the eigenvalues of
    ``B^{-1} A`` are the reciprocals), zero iff ``A = B``, and invariant to congruence
    ``A, B -> W A W^T, W B W^T`` for invertible ``W``.

    Args:
      cov_a: SPD matrices, shape (..., D, D).
      cov_b: SPD matrices, shape (..., D, D); batch dimensions broadcast with
        ``cov_a``.

    Returns:
      Distances, shape (...) (a 0-d array for a single pair). Non-positive-definite
      inputs give NaN.

    Raises:
      ValueError: if an input is not (..., D, D) or the D's differ.
    """
    _check_covariances(cov_a, "cov_a")
    _check_covariances(cov_b, "cov_b")
    if jnp.shape(cov_a)[-1] != jnp.shape(cov_b)[-1]:
        raise ValueError(f"cov_a and cov_b must have the same D, got shapes "
                         f"{jnp.shape(cov_a)} and {jnp.shape(cov_b)}.")
    dtype = jnp.result_type(_as_float(cov_a).dtype, _as_float(cov_b).dtype)
    return _forstner_moonen(jnp.asarray(cov_a, dtype), jnp.asarray(cov_b, dtype))


@functools.partial(compiler.jit, static_argnames=("batch_size",))
def _pairwise_fm(covs, rows, cols, batch_size):
    chol = jnp.linalg.cholesky(covs)

    def one_pair(pair):
        i, j = pair
        return _fm_from_cholesky(chol[i], covs[j])

    return jax.lax.map(one_pair, (rows, cols), batch_size=batch_size)


def pairwise_forstner_moonen(covs: jax.Array, *, batch_size: int = 1024) -> jax.Array:
    """Förstner-Moonen distances between all pairs of K covariance matrices.

    Pairs ``(i, j)`` with ``i < j`` are listed in row-major order (``np.triu_indices(K,
    1)``, the order of ``scipy.spatial.distance.pdist``'s condensed output). Each
    matrix is factorised once; pairs are processed ``batch_size`` at a time, so memory
    is ``O(batch_size * D^2)`` rather than ``O(K^2 D^2)``.

    Args:
      covs: SPD matrices, shape (K, D, D).
      batch_size: number of pairs evaluated together (vectorised).

    Returns:
      Distances ``d(covs[i], covs[j])``, shape (K * (K - 1) / 2,).

    Raises:
      ValueError: if ``covs`` is not (K, D, D) or ``batch_size < 1``.
    """
    _check_covariances(covs, "covs", batched=True)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    covs = _as_float(covs)
    rows, cols = np.triu_indices(covs.shape[0], k=1)
    if rows.size == 0:
        return jnp.zeros((0,), covs.dtype)
    return _pairwise_fm(covs, jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32),
                        batch_size=min(int(batch_size), rows.size))


def wishart_null_covariances(key: jax.Array, pooled_cov: jax.Array, dof,
                             num_samples: int) -> jax.Array:
    r"""Covariance estimates under the null model of tied class covariances.

    If every class truly had covariance ``pooled_cov`` and estimates differed only by
    sampling error, a class with ``dof`` points would give

    .. math::  \hat\Sigma_k \sim \mathrm{W}(\mathrm{dof}, \hat\Sigma / \mathrm{dof}),

    whose mean is ``pooled_cov``. The paper uses ``dof = N_bar``, the average number of
    points per class (appendix 9). Sampling is exact for real ``dof`` (Bartlett
    decomposition, :func:`dpmm_jax.synthetic.sample_wishart`).

    Args:
      key: a ``jax.random`` key.
      pooled_cov: the pooled within-class covariance, shape (D, D), SPD.
      dof: degrees of freedom, a scalar ``> D - 1`` (non-integer allowed). With fewer
        points than dimensions the estimates are singular and FM distances infinite,
        so that case is rejected.
      num_samples: S, the number of null covariance matrices.

    Returns:
      Null covariance matrices, shape (S, D, D).

    Raises:
      ValueError: if ``pooled_cov`` is not (D, D), ``dof <= D - 1`` or
        ``num_samples < 1``.
    """
    validation.prng_key(key)
    _check_covariances(pooled_cov, "pooled_cov")
    if len(jnp.shape(pooled_cov)) != 2:
        raise ValueError(f"pooled_cov must have shape (D, D), got {jnp.shape(pooled_cov)}.")
    dim = jnp.shape(pooled_cov)[-1]
    dof_value = float(dof)
    if not dof_value > dim - 1:
        raise ValueError(f"dof must be > D - 1 = {dim - 1} (the null estimates would be "
                         f"singular), got {dof_value}.")
    pooled_cov = _as_float(pooled_cov)
    return synthetic.sample_wishart(key, dof_value, pooled_cov / dof_value, num_samples)


def _class_and_pooled_variances(class_variances, pooled_variances):
    """Returns ((K, D) class variances, (D,) pooled variances) from either form."""
    class_variances = _as_float(class_variances)
    if class_variances.ndim == 3:
        _check_covariances(class_variances, "class_variances")
        class_variances = jnp.diagonal(class_variances, axis1=-2, axis2=-1)
    elif class_variances.ndim != 2:
        raise ValueError("class variances must have shape (K, D) or (K, D, D), got "
                         f"{class_variances.shape}.")
    pooled_variances = _as_float(pooled_variances)
    if pooled_variances.ndim == 2:
        _check_covariances(pooled_variances, "pooled_variances")
        pooled_variances = jnp.diagonal(pooled_variances)
    if pooled_variances.shape != class_variances.shape[-1:]:
        raise ValueError(f"pooled_variances must have shape ({class_variances.shape[-1]},) "
                         f"(or (D, D)), got {pooled_variances.shape}.")
    dtype = jnp.result_type(class_variances.dtype, pooled_variances.dtype)
    return class_variances.astype(dtype), pooled_variances.astype(dtype)


def diagonal_scale_factors(class_covs_or_variances: jax.Array,
                           pooled_variances: jax.Array) -> jax.Array:
    r"""Per-class geometric-mean ratio of a class's variances to the pooled ones.

    .. math::
        s_k = \exp\Big(\frac1D \sum_{d=1}^D \log \frac{\sigma^2_{k,d}}{\sigma^2_{d}}\Big),

    with ``sigma^2_{k,d}`` the diagonal of class k's covariance and ``sigma^2_d`` the
    pooled variances. ``s_k > 1`` means class k is more spread out than average in a
    typical dimension. A wide spread of ``s_k`` across classes is what the coupled
    diagonal model's scale ``gamma_k`` captures (section 5.3, figure 2).

    Args:
      class_covs_or_variances: class covariances (K, D, D) (only the diagonals are
        used) or class variances (K, D); entries must be positive.
      pooled_variances: pooled variances (D,), or a pooled covariance (D, D) whose
        diagonal is used.

    Returns:
      Scale factors ``s_k``, shape (K,).

    Raises:
      ValueError: on inconsistent shapes.
    """
    class_var, pooled_var = _class_and_pooled_variances(class_covs_or_variances,
                                                        pooled_variances)
    return jnp.exp(jnp.mean(jnp.log(class_var) - jnp.log(pooled_var), axis=-1))


@compiler.jit
def _mean_pairwise_correlation(values):
    centred = values - jnp.mean(values, axis=0)
    unit = centred / jnp.linalg.norm(centred, axis=0)  # unit-norm columns
    dim = values.shape[1]
    # sum_{d, d'} corr(d, d') = |sum_d unit_d|^2 and the D diagonal terms are 1.
    total = jnp.sum(jnp.sum(unit, axis=1) ** 2)
    return (total - dim) / (dim * (dim - 1))


def diagonal_scale_correlation(class_variances: jax.Array,
                               pooled_variances: jax.Array) -> float:
    r"""Mean pairwise correlation, across dimensions, of log variance ratios.

    Let ``l_{k,d} = log(sigma^2_{k,d} / sigma^2_d)``, the log ratio of class k's
    variance in dimension d to the pooled variance. For each pair of dimensions
    ``d != d'`` take the Pearson correlation, over the K classes, of the columns
    ``l_{:,d}`` and ``l_{:,d'}``; return the average of the ``D (D - 1) / 2``
    correlations:

    .. math::
        \bar r = \frac{2}{D(D-1)} \sum_{d < d'} \mathrm{corr}_k(l_{k,d}, l_{k,d'}).

    Interpretation: if the variances of a class are independent across dimensions
    (the diagonal model's assumption), ``r_bar`` is 0 in expectation; with i.i.d.
    classes its standard deviation is then exactly ``1 / sqrt((K - 1) D (D - 1) / 2)``
    (pairwise correlations of independent columns are uncorrelated with variance
    ``1 / (K - 1)``). If instead every class has a common factor,
    ``sigma^2_{k,d} = gamma_k sigma^2_d eps_{k,d}`` with independent ``eps``, then
    ``l_{k,d} = log gamma_k + log eps_{k,d}`` and the correlation is
    ``Var(log gamma) / (Var(log gamma) + Var(log eps))`` > 0: a class's variances are
    jointly larger or smaller than average, the evidence for the coupled diagonal
    model. Dividing by the pooled variances shifts each column by a constant, so it
    does not change ``r_bar``; it is kept for the interpretation of ``l``.

    Args:
      class_variances: class variances (K, D), or covariances (K, D, D) whose
        diagonals are used; entries must be positive. Needs K >= 2, D >= 2.
      pooled_variances: pooled variances (D,), or a pooled covariance (D, D).

    Returns:
      The mean pairwise correlation ``r_bar`` in [-1/(D-1), 1] as a Python float (NaN
      if some dimension's log ratio is constant across classes).

    Raises:
      ValueError: on inconsistent shapes, K < 2 or D < 2.
    """
    class_var, pooled_var = _class_and_pooled_variances(class_variances,
                                                        pooled_variances)
    num_classes, dim = class_var.shape
    if num_classes < 2 or dim < 2:
        raise ValueError(f"need at least 2 classes and 2 dimensions, got K={num_classes}, "
                         f"D={dim}.")
    log_ratio = jnp.log(class_var) - jnp.log(pooled_var)
    return float(_mean_pairwise_correlation(log_ratio))
