"""dpmm_jax.sklearn: scikit-learn's estimator checks and the estimators' own contract."""
import numpy as np
import pytest

pytest.importorskip("sklearn")
from sklearn.base import clone  # pylint: disable=g-import-not-at-top
from sklearn.utils.estimator_checks import parametrize_with_checks

import dpmm_jax
from dpmm_jax.sklearn import OODClassifier, OODDetector

# Checks that cannot apply, and why (scikit-learn runs them, they must fail):
NOT_APPLICABLE = {
    # Both call fit(X) without labels: scikit-learn's outlier detectors are
    # unsupervised, while this one learns its priors from the variation between the
    # labelled training classes (K >= 2). fit(X, y) and fit_predict(X, y) work.
    "check_outliers_train": "needs class labels y: fit(X) alone is not defined",
    "check_outliers_fit_predict": "needs class labels y: fit_predict(X) is not defined",
}


# One DPMM (tied: closed-form fit, few compilations) per estimator class; the other
# models differ only in dpmm_jax.fit_detector's options, which the tests below cover.
@parametrize_with_checks(
    [OODClassifier(model="tied"), OODDetector(model="tied")],
    expected_failed_checks=lambda est: NOT_APPLICABLE if isinstance(est, OODDetector)
    else {})
def test_sklearn_estimator_checks(estimator, check):
  check(estimator)


def _data(seed=0, n=40):
  rng = np.random.default_rng(seed)
  names = np.array(["cat", "dog", "emu"])
  means = np.array([[0.0, 0.0, 0.0], [6.0, 0.0, 1.0], [0.0, 6.0, -1.0]])
  y = names[np.repeat(np.arange(3), n)]
  x = means[np.repeat(np.arange(3), n)] + rng.normal(size=(3 * n, 3))
  x_ood = rng.normal(size=(30, 3)) + np.array([20.0, 20.0, 20.0])
  return x, y, x_ood


def test_detector_contract():
  x, y, x_ood = _data()
  det = OODDetector(model="diag", contamination=0.1, max_iter=50).fit(x, y)
  assert list(det.classes_) == ["cat", "dog", "emu"] and det.n_features_in_ == 3
  # Scores are dpmm_jax's, higher = more in-distribution.
  np.testing.assert_allclose(det.score_samples(x), np.asarray(
      dpmm_jax.score(det.detector_, x), np.float64))
  # contamination: that share of the training points is flagged.
  assert np.mean(det.predict(x) == -1) == pytest.approx(0.1, abs=1.5 / len(x))
  assert np.all(det.predict(x_ood) == -1)
  np.testing.assert_allclose(det.decision_function(x), det.score_samples(x) - det.offset_)
  proba = det.predict_proba(x_ood)
  assert proba.shape == (30, 2) and np.allclose(proba.sum(1), 1.0)
  np.testing.assert_allclose(proba[:, 1], np.asarray(dpmm_jax.outlier_probability(
      det.detector_, x_ood, alpha=1.0), np.float64), rtol=1e-6)
  assert np.all(proba[:, 1] > 0.5)
  # Threshold from held-out ID data: 95 % of them accepted.
  x_val, _, _ = _data(seed=1)
  det.set_threshold(x_val, tpr=0.95)
  assert np.mean(det.predict(x_val) == 1) == pytest.approx(0.95, abs=1.5 / len(x_val))
  # Every model option is a parameter.
  params = det.get_params()
  for opts in dpmm_jax.MODEL_OPTIONS.values():
    assert set(opts) <= set(params)
  assert clone(det).set_params(max_iter=7).max_iter == 7
  # Options the model does not take: a clear error naming the model.
  with pytest.raises(TypeError, match=r"'rmds'.*options are rtol"):
    OODDetector(model="rmds", max_iter=5).fit(x, y)
  # Baselines have no new-class probability.
  assert not hasattr(OODDetector(model="rmds"), "predict_proba")


def test_classifier_contract():
  x, y, x_ood = _data()
  clf = OODClassifier(model="rmds").fit(x, y)
  assert clf.score(x, y) > 0.95
  assert set(clf.predict(x)) <= {"cat", "dog", "emu"}
  proba = clf.predict_proba(x[:5])
  assert proba.shape == (5, 3) and np.allclose(proba.sum(1), 1.0)
  assert np.all(clf.predict_ood(x_ood) == -1)
  with pytest.raises(ValueError, match="at least 2 classes"):
    OODClassifier().fit(x, np.full(len(x), "cat"))
