"""Model densities against scipy, the models' limits, and the Mahalanobis baselines.

Float32 tolerances: the log densities compared here are O(10) nats, built from O(D^2)
products of O(1)-O(100) numbers; float32 round-off is then ~1e-5 relative per operation
and a few 1e-4 absolute in the result. We use atol = 2e-3 nats (probability ratios
within 0.2%): any formula slip (wrong degrees of freedom, a missing (kappa+1)/kappa
factor, Psi instead of Psi/(nu-D+1)) moves these log densities by >= 0.05 nats.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import dpmm_jax
from dpmm_jax import metrics
from dpmm_jax import preprocess
from dpmm_jax import scores as scores_lib
from dpmm_jax import stats as stats_lib
from dpmm_jax import synthetic
from dpmm_jax.models import coupled, diag, full, mahalanobis, tied

ATOL = 2e-3
# Jitted: called eagerly, these run op by op and compile every operation on first use.
_FULL_PARAMS = jax.jit(full.params_from_hyper)
_DIAG_PARAMS = jax.jit(diag.params_from_hyper)
_LOG_PREDICTIVE = {full: jax.jit(full.log_predictive), diag: jax.jit(diag.log_predictive)}
K, D = 5, 3


def _spearman(a, b):
  return scipy.stats.spearmanr(np.asarray(a, np.float64), np.asarray(b, np.float64))[0]


@functools.lru_cache(maxsize=None)
def _data(seed=0, num_classes=K, dim=D, n_per_class=15):
  """Classes with different sizes, covariances and offsets; test points in and out."""
  rng = np.random.default_rng(seed)
  counts = n_per_class + np.arange(num_classes) * 3
  y = np.repeat(np.arange(num_classes), counts).astype(np.int32)
  mix = rng.normal(size=(num_classes, dim, dim)) * 0.5 + np.eye(dim)
  centres = 4.0 * rng.normal(size=(num_classes, dim)) + 1.0
  x = centres[y] + np.einsum("nd,nde->ne", rng.normal(size=(len(y), dim)), mix[y])
  x_test = np.concatenate([centres[np.arange(20) % num_classes]
                           + rng.normal(size=(20, dim)),
                           10.0 * rng.normal(size=(10, dim))])
  return x.astype(np.float32), y, x_test.astype(np.float32)


def _np_class_stats(x, y, num_classes):
  x = np.asarray(x, np.float64)
  n = np.array([np.sum(y == k) for k in range(num_classes)], np.float64)
  mean = np.stack([x[y == k].mean(0) for k in range(num_classes)])
  scatter = np.stack([(x[y == k] - mean[k]).T @ (x[y == k] - mean[k])
                      for k in range(num_classes)])
  return n, mean, scatter


# --------------------------------------------------------------------------- tied
def _np_tied_sigma0(prior_scale, x64, n, mean, sigma):
  """Sigma0 of the tied model: the total covariance (paper) or the empirical-Bayes
  between-class scatter less (K/N) Sigma, clipped at 0 in the Sigma-whitened basis (and
  floored at 100 eps32 of its largest eigenvalue, as the library does)."""
  if prior_scale == "total":
    return np.cov(x64.T, bias=True)
  mu0 = x64.mean(0)
  between = ((mean - mu0) * (n / n.sum())[:, None]).T @ (mean - mu0)
  chol = np.linalg.cholesky(sigma)
  b = np.linalg.solve(chol, np.linalg.solve(chol, between).T).T
  lam, vec = np.linalg.eigh(0.5 * (b + b.T))
  lam = np.maximum(lam - len(n) / n.sum(), 0.0)
  lam = np.maximum(lam, 100 * np.finfo(np.float32).eps * lam.max())
  return chol @ (vec * lam) @ vec.T @ chol.T


@pytest.mark.parametrize("prior_scale", ["empirical_bayes", "total"])
def test_tied_log_predictive_is_eq2(prior_scale):
  x, y, xt = _data()
  p = tied.fit(stats_lib.from_labels(x, y, K, full=False), prior_scale=prior_scale)
  class_lp, prior_lp = tied.log_predictive(p, xt)
  n, mean, scatter = _np_class_stats(x, y, K)
  x64 = x.astype(np.float64)
  mu0 = x64.mean(0)
  sigma = scatter.sum(0) / len(x)              # pooled within-class covariance
  sigma0 = _np_tied_sigma0(prior_scale, x64, n, mean, sigma)
  for k in range(K):
    post_cov = np.linalg.inv(np.linalg.inv(sigma0) + n[k] * np.linalg.inv(sigma))
    post_mean = post_cov @ (np.linalg.solve(sigma0, mu0) + n[k] * np.linalg.solve(sigma, mean[k]))
    ref = scipy.stats.multivariate_normal(post_mean, post_cov + sigma).logpdf(xt)
    np.testing.assert_allclose(class_lp[:, k], ref, atol=ATOL, rtol=1e-4)
  ref0 = scipy.stats.multivariate_normal(mu0, sigma0 + sigma).logpdf(xt)
  np.testing.assert_allclose(prior_lp, ref0, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("preprocess_features,prior_scale",
                         [(False, "empirical_bayes"), (True, "empirical_bayes"),
                          (True, "total")])
def test_outlier_probability_is_eq1(preprocess_features, prior_scale):
  """p(y = K+1 | x) = alpha p(x) / (sum_k N_k p(x | D_k) + alpha p(x)) for the tied
  model, computed from scipy densities in the raw feature space. With preprocessing the
  densities change by the same Jacobian, which cancels in the ratio (and both Sigma0
  choices are equivariant under the invertible affine preprocessing)."""
  x, y, xt = _data(seed=1)
  det = dpmm_jax.fit_detector(x, y, "tied", preprocess=preprocess_features,
                              prior_scale=prior_scale)
  n, mean, scatter = _np_class_stats(x, y, K)
  x64 = x.astype(np.float64)
  mu0, sigma = x64.mean(0), scatter.sum(0) / len(x)
  sigma0 = _np_tied_sigma0(prior_scale, x64, n, mean, sigma)
  log_terms = []
  for k in range(K):
    post_cov = np.linalg.inv(np.linalg.inv(sigma0) + n[k] * np.linalg.inv(sigma))
    post_mean = post_cov @ (np.linalg.solve(sigma0, mu0) + n[k] * np.linalg.solve(sigma, mean[k]))
    log_terms.append(np.log(n[k])
                     + scipy.stats.multivariate_normal(post_mean, post_cov + sigma).logpdf(xt))
  log_inlier = scipy.special.logsumexp(np.stack(log_terms, -1), axis=-1)
  log_prior = scipy.stats.multivariate_normal(mu0, sigma0 + sigma).logpdf(xt)
  np.testing.assert_allclose(dpmm_jax.score(det, xt), log_inlier - log_prior, atol=5e-3,
                             rtol=1e-4)
  probs = []
  for alpha in (0.1, 1.0, 30.0):
    ref = np.exp(np.log(alpha) + log_prior
                 - np.logaddexp(log_inlier, np.log(alpha) + log_prior))
    got = np.asarray(dpmm_jax.outlier_probability(det, xt, alpha=alpha))
    np.testing.assert_allclose(got, ref, atol=2e-3)
    probs.append(got)
  assert np.all(probs[0] <= probs[1] + 1e-7) and np.all(probs[1] <= probs[2] + 1e-7)
  assert np.ptp(probs[1]) > 0.5      # the test set holds clear inliers and outliers


def test_an_infinite_prior_density_is_a_certain_new_class():
  """A +inf prior density (the coupled model on its prior mean) gives the new class
  probability 1 and a -inf score, not NaN; other rows are the plain softmax."""
  log_counts = jnp.log(jnp.array([3.0, 5.0]))
  class_lp = jnp.array([[-1.0, -2.0], [-1.0, -2.0]])
  prior_lp = jnp.array([-3.0, jnp.inf])
  probs = np.asarray(scores_lib.label_probabilities(log_counts, class_lp, prior_lp, 2.0))
  np.testing.assert_array_equal(probs[1], [0.0, 0.0, 1.0])
  logits = np.array([np.log(3.0) - 1.0, np.log(5.0) - 2.0, np.log(2.0) - 3.0])
  np.testing.assert_allclose(probs[0], np.exp(logits) / np.exp(logits).sum(), rtol=1e-6)
  s = np.asarray(scores_lib.dpmm_score(log_counts, class_lp, prior_lp))
  assert s[1] == -np.inf and np.isfinite(s[0])
  assert float(scores_lib.outlier_probability(s, 2.0)[1]) == 1.0


def test_label_probabilities_last_column_is_outlier_probability():
  x, y, xt = _data()
  p = tied.fit(stats_lib.from_labels(x, y, K, full=False))
  class_lp, prior_lp = tied.log_predictive(p, xt)
  probs = scores_lib.label_probabilities(p.log_counts, class_lp, prior_lp, 2.0)
  np.testing.assert_allclose(np.sum(probs, -1), 1.0, atol=1e-5)
  s = scores_lib.dpmm_score(p.log_counts, class_lp, prior_lp)
  np.testing.assert_allclose(probs[:, -1], scores_lib.outlier_probability(s, 2.0),
                             atol=1e-5)
  # (Far outliers' class probabilities underflow to 0; compare on the inliers.)
  np.testing.assert_array_equal(scores_lib.predict(p.log_counts, class_lp)[:20],
                                np.argmax(np.asarray(probs[:20, :-1]), -1))


# --------------------------------------------------------------- full and diagonal
def _full_hyper(st, df, kappa0):
  return full.Hyper(stats_lib.global_mean(st), stats_lib.pooled_covariance(st),
                    jnp.asarray(df, jnp.float32), jnp.asarray(kappa0, jnp.float32))


@pytest.mark.parametrize("df_excess,kappa0", [(0.5, 0.05), (20.0, 2.0), (1e6, 0.05)])
def test_full_log_predictive_is_scipy_multivariate_t(df_excess, kappa0):
  x, y, xt = _data(seed=2)
  st = stats_lib.from_labels(x, y, K)
  df0 = D + 1 + df_excess
  p = _FULL_PARAMS(_full_hyper(st, df0, kappa0), st)
  class_lp, prior_lp = _LOG_PREDICTIVE[full](p, xt)
  n, mean, scatter = _np_class_stats(x, y, K)
  x64 = x.astype(np.float64)
  mu0, sigma0 = x64.mean(0), scatter.sum(0) / len(x)
  psi0 = (df0 - D - 1) * sigma0
  for k in range(K):
    kap, nu = kappa0 + n[k], df0 + n[k]
    loc = (kappa0 * mu0 + n[k] * mean[k]) / kap
    d = mean[k] - mu0
    psi = psi0 + scatter[k] + kappa0 * n[k] / kap * np.outer(d, d)
    dof = nu - D + 1
    ref = scipy.stats.multivariate_t(loc, (kap + 1) / (kap * dof) * psi, df=dof).logpdf(xt)
    np.testing.assert_allclose(class_lp[:, k], ref, atol=ATOL, rtol=1e-4)
  dof0 = df0 - D + 1
  ref0 = scipy.stats.multivariate_t(mu0, (kappa0 + 1) / (kappa0 * dof0) * psi0,
                                    df=dof0).logpdf(xt)
  np.testing.assert_allclose(prior_lp, ref0, atol=ATOL, rtol=1e-4)


def _diag_hyper(st, df, kappa0):
  dim = st.dim
  return diag.Hyper(stats_lib.global_mean(st), stats_lib.pooled_variance(st),
                    jnp.broadcast_to(jnp.asarray(df, jnp.float32), (dim,)),
                    jnp.broadcast_to(jnp.asarray(kappa0, jnp.float32), (dim,)))


def _scipy_diag_predictive(x, y, xt, df0, kappa0):
  """(class (M, K), prior (M,)) products of scipy.stats.t predictives, NIX in float64."""
  num_classes = int(y.max()) + 1
  n, mean, scatter = _np_class_stats(x, y, num_classes)
  x64 = x.astype(np.float64)
  mu0 = x64.mean(0)
  s0 = np.diag(scatter.sum(0)) / len(x)
  class_lp = []
  for k in range(num_classes):
    kap, nu = kappa0 + n[k], df0 + n[k]
    loc = (kappa0 * mu0 + n[k] * mean[k]) / kap
    s2 = (df0 * s0 + np.diag(scatter[k]) + kappa0 * n[k] / kap * (mean[k] - mu0) ** 2) / nu
    class_lp.append(scipy.stats.t(nu, loc, np.sqrt((kap + 1) / kap * s2)).logpdf(xt).sum(-1))
  prior_lp = scipy.stats.t(df0, mu0, np.sqrt((kappa0 + 1) / kappa0 * s0)).logpdf(xt).sum(-1)
  return np.stack(class_lp, -1), prior_lp


# nu0 = 1e6 is the default cap, where EM puts nu0 when covariances are tied. In float32
# a naive lgamma((nu+1)/2) - lgamma(nu/2) is off by ~0.06 nats per dimension there
# (student_t.t_log_normalizer avoids it).
_DIAG_DF = [pytest.param(np.array([0.7, 3.0, 40.0]), id="moderate_df"),
            pytest.param(np.array([1e6, 1e6, 3.0]), id="df_at_cap")]


@pytest.mark.parametrize("df0", _DIAG_DF)
def test_diag_log_predictive_is_scipy_product_of_t(df0):
  x, y, xt = _data(seed=3)
  st = stats_lib.from_labels(x, y, K, full=False)
  kappa0 = np.array([0.01, 0.3, 5.0])
  class_lp, prior_lp = _LOG_PREDICTIVE[diag](
      _DIAG_PARAMS(_diag_hyper(st, df0, kappa0), st), xt)
  ref_class, ref_prior = _scipy_diag_predictive(x, y, xt, df0, kappa0)
  np.testing.assert_allclose(class_lp, ref_class, atol=ATOL, rtol=1e-4)
  np.testing.assert_allclose(prior_lp, ref_prior, atol=ATOL, rtol=1e-4)


@jax.jit
def _coupled_log_predictive(hyper, st, x):
  return coupled.log_predictive(coupled.params_from_hyper(hyper, st), x)


@pytest.mark.parametrize("df0", _DIAG_DF)
def test_coupled_with_concentrated_gamma_is_the_diag_model(df0):
  """gamma_k ~ Gamma(a, a) has sd 1/sqrt(a); at a = 1e6 (sd 1e-3) the coupled model's
  scale mixture differs from the diagonal model by O(1/a) nats ~ 1e-5 per point, below
  float32 noise; at a = 3 it differs by O(0.1) nats (checked for teeth)."""
  x, y, xt = _data(seed=4)
  st = stats_lib.from_labels(x, y, K, full=False)
  kappa0 = np.array([0.05, 0.1, 1.0])
  h = _diag_hyper(st, df0, kappa0)
  ref_class, ref_prior = _scipy_diag_predictive(x, y, xt, df0, kappa0)

  def coupled_lp(shape):
    return _coupled_log_predictive(coupled.Hyper(*h, jnp.asarray(shape, jnp.float32)), st,
                                   xt)

  c_class, c_prior = coupled_lp(1e6)
  np.testing.assert_allclose(c_class, ref_class, atol=ATOL, rtol=1e-4)
  np.testing.assert_allclose(c_prior, ref_prior, atol=ATOL, rtol=1e-4)
  loose_class, loose_prior = coupled_lp(3.0)
  assert np.max(np.abs(np.asarray(loose_prior) - ref_prior)) > 0.05


# ------------------------------------------------------------------- nu0 -> infinity
def _tied_shaped_data(seed=0, num_classes=8, dim=3, n_per_class=40, spread=4.0):
  """Unequal class covariances, but class means whose empirical between-class covariance
  is exactly spread^2 x the pooled within-class covariance. Then the total covariance is
  (1 + spread^2) x pooled and with kappa0 = 1 / (1 + spread^2) the NIW model's mean prior
  Sigma0 / kappa0 equals the tied model's (total covariance): as nu0 -> infinity the
  full model becomes the tied model exactly."""
  rng = np.random.default_rng(seed)
  y = np.repeat(np.arange(num_classes), n_per_class)
  mix = rng.normal(size=(num_classes, dim, dim)) * 0.6 + np.eye(dim)
  resid = np.einsum("nd,nde->ne", rng.normal(size=(len(y), dim)), mix[y])
  for k in range(num_classes):
    resid[y == k] -= resid[y == k].mean(0)
  pooled = resid.T @ resid / len(y)
  z = rng.normal(size=(num_classes, dim))
  z -= z.mean(0)
  z = z @ np.linalg.inv(np.linalg.cholesky(z.T @ z / num_classes)).T
  means = spread * z @ np.linalg.cholesky(pooled).T + 3.0
  x = means[y] + resid
  x_test = np.concatenate([means[np.arange(40) % num_classes]
                           + np.einsum("nd,nde->ne", rng.normal(size=(40, dim)),
                                       mix[np.arange(40) % num_classes]),
                           3.0 + spread * rng.normal(size=(40, dim))
                           @ np.linalg.cholesky(pooled).T])
  return x.astype(np.float32), y.astype(np.int32), x_test.astype(np.float32), spread


def _gaps_to_tied(model, params_at, tied_params, x_test, inliers):
  """Distance of ``model`` to the tied model at nu0 = 30, 1e3, 1e6 (1e6: the default cap).

  params_at: nu0 -> the model's Params. Returns (gaps, rhos): per nu0, the largest
  |score - tied score| and |prior predictive - tied prior predictive| over the
  ``inliers`` rows of x_test (nats), and the Spearman correlation of all the scores.
  """
  t_class, t_prior = tied.log_predictive(tied_params, x_test)
  t_score = scores_lib.dpmm_score(tied_params.log_counts, t_class, t_prior)
  gaps, rhos = [], []
  for df in (30.0, 1e3, 1e6):
    p = params_at(df)
    m_class, m_prior = _LOG_PREDICTIVE[model](p, x_test)
    m_score = scores_lib.dpmm_score(p.log_counts, m_class, m_prior)
    gaps.append(max(np.max(np.abs(np.asarray(m_score - t_score)[inliers])),
                    np.max(np.abs(np.asarray(m_prior - t_prior)[inliers]))))
    rhos.append(_spearman(m_score, t_score))
  return gaps, rhos


def test_full_model_tends_to_tied_model_as_nu0_grows():
  x, y, xt, spread = _tied_shaped_data()
  num_classes = int(y.max()) + 1
  st = stats_lib.from_labels(x, y, num_classes)
  tp = tied.fit(st, prior_scale="total")   # the hierarchical models' limit: Sigma0/kappa0 = total
  kappa0 = 1.0 / (1.0 + spread ** 2)
  gaps, rhos = _gaps_to_tied(
      full, lambda df: _FULL_PARAMS(_full_hyper(st, df, kappa0), st), tp, xt,
      inliers=slice(0, 40))
  # Student-t -> Gaussian: log St - log N ~ (maha^2 - 2 (D + 2) maha + D (D + 2)) / (4 nu)
  # shrinks like 1/nu0. For an inlier the score is dominated by its own class and the
  # prior predictive, both at moderate maha (<~ 30); far-away classes (maha ~ 1e3) differ
  # by much more but carry no weight. float64 gives gaps 2.7, 0.25, 2.6e-4 nats; float32
  # matches (a naive lgamma difference in the Student-t normaliser would add ~0.1 nats
  # at nu0 = 1e6).
  assert gaps[1] < 0.2 * gaps[0] and gaps[2] < 0.01 * gaps[1], gaps
  assert gaps[-1] < 1e-3 and gaps[0] > 1.0, gaps
  assert np.all(np.diff(rhos) >= -1e-4) and rhos[-1] > 0.999, rhos


def test_diag_model_tends_to_tied_model_in_preprocessed_space():
  """After the section-8 transform the total covariance is I and the pooled one diagonal
  (s0^2), so with kappa0_d = s0_d^2 the diagonal model's mean prior s0^2 / kappa0 = I is
  the tied model's, and nu0 -> infinity recovers the tied model exactly."""
  x, y, xt = _data(seed=5, n_per_class=30)
  raw = stats_lib.from_labels(x, y, K, full=False)
  t = preprocess.fit(raw)
  z, zt = preprocess.apply(t, x), preprocess.apply(t, xt)
  st = stats_lib.from_labels(z, y, K, full=False)
  tp = tied.fit(st, prior_scale="total")   # the hierarchical models' limit: Sigma0/kappa0 = total
  s0 = stats_lib.pooled_variance(st)
  gaps, rhos = _gaps_to_tied(
      diag, lambda df: _DIAG_PARAMS(
          _diag_hyper(st, df, 1.0)._replace(mean_concentration=s0), st), tp, zt,
      inliers=slice(0, 20))
  # The gap shrinks like 1/nu0 (float64: 3.7, 0.31, 3.4e-4 nats).
  assert gaps[1] < 0.2 * gaps[0] and gaps[2] < 0.01 * gaps[1], gaps
  assert gaps[-1] < 1e-3 and gaps[0] > 1.0, gaps
  assert np.all(np.diff(rhos) >= -1e-4) and rhos[-1] > 0.999, rhos


def test_full_ranking_approaches_tied_ranking_on_generic_data():
  """Generic (section 6.1) data with unequal covariances: the structural difference in
  the mean priors remains, but the rankings move towards the tied model's with nu0."""
  ds = synthetic.make_dataset(jax.random.PRNGKey(0), num_classes=10, dim=3, nu0=5.0,
                              kappa0=0.01, num_train_per_class=100)
  xt = np.concatenate([ds.x_test, ds.x_ood])
  st = stats_lib.from_labels(ds.x_train, ds.y_train, 10)
  tp = tied.fit(st, prior_scale="total")   # the hierarchical models' limit: Sigma0/kappa0 = total
  t_score = scores_lib.dpmm_score(tp.log_counts, *tied.log_predictive(tp, xt))
  hyper, _ = full.fit_hyper(st)
  rhos = []
  for df in (D + 2.0, 100.0, 1e6):
    p = _FULL_PARAMS(hyper._replace(df=jnp.asarray(df, jnp.float32)), st)
    rhos.append(_spearman(scores_lib.dpmm_score(p.log_counts, *_LOG_PREDICTIVE[full](p, xt)),
                          t_score))
  assert rhos[0] < rhos[1] < rhos[2], rhos
  assert rhos[2] > 0.95, rhos


def test_tied_dpmm_score_matches_rmds_in_proposition_2_regime():
  """Many points per class (N_k = 2000) and class means spread widely (kappa = ||R|| ~
  1/900): the tied DPMM score is a near-monotone function of RMDS."""
  rng = np.random.default_rng(0)
  num_classes, dim, n = 10, 4, 2000
  a = rng.normal(size=(dim, dim))
  chol = np.linalg.cholesky(a @ a.T / dim + 0.3 * np.eye(dim))
  means = 30.0 * rng.normal(size=(num_classes, dim)) @ chol.T
  y = np.repeat(np.arange(num_classes), n).astype(np.int32)
  x = (means[y] + rng.normal(size=(len(y), dim)) @ chol.T).astype(np.float32)
  y_test = np.arange(300) % num_classes
  x_test = np.concatenate([means[y_test] + rng.normal(size=(300, dim)) @ chol.T,
                           30.0 * rng.normal(size=(300, dim)) @ chol.T
                           + rng.normal(size=(300, dim)) @ chol.T]).astype(np.float32)
  s_tied = dpmm_jax.score(dpmm_jax.fit_detector(x, y, "tied"), x_test)
  s_rmds = dpmm_jax.score(dpmm_jax.fit_detector(x, y, "rmds"), x_test)
  assert _spearman(s_tied, s_rmds) >= 0.99


# --------------------------------------------------------------- Mahalanobis baselines
def test_independent_rmds_with_fewer_points_than_dimensions():
  ds = synthetic.make_dataset(jax.random.PRNGKey(1), num_classes=10, dim=8, nu0=12.0,
                              num_train_per_class=6)   # N_k = 6 <= D = 8
  det = dpmm_jax.fit_detector(np.asarray(ds.x_train), np.asarray(ds.y_train), "indep_rmds")
  s_in, s_out = dpmm_jax.score(det, ds.x_test), dpmm_jax.score(det, ds.x_ood)
  assert np.all(np.isfinite(s_in)) and np.all(np.isfinite(s_out))
  assert metrics.auroc(s_in, s_out) > 0.65
  # Every regularised class covariance is full rank despite N_k < D.
  st = stats_lib.from_labels(det_transform(det, ds.x_train), ds.y_train, 10)
  eig = np.linalg.eigvalsh(np.asarray(mahalanobis.regularised_class_covariances(st),
                                      np.float64))
  assert np.all(eig > 0)


def det_transform(det, x):
  return preprocess.apply(det.transform, jnp.asarray(x))


@pytest.mark.parametrize("model", ["mds", "rmds"])
def test_mahalanobis_scores_survive_a_nearly_degenerate_raw_feature(model):
  """Raw features (no preprocessing) with an extra column = another column + 1e-6 noise,
  all scaled by 1e3: the within-class covariance is singular to float32 precision, yet
  the scores keep the AUROC of the well-conditioned features."""
  ds = synthetic.make_dataset(jax.random.PRNGKey(2), num_classes=10, dim=3, nu0=6.0,
                              num_train_per_class=30)
  rng = np.random.default_rng(0)

  def degenerate(x):
    x = np.asarray(x, np.float64)
    extra = x[:, :1] + 1e-6 * rng.normal(size=(len(x), 1))
    return (1e3 * np.concatenate([x, extra], 1)).astype(np.float32)

  y = np.asarray(ds.y_train)
  good = dpmm_jax.fit_detector(np.asarray(ds.x_train), y, model, preprocess=False)
  bad = dpmm_jax.fit_detector(degenerate(ds.x_train), y, model, preprocess=False)
  auc_good = metrics.auroc(dpmm_jax.score(good, ds.x_test), dpmm_jax.score(good, ds.x_ood))
  s_in, s_out = dpmm_jax.score(bad, degenerate(ds.x_test)), dpmm_jax.score(bad, degenerate(ds.x_ood))
  assert np.all(np.isfinite(s_in)) and np.all(np.isfinite(s_out))
  assert abs(metrics.auroc(s_in, s_out) - auc_good) < 0.02, (auc_good,)
  assert auc_good > 0.7
