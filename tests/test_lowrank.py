"""The low-rank-plus-shared DPMM through the public API (float32): options, diagnostics,
large offsets. Its formulas are checked against a dense scipy oracle in
tests/test_lowrank_f64.py."""
import functools
import warnings

import numpy as np
import pytest

import dpmm_jax

K, D, NK = 6, 24, 12    # N_k < D


@functools.lru_cache(maxsize=None)
def _data():
  """Classes with two planted directions of large variance each, and test points."""
  rng = np.random.default_rng(3)
  xs, ys, tests = [], [], []
  for k in range(K):
    spikes = rng.normal(size=(D, 2)) * 5.0
    chol = np.linalg.cholesky(np.eye(D) + spikes @ spikes.T)
    mean = 4.0 * rng.normal(size=D)
    draw = mean + rng.normal(size=(NK + 20, D)) @ chol.T
    xs.append(draw[:NK])
    tests.append(draw[NK:])
    ys.append(np.full(NK, k))
  return (np.concatenate(xs).astype(np.float32), np.concatenate(ys),
          np.concatenate(tests).astype(np.float32), np.repeat(np.arange(K), 20))


@pytest.mark.parametrize("options,error", [
    ({"max_rank": -1}, ValueError), ({"max_rank": True}, TypeError),
    ({"max_rank": 2.5}, TypeError), ({"edge_scale": -0.5}, ValueError),
    ({"edge_scale": "big"}, TypeError), ({"edge_scale": float("nan")}, ValueError)])
def test_bad_options_raise_clear_errors(options, error):
  x, y, *_ = _data()
  name = next(iter(options))
  with pytest.raises(error, match=name):
    dpmm_jax.fit_detector(x, y, "lowrank", preprocess=False, **options)


def test_a_binding_rank_cap_is_reported_and_warned():
  x, y, *_ = _data()
  with pytest.warns(dpmm_jax.FitDiagnosticWarning, match="max_rank"):
    det, report = dpmm_jax.fit_detector_with_info(x, y, "lowrank", preprocess=False,
                                                  max_rank=1)
  assert report.rank_capped and np.any(np.asarray(det.params.num_spikes) > 1)
  # A cap the planted structure fits under, or a fixed rank (edge_scale = 0), is silent.
  for options in ({"max_rank": 8}, {"max_rank": 1, "edge_scale": 0.0}):
    with warnings.catch_warnings():
      warnings.simplefilter("error", dpmm_jax.FitDiagnosticWarning)
      _, report = dpmm_jax.fit_detector_with_info(x, y, "lowrank", preprocess=False,
                                                  **options)
    assert not report.rank_capped


def test_the_kept_directions_predict_held_out_points_better_than_the_prior_alone():
  """Held-out log predictive density of each point under its own class: the default
  (planted directions kept) against max_rank = 0 (covariances from the prior alone)."""
  x, y, x_test, y_test = _data()
  held_out = {}
  for max_rank in (0, 32):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", dpmm_jax.FitDiagnosticWarning)   # max_rank = 0
      det = dpmm_jax.fit_detector(x, y, "lowrank", max_rank=max_rank)
    scores = np.asarray(dpmm_jax.class_scores(det, x_test))       # log N_k + log p(x | k)
    held_out[max_rank] = np.mean(scores[np.arange(len(y_test)), y_test])
  # Two directions of variance 1 + 25 D-ish per class: several nats per point.
  assert held_out[32] > held_out[0] + 2.0, held_out


@pytest.mark.parametrize("offset", [1e2, 1e3, 1e4])
def test_large_offsets_without_preprocessing_score_like_centred_features(offset):
  """The Woodbury distances are centred on mu0 before squaring, so a common offset of
  1e4 within-class spreads changes nothing in float32 beyond the round-off of the shifted
  inputs (eps * offset per coordinate), in units of the score scale. Expanded about the
  origin instead, the float32 error would be ~eps |x|^2 ~ 300 nats at offset 1e4."""
  x, y, x_test, _ = _data()
  base = dpmm_jax.fit_detector(x, y, "lowrank", preprocess=False)
  moved = dpmm_jax.fit_detector(x + np.float32(offset), y, "lowrank", preprocess=False)
  want = np.asarray(dpmm_jax.class_scores(base, x_test))
  got = np.asarray(dpmm_jax.class_scores(moved, x_test + np.float32(offset)))
  np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
  scale = np.abs(want).max()
  eps = np.finfo(np.float32).eps
  np.testing.assert_allclose(got, want, rtol=0, atol=2 * eps * max(offset, 1e2) * scale)


def test_rank_caps_share_one_compiled_em():
  """The EM of the hyperparameters does not depend on max_rank: fits with other caps
  reuse its program (only the predictives compile again), and every cap gets the same
  hyperparameters, the full model's."""
  from dpmm_jax import stats as stats_lib   # pylint: disable=g-import-not-at-top
  from dpmm_jax.models import full, lowrank   # pylint: disable=g-import-not-at-top
  x, y, *_ = _data()
  st = stats_lib.from_labels(x[:, :7], y, K)              # a dimension private to this test
  hyper_before = lowrank._fit_hyper._cache_size()
  params_before = lowrank.params_from_hyper._cache_size()
  fits = [lowrank.fit(st, max_rank=r) for r in (1, 2, 3)]
  assert lowrank._fit_hyper._cache_size() - hyper_before == 1
  assert lowrank.params_from_hyper._cache_size() - params_before == 3
  reference, _ = full.fit(st)
  for params, info in fits:
    assert bool(info.converged)
    for got, want in zip(params.hyper, reference.hyper):
      np.testing.assert_array_equal(got, want)
  assert [p.factors.shape[1] for p, _ in fits] == [1, 2, 3]
