"""Tests for dpmm_jax.analysis.

Deterministic float32 checks use test matrices with condition number below ~50, for
which eigenvalues of L^{-1} B L^{-T} carry relative errors of order
cond * eps_32 ~ 1e-5; the tolerances below (1e-4 relative, 1e-4 absolute near 0)
leave a margin over that and are still orders of magnitude below the O(1) changes a
wrong formula would cause. Monte Carlo checks allow Z = 5 standard errors, estimated
from the sample (see tests/test_synthetic.py).
"""

import jax
import numpy as np
import pytest
import scipy.linalg
from scipy import stats
from scipy.spatial.distance import pdist
from scipy.special import polygamma

from dpmm_jax import analysis

Z = 5.0
RTOL = 1e-4
ATOL = 1e-4


def _key(seed):
    return jax.random.PRNGKey(seed)


def _random_spd(rng, *batch_and_dim, jitter=0.5):
    *batch, dim = batch_and_dim
    a = rng.normal(size=(*batch, dim, dim))
    return a @ np.swapaxes(a, -1, -2) / dim + jitter * np.eye(dim)


def _reference_fm(a, b):
    """float64 reference via scipy's generalised symmetric eigensolver."""
    eigenvalues = scipy.linalg.eigh(b, a, eigvals_only=True)
    return np.sqrt(np.sum(np.log(eigenvalues) ** 2))


def test_fm_matches_scipy_reference():
    rng = np.random.default_rng(0)
    for dim in [1, 2, 5, 16]:
        a = _random_spd(rng, 6, dim)
        b = _random_spd(rng, 6, dim)
        got = np.asarray(analysis.forstner_moonen_distance(a, b))
        assert got.shape == (6,)
        expected = np.array([_reference_fm(x, y) for x, y in zip(a, b)])
        np.testing.assert_allclose(got, expected, rtol=RTOL)
        assert np.median(expected) > 0.1  # the comparison is not trivially near zero


def test_fm_known_values():
    dim = 4
    eye = np.eye(dim)
    # d(I, c I) = sqrt(D) |log c|.
    np.testing.assert_allclose(analysis.forstner_moonen_distance(eye, 3.0 * eye),
                               np.sqrt(dim) * np.log(3.0), rtol=RTOL)
    # Diagonal matrices: sqrt(sum_i log(b_i / a_i)^2).
    a, b = np.array([1.0, 2.0, 0.5, 4.0]), np.array([2.0, 2.0, 4.0, 1.0])
    np.testing.assert_allclose(analysis.forstner_moonen_distance(np.diag(a), np.diag(b)),
                               np.linalg.norm(np.log(b / a)), rtol=RTOL)
    # A non-commuting 2x2 pair, checked by hand: A = I, B has eigenvalues 1 and 4.
    b = np.array([[2.5, 1.5], [1.5, 2.5]])
    np.testing.assert_allclose(analysis.forstner_moonen_distance(np.eye(2), b),
                               np.log(4.0), rtol=RTOL)


def test_fm_symmetric_zero_on_diagonal_and_congruence_invariant():
    rng = np.random.default_rng(1)
    dim = 6
    a = _random_spd(rng, 20, dim)
    b = _random_spd(rng, 20, dim)
    d_ab = np.asarray(analysis.forstner_moonen_distance(a, b))
    d_ba = np.asarray(analysis.forstner_moonen_distance(b, a))
    np.testing.assert_allclose(d_ab, d_ba, rtol=RTOL)
    np.testing.assert_allclose(analysis.forstner_moonen_distance(a, a), 0.0, atol=ATOL)
    # Congruence by invertible, non-orthogonal W = Q diag(s), cond(W) <= 4.
    q, _ = np.linalg.qr(rng.normal(size=(20, dim, dim)))
    w = q * rng.uniform(0.5, 2.0, size=(20, 1, dim))
    wt = np.swapaxes(w, -1, -2)
    d_w = np.asarray(analysis.forstner_moonen_distance(w @ a @ wt, w @ b @ wt))
    np.testing.assert_allclose(d_w, d_ab, rtol=RTOL)
    # Broadcasting a single matrix against a batch.
    d_bcast = np.asarray(analysis.forstner_moonen_distance(a[0], b))
    expected = np.array([_reference_fm(a[0], y) for y in b])
    np.testing.assert_allclose(d_bcast, expected, rtol=RTOL)


def test_fm_triangle_inequality():
    rng = np.random.default_rng(2)
    a, b, c = (_random_spd(rng, 50, 4) for _ in range(3))
    d = analysis.forstner_moonen_distance
    assert np.all(np.asarray(d(a, c)) <= np.asarray(d(a, b) + d(b, c)) * (1 + RTOL))


@pytest.mark.parametrize("num,batch_size", [(7, 4), (12, 1024), (2, 1)])
def test_pairwise_matches_loop_and_pdist_order(num, batch_size):
    rng = np.random.default_rng(3)
    covs = _random_spd(rng, num, 3)
    got = np.asarray(analysis.pairwise_forstner_moonen(covs, batch_size=batch_size))
    assert got.shape == (num * (num - 1) // 2,)
    flat = covs.reshape(num, -1)
    expected = pdist(flat, lambda u, v: _reference_fm(u.reshape(3, 3), v.reshape(3, 3)))
    np.testing.assert_allclose(got, expected, rtol=RTOL)


def test_pairwise_single_matrix_and_errors():
    assert analysis.pairwise_forstner_moonen(np.eye(3)[None]).shape == (0,)
    with pytest.raises(ValueError, match="covs"):
        analysis.pairwise_forstner_moonen(np.eye(3))
    with pytest.raises(ValueError, match="batch_size"):
        analysis.pairwise_forstner_moonen(np.stack([np.eye(2)] * 3), batch_size=0)
    with pytest.raises(ValueError, match="same D"):
        analysis.forstner_moonen_distance(np.eye(2), np.eye(3))
    with pytest.raises(ValueError, match="cov_a"):
        analysis.forstner_moonen_distance(np.ones((2, 3)), np.eye(3))


@pytest.mark.parametrize("dof", [12.0, 7.5])
def test_wishart_null_mean_and_variance(dof):
    dim, num_samples = 4, 20_000
    rng = np.random.default_rng(4)
    pooled = _random_spd(rng, dim)
    samples = np.asarray(analysis.wishart_null_covariances(_key(0), pooled, dof,
                                                           num_samples), np.float64)
    assert samples.shape == (num_samples, dim, dim)
    mean = samples.mean(0)
    se = samples.std(0, ddof=1) / np.sqrt(num_samples)
    assert np.all(np.abs(mean - pooled) <= Z * se), np.abs(mean - pooled) / se
    # Entry variances of W(dof, pooled / dof) from scipy; SE of a sample variance.
    expected_var = stats.wishart(df=dof, scale=pooled / dof).var()
    centred = samples - mean
    var = (centred ** 2).mean(0)
    se_var = np.sqrt(((centred ** 4).mean(0) - var ** 2) / num_samples)
    assert np.all(np.abs(var - expected_var) <= Z * se_var)


def test_wishart_null_fm_distances_shrink_with_dof():
    """Null FM distances concentrate as the class size grows (sampling error ~ 1/sqrt(N))."""
    pooled = np.diag([1.0, 2.0, 3.0])
    small = analysis.pairwise_forstner_moonen(
        analysis.wishart_null_covariances(_key(1), pooled, 20, 40))
    large = analysis.pairwise_forstner_moonen(
        analysis.wishart_null_covariances(_key(2), pooled, 2000, 40))
    # Median ratio should be about sqrt(2000 / 20) = 10; demand more than 5.
    assert np.median(small) > 5 * np.median(large)


def test_wishart_null_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dof"):
        analysis.wishart_null_covariances(_key(0), np.eye(3), 2.0, 5)
    with pytest.raises(ValueError, match="pooled_cov"):
        analysis.wishart_null_covariances(_key(0), np.ones((2, 3)), 5.0, 5)
    with pytest.raises(ValueError, match="num_samples"):
        analysis.wishart_null_covariances(_key(0), np.eye(3), 5.0, 0)


def test_diagonal_scale_factors():
    rng = np.random.default_rng(5)
    k, d = 6, 5
    pooled = rng.uniform(0.5, 2.0, d)
    factors = rng.uniform(0.2, 5.0, k)
    # Exact common factors are recovered.
    np.testing.assert_allclose(analysis.diagonal_scale_factors(factors[:, None] * pooled,
                                                               pooled),
                               factors, rtol=1e-5)
    # General case: geometric mean of the ratios; covariance and variance inputs agree.
    class_var = rng.uniform(0.1, 3.0, (k, d))
    expected = np.exp(np.mean(np.log(class_var / pooled), axis=1))
    covs = np.stack([np.diag(v) + 0.01 * (np.ones((d, d)) - np.eye(d)) for v in class_var])
    np.testing.assert_allclose(analysis.diagonal_scale_factors(class_var, pooled),
                               expected, rtol=1e-5)
    np.testing.assert_allclose(analysis.diagonal_scale_factors(covs, np.diag(pooled)),
                               expected, rtol=1e-5)
    with pytest.raises(ValueError, match="pooled_variances"):
        analysis.diagonal_scale_factors(class_var, pooled[:-1])
    with pytest.raises(ValueError, match="class variances"):
        analysis.diagonal_scale_factors(class_var[0], pooled)


def test_diagonal_scale_correlation_matches_corrcoef():
    rng = np.random.default_rng(6)
    class_var = np.exp(rng.normal(size=(30, 7)) + rng.normal(size=(30, 1)))
    pooled = rng.uniform(0.5, 2.0, 7)
    corr = np.corrcoef(np.log(class_var / pooled), rowvar=False)
    expected = corr[np.triu_indices(7, k=1)].mean()
    assert analysis.diagonal_scale_correlation(class_var, pooled) == pytest.approx(
        expected, abs=1e-5)
    # Exact common factor and nothing else: every column of log ratios is log(scales).
    scales = np.exp(rng.normal(size=30))
    assert analysis.diagonal_scale_correlation(scales[:, None] * pooled, pooled) \
        == pytest.approx(1.0, abs=1e-5)
    # Covariance input (off-diagonal entries 0.01) uses only the diagonals.
    covs = class_var[:, :, None] * np.eye(7) + 0.01 * (1 - np.eye(7))
    assert analysis.diagonal_scale_correlation(covs, np.diag(pooled)) == pytest.approx(
        expected, abs=1e-5)
    with pytest.raises(ValueError, match="2 classes"):
        analysis.diagonal_scale_correlation(class_var[:1], pooled)


def test_diagonal_scale_correlation_null_is_zero():
    """Independent per-dimension sample variances: r_bar has mean 0, sd 1/sqrt((K-1)P).

    Class variances are sample variances of n Gaussian points (scaled chi-square), with
    no common factor; classes are i.i.d., so the docstring's exact null moments apply.
    """
    k, d, n = 300, 12, 20
    rng = np.random.default_rng(7)
    pooled = rng.uniform(0.5, 2.0, d)
    class_var = pooled * rng.chisquare(n - 1, size=(k, d)) / (n - 1)
    r_bar = analysis.diagonal_scale_correlation(class_var, pooled)
    sd = 1 / np.sqrt((k - 1) * d * (d - 1) / 2)
    assert abs(r_bar) <= Z * sd, r_bar / sd


def test_diagonal_scale_correlation_detects_common_factor():
    """log var_kd = log pooled_d + g_k + e_kd, g ~ N(0, s_g^2), e ~ N(0, s_e^2).

    Every pairwise correlation has population value rho = s_g^2 / (s_g^2 + s_e^2). The
    estimator's mean over R replications is compared with rho within Z replication
    standard errors plus the O(1/K) bias of sample correlations, bounded by
    rho (1 - rho^2) / K (twice the normal-theory first-order bias).
    """
    k, d, reps = 200, 8, 40
    s_g, s_e = 0.5, 0.5
    rho = s_g ** 2 / (s_g ** 2 + s_e ** 2)
    rng = np.random.default_rng(8)
    pooled = rng.uniform(0.5, 2.0, d)
    values = []
    for _ in range(reps):
        log_var = (np.log(pooled) + s_g * rng.normal(size=(k, 1))
                   + s_e * rng.normal(size=(k, d)))
        values.append(analysis.diagonal_scale_correlation(np.exp(log_var), pooled))
    values = np.array(values)
    se = values.std(ddof=1) / np.sqrt(reps)
    bias_bound = rho * (1 - rho ** 2) / k
    assert abs(values.mean() - rho) <= Z * se + bias_bound
    # And it is clearly separated from the null (whose sd here is ~0.013).
    assert values.min() > 0.3


def test_diagonal_scale_correlation_on_wishart_null_is_zero():
    """Diagonals of Wishart null covariances carry no common class factor.

    Under W(dof, diag(pooled) / dof) the diagonal entries are independent scaled
    chi-squares, so r_bar has the exact null moments (mean 0, sd 1/sqrt((K-1)P)).
    Scaling each sample by a log-normal factor makes it clearly positive.
    """
    k, d, dof = 400, 6, 30.0
    pooled = np.linspace(0.5, 3.0, d)
    covs = np.asarray(analysis.wishart_null_covariances(_key(3), np.diag(pooled), dof, k),
                      np.float64)
    r_bar = analysis.diagonal_scale_correlation(covs, np.diag(pooled))
    sd = 1 / np.sqrt((k - 1) * d * (d - 1) / 2)
    assert abs(r_bar) <= Z * sd, r_bar / sd
    gamma = np.exp(0.5 * np.random.default_rng(9).normal(size=k))
    # Var(log chi2_30 / 30) = trigamma(15) ~ 0.069 against Var(log gamma) = 0.25.
    # Expected r_bar = 0.25 / (0.25 + trigamma(15)) ~ 0.78 (Var(log gamma) = 0.25,
    # Var(log chi2_30 / 30) = trigamma(15)); the null sd here is ~0.013.
    rho = 0.25 / (0.25 + float(polygamma(1, dof / 2)))
    assert rho > 0.75
    r_coupled = analysis.diagonal_scale_correlation(gamma[:, None, None] * covs, pooled)
    assert r_coupled > 0.5
    # log s_k = log gamma_k + mean_d log(chi2_30 / 30): population correlation with
    # log gamma_k is sqrt(0.25 / (0.25 + trigamma(15) / 6)) ~ 0.98, and its sample
    # estimate over K = 400 has sd ~ (1 - 0.98^2) / sqrt(400) ~ 0.002.
    factors = np.asarray(analysis.diagonal_scale_factors(gamma[:, None, None] * covs,
                                                         pooled))
    expected = np.sqrt(0.25 / (0.25 + float(polygamma(1, dof / 2)) / d))
    assert np.corrcoef(np.log(factors), np.log(gamma))[0, 1] > expected - 0.02
