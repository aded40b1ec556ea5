"""Tests for dpmm_jax.synthetic.

Monte Carlo checks compare a sample statistic with its exact value and allow
``Z = 5`` standard errors, the standard error being estimated from the same sample
(for a sample variance, ``sqrt((m4 - s^4) / S)`` with ``m4`` the fourth central moment).
A correct sampler fails one such check with probability ~6e-7, and a wrong
parameterisation (e.g. a chi-square degree of freedom off by one, scale ``Psi``
instead of ``(nu0 - D - 1) Sigma0``, means drawn with ``Sigma0`` instead of
``Sigma_k``) moves the statistic by many standard errors at the sample sizes used.
Where a standard error needs an eighth moment, the degrees of freedom are chosen so
that it exists. Distributional checks use Kolmogorov-Smirnov tests that a correct
sampler fails with probability 1e-3.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpmm_jax import synthetic

Z = 5.0
KS_ALPHA = 1e-3


def _key(seed):
    return jax.random.PRNGKey(seed)


def _assert_mean_close(samples, expected, name):
    """Checks every entry of the sample mean over axis 0 within Z standard errors."""
    samples = np.asarray(samples, np.float64)
    n = samples.shape[0]
    mean = samples.mean(0)
    se = samples.std(0, ddof=1) / np.sqrt(n)
    err = np.abs(mean - expected)
    assert np.all(err <= Z * se), f"{name}: |mean - expected| / se = {err / se}"


def _assert_var_close(samples, expected_var, name):
    """Checks every entry's sample variance over axis 0 within Z standard errors."""
    samples = np.asarray(samples, np.float64)
    n = samples.shape[0]
    centred = samples - samples.mean(0)
    var = (centred ** 2).mean(0)
    m4 = (centred ** 4).mean(0)
    se = np.sqrt((m4 - var ** 2) / n)
    err = np.abs(var - expected_var)
    assert np.all(err <= Z * se), f"{name}: |var - expected| / se = {err / se}"


def _spd(dim, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(dim, dim))
    return a @ a.T / dim + 0.5 * np.eye(dim)


# ---------------------------------------------------------------------------------
# Samplers.


@pytest.mark.parametrize("df,dim", [(19.0, 2), (20.5, 3), (7.3, 3)])
def test_inverse_wishart_moments_match_scipy(df, dim):
    """Entry means and variances of IW(df, Psi) against scipy.stats.invwishart.

    The variance check's standard error is estimated from fourth moments, which is
    reliable when eighth moments exist; diagonal entries are InvGamma((df - D + 1) / 2),
    whose r-th moment exists iff (df - D + 1) / 2 > r. The check is skipped for df = 7.3
    (non-integer, heavy-tailed), where only means and the marginal law are checked.
    """
    num_samples = 20_000
    psi = _spd(dim, seed=dim)
    samples = np.asarray(synthetic.sample_inverse_wishart(_key(1), df, psi, num_samples),
                         np.float64)
    assert samples.shape == (num_samples, dim, dim)
    np.testing.assert_array_equal(samples, np.swapaxes(samples, 1, 2))
    reference = stats.invwishart(df=df, scale=psi)
    _assert_mean_close(samples, reference.mean(), "invwishart mean")
    if (df - dim + 1) / 2 > 8:
        _assert_var_close(samples, reference.var(), "invwishart var")
    # Each diagonal entry is InvGamma((df - D + 1) / 2, scale = Psi_ii / 2).
    for i in range(dim):
        marginal = stats.invgamma(a=(df - dim + 1) / 2, scale=psi[i, i] / 2)
        assert stats.kstest(samples[:, i, i], marginal.cdf).pvalue > KS_ALPHA


@pytest.mark.parametrize("df", [2.5, 6.0])
def test_wishart_moments_match_scipy(df):
    dim, num_samples = 3, 20_000
    scale = _spd(dim, seed=7)
    samples = np.asarray(synthetic.sample_wishart(_key(2), df, scale, num_samples),
                         np.float64)
    reference = stats.wishart(df=df, scale=scale)
    _assert_mean_close(samples, reference.mean(), "wishart mean")
    _assert_var_close(samples, reference.var(), "wishart var")
    # Diagonal entries are Psi_ii * chi^2(df).
    for i in range(dim):
        assert stats.kstest(samples[:, i, i] / scale[i, i],
                            stats.chi2(df).cdf).pvalue > KS_ALPHA


def test_bartlett_factor_structure_and_shared_use():
    factors = np.asarray(synthetic.sample_bartlett_factor(_key(3), 4.5, 3, 10),
                         np.float64)
    assert factors.shape == (10, 3, 3)
    np.testing.assert_array_equal(factors, np.tril(factors))
    assert np.all(np.diagonal(factors, axis1=1, axis2=2) > 0)
    # With an identity scale and the same key, W = A A^T and IW = (A A^T)^{-1}, so the
    # samplers really are a Wishart and its inverse (float32 round-off only).
    wishart = np.asarray(synthetic.sample_wishart(_key(3), 4.5, np.eye(3), 10), np.float64)
    inverse = np.asarray(synthetic.sample_inverse_wishart(_key(3), 4.5, np.eye(3), 10),
                         np.float64)
    np.testing.assert_allclose(wishart, factors @ np.swapaxes(factors, 1, 2), rtol=1e-5,
                               atol=1e-5)
    products = inverse @ wishart
    residual = np.abs(products - np.eye(3)).max(axis=(1, 2))
    # Round-off grows with cond(W) times float32 eps.
    assert np.all(residual <= 1e-5 * np.linalg.cond(wishart)), residual


@pytest.mark.parametrize("nu0", [9.5, 18.5])
def test_niw_covariance_mean_is_sigma0(nu0):
    dim, num = 2, 20_000
    sigma0 = _spd(dim, seed=11)
    _, covs = synthetic.sample_niw(_key(4), num, np.array([1.0, -2.0]), sigma0, nu0, 0.3)
    _assert_mean_close(covs, sigma0, "E[Sigma_k]")
    reference = stats.invwishart(df=nu0, scale=(nu0 - dim - 1) * sigma0)
    if (nu0 - dim + 1) / 2 > 8:  # eighth moments exist (see the test above).
        _assert_var_close(covs, reference.var(), "Var[Sigma_k]")


def test_niw_means_spread_as_sigma_over_kappa0():
    dim, num, nu0, kappa0 = 2, 20_000, 15.5, 0.25
    mu0 = np.array([3.0, -1.0])
    sigma0 = _spd(dim, seed=12)
    means, covs = synthetic.sample_niw(_key(5), num, mu0, sigma0, nu0, kappa0)
    means, covs = np.asarray(means, np.float64), np.asarray(covs, np.float64)
    # Conditionally on Sigma_k, sqrt(kappa0) L_k^{-1} (mu_k - mu0) ~ N(0, I): entries
    # have mean 0, squares mean 1 (variance 2), cross products mean 0 (variance 1).
    chol = np.linalg.cholesky(covs)
    z = np.sqrt(kappa0) * np.linalg.solve(chol, (means - mu0)[..., None])[..., 0]
    _assert_mean_close(z, np.zeros(dim), "whitened mean")
    outer = (z[:, :, None] * z[:, None, :]).reshape(num, -1)
    _assert_mean_close(outer, np.eye(dim).ravel(), "whitened second moment")
    # Marginally Cov(mu_k) = E[Sigma_k] / kappa0 = Sigma0 / kappa0; mu_k is Student-t
    # with nu0 - D + 1 = 14.5 degrees of freedom, so the 8th moments exist.
    centred = means - mu0
    products = (centred[:, :, None] * centred[:, None, :]).reshape(num, -1)
    _assert_mean_close(products, (sigma0 / kappa0).ravel(), "Cov(mu_k)")


def test_sample_niw_under_jit_matches_eager():
    sigma0 = jnp.eye(3)
    mu0 = jnp.zeros(3)
    eager = synthetic.sample_niw(_key(6), 4, mu0, sigma0, 6.5, 0.1)
    jitted = jax.jit(synthetic.sample_niw, static_argnums=1)(_key(6), 4, mu0, sigma0,
                                                             6.5, 0.1)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------
# make_dataset.


def test_make_dataset_shapes_and_dtypes():
    data = synthetic.make_dataset(_key(0))
    k, d, n = 10, 2, 20
    assert data.x_train.shape == (k * n, d) and data.x_train.dtype == jnp.float32
    assert data.x_test.shape == (k * n, d) and data.x_test.dtype == jnp.float32
    assert data.x_ood.shape == (k * n, d) and data.x_ood.dtype == jnp.float32
    assert data.y_train.shape == (k * n,) and data.y_train.dtype == jnp.int32
    assert data.y_test.shape == (k * n,) and data.y_test.dtype == jnp.int32
    assert data.means.shape == (k, d) and data.covariances.shape == (k, d, d)
    np.testing.assert_array_equal(np.bincount(np.asarray(data.y_train)), [n] * k)
    np.testing.assert_array_equal(np.bincount(np.asarray(data.y_test)), [n] * k)
    for x in data:
        assert np.all(np.isfinite(np.asarray(x)))

    data = synthetic.make_dataset(_key(0), num_classes=3, dim=4, nu0=7.5,
                                  num_train_per_class=5, num_test_per_class=2,
                                  num_ood=11)
    assert data.x_train.shape == (15, 4)
    assert data.x_test.shape == (6, 4)
    assert data.x_ood.shape == (11, 4)
    assert set(np.asarray(data.y_train).tolist()) == {0, 1, 2}
    assert data.covariances.shape == (3, 4, 4)
    assert np.all(np.linalg.eigvalsh(np.asarray(data.covariances, np.float64)) > 0)


def test_make_dataset_is_deterministic_in_the_key():
    a = synthetic.make_dataset(_key(42), num_classes=4)
    b = synthetic.make_dataset(_key(42), num_classes=4)
    c = synthetic.make_dataset(_key(43), num_classes=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    for name in ["x_train", "x_test", "x_ood", "means", "covariances"]:
        assert not np.allclose(getattr(a, name), getattr(c, name)), name
    # Train, test and OOD draws use different randomness.
    assert not np.allclose(a.x_train, a.x_test)


def test_points_follow_their_class_gaussian():
    """Whitened residuals L_k^{-1}(x - mu_k) of train and test points are N(0, I)."""
    k, d, n = 4, 3, 2_000
    data = synthetic.make_dataset(_key(7), num_classes=k, dim=d, nu0=6.5, kappa0=0.1,
                                  num_train_per_class=n, num_test_per_class=n)
    means = np.asarray(data.means, np.float64)
    chol = np.linalg.cholesky(np.asarray(data.covariances, np.float64))
    for x, y in [(data.x_train, data.y_train), (data.x_test, data.y_test)]:
        x, y = np.asarray(x, np.float64), np.asarray(y)
        for c in range(k):
            z = np.linalg.solve(chol[c], (x[y == c] - means[c]).T).T
            assert z.shape == (n, d)
            _assert_mean_close(z, np.zeros(d), f"class {c} whitened mean")
            outer = (z[:, :, None] * z[:, None, :]).reshape(n, -1)
            _assert_mean_close(outer, np.eye(d).ravel(), f"class {c} whitened cov")


def test_ood_points_come_from_fresh_clusters():
    """OOD points are i.i.d. prior-predictive draws: Cov = Sigma0 (1 + 1/kappa0).

    x = mu + e with mu | Sigma ~ N(mu0, Sigma / kappa0), e | Sigma ~ N(0, Sigma), so
    Cov(x) = E[Sigma] (1 + 1/kappa0) = Sigma0 (1 + 1/kappa0). Had the OOD points shared
    one cluster, their spread would be that cluster's Sigma (about Sigma0, a third of
    the target here); had they reused the K class clusters, it would be that of K = 2
    random means.
    """
    d, nu0, kappa0, num_ood = 2, 15.5, 0.5, 20_000
    mu0 = np.array([1.0, 2.0])
    sigma0 = _spd(d, seed=21)
    data = synthetic.make_dataset(_key(8), num_classes=2, dim=d, nu0=nu0, kappa0=kappa0,
                                  num_train_per_class=3, num_test_per_class=3,
                                  num_ood=num_ood, mu0=mu0, sigma0=sigma0)
    x = np.asarray(data.x_ood, np.float64)
    _assert_mean_close(x, mu0, "OOD mean")
    centred = x - mu0
    products = (centred[:, :, None] * centred[:, None, :]).reshape(num_ood, -1)
    _assert_mean_close(products, (sigma0 * (1 + 1 / kappa0)).ravel(), "OOD covariance")


@pytest.mark.parametrize("nu0,kappa0", [(4.0, 1 / 25), (9.5, 0.5)])
def test_ood_marginal_is_prior_predictive_student_t(nu0, kappa0):
    """Projections a^T x_ood follow the NIW prior predictive Student-t.

    x ~ St(df = nu0 - D + 1, loc = mu0, shape = (1 + 1/kappa0) Psi0 / df) with
    Psi0 = (nu0 - D - 1) Sigma0. A KS test covers the paper's default (nu0 = 4), whose
    heavy tails (3 degrees of freedom) rule out moment checks.
    """
    d, num_ood = 2, 5_000
    mu0 = np.array([0.5, -0.5])
    sigma0 = _spd(d, seed=22)
    data = synthetic.make_dataset(_key(9), num_classes=1, dim=d, nu0=nu0, kappa0=kappa0,
                                  num_ood=num_ood, mu0=mu0, sigma0=sigma0)
    x = np.asarray(data.x_ood, np.float64)
    df = nu0 - d + 1
    shape = (1 + 1 / kappa0) * (nu0 - d - 1) * sigma0 / df
    for a in [np.array([1.0, 0.0]), np.array([0.6, -0.8])]:
        dist = stats.t(df=df, loc=a @ mu0, scale=np.sqrt(a @ shape @ a))
        assert stats.kstest(x @ a, dist.cdf).pvalue > KS_ALPHA


def test_default_nu0_class_covariance_law():
    """The default nu0 = 4 (D = 2) class covariances have diagonal InvGamma marginals."""
    data = synthetic.make_dataset(_key(10), num_classes=5_000, num_train_per_class=1,
                                  num_test_per_class=1, num_ood=1)
    covs = np.asarray(data.covariances, np.float64)
    nu0, d = 4.0, 2
    marginal = stats.invgamma(a=(nu0 - d + 1) / 2, scale=(nu0 - d - 1) / 2)
    for i in range(d):
        assert stats.kstest(covs[:, i, i], marginal.cdf).pvalue > KS_ALPHA


# ---------------------------------------------------------------------------------
# Argument validation.


@pytest.mark.parametrize("kwargs,match", [
    (dict(nu0=3.0), "nu0"),
    (dict(nu0=2.5), "nu0"),
    (dict(dim=3, nu0=4.0), "nu0"),
    (dict(kappa0=0.0), "kappa0"),
    (dict(kappa0=-1.0), "kappa0"),
    (dict(num_classes=0), "num_classes"),
    (dict(num_classes=2.0), "num_classes"),
    (dict(dim=0), "dim"),
    (dict(num_train_per_class=0), "num_train_per_class"),
    (dict(num_test_per_class=-1), "num_test_per_class"),
    (dict(num_ood=0), "num_ood"),
    (dict(mu0=np.zeros(3)), "mu0"),
    (dict(sigma0=np.eye(3)), "sigma0"),
])
def test_make_dataset_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        synthetic.make_dataset(_key(0), **kwargs)


def test_samplers_reject_bad_arguments():
    with pytest.raises(ValueError, match="df"):
        synthetic.sample_inverse_wishart(_key(0), 1.5, np.eye(3), 2)
    with pytest.raises(ValueError, match="df"):
        synthetic.sample_wishart(_key(0), 2.0, np.eye(3), 2)
    with pytest.raises(ValueError, match="scale"):
        synthetic.sample_wishart(_key(0), 5.0, np.ones((2, 3)), 2)
    with pytest.raises(ValueError, match="nu0"):
        synthetic.sample_niw(_key(0), 2, np.zeros(2), np.eye(2), 3.0, 1.0)
    with pytest.raises(ValueError, match="kappa0"):
        synthetic.sample_niw(_key(0), 2, np.zeros(2), np.eye(2), 5.0, 0.0)
    with pytest.raises(ValueError, match="num_clusters"):
        synthetic.sample_niw(_key(0), 0, np.zeros(2), np.eye(2), 5.0, 1.0)
