"""Correct for every input: centred Mahalanobis distances far from the origin, classes
whose points are all identical, the coupled model's tails (float32 side; the float64
references are in test_accuracy_f64.py) and the tied model's empirical-Bayes prior scale.
"""
import os
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import dpmm_jax


def _offset_problem(offset, seed=0, num_classes=5, dim=8, n_per_class=40, num_test=200):
  """Classes with unit within-class spread, means ~ N(0, 3^2), all shifted by ``offset``."""
  rng = np.random.default_rng(seed)
  centres = 3.0 * rng.normal(size=(num_classes, dim))
  mix = np.eye(dim) + 0.3 * rng.normal(size=(dim, dim))
  y = np.repeat(np.arange(num_classes), n_per_class).astype(np.int32)
  x = centres[y] + rng.normal(size=(len(y), dim)) @ mix
  yt = rng.integers(0, num_classes, num_test)
  xt = centres[yt] + 1.5 * rng.normal(size=(num_test, dim)) @ mix
  shift = offset * np.linspace(1.0, 2.0, dim)
  return ((x + shift).astype(np.float32), y, (xt + shift).astype(np.float32))


def _np_mahalanobis(x, y, xt, num_classes):
  """float64 numpy MDS and RMDS class scores (M, K) from the float32 inputs."""
  x, xt = np.asarray(x, np.float64), np.asarray(xt, np.float64)
  means = np.stack([x[y == k].mean(0) for k in range(num_classes)])
  r = x - means[y]
  within = r.T @ r / len(x)
  mu0 = x.mean(0)
  total = (x - mu0).T @ (x - mu0) / len(x)
  d = xt[:, None, :] - means[None]
  md = np.einsum("mkd,mkd->mk", d, np.linalg.solve(within, d.reshape(-1, x.shape[1]).T)
                 .T.reshape(d.shape))
  d0 = xt - mu0
  md0 = np.einsum("md,md->m", d0, np.linalg.solve(total, d0.T).T)
  return -md, md0[:, None] - md


@pytest.mark.parametrize("offset", [1e2, 1e3, 1e4])
def test_mahalanobis_scores_far_from_the_origin_match_float64(offset):
  """preprocess=False with features 1e2-1e4 spreads from the origin: the float32 MDS and
  RMDS scores rank the test points as float64 numpy does and pick the same class."""
  x, y, xt = _offset_problem(offset)
  mds_ref, rmds_ref = _np_mahalanobis(x, y, xt, 5)
  for model, ref in (("mds", mds_ref), ("rmds", rmds_ref)):
    det = dpmm_jax.fit_detector(x, y, model, preprocess=False)
    cs = np.asarray(dpmm_jax.class_scores(det, xt), np.float64)
    np.testing.assert_array_equal(np.argmax(cs, -1), np.argmax(ref, -1))
    s = np.asarray(dpmm_jax.score(det, xt), np.float64)
    assert scipy.stats.spearmanr(s, ref.max(-1))[0] > 0.9999, model
    # What float32 cannot avoid: the class means are stored to eps * |offset| (1e-3 spreads
    # at 1e4), which moves distances of O(10) by ~10 * that; the uncentred expansion was
    # off by 0.16 already at offset 1e2 and by units to hundreds at 1e3-1e4.
    tol = 1e-3 * np.std(ref.max(-1)) + 100 * np.finfo(np.float32).eps * offset
    assert np.max(np.abs(s - ref.max(-1))) < tol, model


# ------------------------------------------------------- classes of identical points
GAUSSIAN_MODELS = ("mds", "rmds", "indep_rmds", "tied", "full", "diag", "coupled")


@functools.lru_cache(maxsize=None)
def _identical_class_problem():
  rng = np.random.default_rng(3)
  num_classes, dim = 4, 3
  y = np.repeat(np.arange(num_classes), 20).astype(np.int32)
  x = rng.normal(size=(len(y), dim)) + 3.0 * rng.normal(size=(num_classes, dim))[y]
  x[y == 2] = x[y == 2][0]                  # class 2: 20 copies of one point
  keep = (y != 2) | (np.arange(len(y)) == np.flatnonzero(y == 2)[0])
  xt = 2.0 * rng.normal(size=(12, dim))
  return (x.astype(np.float32), y, x[keep].astype(np.float32), y[keep],
          xt.astype(np.float32))


@pytest.mark.parametrize("model", GAUSSIAN_MODELS)
def test_class_of_identical_points_is_fitted_as_a_singleton(model):
  """A class of 20 identical points is fitted like the de-duplicated one-point class in
  every Gaussian model (covariance from the prior / pooled covariance), with a warning;
  the DPMM class weight still counts all 20. (Before: the coupled model fitted it and
  then could not score any point, independent RMDS, full and diag shrank its covariance
  ~20-fold.)"""
  x, y, x1, y1, xt = _identical_class_problem()
  # This test is about how the class is summarised, not about the EM path: the two fits'
  # statistics differ by float32 round-off, and EM run to its tolerance stops at points
  # that differ along directions where the likelihood is flat (diag: nu0_d 126 vs 128
  # even at tol=1e-12 on one machine). So each EM model takes one plain EM step from its
  # initial hyperparameters (computed from the same, de-duplicated statistics).
  opts = ({"accelerate": False, "max_iter": 1}
          if "accelerate" in dpmm_jax.MODEL_OPTIONS[model] else {})
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", dpmm_jax.ConvergenceWarning)
    with pytest.warns(dpmm_jax.api.IdenticalClassWarning, match="identical"):
      det = dpmm_jax.fit_detector(x, y, model, **opts)
    single = dpmm_jax.fit_detector(x1, y1, model, **opts)
  cs = np.asarray(dpmm_jax.class_scores(det, xt), np.float64)
  ref = np.asarray(dpmm_jax.class_scores(single, xt), np.float64)
  if model in dpmm_jax.api.DPMM_MODELS:
    ref[:, 2] += np.log(20.0)
  # Equal up to float32 round-off; the old behaviour was off by log(20) ~ 3 nats and
  # more, or unscorable.
  np.testing.assert_allclose(cs, ref, rtol=1e-4, atol=1e-3)


# ------------------------------------------------------ tied model's prior scale Sigma0
from dpmm_jax import linalg  # noqa: E402
from dpmm_jax import stats as stats_lib  # noqa: E402
from dpmm_jax import synthetic  # noqa: E402
from dpmm_jax.models import tied  # noqa: E402


def _np_stats(x, y, k):
  """SufficientStats computed in numpy (no compilation per shape)."""
  count = np.bincount(y, minlength=k).astype(np.float64)
  mean = np.zeros((k, x.shape[1]))
  np.add.at(mean, y, x)
  mean /= count[:, None]
  r = x - mean[y]
  sq_dev = np.zeros_like(mean)
  np.add.at(sq_dev, y, r * r)
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  return stats_lib.SufficientStats(f32(count), f32(mean), f32(sq_dev), None, f32(r.T @ r))


def _fitted_sigma0(stats, prior_scale):
  values, vectors = np.linalg.eigh(np.asarray(stats_lib.pooled_covariance(stats), np.float64))
  white = vectors / np.sqrt(values)
  unwhite = np.linalg.inv(white)
  s0 = np.asarray(tied.whitened_prior_scale(stats, jnp.asarray(white, jnp.float32),
                                            prior_scale), np.float64)
  return unwhite.T @ s0 @ unwhite


def test_empirical_bayes_sigma0_converges_to_the_truth_as_k_grows():
  """Data drawn from the tied model (mu_k ~ N(0, Sigma0), x ~ N(mu_k, Sigma), N_k = 10,
  one direction of Sigma0 = 0): the empirical-Bayes Sigma0 approaches the true one as K
  grows (relative Frobenius error ~ 1/sqrt(K)); the paper's total covariance does not
  (it converges to Sigma0 + Sigma)."""
  rng = np.random.default_rng(0)
  dim, nk = 4, 10
  a = rng.normal(size=(dim, dim))
  sigma = a @ a.T / dim + 0.5 * np.eye(dim)
  b = rng.normal(size=(dim, dim - 1))
  sigma0 = b @ b.T                                # rank D - 1: a PSD boundary case
  errors, errors_total = [], []
  for k in (30, 300, 3000):
    means = rng.normal(size=(k, dim)) @ np.linalg.cholesky(sigma0 + 1e-12 * np.eye(dim)).T
    y = np.repeat(np.arange(k), nk)
    x = means[y] + rng.normal(size=(k * nk, dim)) @ np.linalg.cholesky(sigma).T
    st = _np_stats(x, y, k)
    norm = np.linalg.norm(sigma0)
    errors.append(np.linalg.norm(_fitted_sigma0(st, "empirical_bayes") - sigma0) / norm)
    errors_total.append(np.linalg.norm(_fitted_sigma0(st, "total") - sigma0) / norm)
  assert errors[0] > errors[1] > errors[2], errors
  assert errors[2] < 0.06, errors
  assert min(errors_total) > 0.5 * np.linalg.norm(sigma) / np.linalg.norm(sigma0), errors_total


@pytest.mark.parametrize("tied_df", [30.0, 1e4])
def test_empirical_bayes_tied_score_tracks_rmds_at_least_as_well_as_the_paper_choice(tied_df):
  """Proposition 2: the tied score is a smoothed RMDS. With the empirical-Bayes Sigma0 its
  Spearman correlation with RMDS (ID and OOD test points together) is at least that of
  the paper's Sigma0 = total covariance, which counts the within-class covariance twice.
  Problems: K = 40, D = 16, N_k = 15, class covariances Wishart around a shared one with
  ``tied_df`` degrees of freedom (30: differing, 1e4: tied); OOD = 20 held-out classes."""
  rng = np.random.default_rng(int(tied_df))
  k, dim, nk = 60, 16, 15
  a = rng.normal(size=(dim, dim))
  shared = a @ a.T / dim + 0.3 * np.eye(dim)
  means = 1.2 * rng.normal(size=(k, dim))
  chols = []
  for _ in range(k):
    g = rng.normal(size=(int(min(tied_df, 400)), dim)) @ np.linalg.cholesky(shared).T
    cov = g.T @ g / len(g) if tied_df < 1e3 else shared
    chols.append(np.linalg.cholesky(cov))
  y_all = np.repeat(np.arange(k), 2 * nk)
  x_all = means[y_all] + np.einsum("nd,ned->ne", rng.normal(size=(len(y_all), dim)),
                                   np.stack(chols)[y_all])
  first = np.tile(np.arange(2 * nk) < nk, k)
  train = first & (y_all < 40)
  x, y = x_all[train].astype(np.float32), y_all[train].astype(np.int32)
  xt = x_all[~first].astype(np.float32)          # held-out points of all 60 classes
  rmds = np.asarray(dpmm_jax.score(dpmm_jax.fit_detector(x, y, "rmds"), xt))
  rho = {}
  for choice in tied.PRIOR_SCALES:
    s = np.asarray(dpmm_jax.score(dpmm_jax.fit_detector(x, y, "tied", prior_scale=choice), xt))
    rho[choice] = scipy.stats.spearmanr(s, rmds)[0]
  assert rho["empirical_bayes"] >= rho["total"], rho
  assert rho["empirical_bayes"] > 0.95, rho


# ----------------------------------------------------------------- honest fit reports
def test_fit_report_says_when_kappa0_reaches_its_cap():
  """Classes with one common mean and different spreads: the marginal likelihood grows
  with kappa0 without bound, EM moves it onto its cap (1e6), and the report says so
  (before: ``at_cap`` only looked at nu0 and alpha0)."""
  rng = np.random.default_rng(0)
  x, y, _, _, _ = _identical_class_problem()            # shapes shared with the test above
  scales = np.exp(rng.normal(size=4))
  x = (rng.normal(size=x.shape) * np.sqrt(scales[y])[:, None]).astype(np.float32)
  det, report = dpmm_jax.fit_detector_with_info(x, y, "diag")
  assert float(np.max(det.params.hyper.mean_concentration)) >= 0.99e6
  assert report.kappa_at_cap and report.at_cap
  assert report.newton_converged and not report.at_lower_bound and not report.problems


def test_fit_report_lists_newton_and_mode_search_problems():
  """The properties read EM's Newton record and the assembled diagnostics; each problem
  is listed (and warned at fit)."""
  newton = dpmm_jax.newton.NewtonInfo(jnp.asarray(100), jnp.asarray(False), jnp.asarray(False))
  info = dpmm_jax.em.EMInfo(jnp.zeros(3), jnp.asarray(2), jnp.asarray(True), newton)
  flags = {"kappa_at_cap": False, "at_lower_bound": True,
           "mode_search_not_converged": True, "mode_clipped": True}
  report = dpmm_jax.FitReport(info, 3, np.ones(2), flags)
  assert not report.newton_converged and report.at_lower_bound
  assert not report.mode_search_converged and report.mode_clipped
  assert len(report.problems) == 4 and not report.at_cap
  clean = dpmm_jax.FitReport(info._replace(newton=newton._replace(converged=jnp.asarray(True))),
                             3, np.ones(2), dict.fromkeys(flags, False))
  assert clean.problems == ()


# ------------------------------------------------------------------ experiment binary
def test_accuracy_tables_smoke(tmp_path):
  """experiments.accuracy_tables at its smallest: digits only, two models."""
  from experiments import accuracy_tables  # pylint: disable=g-import-not-at-top
  out = accuracy_tables.run(str(tmp_path), problems=("digits",), models=("rmds", "tied"),
                            figure_dir=str(tmp_path / "fig"))
  res = out["benchmarks"]["digits"]["results"]
  # The empirical-Bayes tied model and RMDS agree (Proposition 2) on the ID test set.
  assert abs(res["tied"]["accuracy"] - res["rmds"]["accuracy"]) < 0.02
  row = out["tied_prior"]["rows"][0]
  assert row["spearman_tied_empirical_bayes_vs_rmds"] >= row["spearman_tied_total_vs_rmds"]
  for name in ("benchmark_digits.md", "benchmark_digits.csv", "benchmark_digits.json",
               "accuracy_tied_prior.md"):
    assert (tmp_path / name).exists(), name
  assert (tmp_path / "fig" / "benchmark_digits.png").stat().st_size > 5000


def test_lowrank_study_smoke(tmp_path):
  """experiments.lowrank_study --quick: 6 CLINC150 intents, 16 components."""
  from experiments import lowrank_study  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = lowrank_study.run(str(tmp_path), os.path.join(root, "data", "clinc150_minilm"),
                          quick=True)
  rows = {(r["study"], r["setting"]): r for r in out["rows"]}
  assert out["spectra"]["dim"] == 16 and out["config"]["num_classes"] == 6
  assert ("lowrank", "fixed rank 0 (edge_scale 0)") in rows and len(rows) == len(out["rows"])
  for r in out["rows"]:
    assert 0.5 < r["accuracy"] <= 1.0, r     # 6 classes: chance is 1/6
  text = (tmp_path / "lowrank_study.md").read_text()
  assert "| lowrank | default (noise edge, max_rank 32) |" in text
