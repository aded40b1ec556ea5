"""Mean-field building blocks shared by the variational modules (float64, tight checks).

Expected log likelihoods and KL divergences against Monte Carlo with scipy samplers,
closed forms against scipy where scipy has them, and soft statistics against a direct
numpy computation.
"""
import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy import stats as sps  # noqa: E402

from dpmm_jax import stats  # noqa: E402
from dpmm_jax.conjugate import dirichlet, gamma, niw, nix  # noqa: E402


def _random_niw(rng, k, d, df_extra=3.0):
  a = rng.normal(size=(k, d, d))
  scale = a @ np.swapaxes(a, 1, 2) + d * np.eye(d)
  return niw.NIW(jnp.asarray(rng.normal(size=(k, d))), jnp.asarray(rng.uniform(0.5, 3.0, k)),
                 jnp.asarray(d + df_extra + rng.uniform(0, 5, k)), jnp.asarray(scale))


def _sample_niw(rng, q, k, n):
  """n draws (mu, Sigma) from class k of NIW q."""
  sigmas = sps.invwishart(df=float(q.df[k]), scale=np.asarray(q.scale[k])).rvs(n, random_state=rng)
  mus = np.stack([rng.multivariate_normal(np.asarray(q.loc[k]), s / float(q.mean_concentration[k]))
                  for s in sigmas])
  return mus, sigmas


def _log_niw(mu, sigma, p, k):
  return (sps.invwishart(df=float(p.df[k]), scale=np.asarray(p.scale[k])).logpdf(sigma)
          + sps.multivariate_normal(np.asarray(p.loc[k]),
                                    sigma / float(p.mean_concentration[k])).logpdf(mu))


def test_niw_expected_log_likelihood_matches_monte_carlo():
  rng = np.random.default_rng(0)
  q = _random_niw(rng, 2, 3)
  x = rng.normal(size=(4, 3))
  got = np.asarray(niw.expected_log_likelihood(q, jnp.asarray(x)))
  assert got.shape == (4, 2)
  for k in range(2):
    mus, sigmas = _sample_niw(rng, q, k, 2000)
    vals = np.stack([sps.multivariate_normal(m, s).logpdf(x) for m, s in zip(mus, sigmas)])
    mc, se = vals.mean(0), vals.std(0) / np.sqrt(len(vals))
    np.testing.assert_array_less(np.abs(got[:, k] - mc), 5 * se + 1e-9)


def test_niw_kl_matches_monte_carlo_and_vanishes_at_equality():
  rng = np.random.default_rng(1)
  q, p = _random_niw(rng, 2, 3), _random_niw(rng, 2, 3)
  got = np.asarray(niw.kl_divergence(q, p))
  for k in range(1):
    mus, sigmas = _sample_niw(rng, q, k, 1500)
    vals = np.array([_log_niw(m, s, q, k) - _log_niw(m, s, p, k) for m, s in zip(mus, sigmas)])
    assert abs(got[k] - vals.mean()) < 5 * vals.std() / np.sqrt(len(vals))
  np.testing.assert_allclose(niw.kl_divergence(q, q), 0.0, atol=1e-10)
  assert np.all(got > 0)


def _random_nix(rng, k, d):
  return nix.NIX(jnp.asarray(rng.normal(size=(k, d))), jnp.asarray(rng.uniform(0.5, 3, (k, d))),
                 jnp.asarray(rng.uniform(2, 8, (k, d))), jnp.asarray(rng.uniform(0.3, 2, (k, d))))


def test_nix_expected_log_likelihood_matches_monte_carlo():
  rng = np.random.default_rng(2)
  q = _random_nix(rng, 2, 3)
  x = rng.normal(size=(5, 3))
  got = np.asarray(nix.expected_log_likelihood(q, jnp.asarray(x)))
  n = 20000
  for k in range(2):
    df, s2 = np.asarray(q.df[k]), np.asarray(q.scale_sq[k])
    var = sps.invgamma(df / 2, scale=df * s2 / 2).rvs((n, 3), random_state=rng)
    mu = np.asarray(q.loc[k]) + rng.normal(size=(n, 3)) * np.sqrt(var / np.asarray(q.mean_concentration[k]))
    vals = np.sum(sps.norm.logpdf(x[None], mu[:, None], np.sqrt(var)[:, None]), -1)   # (n, M)
    mc, se = vals.mean(0), vals.std(0) / np.sqrt(n)
    np.testing.assert_array_less(np.abs(got[:, k] - mc), 5 * se)


def test_nix_kl_matches_monte_carlo():
  rng = np.random.default_rng(3)
  q, p = _random_nix(rng, 1, 2), _random_nix(rng, 1, 2)
  got = np.asarray(nix.kl_divergence(q, p))[0]
  n = 40000
  for d in range(2):
    def logpdf(dist, mu, var):
      df, s2 = float(dist.df[0, d]), float(dist.scale_sq[0, d])
      return (sps.invgamma(df / 2, scale=df * s2 / 2).logpdf(var)
              + sps.norm.logpdf(mu, float(dist.loc[0, d]),
                                np.sqrt(var / float(dist.mean_concentration[0, d]))))
    df, s2 = float(q.df[0, d]), float(q.scale_sq[0, d])
    var = sps.invgamma(df / 2, scale=df * s2 / 2).rvs(n, random_state=rng)
    mu = float(q.loc[0, d]) + rng.normal(size=n) * np.sqrt(var / float(q.mean_concentration[0, d]))
    vals = logpdf(q, mu, var) - logpdf(p, mu, var)
    assert abs(got[d] - vals.mean()) < 5 * vals.std() / np.sqrt(n)


def test_gamma_pieces_against_scipy():
  rng = np.random.default_rng(4)
  a, b = rng.uniform(0.5, 5, 3), rng.uniform(0.5, 5, 3)
  a2, b2 = rng.uniform(0.5, 5, 3), rng.uniform(0.5, 5, 3)
  x = rng.uniform(0.1, 3, 3)
  np.testing.assert_allclose(gamma.log_density(x, a, b), sps.gamma(a, scale=1 / b).logpdf(x), rtol=1e-12)
  np.testing.assert_allclose(gamma.entropy(a, b), sps.gamma(a, scale=1 / b).entropy(), rtol=1e-12)
  np.testing.assert_allclose(gamma.mean(a, b), a / b)
  draws = sps.gamma(a, scale=1 / b).rvs((200000, 3), random_state=rng)
  np.testing.assert_allclose(gamma.expected_log(a, b), np.log(draws).mean(0), atol=0.01)
  kl_mc = (sps.gamma(a, scale=1 / b).logpdf(draws) - sps.gamma(a2, scale=1 / b2).logpdf(draws))
  np.testing.assert_array_less(np.abs(gamma.kl_divergence(a, b, a2, b2) - kl_mc.mean(0)),
                               5 * kl_mc.std(0) / np.sqrt(len(draws)))


def test_dirichlet_pieces_against_scipy():
  rng = np.random.default_rng(5)
  q, p = rng.uniform(0.3, 4, 4), rng.uniform(0.3, 4, 4)
  pi = rng.dirichlet(np.ones(4))
  np.testing.assert_allclose(dirichlet.log_density(pi, q), sps.dirichlet(q).logpdf(pi), rtol=1e-12)
  draws = rng.dirichlet(q, 200000)
  np.testing.assert_allclose(dirichlet.expected_log(q), np.log(draws).mean(0), atol=0.01)
  kl_mc = sps.dirichlet(q).logpdf(draws.T) - sps.dirichlet(p).logpdf(draws.T)
  assert abs(dirichlet.kl_divergence(q, p) - kl_mc.mean()) < 5 * kl_mc.std() / np.sqrt(len(draws))
  np.testing.assert_allclose(dirichlet.beta_kl_divergence(q[:2], p[:2], q[:2], p[:2]), 0.0, atol=1e-12)


def test_stick_breaking_expected_log_weights_monte_carlo():
  rng = np.random.default_rng(6)
  a, b = rng.uniform(0.5, 3, 4), rng.uniform(0.5, 3, 4)      # T = 5
  v = rng.beta(a, b, size=(200000, 4))
  v = np.concatenate([v, np.ones((len(v), 1))], 1)
  omega = v * np.concatenate([np.ones((len(v), 1)), np.cumprod(1 - v[:, :-1], 1)], 1)
  np.testing.assert_allclose(omega.sum(1), 1.0, rtol=1e-12)
  got = dirichlet.stick_breaking_expected_log_weights(jnp.asarray(a), jnp.asarray(b))
  assert got.shape == (5,)
  np.testing.assert_allclose(got, np.log(omega).mean(0), atol=0.02)


@pytest.mark.parametrize("full", [True, False])
def test_soft_statistics_match_numpy_and_hard_labels(full):
  rng = np.random.default_rng(7)
  x = rng.normal(size=(50, 3)) * 2 + 1e3         # offset: the centred form must stay exact
  r = rng.dirichlet(np.ones(4), 50)
  r[:, 3] = 0.0                                    # an empty component
  got = stats.from_responsibilities(jnp.asarray(x), jnp.asarray(r), full=full)
  n = r.sum(0)
  np.testing.assert_allclose(got.count, n, rtol=1e-12)
  for k in range(3):
    m = (r[:, k:k + 1] * x).sum(0) / n[k]
    np.testing.assert_allclose(got.mean[k], m, rtol=1e-12)
    d = x - m
    s = (r[:, k:k + 1] * d).T @ d
    np.testing.assert_allclose(got.sq_dev[k], np.diag(s), rtol=1e-10)
    if full:
      np.testing.assert_allclose(got.scatter[k], s, rtol=1e-10, atol=1e-10)
  np.testing.assert_allclose(got.sq_dev[3], 0.0)
  y = rng.integers(0, 3, 50)
  soft = stats.from_responsibilities(jnp.asarray(x), jax.nn.one_hot(y, 3), full=True)
  hard = stats.from_labels(jnp.asarray(x), jnp.asarray(y), 3, full=True)
  for a, b in zip(soft, hard):
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
