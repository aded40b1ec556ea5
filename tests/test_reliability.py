"""Reliability (issue 4): every public entry point validates its inputs, degenerate data
either works (finite scores) or raises a documented error, EM reports caps and
non-convergence, and results are deterministic. See docs/failure_modes.md.

Shapes are kept to a few (K, D) pairs so that the jitted EM fits compile once per pair.
"""
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
import scipy.stats

import dpmm_jax
from dpmm_jax import api
from dpmm_jax import metrics
from dpmm_jax import preprocess
from dpmm_jax import quadrature
from dpmm_jax import special
from dpmm_jax import stats as stats_lib
from dpmm_jax.conjugate import nix

K, D, NK = 3, 4, 25
K_TIED = 6
HIERARCHICAL = ("full", "diag", "coupled")
GAUSSIAN = tuple(m for m in dpmm_jax.MODELS if m not in ("msp", "temp_msp"))


def _blobs(seed=0, num_classes=K, dim=D, per_class=NK, spread=4.0):
  rng = np.random.default_rng(seed)
  means = spread * rng.normal(size=(num_classes, dim))
  y = np.repeat(np.arange(num_classes), per_class).astype(np.int32)
  x = means[y] + rng.normal(size=(len(y), dim)) * rng.uniform(0.5, 1.5, size=(1, dim))
  x_test = np.concatenate([means[np.arange(12) % num_classes]
                           + rng.normal(size=(12, dim)),
                           3.0 * spread * rng.normal(size=(12, dim))])
  return x.astype(np.float32), y, x_test.astype(np.float32)


@functools.lru_cache(maxsize=None)
def _data():
  return _blobs()


@functools.lru_cache(maxsize=None)
def _detector(model):
  x, y, _ = _data()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", dpmm_jax.ConvergenceWarning)
    return dpmm_jax.fit_detector(x, y, model, key=jax.random.PRNGKey(0))


def _fit(x, y, model, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", dpmm_jax.ConvergenceWarning)
    return dpmm_jax.fit_detector(x, y, model, key=jax.random.PRNGKey(0), **kwargs)


def _finite_scores(det, x):
  s = np.asarray(dpmm_jax.score(det, x))
  cs = np.asarray(dpmm_jax.class_scores(det, x))
  assert s.shape == (len(x),) and cs.shape == (len(x), det.num_classes)
  assert np.all(np.isfinite(s)) and np.all(np.isfinite(cs)), (det.model, s)
  return s


# ---------------------------------------------------------------- features: fitting
@pytest.mark.parametrize("bad, match", [
    (lambda x: x[0, 0], "2-D"),
    (lambda x: x[:, 0], r"2-D.*reshape\(-1, 1\)"),
    (lambda x: x[:, :, None], "2-D"),
    (lambda x: x[:, :0], "empty"),
])
def test_fit_rejects_wrong_shapes(bad, match):
  x, y, _ = _data()
  with pytest.raises(ValueError, match=match):
    dpmm_jax.fit_detector(bad(x), y, "tied")


def test_fit_rejects_no_points():
  x, y, _ = _data()
  with pytest.raises(ValueError, match="empty"):
    dpmm_jax.fit_detector(x[:0], y[:0], "tied")


@pytest.mark.parametrize("convert", [
    lambda x: x.astype(str), lambda x: x.astype(object), lambda x: x.astype(np.complex64),
    lambda x: [["a"] * x.shape[1]] * x.shape[0]], ids=["str", "object", "complex", "list"])
def test_fit_rejects_non_real_features_with_type_error(convert):
  x, y, _ = _data()
  with pytest.raises(TypeError, match="x must be a real numeric"):
    dpmm_jax.fit_detector(convert(x), y, "tied")


@pytest.mark.parametrize("bad,preprocess", [(np.nan, True), (np.inf, True),
                                             (-np.inf, True), (np.nan, False)])
def test_non_finite_training_rows_are_counted_and_listed(bad, preprocess):
  # With the preprocessing its first pass checks the rows (the second does not again);
  # without it the only pass does.
  x, y, _ = _data()
  x = x.copy()
  rows = [70, 4, 33, 9, 52, 60, 11]
  x[rows, [0, 1, 2, 3, 0, 1, 2]] = bad
  with pytest.raises(ValueError, match=r"x has 7 row\(s\) with NaN or inf values "
                                       r"\(first rows: \[4, 9, 11, 33, 52, \.\.\.\]\)"):
    dpmm_jax.fit_detector(x, y, "tied", preprocess=preprocess)


def test_non_finite_rows_of_a_memmap_are_reported_with_global_indices(tmp_path):
  x, y, _ = _data()
  mm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32,
                                 shape=x.shape)
  mm[:] = x
  mm[[41, 57], 2] = np.nan
  with pytest.raises(ValueError, match=r"x has 2 row\(s\) with NaN or inf values \(first "
                                       r"rows: \[41, 57\]\)"):
    dpmm_jax.fit_detector(mm, y, "tied", chunk_size=20)


def test_float64_values_beyond_float32_range_are_not_silently_inf():
  x, y, _ = _data()
  x = x.astype(np.float64)
  x[5, 1] = 1e39
  with pytest.raises(ValueError, match=r"1 row\(s\) with values beyond the float32 range"):
    dpmm_jax.fit_detector(x, y, "tied")


def test_statistics_overflow_is_reported():
  x, y, _ = _data()
  x = x * np.float32(1e20)     # finite, but squared deviations overflow float32
  with pytest.raises(ValueError, match="overflowed"):
    dpmm_jax.fit_detector(x, y, "tied", preprocess=False)


@pytest.mark.parametrize("model", ["tied", "diag"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.float16])
def test_integer_bool_and_float16_features_are_converted_to_float32(model, dtype):
  x, y, x_test = _data()
  xq, tq = np.round(x).astype(dtype), np.round(x_test).astype(dtype)
  if dtype == np.bool_:     # independent coin flips with class-dependent probabilities
    rng = np.random.default_rng(1)
    p = rng.uniform(0.2, 0.8, size=(K, D))
    xq, tq = rng.random(x.shape) < p[y], rng.random(x_test.shape) < 0.5
  det = _fit(xq, y, model)
  ref = _fit(np.asarray(xq, np.float32), y, model)
  assert det.params.log_counts.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(dpmm_jax.score(det, tq)),
                                np.asarray(dpmm_jax.score(ref, np.asarray(tq, np.float32))))


# ------------------------------------------------------------------------- labels
@pytest.mark.parametrize("labels, error, match", [
    (lambda y: y.astype(np.float64), TypeError, "integer class labels"),
    (lambda y: y.astype(bool), TypeError, "integer class labels"),
    (lambda y: y.astype(str), TypeError, "integer class labels"),
    (lambda y: y[:-1], ValueError, r"shape \(75,\)"),
    (lambda y: y[:, None], ValueError, r"shape \(75,\)"),
    (lambda y: np.where(np.arange(len(y)) == 8, -2, y), ValueError,
     r"1 negative label\(s\) \(first at rows \[8\]\)"),
])
def test_bad_labels_are_rejected(labels, error, match):
  x, y, _ = _data()
  with pytest.raises(error, match=match):
    dpmm_jax.fit_detector(x, labels(y), "tied")


def test_labels_beyond_num_classes_are_listed():
  x, y, _ = _data()
  with pytest.raises(ValueError, match=r"25 label\(s\) >= num_classes=2 \(first at rows "
                                       r"\[50, 51, 52, 53, 54, \.\.\.\]"):
    dpmm_jax.fit_detector(x, y, "tied", num_classes=2)


@pytest.mark.parametrize("k, error", [(0, ValueError), (2.0, TypeError), (True, TypeError),
                                      ("3", TypeError)])
def test_bad_num_classes_is_rejected(k, error):
  x, y, _ = _data()
  with pytest.raises(error, match="num_classes"):
    dpmm_jax.fit_detector(x, y, "tied", num_classes=k)


def test_a_class_without_points_when_k_is_given_is_named():
  x, y, _ = _data()
  with pytest.raises(ValueError, match=r"2 class\(es\) have no training points "
                                       r"\(first: \[3, 4\]\)"):
    dpmm_jax.fit_detector(x, y, "tied", num_classes=K + 2)


def test_one_class_is_rejected_with_the_reason():
  x, _, _ = _data()
  with pytest.raises(ValueError, match="at least 2 classes.*between classes"):
    dpmm_jax.fit_detector(x, np.zeros(len(x), np.int32), "diag")


# ------------------------------------------------------------------------ options
@pytest.mark.parametrize("kwargs, error, match", [
    ({"model": 3}, TypeError, "model must be a string"),
    ({"model": "GMM"}, ValueError, "Unknown model"),
    ({"preprocess": "yes"}, TypeError, "preprocess"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"chunk_size": 10.5}, TypeError, "chunk_size"),
    ({"num_components": 0}, ValueError, "num_components"),
    ({"num_components": D + 1}, ValueError, "num_components=5 exceeds"),
    ({"model": "diag", "mean_concentration": -1.0}, ValueError, "mean_concentration"),
    ({"model": "coupled", "gamma_shape": float("nan")}, ValueError, "gamma_shape"),
    ({"model": "diag", "bogus": 1}, TypeError, "bogus"),
])
def test_bad_options_are_rejected(kwargs, error, match):
  x, y, _ = _data()
  kwargs = {"model": "tied", **kwargs}
  with pytest.raises(error, match=match):
    dpmm_jax.fit_detector(x, y, **kwargs)


@pytest.mark.parametrize("df, match", [(D + 1.0, r"must exceed D \+ 1 = 5"),
                                       (1.0, r"must exceed D \+ 1 = 5"),
                                       (float("nan"), "df must be a positive finite")])
def test_full_model_rejects_initial_df_at_most_d_plus_one(df, match):
  x, y, _ = _data()
  with pytest.raises(ValueError, match=match):
    dpmm_jax.fit_detector(x, y, "full", df=df)
  # D is the dimension after preprocessing: with 2 components, df = 3.5 > 3 is fine, 3 not.
  with pytest.raises(ValueError, match=r"D \+ 1 = 3 .*D = 2 is the dimension after"):
    dpmm_jax.fit_detector(x, y, "full", num_components=2, df=3.0)


def test_every_keyed_entry_point_names_a_bad_key():
  """Each public function that takes a PRNG key (the jitted building blocks aside) rejects an int seed, a batch of keys
  and a string with one TypeError that says how to make a key, before any work; typed
  and raw keys are both accepted."""
  from dpmm_jax import analysis
  from dpmm_jax import divergence
  from dpmm_jax import gmm
  from dpmm_jax import validation
  x, y, x_test = _data()
  det = _detector("diag")
  calls = {
      "fit_detector": lambda key: dpmm_jax.fit_detector(x, y, "msp", key=key),
      "fit_detectors": lambda key: dpmm_jax.fit_detectors(x, y, ("rmds",), key=key),
      "discover": lambda key: dpmm_jax.discover(det, x_test, key=key),
      "divergence.estimate": lambda key: divergence.estimate(x, x_test, "tv", key=key),
      "gmm.fit_gmm": lambda key: gmm.fit_gmm(x, 2, key=key),
      "analysis.wishart_null_covariances": lambda key: analysis.wishart_null_covariances(
          key, np.eye(D, dtype=np.float32), 10.0, 3),
  }
  batch = jax.random.split(jax.random.PRNGKey(0), 2)
  for name, call in calls.items():
    for bad in (0, "seed", batch, np.zeros(2, np.int32)):
      with pytest.raises(TypeError, match=r"key must be one jax PRNG key, e\.g\. "
                                          r"jax\.random\.key\(0\)"):
        call(bad)
  for good in (jax.random.key(3), jax.random.PRNGKey(3), np.asarray(jax.random.PRNGKey(3))):
    assert validation.prng_key(good) is good


# ------------------------------------------------------------------------- scoring
ENTRY_POINTS = {
    "score": dpmm_jax.score,
    "class_scores": dpmm_jax.class_scores,
    "predict": dpmm_jax.predict,
    "outlier_probability": dpmm_jax.outlier_probability,
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_scoring_entry_points_validate_their_inputs(entry):
  fn = ENTRY_POINTS[entry]
  det = _detector("tied")
  _, _, x_test = _data()
  with pytest.raises(ValueError, match="has 3 features but the detector was fitted on 4"):
    fn(det, x_test[:, :3])
  with pytest.raises(ValueError, match="2-D"):
    fn(det, x_test[0])
  bad = x_test.copy()
  bad[[2, 19], 1] = np.nan
  with pytest.raises(ValueError, match=r"2 row\(s\) with NaN or inf values \(first rows: "
                                       r"\[2, 19\]\)"):
    fn(det, bad)
  with pytest.raises(TypeError, match="real numeric"):
    fn(det, x_test.astype(str))
  with pytest.raises(TypeError, match="Detector"):
    fn(det.params, x_test)
  with pytest.raises(ValueError, match="chunk_size"):
    fn(det, x_test, chunk_size=0)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_empty_batches_score_to_empty_arrays(entry):
  out = np.asarray(ENTRY_POINTS[entry](_detector("tied"), np.zeros((0, D), np.float32)))
  assert out.shape == ((0, K) if entry == "class_scores" else (0,))


def test_far_points_in_float32_raise_instead_of_returning_nan():
  _, _, x_test = _data()
  x = x_test.copy()
  x[[1, 7]] = 3e37
  with pytest.raises(ValueError, match=r"2 row\(s\) of x could not be scored.*\[1, 7\]"):
    dpmm_jax.score(_detector("diag"), x)


def test_points_on_the_coupled_prior_mean_are_named_not_called_overflowed():
  """Where the coupled model's prior predictive density is infinite (a point on the prior
  mean with alpha0 <= D / 2: the integral over gamma diverges at 0), ``score`` names the
  rows and the reason; it used to blame an overflow. Points off the mean score finitely."""
  rng = np.random.default_rng(3)
  scales = np.array([0.1, 1.0, 10.0])          # class scales far apart: a small alpha0
  y = np.repeat(np.arange(K), NK).astype(np.int32)
  x = (rng.normal(size=(K * NK, D)) * np.sqrt(scales[y])[:, None]
       + 5.0 * rng.normal(size=(K, D))[y]).astype(np.float32)
  det = _fit(x, y, "coupled", preprocess=False)
  assert float(det.params.hyper.gamma_shape) <= D / 2
  mean = np.asarray(det.params.hyper.loc, np.float32)
  rows = np.stack([x[0], mean, mean + 0.5, mean])
  with pytest.raises(ValueError, match=r"2 row\(s\) of x have no finite score \(first rows: "
                     r"\[1, 3\]\): they coincide with the coupled model's prior mean"):
    dpmm_jax.score(det, rows)
  _finite_scores(det, rows[:3:2])


# ------------------------------------------------------ statistics entry points
def test_chunked_statistics_validate_their_inputs():
  x, y, _ = _data()
  chunks = lambda xs, ys: zip(np.array_split(xs, 3), np.array_split(ys, 3))  # noqa: E731
  bad = x.copy()
  bad[60, 0] = np.inf
  with pytest.raises(ValueError, match=r"1 row\(s\) with NaN or inf.*\[60\]"):
    stats_lib.from_chunks(chunks(bad, y), K)
  with pytest.raises(ValueError, match=r"outside 0\.\.1.*\[50"):
    stats_lib.from_arrays(x, y, 2, chunk_size=20)
  with pytest.raises(TypeError, match="integer"):
    stats_lib.from_arrays(x, y.astype(np.float32), K)
  with pytest.raises(ValueError, match="features"):
    stats_lib.from_chunks([(x[:10], y[:10]), (x[10:, :3], y[10:])], K)
  with pytest.raises(ValueError, match="2-D"):
    stats_lib.from_arrays(x[:, 0], y, K)
  # The jittable core stays jittable (it is what from_chunks compiles).
  st = jax.jit(stats_lib.from_labels, static_argnames=("num_classes", "full"))(
      x, y, num_classes=K, full=False)
  np.testing.assert_allclose(np.asarray(st.count), [NK] * K)


# ---------------------------------------------------------------- degenerate data
@pytest.mark.parametrize("model", dpmm_jax.MODELS)
def test_singleton_classes_among_larger_ones_score_finitely(model):
  x, y, x_test = _data()
  keep = np.ones(len(y), bool)
  keep[1:NK] = False                     # class 0 keeps a single point
  det = _fit(x[keep], y[keep], model)
  _finite_scores(det, x_test)


@pytest.mark.parametrize("model", GAUSSIAN)
def test_all_singleton_classes_are_rejected_for_gaussian_models(model):
  x, y, _ = _data()
  first = np.searchsorted(y, np.arange(K))
  with pytest.raises(ValueError, match="no within-class variation.*every class has a single"):
    dpmm_jax.fit_detector(x[first], y[first], model)


def test_all_singleton_classes_still_fit_an_msp_head():
  x, y, x_test = _data()
  first = np.searchsorted(y, np.arange(K))
  _finite_scores(_fit(x[first], y[first], "msp"), x_test)


@pytest.mark.parametrize("model", dpmm_jax.MODELS)
def test_one_feature_and_two_classes(model):
  x, y, x_test = _data()
  keep = y < 2
  det = _fit(x[keep, :1], y[keep], model)
  assert det.num_classes == 2 and det.input_dim == 1
  _finite_scores(det, x_test[:, :1])


@pytest.mark.parametrize("model", HIERARCHICAL + ("indep_rmds",))
def test_classes_smaller_than_the_dimension_use_the_prior(model):
  # N_k = 3 < D = 4 for every class, but N - K = 10 >= D: the shared prior makes every
  # class covariance full rank.
  x, y, x_test = _blobs(seed=2, num_classes=5, per_class=3)
  _finite_scores(_fit(x, y, model), x_test)


def _few_shot_components(dof):
  """The few-shot cap on the components, int(FEW_SHOT_FRACTION (N - K)) (binding in the
  tests below: the non-singular bound is larger there)."""
  return int(api.FEW_SHOT_FRACTION * dof)


@pytest.mark.parametrize("model", HIERARCHICAL + ("tied",))
def test_too_few_points_for_the_dimension_fit_the_top_components_with_a_warning(model):
  # N - K = 2 * 3 - 3 = 3 < D = 4: Sigma0 is singular in the 4 preprocessed directions.
  # By default the DPMMs then keep the top int(FEW_SHOT_FRACTION * 3) = 2 principal
  # components and warn; a caller's own num_components is kept (too many: for the
  # hierarchical models an error that suggests the number, while tied floors the flat
  # directions).
  x, y, x_test = _blobs(seed=3, per_class=2)
  kept = _few_shot_components(3)
  with pytest.warns(dpmm_jax.FewShotWarning, match=rf"N - K = 3 training points .* the 4 "
                                                   rf"directions .* top {kept} principal"):
    det = dpmm_jax.fit_detector(x, y, model)
  assert det.transform.projection.shape == (D, kept)
  _finite_scores(det, x_test)
  if model == "tied":
    assert _fit(x, y, model, num_components=4).transform.projection.shape == (D, 4)
  else:
    with pytest.raises(ValueError, match=rf"N - K = 3 < D = 4.*num_components={kept} \(top"):
      dpmm_jax.fit_detector(x, y, model, num_components=4)
  _finite_scores(_fit(x, y, model, num_components=3), x_test)


def test_few_shot_tied_scores_known_class_points_like_training_points():
  """K = 5, N_k = 30, D = 200 (N - K = 145 < 149 preprocessed directions). Flooring the
  flat directions, the tied model scored known-class test points like outliers (median
  -1988 against 41.9 for the training points, session 23); on the top components their
  scores lie near the training points' and far above unseen-class points."""
  rng = np.random.default_rng(0)
  mu = 3.0 * rng.normal(size=(15, 200))
  y = np.repeat(np.arange(5), 30)
  draw = lambda k: (mu[k] + rng.normal(size=(len(k), 200))).astype(np.float32)
  x, known, unseen = draw(y), draw(rng.integers(0, 5, 50)), draw(rng.integers(5, 15, 50))
  with pytest.warns(dpmm_jax.FewShotWarning,
                    match=f"top {_few_shot_components(145)} principal components"):
    det = dpmm_jax.fit_detector(x, y, "tied")
  train, inside, outside = (np.median(np.asarray(dpmm_jax.score(det, a)))
                            for a in (x, known, unseen))
  assert inside > 0.0 and abs(inside - train) < 0.5 * abs(train)
  assert outside < inside - 100.0


def test_few_shot_reduction_is_per_model_in_fit_detectors():
  """``fit_detectors`` shares one preparation: the hierarchical models get the reduced
  one (prepared once, the same as ``fit_detector``'s), RMDS keeps every direction."""
  x, y, x_test = _blobs(seed=3, per_class=2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", dpmm_jax.FewShotWarning)
    both = dpmm_jax.fit_detectors(x, y, ("diag", "coupled", "rmds"))
    alone = dpmm_jax.fit_detector(x, y, "diag")
  kept = _few_shot_components(3)
  assert both["diag"].transform.projection.shape == (D, kept)
  assert both["coupled"].transform.projection.shape == (D, kept)
  assert both["rmds"].transform.projection.shape == (D, D)
  np.testing.assert_array_equal(dpmm_jax.score(both["diag"], x_test),
                                dpmm_jax.score(alone, x_test))


def test_the_suggested_num_components_is_one_that_fits():
  """Few-shot features (K = 10, N_k = 10, D = 256, isotropic; N - K = 90 < D' = 99).
  Near N - K the fit is decided by round-off (with the caller's num_components: 86
  components fail, 85 and 88 fit), so N - K, the suggestion before session 23, is no safe
  answer. The error for a caller's 99 components suggests the most top principal
  components that keep Sigma0 non-singular with a margin, at most FEW_SHOT_FRACTION
  (N - K) (67), and the default fit uses that number."""
  rng = np.random.default_rng(1)
  y = np.repeat(np.arange(10), 10)
  x = (2.0 * rng.normal(size=(10, 256))[y] + rng.normal(size=(100, 256))).astype(np.float32)
  kept = _few_shot_components(90)
  with pytest.raises(ValueError, match=rf"N - K = 90 < D = 99.*Use num_components={kept} "
                                       r"\(top principal"):
    dpmm_jax.fit_detector(x, y, "diag", num_components=99)
  with pytest.warns(dpmm_jax.FewShotWarning, match=f"top {kept} principal components"):
    det = dpmm_jax.fit_detector(x, y, "diag")
  assert det.transform.projection.shape == (256, kept)
  _finite_scores(det, x[:20] + 0.1)


@pytest.mark.parametrize("model", ["mds", "rmds", "msp"])
def test_baselines_floor_a_singular_within_class_covariance(model):
  x, y, x_test = _blobs(seed=3, per_class=2)
  det = _fit(x, y, model)
  assert det.transform.projection.shape == (D, D)          # every direction kept
  _finite_scores(det, x_test)


def _with_constant(x, value=1.5):
  x = x.copy()
  x[:, 2] = value
  return x


def _with_duplicate(x):
  x = x.copy()
  x[:, 3] = x[:, 1]
  return x


@pytest.mark.parametrize("model", dpmm_jax.MODELS)
@pytest.mark.parametrize("degenerate", [_with_constant, _with_duplicate])
def test_constant_and_duplicated_features_are_dropped_by_the_preprocessing(model, degenerate):
  x, y, x_test = _data()
  det = _fit(degenerate(x), y, model)
  assert det.transform.projection.shape == (D, D - 1)   # one direction had no variance
  _finite_scores(det, degenerate(x_test))


@pytest.mark.parametrize("model", HIERARCHICAL)
def test_constant_feature_without_preprocessing_is_named(model):
  x, y, _ = _data()
  with pytest.raises(ValueError, match=r"1 of the 4 features have \(almost\) no within-class "
                                       r"variance \(first: \[2\]\).*preprocess=True"):
    dpmm_jax.fit_detector(_with_constant(x), y, model, preprocess=False)


def test_feature_constant_within_each_class_is_named():
  """A feature that encodes the label: after the preprocessing the flat direction is a
  combination of features, so the error points to the raw fit that names them; the raw
  fit names feature 0."""
  x, y, _ = _data()
  x = x.copy()
  x[:, 0] = y
  with pytest.raises(ValueError, match=r"1 of the 4 directions kept by the preprocessing .*"
                                       r"combinations of features, that are constant within "
                                       r"each class .*a fit with preprocess=False names"):
    dpmm_jax.fit_detector(x, y, "diag")
  with pytest.raises(ValueError, match=r"1 of the 4 features .*\(first: \[0\]\).*constant "
                                       r"within each class"):
    dpmm_jax.fit_detector(x, y, "diag", preprocess=False)


def test_duplicated_feature_without_preprocessing():
  x, y, x_test = _data()
  with pytest.raises(ValueError, match=r"numerical rank is 3 < D = 4 \(duplicated"):
    dpmm_jax.fit_detector(_with_duplicate(x), y, "full", preprocess=False)
  # The diagonal models never need the correlations.
  _finite_scores(_fit(_with_duplicate(x), y, "diag", preprocess=False), _with_duplicate(x_test))


@pytest.mark.parametrize("model", ["mds", "rmds", "indep_rmds", "tied", "msp"])
def test_constant_feature_without_preprocessing_is_floored_by_the_baselines(model):
  x, y, x_test = _data()
  _finite_scores(_fit(_with_constant(x), y, model, preprocess=False), _with_constant(x_test))


@functools.lru_cache(maxsize=None)
def _six_classes():
  # Six classes in 4-D: the between-class covariance has full rank, so the preprocessing's
  # within-class eigenbasis is well determined (with K - 1 < D it is not, and the diagonal
  # models' fits then depend on round-off through the arbitrary basis).
  return _blobs(seed=4, num_classes=K_TIED, per_class=25)


@pytest.mark.parametrize("model", GAUSSIAN)
@pytest.mark.parametrize("preprocess", [True, False])
@pytest.mark.parametrize("scale", [1e-8, 1e8])
def test_tiny_and_huge_feature_scales(model, preprocess, scale):
  """Every Gaussian model is equivariant under x -> c x (all log densities shift by the
  same -D log c), so in exact arithmetic the scores do not move. They must not move
  beyond round-off, except for EM on raw features: its relative tolerance on the log
  marginal likelihood, which shifts by -N D log c, then stops EM at a different point
  (documented); there only the ranking must survive. With the preprocessing, the
  hierarchical fits run 12 plain EM steps and no stopping rule: EM run to a tolerance
  ends on a flat ridge of nu0 where round-off decides the stopping point, which would
  test EM's stopping, not equivariance. (XLA's -O0 code generation stopped the coupled
  fit at nu0_2 = 215 against 182, log marginal likelihoods 9e-4 apart, which moved far
  point 16 by 13 nats; even at tol = 1e-9 the diag fit of the 1e-8 features stopped at
  its round-off floor after 16 steps, at nu0_2 = 183 against 214 after 19, and moved it
  by 12.8 nats on an AVX-512 machine, session 22.) The fixed steps agree to ~5e-6."""
  x, y, x_test = _six_classes()
  options = ({"tol": 1e-30, "max_iter": 12, "accelerate": False}
             if model in HIERARCHICAL and preprocess else {})
  ref_det = _fit(x, y, model, preprocess=preprocess, **options)
  ref = np.asarray(dpmm_jax.score(ref_det, x_test))
  c = np.float32(scale)
  det = _fit(x * c, y, model, preprocess=preprocess, **options)
  s = _finite_scores(det, x_test * c)
  n = 12   # the first 12 test points are in-distribution, the rest far outliers
  np.testing.assert_array_equal(np.asarray(dpmm_jax.predict(det, x_test[:n] * c)),
                                np.asarray(dpmm_jax.predict(ref_det, x_test[:n])))
  assert abs(metrics.auroc(s[:n], s[n:]) - metrics.auroc(ref[:n], ref[n:])) < 1e-2
  if model in HIERARCHICAL and not preprocess:
    assert scipy.stats.spearmanr(s, ref)[0] > 0.99
  elif model in HIERARCHICAL:
    np.testing.assert_allclose(s, ref, rtol=1e-4, atol=1e-4 * np.std(ref))
  else:
    np.testing.assert_allclose(s, ref, rtol=1e-3, atol=1e-3 * np.std(ref))


@pytest.mark.parametrize("scale", [1e-8, 1e8])
def test_msp_heads_at_tiny_and_huge_scales_are_finite(scale):
  x, y, x_test = _data()
  c = np.float32(scale)
  for model in ("msp", "temp_msp"):
    _finite_scores(_fit(x * c, y, model), x_test * c)


# ------------------------------------------------------------------- EM edge cases
NK_TIED = 60


@functools.lru_cache(maxsize=None)
def _tied_data():
  """Truly tied: every class is the same point cloud shifted, so all class scatters are
  identical and the marginal likelihood increases in nu0 all the way to infinity. The
  class means are spread exactly like the cloud (their scatter is 36 x the cloud's), so
  the tied model's prior on the means (the total covariance) is the hierarchical models'
  Sigma0 / kappa0 up to the value of kappa0."""
  rng = np.random.default_rng(7)
  chol = np.linalg.cholesky(np.diag([1.0, 0.7, 1.3, 0.9]) + 0.3)
  cloud = rng.normal(size=(NK_TIED, D))
  cloud -= cloud.mean(0)
  cloud = cloud @ np.linalg.inv(np.linalg.cholesky(cloud.T @ cloud / NK_TIED)).T @ chol.T
  z = rng.normal(size=(K_TIED, D))
  z -= z.mean(0)
  means = 6.0 * z @ np.linalg.inv(np.linalg.cholesky(z.T @ z / K_TIED)).T @ chol.T
  x = (means[:, None, :] + cloud[None]).reshape(-1, D)
  y = np.repeat(np.arange(K_TIED), NK_TIED).astype(np.int32)
  x_test = np.concatenate([means[np.arange(30) % K_TIED] + rng.normal(size=(30, D)) @ chol.T,
                           6.0 * rng.normal(size=(30, D)) @ chol.T])
  return x.astype(np.float32), y, x_test.astype(np.float32)


def _gaussian_limit_scores(det, x):
  """Reference for nu0 -> inf (and gamma_k = 1) with the fitted mu0, Sigma0, kappa0: the
  tied-covariance Gaussian DPMM x | k ~ N(mu_k, Sigma0), mu_k ~ N(mu0, Sigma0 / kappa0)
  (per dimension for the diagonal models), in float64, in the model space."""
  h = det.params.hyper
  x_train, y_train, _ = _tied_data()
  apply = lambda a: np.asarray(preprocess.apply(det.transform, a), np.float64)  # noqa: E731
  z, zt = apply(x), apply(x_train)
  mu0 = np.asarray(h.loc, np.float64)
  kappa0 = np.asarray(h.mean_concentration, np.float64)
  if det.model == "full":
    cov = np.asarray(h.mean_cov, np.float64)
    scaled = lambda kappa: cov * (1.0 + 1.0 / kappa)  # noqa: E731
  else:
    var = np.asarray(h.var, np.float64)
    scaled = lambda kappa: np.diag(var * (1.0 + 1.0 / kappa))  # noqa: E731
  class_lp = []
  for k in range(det.num_classes):
    n = np.sum(y_train == k)
    kappa = kappa0 + n
    loc = (kappa0 * mu0 + n * zt[y_train == k].mean(0)) / kappa
    class_lp.append(np.log(n) + scipy.stats.multivariate_normal(loc, scaled(kappa)).logpdf(z))
  prior = scipy.stats.multivariate_normal(mu0, scaled(kappa0)).logpdf(z)
  return scipy.special.logsumexp(np.stack(class_lp, -1), axis=-1) - prior


@pytest.mark.parametrize("model", HIERARCHICAL)
def test_truly_tied_covariances_end_at_the_df_cap_and_score_like_the_tied_model(model):
  x, y, x_test = _tied_data()
  with warnings.catch_warnings():
    warnings.simplefilter("error", dpmm_jax.ConvergenceWarning)
    det, report = dpmm_jax.fit_detector_with_info(x, y, model)
  df = np.asarray(det.params.hyper.df)
  cap = 1e6 + (D + 1 if model == "full" else 0)
  np.testing.assert_allclose(df, cap, rtol=1e-6)
  assert report.converged and report.at_cap and bool(np.all(report.em.newton.at_upper))
  if model == "coupled":      # gamma_k = 1 for every class: alpha0 at its cap too
    np.testing.assert_allclose(float(det.params.hyper.gamma_shape), 1e6, rtol=1e-6)
  s = _finite_scores(det, x_test)
  ref = _gaussian_limit_scores(det, x_test)
  assert scipy.stats.spearmanr(s, ref)[0] > 0.9999
  np.testing.assert_allclose(s, ref, atol=1e-2 * np.std(ref))
  tied = np.asarray(dpmm_jax.score(_fit(x, y, "tied"), x_test))
  assert scipy.stats.spearmanr(s, tied)[0] > 0.99
  n = len(x_test) // 2
  assert abs(metrics.auroc(s[:n], s[n:]) - metrics.auroc(tied[:n], tied[n:])) < 0.02


@pytest.mark.parametrize("model", HIERARCHICAL)
def test_non_convergence_is_reported_and_warned(model):
  x, y, _ = _data()
  with pytest.warns(dpmm_jax.ConvergenceWarning, match="max_iter=2"):
    det, report = dpmm_jax.fit_detector_with_info(x, y, model, max_iter=2, tol=1e-12)
  assert not report.converged and report.num_iters == 2
  assert not bool(report.em.converged)
  _finite_scores(det, x)


def test_converged_fits_do_not_warn():
  x, y, _ = _data()
  with warnings.catch_warnings():
    warnings.simplefilter("error", dpmm_jax.ConvergenceWarning)
    _, report = dpmm_jax.fit_detector_with_info(x, y, "diag")
  assert report.converged and report.num_iters >= 1


def test_reports_of_models_without_em():
  x, y, _ = _data()
  for model in ("tied", "rmds"):
    _, report = dpmm_jax.fit_detector_with_info(x, y, model)
    assert report.em is None and report.converged and report.num_iters == 0
    assert not report.at_cap


# --------------------------------------------------------------------- determinism
@pytest.mark.parametrize("model", dpmm_jax.MODELS)
def test_same_inputs_and_seed_give_identical_outputs(model):
  x, y, x_test = _data()
  a = dpmm_jax.fit_detector(x, y, model, key=jax.random.PRNGKey(3))
  b = dpmm_jax.fit_detector(x.copy(), y.copy(), model, key=jax.random.PRNGKey(3))
  for leaf_a, leaf_b in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(leaf_a), np.asarray(leaf_b))
  np.testing.assert_array_equal(np.asarray(dpmm_jax.score(a, x_test)),
                                np.asarray(dpmm_jax.score(b, x_test)))
  np.testing.assert_array_equal(np.asarray(dpmm_jax.predict(a, x_test)),
                                np.asarray(dpmm_jax.predict(b, x_test)))


# ------------------------------------------------ numerics at large concentrations
def _nix_log_evidence_f64(loc, var, df, kappa, count, mean, sq_dev):
  """float64 reference straight from the normalisers (cancellation is harmless there
  up to df ~ 1e6: relative error ~ 1e-16 * df log df)."""
  n = count[:, None]
  kp, nup = kappa + n, df + n
  diff = mean - loc
  nu_s2 = df * var + sq_dev + kappa * n / kp * diff ** 2

  def log_z(k, nu, nus2):
    return -0.5 * np.log(k) + scipy.special.gammaln(nu / 2) - nu / 2 * np.log(nus2 / 2)
  return log_z(kp, nup, nu_s2) - log_z(kappa, df, df * var) - 0.5 * n * np.log(2 * np.pi)


@pytest.mark.parametrize("df", [0.5, 3.0, 40.0, 1e3, 1e5, 1e6])
def test_nix_log_evidence_in_float32_is_accurate_at_any_df(df):
  rng = np.random.default_rng(0)
  count = np.array([1.0, 5.0, 300.0])
  mean = rng.normal(size=(3, D))
  sq_dev = rng.uniform(0.0, 2.0, size=(3, D)) * count[:, None]
  loc, var, kappa = rng.normal(size=D), rng.uniform(0.5, 2.0, D), rng.uniform(0.01, 3, D)
  ref = _nix_log_evidence_f64(loc, var, df, kappa, count, mean, sq_dev)
  prior = nix.prior(jnp.asarray(loc, jnp.float32), jnp.asarray(var, jnp.float32),
                    jnp.full(D, df, jnp.float32), jnp.asarray(kappa, jnp.float32))
  got = np.asarray(nix.log_evidence(prior, jnp.asarray(count, jnp.float32),
                                    jnp.asarray(mean, jnp.float32),
                                    jnp.asarray(sq_dev, jnp.float32)), np.float64)
  # A few float32 ulps of the terms, independent of df (the direct float32 difference of
  # normalisers is off by ~df log(df) * 6e-8: ~1 nat at df = 1e6).
  err, bound = np.abs(got - ref), 2e-6 * np.abs(ref) + 2e-5 * (1 + count[:, None])
  assert np.all(err <= bound), (err, bound)
  post = nix.posterior(prior, jnp.asarray(count, jnp.float32), jnp.asarray(mean, jnp.float32),
                       jnp.asarray(sq_dev, jnp.float32))
  if df <= 1e3:   # same quantity as the direct form where that is still accurate
    np.testing.assert_allclose(
        got, np.asarray(nix.log_marginal_likelihood(prior, post, jnp.asarray(count))),
        rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("z", [0.3, 4.0, 9.99, 10.0, 250.0, 5e5, 1e7])
@pytest.mark.parametrize("h", [0.5, 1.0, 12.0, 650.0])
def test_log_gamma_ratio_excess_in_float32(z, h):
  if float(h).is_integer():   # exact: lgamma(z + h) - lgamma(z) = sum_j log(z + j)
    ref = float(np.sum(np.log1p(np.arange(h) / z)))
  elif z < 1e3:
    ref = scipy.special.gammaln(z + h) - scipy.special.gammaln(z) - h * np.log(z)
  else:
    pytest.skip("no float64 reference without cancellation")
  got = float(special.log_gamma_ratio_excess(jnp.float32(z), jnp.float32(h)))
  # Below z = 10 the direct formula carries a few ulps of each log-gamma; above, a few ulps
  # of the (small) result and of h. The naive difference is off by ~1 at z = 1e7.
  eps = float(np.finfo(np.float32).eps)
  direct_terms = (abs(scipy.special.gammaln(z + h)) + abs(scipy.special.gammaln(z))
                  + h * abs(np.log(z)))
  bound = 8 * eps * (direct_terms if z < 10 else abs(ref) + h)
  assert abs(got - ref) <= bound, (got, ref, bound)


@pytest.mark.parametrize("shape", [0.5, 3.0, 20.0, 1e3, 1e6])
def test_log_gamma_density_of_log_in_float32(shape):
  u = np.array([-3.0, -0.5, -0.05, 0.0, 1e-3, 0.08, 0.5, 2.0])
  u = u / np.sqrt(shape) if shape > 1 else u
  ref = (shape * np.log(shape) - scipy.special.gammaln(shape) + shape * u
         - shape * np.exp(u))
  ref_stable = (scipy.special.xlogy(shape, shape) - shape - scipy.special.gammaln(shape)
                - shape * (np.expm1(u) - u))
  np.testing.assert_allclose(ref, ref_stable, atol=1e-9 * shape)
  got = np.asarray(quadrature.log_gamma_density_of_log(jnp.asarray(u, jnp.float32),
                                                       jnp.float32(shape)))
  np.testing.assert_allclose(got, ref_stable, rtol=1e-5, atol=1e-5)
