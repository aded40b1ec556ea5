"""scikit-learn estimators: an OOD detector and a classifier that also scores OOD-ness.

scikit-learn is an optional extra (``pip install "dpmm_jax[sklearn]"``); it is imported
when this module is, never by ``import dpmm_jax``.

* :class:`OODDetector` follows scikit-learn's outlier-detector conventions
  (``IsolationForest``, ``LocalOutlierFactor``): ``fit(X, y)`` with class labels,
  ``score_samples`` (higher = more in-distribution), ``decision_function`` (negative =
  OOD), ``predict`` (+1 in-distribution, -1 OOD), and for the DPMM models
  ``predict_proba`` of the new-class event.
* :class:`OODClassifier` is a scikit-learn classifier (``predict`` returns the class
  labels, ``predict_proba`` the class posterior) with the OOD score as
  ``score_samples`` and the outlier decision as ``predict_ood``.

Labels may be any sortable hashable values (strings, ints, ...): ``classes_`` holds them
in sorted order, as ``LabelEncoder`` does. Every option of ``dpmm_jax.fit_detector`` and
of the models (``dpmm_jax.MODEL_OPTIONS``) is a constructor parameter, so
``get_params`` / ``set_params`` / ``GridSearchCV`` reach them; a model option left at
None uses the model's default, and one set for a model that does not take it is an
error at ``fit``.

Threshold: ``contamination`` (default 0.05) sets ``offset_`` so that that share of the
*training* points is flagged as OOD. Training scores are in-sample (optimistic), so for
a calibrated rate call ``set_threshold(X_val, tpr=0.95)`` with held-out ID data: then
95 % of those points are accepted.
"""
from typing import Any, Dict

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, OutlierMixin
from sklearn.utils.metaestimators import available_if
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from dpmm_jax import api
from dpmm_jax import scores as scores_lib

__all__ = ["OODDetector", "OODClassifier"]

_MODEL_OPTION_NAMES = tuple(sorted({o for opts in api.MODEL_OPTIONS.values() for o in opts}))


def _is_dpmm(estimator) -> bool:
  return estimator.model in api.DPMM_MODELS


class _Base(BaseEstimator):
  """Shared fit and scoring; see the module docstring."""

  def __init__(self, model: str = "tied", *, preprocess: bool = True,
               num_components=None, alpha: float = 1.0, contamination: float = 0.05,
               random_state=None, chunk_size: int = 65536, df=None,
               mean_concentration=None, gamma_shape=None, tol=None, max_iter=None,
               df_cap=None, options=None, rtol=None, pseudo_count=None, num_steps=None,
               learning_rate=None, weight_decay=None, batch_size=None, accelerate=None,
               prior_scale=None, max_rank=None, edge_scale=None):
    self.model = model
    self.preprocess = preprocess
    self.num_components = num_components
    self.alpha = alpha
    self.contamination = contamination
    self.random_state = random_state
    self.chunk_size = chunk_size
    self.df = df
    self.mean_concentration = mean_concentration
    self.gamma_shape = gamma_shape
    self.tol = tol
    self.max_iter = max_iter
    self.df_cap = df_cap
    self.options = options
    self.rtol = rtol
    self.pseudo_count = pseudo_count
    self.num_steps = num_steps
    self.learning_rate = learning_rate
    self.weight_decay = weight_decay
    self.batch_size = batch_size
    self.accelerate = accelerate
    self.prior_scale = prior_scale
    self.max_rank = max_rank
    self.edge_scale = edge_scale

  def _model_options(self) -> Dict[str, Any]:
    return {name: getattr(self, name) for name in _MODEL_OPTION_NAMES
            if getattr(self, name) is not None}

  def fit(self, X, y):
    """Fits the detector on features ``X`` (N, D) with class labels ``y`` (N,).

    Returns:
      self.
    """
    if not isinstance(self.contamination, (int, float)) or not (
        0.0 < self.contamination <= 0.5):
      raise ValueError(f"contamination must be in (0, 0.5], got {self.contamination!r}.")
    X, y = validate_data(self, X, y, dtype=[np.float64, np.float32])
    check_classification_targets(y)
    self.classes_, y_idx = np.unique(y, return_inverse=True)
    if self.classes_.size < 2:
      raise ValueError(
          f"{type(self).__name__} needs at least 2 classes in y, got 1 class "
          f"({self.classes_[0]!r}): the priors are learned from the variation between "
          "classes.")
    key = None
    if self.model in ("msp", "temp_msp"):
      import jax  # pylint: disable=g-import-not-at-top
      seed = np.random.RandomState(self.random_state).randint(2**31 - 1) if not isinstance(
          self.random_state, (int, np.integer)) else int(self.random_state)
      key = jax.random.PRNGKey(seed)
    self.detector_, self.fit_report_ = api.fit_detector_with_info(
        X, y_idx.astype(np.int32), self.model, num_classes=self.classes_.size,
        preprocess=self.preprocess, num_components=self.num_components,
        chunk_size=self.chunk_size, key=key, **self._model_options())
    # EM iterations; closed-form fits (baselines, tied) and MSP heads count as one step.
    self.n_iter_ = max(1, self.fit_report_.num_iters)
    train_scores = self._score(X)
    self.offset_ = float(np.quantile(train_scores, self.contamination))
    return self

  def _score(self, X) -> np.ndarray:
    return np.asarray(api.score(self.detector_, X), np.float64)

  def _check_X(self, X):
    check_is_fitted(self)
    return validate_data(self, X, reset=False, dtype=[np.float64, np.float32])

  def score_samples(self, X) -> np.ndarray:
    """(M,) OOD score, higher = more in-distribution (the DPMM score for DPMM models)."""
    return self._score(self._check_X(X))

  def set_threshold(self, X, tpr: float = 0.95):
    """Sets ``offset_`` so that a share ``tpr`` of the ID points ``X`` (held out from
    training) score at or above it, i.e. are predicted in-distribution.

    Returns:
      self.
    """
    if not 0.0 < float(tpr) <= 1.0:
      raise ValueError(f"tpr must be in (0, 1], got {tpr!r}.")
    s = self.score_samples(X)
    self.offset_ = float(np.quantile(s, 1.0 - float(tpr)))
    return self

  @available_if(_is_dpmm)
  def outlier_probability(self, X) -> np.ndarray:
    """(M,) p(y = K+1 | x), the probability of a new class (DPMM models only)."""
    return np.asarray(scores_lib.outlier_probability(self.score_samples(X), self.alpha),
                      np.float64)

  def _more_tags(self):  # scikit-learn < 1.6
    return {"requires_y": True}

  def __sklearn_tags__(self):
    tags = super().__sklearn_tags__()
    tags.target_tags.required = True
    tags.input_tags.allow_nan = False
    return tags


class OODDetector(OutlierMixin, _Base):
  """scikit-learn outlier detector fitted on labelled in-distribution data.

  Args:
    model: one of ``dpmm_jax.MODELS`` (default ``"tied"``).
    preprocess, num_components, chunk_size: as in ``dpmm_jax.fit_detector``.
    alpha: DP concentration of ``predict_proba`` / ``outlier_probability``.
    contamination: share of training points below ``offset_`` (default 0.05).
    random_state: seed of the MSP heads' minibatches (other models are deterministic).
    df, mean_concentration, gamma_shape, tol, max_iter, df_cap, options, rtol,
      pseudo_count, num_steps, learning_rate, weight_decay, batch_size, accelerate,
      prior_scale, max_rank, edge_scale: model options
      (``dpmm_jax.MODEL_OPTIONS``); None = the model's default.

  Attributes:
    classes_: (K,) the training labels, sorted.
    detector_: the fitted ``dpmm_jax.Detector``.
    fit_report_: the ``dpmm_jax.FitReport`` (EM trace, convergence).
    offset_: the threshold on ``score_samples``.
    n_features_in_: D.
  """

  def fit_predict(self, X, y, **kwargs) -> np.ndarray:  # pylint: disable=arguments-differ
    """Fits on ``(X, y)`` and returns ``predict(X)`` (+1 / -1)."""
    return self.fit(X, y, **kwargs).predict(X)

  def decision_function(self, X) -> np.ndarray:
    """(M,) ``score_samples(X) - offset_``; negative = predicted OOD."""
    return self.score_samples(X) - self.offset_

  def predict(self, X) -> np.ndarray:
    """(M,) +1 for in-distribution, -1 for OOD (``decision_function < 0``)."""
    return np.where(self.decision_function(X) >= 0, 1, -1).astype(np.int64)

  @available_if(_is_dpmm)
  def predict_proba(self, X) -> np.ndarray:
    """(M, 2): column 0 p(one of the K known classes | x), column 1 p(new class | x)
    under the DPMM with concentration ``alpha`` (DPMM models only)."""
    p_new = self.outlier_probability(X)
    return np.stack([1.0 - p_new, p_new], axis=1)


class OODClassifier(ClassifierMixin, _Base):
  """scikit-learn classifier over the training classes that also scores OOD-ness.

  ``predict`` returns class labels, ``predict_proba`` the posterior over the K classes
  (softmax of the per-class scores: ``log N_k + log p(x | D_k)`` for the DPMMs,
  ``-MD_k`` / ``RMD_k`` for the Mahalanobis baselines, logits for the MSP heads), and
  ``decision_function`` those per-class scores. ``score_samples`` is the OOD score and
  ``predict_ood`` the +1 / -1 decision at ``offset_``. Arguments as :class:`OODDetector`.
  """

  def _class_scores(self, X) -> np.ndarray:
    X = self._check_X(X)
    return np.asarray(api.class_scores(self.detector_, X), np.float64)

  def decision_function(self, X) -> np.ndarray:
    """(M, K) per-class scores (columns in the order of ``classes_``); with two classes
    (M,), the second class's score minus the first's (scikit-learn's binary layout)."""
    z = self._class_scores(X)
    return z[:, 1] - z[:, 0] if z.shape[1] == 2 else z

  def predict_proba(self, X) -> np.ndarray:
    """(M, K) class posterior given that x is in-distribution."""
    z = self._class_scores(X)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)

  def predict(self, X) -> np.ndarray:
    """(M,) predicted class labels (from ``classes_``)."""
    z = self._class_scores(X)
    return self.classes_[np.argmax(z, axis=1)]

  def predict_ood(self, X) -> np.ndarray:
    """(M,) +1 for in-distribution, -1 for OOD (``score_samples < offset_``)."""
    return np.where(self.score_samples(X) >= self.offset_, 1, -1).astype(np.int64)
