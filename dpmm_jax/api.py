"""The one-call API: fit a detector, then score, predict and compute outlier probabilities.

A ``Detector`` is a pytree (the model name is static metadata), so it can be passed
through ``jax.jit``; it carries the fitted section-8 transform and the fitted model.
"""
import dataclasses
import functools
from typing import Any, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import preprocess as preprocess_lib
from dpmm_jax import scores as scores_lib
from dpmm_jax import stats as stats_lib
from dpmm_jax import validation
from dpmm_jax.models import coupled, diag, full, linear, mahalanobis, tied

MODELS = ("mds", "rmds", "indep_rmds", "msp", "temp_msp", "tied", "full", "diag", "coupled")
DPMM_MODELS = ("tied", "full", "diag", "coupled")
# Models whose fit needs the (K, D, D) per-class scatter.
_FULL_STATS = ("indep_rmds", "full")
MSP_TEMPERATURE = 1000.0


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("transform", "params"), meta_fields=("model", "num_classes"))
@dataclasses.dataclass(frozen=True)
class Detector:
  """A fitted detector.

  Attributes:
    model: one of ``MODELS`` (static).
    num_classes: K (static).
    transform: fitted ``preprocess.Transform`` or None.
    params: the model's fitted parameters (a pytree).
  """
  model: str
  num_classes: int
  transform: Optional[preprocess_lib.Transform]
  params: Any

  @property
  def input_dim(self) -> int:
    if self.transform is not None:
      return self.transform.loc.shape[0]
    return _model_dim(self)


def _model_dim(det) -> int:
  p = det.params
  for name in ("means", "class_loc", "loc"):
    if hasattr(p, name):
      return getattr(p, name).shape[-1]
  if hasattr(p, "class_pred"):
    return p.class_pred.loc.shape[-1]
  if hasattr(p, "weights"):
    return p.weights.shape[0]
  return p.class_mean.shape[-1]


class FitReport(NamedTuple):
  """What ``fit_detector_with_info`` says about the fit: EM info (or None), the
  preprocessing output dimension and the training-set class counts."""
  em: Any
  dim: int
  counts: np.ndarray


def _transformed_chunks(x, y, transform, chunk_size):
  for start in range(0, x.shape[0], chunk_size):
    xc = np.asarray(x[start:start + chunk_size])
    validation.check_finite_chunk(xc, "x", start)
    xc = jnp.asarray(xc, validation._float_dtype(xc.dtype))
    if transform is not None:
      xc = preprocess_lib.apply(transform, xc)
    yield xc, y[start:start + chunk_size]


def _fit_model(model, stats, x_fn, y, key, options):
  if model in ("mds", "rmds"):
    return mahalanobis.fit(stats, **options), None
  if model == "indep_rmds":
    return mahalanobis.fit(stats, independent=True, **options), None
  if model == "tied":
    return tied.fit(stats, **options), None
  if model in ("msp", "temp_msp"):
    key = jax.random.PRNGKey(0) if key is None else key
    params, info = linear.fit(x_fn(), y, stats.num_classes, key=key, **options)
    return params, info
  module = {"full": full, "diag": diag, "coupled": coupled}[model]
  return module.fit(stats, **options)


def fit_detector_with_info(x, y, model: str = "coupled", *, num_classes=None,
                           preprocess: bool = True, num_components=None,
                           chunk_size: int = 65536, key=None, **options):
  """Like ``fit_detector`` but also returns a ``FitReport`` (EM trace, convergence)."""
  if model not in MODELS:
    raise ValueError(f"Unknown model {model!r}; choose one of {MODELS}.")
  x = validation.features(x, "x", allow_memmap=True)
  y, num_classes = validation.labels(y, x.shape[0], num_classes)
  chunk_size = int(min(chunk_size, x.shape[0]))
  dtype = jnp.asarray(np.zeros((), validation._float_dtype(x.dtype))).dtype
  transform = None
  if preprocess:
    raw = stats_lib.from_chunks(_transformed_chunks(x, y, None, chunk_size), num_classes,
                                full=False, chunk_size=chunk_size, dtype=dtype)
    transform = preprocess_lib.fit(raw, num_components)
  elif num_components is not None:
    raise ValueError("num_components needs preprocess=True.")
  stats = stats_lib.from_chunks(_transformed_chunks(x, y, transform, chunk_size),
                                num_classes, full=model in _FULL_STATS,
                                chunk_size=chunk_size, dtype=dtype)

  def transformed_features():
    return jnp.concatenate([c for c, _ in _transformed_chunks(x, y, transform, chunk_size)])

  params, info = _fit_model(model, stats, transformed_features, y, key, options)
  det = Detector(model, num_classes, transform, params)
  return det, FitReport(info, int(stats.dim), np.asarray(stats.count))


def fit_detector(x, y, model: str = "coupled", **kwargs) -> Detector:
  """Fits an OOD detector on training features.

  Args:
    x: (N, D) training features (numpy, jax or ``np.memmap``; read in chunks).
    y: (N,) integer labels in 0..K-1.
    model: one of ``MODELS``.
    num_classes: K (default max(y) + 1; every class needs at least one point).
    preprocess: apply the paper's section-8 whitening/rotation (default True).
    num_components: keep this many top principal components (needs preprocess).
    chunk_size: rows per chunk when accumulating statistics.
    key: PRNG key (MSP heads only).
    **options: passed to the model's fit (e.g. ``tol``, ``max_iter`` for EM models).
  Returns:
    Detector.
  """
  return fit_detector_with_info(x, y, model, **kwargs)[0]


# ----------------------------------------------------------------------- evaluation
def _class_and_score(det: Detector, x):
  """(class scores (M, K), OOD score (M,)) for one chunk, in transformed space."""
  p = det.params
  if det.model in DPMM_MODELS:
    module = {"tied": tied, "full": full, "diag": diag, "coupled": coupled}[det.model]
    class_lp, prior_lp = module.log_predictive(p, x)
    class_scores = p.log_counts + class_lp
    return class_scores, jax.nn.logsumexp(class_scores, -1) - prior_lp
  if det.model == "mds":
    cs = mahalanobis.mds_class_scores(p, x)
    return cs, jnp.max(cs, -1)
  if det.model in ("rmds", "indep_rmds"):
    cs = mahalanobis.rmds_class_scores(p, x)
    return cs, jnp.max(cs, -1)
  temperature = MSP_TEMPERATURE if det.model == "temp_msp" else 1.0
  return linear.logits(p, x), linear.log_msp_score(p, x, temperature)


@jax.jit
def _evaluate_chunk(det: Detector, x):
  if det.transform is not None:
    x = preprocess_lib.apply(det.transform, x)
  class_scores, score = _class_and_score(det, x)
  return class_scores, score


def _evaluate(det: Detector, x, chunk_size: int):
  x = validation.features(x, "x", dim=det.input_dim, allow_memmap=True)
  n = x.shape[0]
  chunk_size = int(min(chunk_size, n))
  dtype = validation._float_dtype(x.dtype)
  class_parts, score_parts = [], []
  for start in range(0, n, chunk_size):
    xc = np.asarray(x[start:start + chunk_size])
    validation.check_finite_chunk(xc, "x", start)
    m = xc.shape[0]
    if m < chunk_size:  # pad to one shape: one compilation for all chunks
      xc = np.concatenate([xc, np.repeat(xc[-1:], chunk_size - m, axis=0)])
    cs, s = _evaluate_chunk(det, jnp.asarray(xc, dtype))
    class_parts.append(cs[:m])
    score_parts.append(s[:m])
  return jnp.concatenate(class_parts), jnp.concatenate(score_parts)


def score(det: Detector, x, chunk_size: int = 2048):
  """(M,) OOD score, higher = more in-distribution (the DPMM score C~ for DPMM models)."""
  return _evaluate(det, x, chunk_size)[1]


def class_scores(det: Detector, x, chunk_size: int = 2048):
  """(M, K) per-class scores (log N_k + log p(x | D_k) for DPMM models; -MD_k for MDS,
  RMD_k for RMDS; logits for MSP heads)."""
  return _evaluate(det, x, chunk_size)[0]


def predict(det: Detector, x, chunk_size: int = 2048):
  """(M,) predicted class index."""
  return jnp.argmax(class_scores(det, x, chunk_size), axis=-1)


def outlier_probability(det: Detector, x, alpha: float = 1.0, chunk_size: int = 2048):
  """(M,) p(y = K+1 | x) under the DPMM with concentration ``alpha`` (DPMM models only)."""
  if det.model not in DPMM_MODELS:
    raise ValueError(f"outlier_probability needs a DPMM model {DPMM_MODELS}, "
                     f"got {det.model!r}.")
  validation.positive(alpha, "alpha")
  return scores_lib.outlier_probability(score(det, x, chunk_size), alpha)
