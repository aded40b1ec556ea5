"""The one-call API: dpmm_jax.fit_detector / score / predict / outlier_probability /
class_scores over every model in dpmm_jax.MODELS, pytree behaviour and input errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmm_jax
from dpmm_jax import api
from dpmm_jax import metrics
from dpmm_jax import preprocess
from dpmm_jax import scores as scores_lib
from dpmm_jax import stats as stats_lib
from dpmm_jax.models import diag, full

K, D, NK = 4, 5, 30


@functools.lru_cache(maxsize=None)
def _data(seed=0):
  """Separable classes (means ~6 within-class sds apart), ID test points, outliers."""
  rng = np.random.default_rng(seed)
  means = 6.0 * rng.normal(size=(K, D))
  scales = rng.uniform(0.5, 1.5, size=(K, D))

  def draw(labels):
    return means[labels] + scales[labels] * rng.normal(size=(len(labels), D))

  y = np.repeat(np.arange(K), NK).astype(np.int32)
  y_test = np.arange(60) % K
  x_ood = 25.0 * rng.normal(size=(60, D)) / np.sqrt(D) + rng.normal(size=(60, D))
  return (draw(y).astype(np.float32), y, draw(y_test).astype(np.float32), y_test,
          x_ood.astype(np.float32))


@functools.lru_cache(maxsize=None)
def _detector(model, seed=0):
  x, y, *_ = _data(seed)
  return dpmm_jax.fit_detector(x, y, model, key=jax.random.PRNGKey(0))


@pytest.mark.parametrize("model", dpmm_jax.MODELS)
def test_every_model_fits_scores_and_predicts(model):
  _, _, x_test, y_test, x_ood = _data()
  det = _detector(model)
  assert det.model == model and det.num_classes == K and det.input_dim == D
  s_in, s_out = np.asarray(dpmm_jax.score(det, x_test)), np.asarray(dpmm_jax.score(det, x_ood))
  assert s_in.shape == (60,) and np.all(np.isfinite(s_in)) and np.all(np.isfinite(s_out))
  cs = np.asarray(dpmm_jax.class_scores(det, x_test))
  assert cs.shape == (60, K) and np.all(np.isfinite(cs))
  pred = np.asarray(dpmm_jax.predict(det, x_test))
  assert pred.shape == (60,)
  assert metrics.accuracy(pred, y_test) > 0.9          # chance is 0.25
  if model not in ("msp", "temp_msp"):
    # Far outliers (sd ~25 vs class means sd ~6) mostly score below the inliers
    # (independent RMDS, with 30 points per 5-D class covariance, reaches 0.90).
    assert metrics.auroc(s_in, s_out) > 0.8
  if model in dpmm_jax.DPMM_MODELS:
    p_in = np.asarray(dpmm_jax.outlier_probability(det, x_test))
    p_out = np.asarray(dpmm_jax.outlier_probability(det, x_ood))
    assert np.all((p_in >= 0) & (p_in <= 1)) and np.all((p_out >= 0) & (p_out <= 1))
    assert np.mean(p_out) > np.mean(p_in)


def test_fit_report_for_em_and_closed_form_models():
  x, y, *_ = _data()
  det, report = dpmm_jax.fit_detector_with_info(x, y, "diag")
  assert report.dim == D
  np.testing.assert_array_equal(report.counts, np.full(K, NK))
  trace = np.asarray(report.em.log_marginal_trace)
  assert np.isfinite(trace[int(report.em.num_iters)])
  _, report = dpmm_jax.fit_detector_with_info(x, y, "rmds", num_components=3)
  assert report.em is None and report.dim == 3


# Model-agnostic mechanics (pytree, chunking) use the cheaper-to-compile models; the
# coupled model's scoring compiles in ~10 s per new input shape.
@pytest.mark.parametrize("model", ["diag", "full", "rmds"])
def test_detector_passes_through_jit_and_tree_util(model):
  _, _, x_test, _, x_ood = _data()
  x = np.concatenate([x_test[:30], x_ood[:30]])     # 60 rows: the shape other tests use
  det = _detector(model)
  ref = np.asarray(dpmm_jax.score(det, x))

  if model == "rmds":
    from dpmm_jax.models import mahalanobis

    def functional_score(d, xs):
      z = preprocess.apply(d.transform, xs)
      return jnp.max(mahalanobis.rmds_class_scores(d.params, z), -1)
  else:
    module = {"diag": diag, "full": full}[model]

    def functional_score(d, xs):
      z = preprocess.apply(d.transform, xs)
      return scores_lib.dpmm_score(d.params.log_counts, *module.log_predictive(d.params, z))

  traces = []

  @jax.jit
  def jitted(d, xs):
    traces.append(d.model)        # static metadata is visible while tracing
    return functional_score(d, xs)

  np.testing.assert_allclose(jitted(det, x), ref, rtol=1e-4, atol=1e-3)
  leaves, treedef = jax.tree_util.tree_flatten(det)
  assert all(isinstance(leaf, jax.Array) for leaf in leaves)
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  assert isinstance(rebuilt, dpmm_jax.Detector)
  assert (rebuilt.model, rebuilt.num_classes) == (det.model, det.num_classes)
  np.testing.assert_array_equal(dpmm_jax.score(rebuilt, x), ref)
  copied = jax.tree_util.tree_map(lambda a: a + 0, det)      # new buffers, same values
  np.testing.assert_allclose(jitted(copied, x), ref, rtol=1e-4, atol=1e-3)
  assert traces == [model]                                   # no retrace for equal shapes


@pytest.mark.parametrize("model", ["diag", "full", "indep_rmds", "msp"])
def test_chunked_scoring_equals_unchunked(model):
  _, _, x_test, _, x_ood = _data()
  x = np.concatenate([x_test[:30], x_ood[:30]])              # M = 60
  det = _detector(model)
  whole_s = np.asarray(dpmm_jax.score(det, x, chunk_size=len(x)))
  whole_c = np.asarray(dpmm_jax.class_scores(det, x, chunk_size=len(x)))
  chunk = 23                                                 # 60 = 2 * 23 + 14
  np.testing.assert_allclose(dpmm_jax.score(det, x, chunk_size=chunk), whole_s,
                             rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dpmm_jax.class_scores(det, x, chunk_size=chunk), whole_c,
                             rtol=1e-5, atol=1e-4)
  if model in dpmm_jax.DPMM_MODELS:
    np.testing.assert_allclose(dpmm_jax.outlier_probability(det, x, chunk_size=chunk),
                               dpmm_jax.outlier_probability(det, x), atol=1e-6)


def test_memmap_training_features_equal_in_memory(tmp_path):
  """Closed-form models, so that only the chunked statistics are compared (EM fits
  amplify float round-off along directions where the likelihood is flat)."""
  x, y, x_test, *_ = _data()
  xm = np.memmap(tmp_path / "x.f32", dtype=np.float32, mode="w+", shape=x.shape)
  xm[:] = x
  xm.flush()
  xr = np.memmap(tmp_path / "x.f32", dtype=np.float32, mode="r", shape=x.shape)
  for model in ("tied", "indep_rmds"):
    det = dpmm_jax.fit_detector(xr, y, model, chunk_size=50)   # 120 = 2*50 + 20
    ref = _detector(model)
    np.testing.assert_allclose(det.transform.loc, ref.transform.loc, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dpmm_jax.score(det, x_test), dpmm_jax.score(ref, x_test),
                               rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(dpmm_jax.predict(det, x_test), dpmm_jax.predict(ref, x_test))


def test_fitting_from_a_memory_map_releases_its_pages(tmp_path, monkeypatch):
  # Both passes over a read-only memory map (transform, then transformed statistics)
  # hand every chunk's pages back; the detector equals the in-memory one.
  x, y, x_test, *_ = _data()
  np.save(tmp_path / "x.npy", x)
  xr = np.load(tmp_path / "x.npy", mmap_mode="r")
  released = []
  real = stats_lib.release_pages

  def spy(view):
    released.append((view.ctypes.data - xr.ctypes.data) // xr.strides[0])
    real(view)

  monkeypatch.setattr(stats_lib, "release_pages", spy)
  det = dpmm_jax.fit_detector(xr, y, "tied", chunk_size=50)      # 120 = 2*50 + 20
  assert sorted(released) == [0, 0, 50, 50, 100, 100]
  np.testing.assert_array_equal(np.asarray(xr), x)               # re-read after release
  np.testing.assert_allclose(dpmm_jax.score(det, x_test),
                             dpmm_jax.score(_detector("tied"), x_test), rtol=1e-4, atol=1e-3)


def test_preprocess_false_and_num_components():
  x, y, x_test, y_test, _ = _data()
  det = dpmm_jax.fit_detector(x, y, "diag", preprocess=False)
  assert det.transform is None and det.input_dim == D
  assert metrics.accuracy(dpmm_jax.predict(det, x_test), y_test) > 0.9
  det = dpmm_jax.fit_detector(x, y, "tied", num_components=3)
  assert det.transform.projection.shape == (D, 3) and det.input_dim == D
  assert np.all(np.isfinite(np.asarray(dpmm_jax.score(det, x_test))))


# ----------------------------------------------------------------------------- errors
def test_score_rejects_wrong_feature_dimension():
  _, _, x_test, *_ = _data()
  with pytest.raises(ValueError, match="features"):
    dpmm_jax.score(_detector("tied"), x_test[:, :3])


def test_fit_rejects_label_length_mismatch():
  x, y, *_ = _data()
  with pytest.raises(ValueError, match="shape"):
    dpmm_jax.fit_detector(x, y[:-1], "tied")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_are_reported_with_their_count(bad):
  x, y, x_test, *_ = _data()
  x = x.copy()
  x[[3, 17, 40], [0, 2, 1]] = bad
  with pytest.raises(ValueError, match=r"\b3 row"):
    dpmm_jax.fit_detector(x, y, "tied")
  x_test = x_test.copy()
  x_test[[5, 6], 4] = bad
  with pytest.raises(ValueError, match=r"\b2 row"):
    dpmm_jax.score(_detector("tied"), x_test)


def test_labels_outside_range_are_rejected():
  x, y, *_ = _data()
  y_neg = y.copy()
  y_neg[0] = -1
  with pytest.raises(ValueError, match="negative"):
    dpmm_jax.fit_detector(x, y_neg, "tied")
  with pytest.raises(ValueError, match=r"0\.\.2"):
    dpmm_jax.fit_detector(x, y, "tied", num_classes=3)      # label 3 >= num_classes


def test_empty_class_is_rejected():
  x, y, *_ = _data()
  with pytest.raises(ValueError, match="no training points"):
    dpmm_jax.fit_detector(x, y, "tied", num_classes=K + 1)
  y_gap = np.where(y == 1, 2, y).astype(np.int32)            # class 1 has no points
  with pytest.raises(ValueError, match="no training points"):
    dpmm_jax.fit_detector(x, y_gap, "tied")


def test_fewer_than_two_classes_is_rejected():
  x, *_ = _data()
  with pytest.raises(ValueError, match="at least 2 classes"):
    dpmm_jax.fit_detector(x, np.zeros(len(x), np.int32), "tied")


def test_float_labels_are_rejected():
  x, y, *_ = _data()
  with pytest.raises(TypeError, match="integer"):
    dpmm_jax.fit_detector(x, y.astype(np.float32), "tied")


@pytest.mark.parametrize("reshape", [lambda a: a.reshape(-1), lambda a: a[:, :, None]],
                         ids=["1d", "3d"])
def test_wrong_ndim_is_rejected(reshape):
  x, y, *_ = _data()
  with pytest.raises(ValueError, match="2-D"):
    dpmm_jax.fit_detector(reshape(x), y, "tied")
  with pytest.raises(ValueError, match="2-D"):
    dpmm_jax.score(_detector("tied"), reshape(x[:10]))


def test_non_numeric_features_are_rejected():
  x, y, *_ = _data()
  with pytest.raises(TypeError):
    dpmm_jax.fit_detector(x.astype(str), y, "tied")


@pytest.mark.parametrize("model", ["mds", "rmds", "indep_rmds", "msp"])
def test_outlier_probability_needs_a_dpmm_model(model):
  _, _, x_test, *_ = _data()
  with pytest.raises(ValueError, match="DPMM"):
    dpmm_jax.outlier_probability(_detector(model), x_test)


@pytest.mark.parametrize("alpha", [0.0, -1.0, np.inf, np.nan])
def test_outlier_probability_rejects_bad_alpha(alpha):
  _, _, x_test, *_ = _data()
  with pytest.raises(ValueError, match="alpha"):
    dpmm_jax.outlier_probability(_detector("tied"), x_test, alpha=alpha)


@pytest.mark.parametrize("df", [D + 1.0, D, 2.0])
def test_niw_initial_df_must_exceed_d_plus_one(df):
  x, y, *_ = _data()
  with pytest.raises(ValueError, match="D \\+ 1"):
    dpmm_jax.fit_detector(x, y, "full", df=df)


def test_unknown_model_and_num_components_without_preprocess():
  x, y, *_ = _data()
  with pytest.raises(ValueError, match="Unknown model"):
    dpmm_jax.fit_detector(x, y, "gmm")
  with pytest.raises(ValueError, match="num_components"):
    dpmm_jax.fit_detector(x, y, "tied", preprocess=False, num_components=2)


@pytest.mark.parametrize("options", [{"tol": 0.0}, {"max_iter": 0}, {"max_iter": 2.5}])
def test_bad_em_options_are_rejected(options):
  x, y, *_ = _data()
  with pytest.raises(ValueError):
    dpmm_jax.fit_detector(x, y, "diag", **options)


# ------------------------------------------------------------- several models, one pass
@pytest.mark.parametrize("models", [("tied", "diag", "coupled", "rmds", "mds", "msp"),
                                    ("full", "indep_rmds", "msp")])
def test_fit_detectors_equal_one_model_fits(models):
  """Every detector of fit_detectors scores like fit_detector with the same arguments.

  Grouped by the statistics they need: a call that mixes models with and without the
  (K, D, D) scatter computes the diagonal statistics by the scatter path, equal only to
  float32 rounding (~1e-6), which moves where EM stops on its tolerance."""
  x, y, x_test, _, x_ood = _data()
  dets = dpmm_jax.fit_detectors(x, y, models, key=jax.random.PRNGKey(0))
  assert tuple(dets) == models
  x_all = np.concatenate([x_test, x_ood])
  for model in models:
    expected = np.asarray(dpmm_jax.score(_detector(model), x_all))
    got = np.asarray(dpmm_jax.score(dets[model], x_all))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max(),
                               err_msg=model)


def test_fit_detectors_reads_the_data_twice(monkeypatch):
  """Statistics passes: 2 (transform, then transformed statistics) for five models
  sharing them, where five fit_detector calls make 10."""
  x, y, *_ = _data()
  calls = []
  original = stats_lib.from_chunks

  def counting(*args, **kwargs):
    calls.append((kwargs.get("full"), kwargs.get("pooled", True)))
    return original(*args, **kwargs)

  monkeypatch.setattr(stats_lib, "from_chunks", counting)
  reports = dpmm_jax.fit_detectors_with_info(x, y, dpmm_jax.DPMM_MODELS + ("rmds",))
  # The full scatter once, for the full model.
  assert calls == [(False, True), (True, True)]
  assert all(isinstance(r, dpmm_jax.FitReport) for _, r in reports.values())
  calls.clear()
  dpmm_jax.fit_detectors(x, y, ("diag", "coupled"))
  # No model needs the (K, D, D) scatter, nor the (D, D) pooled one after the transform;
  # on a problem this small the second pass sums it anyway, so that both passes run one
  # compiled program (api._SHARED_STATS_PROGRAM_MAX_ND2); above the bound it does not.
  assert calls == [(False, True), (False, True)]
  monkeypatch.setattr(api, "_SHARED_STATS_PROGRAM_MAX_ND2", x.shape[0] * x.shape[1] ** 2 - 1)
  for model, pooled in (("coupled", False), ("diag", False), ("tied", True),
                        ("rmds", True)):
    calls.clear()
    dpmm_jax.fit_detector(x, y, model)
    assert calls == [(False, True), (False, pooled)], model


def test_fit_detectors_per_model_options_and_errors():
  x, y, *_ = _data()
  with pytest.warns(dpmm_jax.ConvergenceWarning) as record:
    out = dpmm_jax.fit_detectors_with_info(x, y, ("diag", "rmds"),
                                           options={"diag": {"max_iter": 1}})
  assert out["diag"][1].num_iters == 1 and not out["diag"][1].converged
  # The warning names the caller's line, as fit_detector's does.
  assert all(r.filename == __file__ for r in record), [r.filename for r in record]
  with pytest.raises(ValueError, match="repeated"):
    dpmm_jax.fit_detectors(x, y, ("diag", "diag"))
  with pytest.raises(ValueError, match="not in models"):
    dpmm_jax.fit_detectors(x, y, ("diag",), options={"full": {"tol": 1e-3}})
  with pytest.raises(TypeError, match="Unknown option"):
    dpmm_jax.fit_detectors(x, y, ("diag",), options={"diag": {"rtol": 1e-3}})
  with pytest.raises(ValueError, match="Unknown model"):
    dpmm_jax.fit_detectors(x, y, ("diag", "gmm"))
  with pytest.raises(ValueError, match="empty"):
    dpmm_jax.fit_detectors(x, y, ())
  with pytest.raises(TypeError, match=r"options\['diag'\] must be a dict"):
    dpmm_jax.fit_detectors(x, y, ("diag",), options={"diag": 1e-3})
  with pytest.raises(TypeError, match="options must be a dict"):
    dpmm_jax.fit_detectors(x, y, ("diag",), options=[("diag", {})])


@pytest.mark.parametrize("fit", ["fit_detector", "fit_detector_with_info"])
def test_fit_warnings_name_the_callers_line(fit):
  """ConvergenceWarning and IdenticalClassWarning point at the line that called the API."""
  x, y, *_ = _data()
  x = x.copy()
  x[y == 0] = x[y == 0][0]                       # class 0: identical points
  with pytest.warns(UserWarning) as record:
    getattr(dpmm_jax, fit)(x, y, "diag", max_iter=1)
  kinds = {type(r.message) for r in record}
  assert {dpmm_jax.ConvergenceWarning, dpmm_jax.IdenticalClassWarning} <= kinds, kinds
  assert all(r.filename == __file__ for r in record), [(r.filename, r.lineno) for r in record]
