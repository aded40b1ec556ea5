"""Float64 checks of the low-rank-plus-shared DPMM (``models.lowrank``) against oracles.

The oracle builds each class's predictive covariance densely in numpy from the paper's
NIW posterior (scatter, mean-shrinkage term, Sigma0-whitening, eigenvalues above the
Marchenko-Pastur edge, at most ``max_rank``) and scores it with
``scipy.stats.multivariate_t``: nothing of the library's Woodbury scoring is reused.
"""
import functools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scipy.stats  # noqa: E402

from dpmm_jax import stats as stats_lib  # noqa: E402
from dpmm_jax.models import full, lowrank  # noqa: E402

K, D, N_K = 5, 12, 9    # N_k < D: the regime the model is for


@functools.lru_cache(maxsize=None)
def _problem():
  """Classes with one or two planted directions of large variance, plus test points."""
  rng = np.random.default_rng(0)
  xs, ys = [], []
  for k in range(K):
    spikes = rng.normal(size=(D, 1 + k % 2)) * np.array([6.0, 3.0][:1 + k % 2])
    cov = np.eye(D) + spikes @ spikes.T
    xs.append(rng.multivariate_normal(rng.normal(size=D) * 2.0, cov, size=N_K))
    ys.append(np.full(N_K, k))
  x, y = np.concatenate(xs), np.concatenate(ys)
  stats = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), K, full=True)
  test = np.concatenate([x[::3] + rng.normal(size=x[::3].shape) * 0.5,
                         rng.normal(size=(10, D)) * 6.0])
  return stats, test


def _oracle(hyper, stats, x, max_rank, edge_scale):
  """(class (M, K), prior (M,)) log densities from dense covariances and scipy."""
  mu0, sigma0 = np.asarray(hyper.loc), np.asarray(hyper.mean_cov)
  nu0, kappa0 = float(hyper.df), float(hyper.mean_concentration)
  a = nu0 - D - 1
  chol0 = np.linalg.cholesky(sigma0)
  out = []
  for k in range(K):
    n, mean = float(stats.count[k]), np.asarray(stats.mean[k])
    d = mean - mu0
    evidence = np.asarray(stats.scatter[k]) + kappa0 * n / (kappa0 + n) * np.outer(d, d)
    white = np.linalg.solve(chol0, np.linalg.solve(chol0, evidence).T)
    w, v = np.linalg.eigh(0.5 * (white + white.T))
    order = np.argsort(w)[::-1][:max_rank]
    edge = edge_scale * (np.sqrt(n - 1) + np.sqrt(D)) ** 2
    w, v = w[order], v[:, order]
    keep = w > max(edge, 0.0)
    low = (v[:, keep] * w[keep]) @ v[:, keep].T
    kappa, dof = kappa0 + n, nu0 + n - D + 1
    cov = (kappa + 1) / (kappa * dof) * chol0 @ (a * np.eye(D) + low) @ chol0.T
    loc = (kappa0 * mu0 + n * mean) / kappa
    out.append(scipy.stats.multivariate_t(loc, cov, df=dof).logpdf(x))
  dof0 = nu0 - D + 1
  prior = scipy.stats.multivariate_t(mu0, (kappa0 + 1) / (kappa0 * dof0) * a * sigma0,
                                     df=dof0).logpdf(x)
  return np.stack(out, -1), prior


@pytest.mark.parametrize("max_rank,edge_scale", [(32, 1.0), (1, 1.0), (0, 1.0), (3, 0.0),
                                                  (2, 0.05)])
def test_log_predictive_matches_dense_scipy_oracle(max_rank, edge_scale):
  stats, x = _problem()
  hyper, _ = full.fit_hyper(stats)
  params = lowrank.params_from_hyper(hyper, stats, max_rank, edge_scale)
  class_lp, prior_lp = lowrank.log_predictive(params, jnp.asarray(x))
  want_class, want_prior = _oracle(hyper, stats, x, max_rank, edge_scale)
  np.testing.assert_allclose(np.asarray(class_lp), want_class, rtol=1e-10, atol=1e-8)
  np.testing.assert_allclose(np.asarray(prior_lp), want_prior, rtol=1e-10, atol=1e-8)


def test_planted_directions_are_kept_and_noise_is_not():
  stats, _ = _problem()
  hyper, _ = full.fit_hyper(stats)
  spikes = np.asarray(lowrank.params_from_hyper(hyper, stats).num_spikes)
  # One or two planted directions per class (k % 2 + 1); noise adds none at N_k = 9.
  np.testing.assert_array_equal(spikes, [1 + k % 2 for k in range(K)])


def test_without_edge_and_cap_it_is_the_full_model():
  """edge_scale = 0 and max_rank = D keep all of B_k: the full model's predictive."""
  stats, x = _problem()
  hyper, _ = full.fit_hyper(stats)
  got = lowrank.log_predictive(lowrank.params_from_hyper(hyper, stats, D, 0.0),
                               jnp.asarray(x))
  want = full.log_predictive(full.params_from_hyper(hyper, stats), jnp.asarray(x))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-10, atol=1e-8)


def test_fit_uses_the_full_models_em():
  stats, _ = _problem()
  params, info = lowrank.fit(stats)
  hyper, want_info = full.fit_hyper(stats)
  for got, want in zip(params.hyper, hyper):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12)
  assert int(info.num_iters) == int(want_info.num_iters) and bool(info.converged)
