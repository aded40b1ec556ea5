"""The one-call API: fit a detector, then score, predict and compute outlier probabilities.

A ``Detector`` is a pytree (the model name is static metadata), so it can be passed
through ``jax.jit``; it carries the fitted section-8 transform and the fitted model.

Inputs are validated here (``validation``); what is rejected, and why, is listed in
``docs/failure_modes.md``. The fit never returns a detector with non-finite parameters,
and scoring never returns non-finite scores for finite inputs: both raise instead.
"""
import contextlib
import dataclasses
import functools
import warnings
from typing import Any, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import compiler
from dpmm_jax import eb_uncertainty
from dpmm_jax import em
from dpmm_jax import entry_points
from dpmm_jax import precision
from dpmm_jax import preprocess as preprocess_lib
from dpmm_jax import scores as scores_lib
from dpmm_jax import stats as stats_lib
from dpmm_jax import linalg
from dpmm_jax import validation
from dpmm_jax.models import coupled, diag, full, linear, lowrank, mahalanobis, tied

MODELS = ("mds", "rmds", "indep_rmds", "msp", "temp_msp", "tied", "full", "diag", "coupled",
          "lowrank")
DPMM_MODELS = ("tied", "full", "diag", "coupled", "lowrank")
# Models whose fit needs the (K, D, D) per-class scatter.
_FULL_STATS = ("indep_rmds", "full", "lowrank")
# Models whose fit reads no (D, D) statistic: fitted alone, their statistics pass skips the
# pooled scatter (an (N, D) x (N, D) product), and they are always fitted without it.
_DIAGONAL_STATS = ("diag", "coupled", "msp", "temp_msp")
# Models whose Sigma0 is the average within-class covariance (it must be non-singular).
_HIERARCHICAL = ("full", "diag", "coupled", "lowrank")
# DPMMs fitted on fewer top principal components when the data have too few points for
# their preprocessed dimension (``_few_shot_prepared``). The tied model would floor the
# flat directions instead, and known-class test points, which do vary along them, would
# then score like outliers (K = 5, N_k = 30, D = 200: median score -1988 against 41.9
# for the training points; benchmarks/RESULTS.md, session 23).
_FEW_SHOT_MODELS = _HIERARCHICAL + ("tied",)
# Hierarchical models with the NIW prior (full Sigma0, nu0 > D + 1): EM of ``full``.
_NIW_MODELS = ("full", "lowrank")
_MODULES = {"tied": tied, "full": full, "diag": diag, "coupled": coupled, "lowrank": lowrank}
MSP_TEMPERATURE = 1000.0
_EM_OPTIONS = ("df", "mean_concentration", "tol", "max_iter", "df_cap", "accelerate")
_MSP_OPTIONS = ("num_steps", "learning_rate", "weight_decay", "batch_size")
# The keyword options each model's fit accepts (``**options`` of fit_detector).
MODEL_OPTIONS = {
    "mds": ("rtol",), "rmds": ("rtol",), "indep_rmds": ("pseudo_count", "rtol"),
    "msp": _MSP_OPTIONS, "temp_msp": _MSP_OPTIONS, "tied": ("rtol", "prior_scale"),
    "full": _EM_OPTIONS, "diag": _EM_OPTIONS,
    "coupled": _EM_OPTIONS + ("gamma_shape", "options"),
    "lowrank": _EM_OPTIONS + ("max_rank", "edge_scale"),
}


class ConvergenceWarning(UserWarning):
  """EM stopped at ``max_iter`` before meeting its tolerance (the detector is usable and
  uses the last iterate; ``fit_detector_with_info`` returns the trace)."""


class IdenticalClassWarning(UserWarning):
  """A class's training points are all identical; it is fitted as a single point."""


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


class FewShotWarning(UserWarning):
  """Too few training points for the preprocessed dimension (N - K close to or below
  D'): a hierarchical or tied model was fitted on fewer top principal components, the
  most that keep its Sigma0 non-singular, at most ``FEW_SHOT_FRACTION`` (N - K) (the
  message names the number; pass ``num_components`` to choose)."""


class FitDiagnosticWarning(UserWarning):
  """The fit reached a state worth a look (``FitReport.problems`` lists it): a Newton
  M-step that did not converge or ended on its lower bound, or the coupled model's
  search for a class's posterior mode of log gamma_k that did not converge or was
  clipped at +-30. The detector is usable; its scores for the affected classes rest on
  that state."""


class FitReport(NamedTuple):
  """What ``fit_detector_with_info`` says about the fit: EM info (``em.EMInfo`` for the
  hierarchical models, ``linear.LinearFitInfo`` for MSP heads, else None), the
  preprocessing output dimension, the training-set class counts, ``diagnostics``
  ({name: bool}, hierarchical models only; see the properties) and ``hyper_se``:
  ``eb_uncertainty.HyperStandardErrors`` of the EM hyperparameters (inf and flagged on a
  cap) when the fit was asked for ``standard_errors=True``, else None."""
  em: Any
  dim: int
  counts: np.ndarray
  diagnostics: Optional[Dict[str, bool]] = None
  hyper_se: Any = None

  def _flag(self, name: str) -> bool:
    return bool((self.diagnostics or {}).get(name, False))

  @property
  def converged(self) -> bool:
    """EM met its tolerance (True for models without EM)."""
    return bool(np.asarray(getattr(self.em, "converged", True)))

  @property
  def num_iters(self) -> int:
    """EM iterations run (0 for models without EM)."""
    return int(np.asarray(getattr(self.em, "num_iters", 0)))

  @property
  def at_cap(self) -> bool:
    """Some concentration ended at its cap: nu0 or the coupled model's alpha0 (tied
    covariances), or kappa0 (class means that vary no more than their noise). Its
    optimum is at infinity, which EM reached and reports; not a failure."""
    newton = getattr(self.em, "newton", None)
    nu_alpha = newton is not None and bool(np.any(np.asarray(newton.at_upper)))
    return nu_alpha or self.kappa_at_cap

  @property
  def kappa_at_cap(self) -> bool:
    """kappa0 ended at its cap (1e6): the prior on the class means is a point mass."""
    return self._flag("kappa_at_cap")

  @property
  def newton_converged(self) -> bool:
    """The last EM iteration's Newton M-steps (nu0, alpha0) met their tolerance."""
    newton = getattr(self.em, "newton", None)
    return newton is None or bool(np.all(np.asarray(newton.converged)))

  @property
  def at_lower_bound(self) -> bool:
    """A Newton-updated concentration (nu0, alpha0) ended on its lower bound."""
    return self._flag("at_lower_bound")

  @property
  def mode_search_converged(self) -> bool:
    """Coupled model: every class's Newton search for the mode of log gamma_k converged."""
    return not self._flag("mode_search_not_converged")

  @property
  def mode_clipped(self) -> bool:
    """Coupled model: some class's mode of log gamma_k was clipped at +-30."""
    return self._flag("mode_clipped")

  @property
  def rank_capped(self) -> bool:
    """Lowrank model: some class had more directions above the noise edge than
    ``max_rank`` keeps (its covariance lost real structure; raise max_rank)."""
    return self._flag("rank_capped")

  @property
  def problems(self) -> Tuple[str, ...]:
    """Human-readable list of the diagnostics that call for a look (warned at fit)."""
    out = []
    if not self.newton_converged:
      out.append("a Newton M-step (nu0 or alpha0) did not converge in the last EM iteration")
    if self.at_lower_bound:
      out.append("a concentration (nu0 or alpha0) ended on its lower bound")
    if not self.mode_search_converged:
      out.append("the coupled model's search for a class's mode of log gamma_k did not "
                 "converge")
    if self.mode_clipped:
      out.append("the coupled model clipped a class's mode of log gamma_k at +-30 (a class "
                 "with (almost) no spread, or far larger than the rest)")
    if self.rank_capped:
      out.append("the lowrank model kept max_rank directions of a class that had more above "
                 "the noise edge (raise max_rank)")
    return tuple(out)


def _diagnostics(model: str, params, stats) -> Optional[Dict[str, bool]]:
  """Flags assembled from the fitted hyperparameters (hierarchical models only)."""
  if model not in _HIERARCHICAL:
    return None
  hyper = params.hyper
  module = _MODULES[model]
  kappa_cap = getattr(module, "KAPPA_CAP", diag.KAPPA_CAP)
  kappa = np.asarray(hyper.mean_concentration, np.float64)
  tiny = 1e-6
  # Newton's lower bound is x = theta - offset >= 1e-3 (newton.maximize); full: offset D+1.
  offset = stats.dim + 1.0 if model in _NIW_MODELS else 0.0
  low = [np.asarray(hyper.df, np.float64) - offset]
  if model == "coupled":
    low.append(np.asarray(hyper.gamma_shape, np.float64))
  flags = {"kappa_at_cap": bool(np.any(kappa >= kappa_cap * (1 - tiny))),
           "at_lower_bound": bool(any(np.any(v <= 1e-3 * (1 + 1e-3)) for v in low))}
  if model == "lowrank":
    flags["rank_capped"] = bool(np.any(
        np.asarray(params.num_spikes) > params.factors.shape[1]))
  if model == "coupled":
    mode, _, converged = coupled.posterior_mode(hyper, stats)
    flags["mode_search_not_converged"] = not bool(np.all(np.asarray(converged)))
    flags["mode_clipped"] = bool(np.any(np.abs(np.asarray(mode)) >= coupled.U_BOUND))
  return flags


def _chunk_rows(n: int, chunk_size: int, smallest: int = 32) -> int:
  """Rows per scoring chunk: ``chunk_size``, or for fewer rows the next power of two
  (at least ``smallest``), so batches of varying size share a few compilations instead
  of compiling once per batch size."""
  if n >= chunk_size:
    return chunk_size
  return int(min(chunk_size, max(smallest, 1 << (n - 1).bit_length())))


def _transformed_chunks(x, y, transform, chunk_size, checked: bool = False):
  """(transformed (n, D') chunk, labels) of the training rows, one chunk in memory; the
  pages of a read-only memory map are released as each chunk is read
  (``stats.read_chunk``; without that, each pass over a 3.7 GB file left it all
  resident). The rows are checked for NaN and inf unless ``checked`` (an earlier pass
  did)."""
  for start in range(0, x.shape[0], chunk_size):
    chunk = stats_lib.read_chunk(x[start:start + chunk_size])
    xc = jnp.asarray(validation.check_finite_chunk(chunk, "x", start, check=not checked))
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
  return _MODULES[model].fit(stats, **options)


def _within_variances(stats) -> np.ndarray:
  """(D,) average within-class variance of each coordinate (float64)."""
  total = float(np.sum(np.asarray(stats.count, np.float64)))
  if stats.pooled_scatter is not None:
    return np.diag(np.asarray(stats.pooled_scatter, np.float64)) / total
  return np.asarray(stats.sq_dev, np.float64).sum(axis=0) / total  # the same diagonal


@precision.float32_matmuls
def _flat_directions(stats) -> np.ndarray:
  """Indices of the coordinates whose within-class variance is at most
  ``linalg.default_rtol`` times their total variance."""
  count = np.asarray(stats.count, np.float64)
  total = count.sum()
  within_var = _within_variances(stats)
  rtol = linalg.default_rtol(np.asarray(stats.sq_dev).dtype)
  mean = np.asarray(stats.mean, np.float64)
  centred = mean - count @ mean / total
  total_var = within_var + np.einsum("k,kd->d", count, centred * centred) / total
  return np.flatnonzero(within_var <= rtol * total_var)


@precision.float32_matmuls
def _nonsingular_components(stats, transform, within_var) -> int:
  """The largest num_components whose transform leaves the average within-class
  covariance non-singular (every direction's within-class variance above 4
  ``linalg.default_rtol`` of its total variance), 0 if none; from the statistics in the
  transform's space, without another pass over the data.

  The projection is P = V L^(-1/2) R (V, L: the top total-covariance eigenpairs, R the
  within-class rotation), so P^T P = R^T L^(-1) R: its eigenvectors, by ascending
  eigenvalue, are the whitened top principal directions in the transform's coordinates,
  where the total covariance is I. The smallest eigenvalue of the within-class
  covariance restricted to the first k of them falls as k grows (interlacing), so the
  largest k is found by bisection.
  """
  proj = np.asarray(transform.projection, np.float64)
  _, order = np.linalg.eigh(proj.T @ proj)        # columns: top principal first
  if stats.pooled_scatter is not None:
    within = np.asarray(stats.pooled_scatter, np.float64) / float(np.sum(stats.count))
  else:                            # diagonal in the transform's coordinates by construction
    within = np.diag(within_var)
  rtol = linalg.default_rtol(np.asarray(stats.sq_dev).dtype)

  def nonsingular(k):
    q = order[:, :k]
    # A margin over the fit's own test (``_flat_directions``): the refit recomputes the
    # transform and the statistics, with their own round-off.
    return np.linalg.eigvalsh(q.T @ within @ q)[0] > 4.0 * rtol

  lo, hi = 0, proj.shape[1]                       # nonsingular(lo) holds, hi unknown
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if nonsingular(mid):
      lo = mid
    else:
      hi = mid - 1
  return lo


# With N - K below this many times the preprocessed dimension, the hierarchical models
# and tied (``_FEW_SHOT_MODELS``) get at most FEW_SHOT_FRACTION (N - K) top principal
# components.
_FEW_SHOT_RATIO = 1.25
# A sample covariance from n degrees of freedom in k dimensions has its smallest
# eigenvalue shrunk by about (1 - sqrt(k / n))^2: 0.018 at k = 3n/4, 3e-4 at k = 0.96 n.
# Near the edge the fitted Sigma0 is nearly singular and the axis-aligned models rank
# badly: K = 20, N_k = 8, D = 512 (N - K = 140) scored AUROC 0.83 (coupled, diag) with
# 135 components and 1.000 with 121, 105 or 70 (benchmarks/RESULTS.md, session 23).
FEW_SHOT_FRACTION = 0.75


def _within_dof(stats) -> int:
  """N - K: the degrees of freedom of the pooled within-class scatter."""
  return int(np.sum(np.asarray(stats.count))) - stats.num_classes


def _suggested_components(stats, transform, within_var) -> int:
  """The num_components to suggest or use when Sigma0 is singular after the
  preprocessing: the most top principal components that keep it non-singular
  (``_nonsingular_components``), at most FEW_SHOT_FRACTION (N - K) when the data have
  too few points for their dimension; 0 if none works."""
  usable = _nonsingular_components(stats, transform, within_var)
  dof = _within_dof(stats)
  if dof < _FEW_SHOT_RATIO * stats.dim:
    usable = min(usable, int(FEW_SHOT_FRACTION * dof))
  return max(usable, 0)


@precision.float32_matmuls
def _check_within_class(stats, model: str, preprocessed: bool, transform=None):
  """Rejects training data whose within-class covariance cannot carry the model.

  Every Gaussian model needs some within-class variation; the hierarchical models use
  the average within-class covariance as Sigma0, which must be non-singular (in float
  precision): a feature that is constant within every class, or a full covariance of
  rank below D (duplicated or collinear features, N - K < D), makes the NIW/NIX priors
  improper and the fit NaN. The baselines and the tied model floor such directions.
  """
  count = np.asarray(stats.count, np.float64)
  total = count.sum()
  num_classes, dim = stats.num_classes, stats.dim
  within_var = _within_variances(stats)
  if not np.any(within_var > 0):
    singletons = int(np.sum(count == 1))
    which = ("every class has a single point" if singletons == num_classes else
             f"{singletons} of {num_classes} classes have a single point, the others only "
             "identical points")
    raise ValueError(
        f"The training features have no within-class variation ({which}), so no "
        "covariance can be estimated. Every Gaussian model needs some class with two or "
        "more distinct points (the MSP heads do not).")
  if model not in _HIERARCHICAL:
    return
  rtol = linalg.default_rtol(np.asarray(stats.sq_dev).dtype)
  dof = _within_dof(stats)
  few = f"; N - K = {dof} < D = {dim}" if dof < dim else ""
  flat = _flat_directions(stats)
  if flat.size:
    if preprocessed:
      what = (f"{flat.size} of the {dim} directions kept by the preprocessing have (almost) "
              f"no within-class variance (first: {validation._listed(flat)}): "
              + (f"too few points per class{few}" if dof < dim else
                 # The smallest eigenvalue of a sample covariance with dof degrees of
                 # freedom in D dimensions is ~(1 - sqrt(D / dof))^2 of its scale.
                 f"too few points per class for this many directions (N - K = {dof} is "
                 f"close to D = {dim})" if dof < _FEW_SHOT_RATIO * dim else
                 "features, or combinations of features, that are constant within each "
                 "class but differ between classes (such as a feature that encodes the "
                 "label)"))
      usable = 0 if transform is None else _suggested_components(stats, transform,
                                                                  within_var)
      fixes = []
      if usable:
        fixes.append(f"Use num_components={usable} (top principal components in which it "
                     "is non-singular" + (f", at most {FEW_SHOT_FRACTION:g} (N - K))"
                                          if dof < _FEW_SHOT_RATIO * dim else ")"))
      if dof >= _FEW_SHOT_RATIO * dim or not usable:
        fixes.append("remove the features responsible (a fit with preprocess=False names "
                     "single features that are constant within each class)")
      fix = ", or ".join(fixes)
      fix = fix[0].upper() + fix[1:]
    else:
      what = (f"{flat.size} of the {dim} features have (almost) no within-class variance "
              f"(first: {validation._listed(flat)}): constant features, or features "
              f"constant within each class")
      fix = "Remove them or use preprocess=True (drops constant and duplicated features)"
    raise ValueError(
        f"The {model} model uses the average within-class covariance as its prior scale "
        f"Sigma0, which must be non-singular, but {what}. {fix}, or use model='tied' or "
        "'rmds', which floor such directions.")
  if model in _NIW_MODELS and dim > 1:
    pooled = np.asarray(stats.pooled_scatter, np.float64) / total
    scale = np.sqrt(within_var)
    corr = pooled / np.outer(scale, scale)
    eig = np.linalg.eigvalsh(0.5 * (corr + corr.T))
    rank = int(np.sum(eig > rtol * eig[-1]))
    if rank < dim:
      cause = ("too few points per class" + few if dof < dim
               else "duplicated or linearly dependent features")
      fix = (f"num_components={rank}" if preprocessed
             else "preprocess=True (drops duplicated features) or num_components")
      raise ValueError(
          f"The {model} model uses the average within-class covariance as its prior scale "
          f"Sigma0, which must be non-singular, but its numerical rank is {rank} < D = "
          f"{dim} ({cause}). Use {fix}, or model='diag', 'tied' or 'rmds'.")


def _singletons_for_identical_classes(stats):
  """``stats`` with each class of identical points as one point (``as_singletons``),
  checked on the host first: the common case, no such class, compiles nothing."""
  which = np.asarray(stats_lib.identical_classes(stats))
  return stats_lib.as_singletons(stats, which) if which.any() else stats


def _identical_classes_as_singletons(stats, model: str, stacklevel: int):
  """Fits each class whose N_k > 1 points are all identical as one point (warns).

  Every Gaussian model then treats it the same way: as the de-duplicated singleton class,
  mean = the point, covariance from the prior (hierarchical models, tied) or the pooled
  covariance (baselines). Left as N_k points of zero spread, the per-class-covariance
  models would shrink its covariance by ~1/N_k (independent RMDS, full, diag) or drive its
  scale to zero (coupled: no ordinary point could then be scored). The DPMM class weight
  stays N_k (set after the fit). See docs/failure_modes.md.
  """
  which = np.asarray(stats_lib.identical_classes(stats))
  if not which.any():
    return stats
  warnings.warn(
      f"{int(which.sum())} class(es) (first: {validation._listed(np.flatnonzero(which))}) "
      "have two or more training points that are all identical. The "
      f"{model} model fits each of them as a single point (its covariance comes from the "
      "prior or the pooled covariance, as for a one-point class); remove exact duplicates "
      "to silence this warning.", IdenticalClassWarning, stacklevel=stacklevel + 1)
  return stats_lib.as_singletons(stats, which)


def _few_shot_prepared(prep: "_Prepared", model: str, stacklevel: int) -> "_Prepared":
  """``prep``, or for a DPMM (``_FEW_SHOT_MODELS``) whose Sigma0 is singular because the
  data have too few points for the preprocessed dimension (N - K below
  ``_FEW_SHOT_RATIO`` D'), the same data prepared with ``_suggested_components`` top
  principal components (warns; two more passes over the data, which are few here). Only
  when the caller left ``num_components`` to the preprocessing; a caller's own choice is
  kept (and its error suggests a number). Computed once per prepared data set
  (``fit_detectors``)."""
  if (model not in _FEW_SHOT_MODELS or not prep.preprocess
      or prep.num_components is not None or prep.transform is None):
    return prep
  if "few_shot" not in prep.reduced:
    stats = prep.stats
    stats = _singletons_for_identical_classes(stats)
    dof = _within_dof(stats)
    usable = 0
    if dof < _FEW_SHOT_RATIO * stats.dim and _flat_directions(stats).size:
      usable = _suggested_components(stats, prep.transform, _within_variances(stats))
    reduced = None
    if 0 < usable < stats.dim:
      reduced = _prepare(prep.x, prep.y, num_classes=prep.num_classes, preprocess=True,
                         num_components=usable, chunk_size=prep.chunk_size, full=prep.full,
                         msp=False, pooled=prep.pooled)
    prep.reduced["few_shot"] = (reduced, dof, stats.dim)
  reduced, dof, dim = prep.reduced["few_shot"]
  if reduced is None:
    return prep
  kept = reduced.stats.dim
  warnings.warn(
      f"Fitting the {model!r} model: N - K = {dof} training points beyond the class means "
      f"are too few for the {dim} directions kept by the preprocessing (the average "
      f"within-class covariance Sigma0 is singular in float precision), so the detector "
      f"uses the top {kept} principal components (num_components={kept}: Sigma0 is "
      f"non-singular there, and they are at most {FEW_SHOT_FRACTION:g} (N - K), which "
      "keeps its estimate well conditioned). Pass num_components to choose, or use "
      "model='rmds', which keeps every direction with a floored variance.",
      FewShotWarning, stacklevel=stacklevel + 1)
  return reduced


def _check_finite_params(det: "Detector"):
  for path, leaf in jax.tree_util.tree_flatten_with_path(det)[0]:
    leaf = np.asarray(leaf)
    if np.issubdtype(leaf.dtype, np.inexact) and not np.all(np.isfinite(leaf)):
      raise ValueError(
          f"Fitting the {det.model} model produced non-finite parameters "
          f"({jax.tree_util.keystr(path)}); the training features are numerically "
          "degenerate for it (see docs/failure_modes.md).")


def _check_model(model, options):
  if not isinstance(model, str):
    raise TypeError(f"model must be a string naming one of {MODELS}, got {model!r}.")
  if model not in MODELS:
    raise ValueError(f"Unknown model {model!r}; choose one of {MODELS}.")
  unknown = sorted(set(options) - set(MODEL_OPTIONS[model]))
  if unknown:
    raise TypeError(
        f"Unknown option(s) {unknown} for model {model!r}; its options are "
        f"{', '.join(MODEL_OPTIONS[model]) or 'none'} (and for every model: num_classes, "
        "preprocess, num_components, chunk_size, key).")


# N D^2 up to which the model-space statistics pass also sums the pooled scatter (see
# ``_prepare``): 2^29 flops of products, 2-4 ms at the 135-260 GFLOP/s a plain X^T X
# reached at D = 64-128 on a 2-core CPU (benchmarks/RESULTS.md, session 23).
_SHARED_STATS_PROGRAM_MAX_ND2 = 1 << 28


class _Prepared(NamedTuple):
  """Validated training data, its section-8 transform and its statistics (one pass)."""
  x: Any
  y: np.ndarray
  num_classes: int
  transform: Any
  stats: stats_lib.SufficientStats   # in transformed space; scatter only if ``full``
  counts: np.ndarray                 # (K,) N_k before identical classes are de-duplicated
  chunk_size: int
  preprocess: bool
  num_components: Any = None         # the caller's (None: chosen by the preprocessing)
  full: bool = True
  pooled: bool = True
  # The same data prepared with fewer components for the hierarchical models, when the
  # caller gave none and Sigma0 is singular (``_few_shot_prepared``); filled on demand.
  reduced: Any = None


def _prepare(x, y, *, num_classes, preprocess, num_components, chunk_size, full: bool,
             msp: bool, pooled: bool = True) -> _Prepared:
  """Validates the inputs and runs the statistics passes shared by every model: one pass
  for the preprocessing transform (if any), one for the transformed statistics.
  ``msp``: the transform of the MSP heads (identical classes not de-duplicated).
  ``pooled``: the transformed statistics need the pooled scatter (always with ``full``)."""
  if not isinstance(preprocess, (bool, np.bool_)):
    raise TypeError(f"preprocess must be True or False, got {preprocess!r}.")
  chunk_size = validation.positive_int(chunk_size, "chunk_size")
  x = validation.features(x, "x", allow_memmap=True)
  y, num_classes = validation.labels(y, x.shape[0], num_classes)
  if num_components is not None:
    num_components = validation.positive_int(num_components, "num_components")
    if not preprocess:
      raise ValueError("num_components needs preprocess=True.")
    if num_components > x.shape[1]:
      raise ValueError(f"num_components={num_components} exceeds the number of features "
                       f"D = {x.shape[1]}.")
  chunk_size = _chunk_rows(x.shape[0], chunk_size)
  dtype = jnp.asarray(np.zeros((), validation._float_dtype(x.dtype))).dtype
  transform = None
  if preprocess:
    raw = stats_lib.from_chunks(_transformed_chunks(x, y, None, chunk_size), num_classes,
                                full=False, chunk_size=chunk_size, dtype=dtype,
                                finite_checked=True)
    validation.finite_stats(raw)
    if not msp:
      raw = _singletons_for_identical_classes(raw)
    transform = preprocess_lib.fit(raw, num_components)
  # On a small problem the second pass sums the pooled scatter even when no model needs
  # it (2 N D^2 flops, a few ms), so both passes run one compiled statistics program.
  pooled = pooled or full or bool(
      preprocess and x.shape[0] * x.shape[1] ** 2 <= _SHARED_STATS_PROGRAM_MAX_ND2)
  # The rows' values were checked while they were read (by the first pass when there is
  # a transform); a transform of finite rows that overflows shows in finite_stats.
  stats = stats_lib.from_chunks(
      _transformed_chunks(x, y, transform, chunk_size, checked=transform is not None),
      num_classes, full=full, chunk_size=chunk_size, dtype=dtype, pooled=pooled,
      finite_checked=True)
  validation.finite_stats(stats)
  return _Prepared(x, y, num_classes, transform, stats, np.asarray(stats.count), chunk_size,
                   bool(preprocess), num_components, full, pooled, {})


def _fit_prepared(prep: _Prepared, model: str, key, standard_errors: bool, options,
                  stacklevel: int):
  """Fits one model on prepared statistics; returns (Detector, FitReport) and warns.
  ``stacklevel``: of the warnings, counted from this function."""
  prep = _few_shot_prepared(prep, model, stacklevel + 1)
  stats = prep.stats
  if model not in _FULL_STATS and stats.scatter is not None:
    stats = stats._replace(scatter=None)
  if model not in ("msp", "temp_msp"):
    stats = _identical_classes_as_singletons(stats, model, stacklevel + 1)
    _check_within_class(stats, model, prep.preprocess, prep.transform)
  if model in _DIAGONAL_STATS:
    # One program per shape whether or not another model needed the pooled scatter.
    stats = stats._replace(pooled_scatter=None)
  if model in _NIW_MODELS and options.get("df") is not None:
    df = options["df"]
    validation.positive(df, "df")
    if not float(df) > stats.dim + 1:
      raise ValueError(
          f"Initial df (nu0) must exceed D + 1 = {stats.dim + 1} for the NIW prior with "
          f"E[Sigma] = Sigma0 (D = {stats.dim} is the dimension after preprocessing); got "
          f"{df}.")

  def transformed_features():
    return jnp.concatenate([c for c, _ in _transformed_chunks(prep.x, prep.y, prep.transform,
                                                              prep.chunk_size)])

  params, info = _fit_model(model, stats, transformed_features, prep.y, key, options)
  if model in DPMM_MODELS:
    # The class weights N_k of the DP mixture count every training point, duplicates too.
    params = params._replace(
        log_counts=jnp.asarray(np.log(np.asarray(prep.counts, params.log_counts.dtype))))
  det = Detector(model, prep.num_classes, prep.transform, params)
  _check_finite_params(det)
  hyper_se = None
  if standard_errors and model in _HIERARCHICAL:
    # lowrank's hyperparameters are the full model's (same prior, same EM).
    hyper_se = eb_uncertainty.hyperparameter_standard_errors(
        "full" if model in _NIW_MODELS else model, stats, params.hyper,
        df_cap=options.get("df_cap", 1e6),
        **({"options": options["options"]} if "options" in options else {}))
  report = FitReport(info, int(stats.dim), prep.counts, _diagnostics(model, params, stats),
                     hyper_se)
  for problem in report.problems:
    warnings.warn(f"Fitting the {model!r} model: {problem}; see FitReport and "
                  "docs/failure_modes.md.", FitDiagnosticWarning, stacklevel=stacklevel + 1)
  if not report.converged:
    warnings.warn(
        f"EM for the {model!r} model stopped at max_iter={report.num_iters} before the "
        "relative change of the log marginal likelihood met tol; the detector uses the "
        "last iterate. Raise max_iter, or inspect "
        "fit_detector_with_info(...)[1].em.log_marginal_trace.",
        ConvergenceWarning, stacklevel=stacklevel + 1)
  return det, report


def _fit_with_info(x, y, model, *, num_classes, preprocess, num_components, chunk_size, key,
                   standard_errors, stacklevel: int, options):
  """``fit_detector_with_info``. ``stacklevel``: how many frames above this function's
  caller the warnings name (2: a public function and its ``entry_points.public_call`` wrapper)."""
  _check_model(model, options)
  if not isinstance(standard_errors, (bool, np.bool_)):
    raise TypeError(f"standard_errors must be True or False, got {standard_errors!r}.")
  if key is not None:
    validation.prng_key(key)
  prep = _prepare(x, y, num_classes=num_classes, preprocess=preprocess,
                  num_components=num_components, chunk_size=chunk_size,
                  full=model in _FULL_STATS, msp=model in ("msp", "temp_msp"),
                  pooled=model not in _DIAGONAL_STATS)
  return _fit_prepared(prep, model, key, standard_errors, options, stacklevel=stacklevel + 2)


@entry_points.public_call
def fit_detector_with_info(x, y, model: str = "coupled", *, num_classes=None,
                           preprocess: bool = True, num_components=None,
                           chunk_size: int = 65536, key=None, standard_errors: bool = False,
                           **options):
  """Like ``fit_detector`` but also returns a ``FitReport`` (EM trace, convergence).

  ``standard_errors=True`` (hierarchical models) adds observed-information standard
  errors of the EM hyperparameters to the report (``FitReport.hyper_se``, see
  ``dpmm_jax.eb_uncertainty``); they are conditional on the plug-in mu0 and Sigma0.

  Warns with ``ConvergenceWarning`` when EM stops at ``max_iter`` before its tolerance.
  """
  # Warnings point at the caller: past this function and public_call's wrapper.
  return _fit_with_info(x, y, model, num_classes=num_classes, preprocess=preprocess,
                        num_components=num_components, chunk_size=chunk_size, key=key,
                        standard_errors=standard_errors, stacklevel=2, options=options)


@entry_points.public_call
def fit_detectors_with_info(x, y, models=DPMM_MODELS + ("rmds",), *, num_classes=None,
                            preprocess: bool = True, num_components=None,
                            chunk_size: int = 65536, key=None,
                            standard_errors: bool = False, options=None):
  """Fits several models on one pass over the data: {model: (Detector, FitReport)}.

  The statistics (and the preprocessing transform) are computed once and shared, so
  fitting the four DPMMs and RMDS reads the training features twice, not ten times. Each
  detector equals ``fit_detector_with_info(x, y, model, ...)`` with the same arguments.
  The MSP heads, which train on the features themselves, share the reading of the data
  but not the statistics.

  Args:
    x, y, num_classes, preprocess, num_components, chunk_size, key, standard_errors: as
      for ``fit_detector_with_info``, shared by every model.
    models: names from ``MODELS`` (default: the four DPMMs and RMDS), no repeats.
    options: {model: {option: value}} per-model options (``MODEL_OPTIONS[model]``).
  Returns:
    dict model -> (Detector, FitReport), in the order of ``models``.
  """
  if isinstance(models, str):
    models = (models,)
  models = tuple(models)
  if not models:
    raise ValueError("models is empty; name at least one of MODELS.")
  if len(set(models)) != len(models):
    raise ValueError(f"models has repeated names: {models}.")
  if options is not None and not isinstance(options, dict):
    raise TypeError(f"options must be a dict {{model: {{option: value}}}}, got "
                    f"{type(options).__name__}.")
  options = {} if options is None else dict(options)
  for model, opts in options.items():
    if not isinstance(opts, dict):
      raise TypeError(f"options[{model!r}] must be a dict of that model's options, got "
                      f"{type(opts).__name__}.")
  unused = sorted(set(options) - set(models))
  if unused:
    raise ValueError(f"options given for model(s) {unused} that are not in models {models}.")
  for model in models:
    _check_model(model, options.get(model, {}))
  if key is not None:
    validation.prng_key(key)
  if not isinstance(standard_errors, (bool, np.bool_)):
    raise TypeError(f"standard_errors must be True or False, got {standard_errors!r}.")
  common = dict(num_classes=num_classes, preprocess=preprocess,
                num_components=num_components, chunk_size=chunk_size)
  prepared = {}
  gaussian = [m for m in models if m not in ("msp", "temp_msp")]
  if gaussian:
    prepared[False] = _prepare(x, y, full=any(m in _FULL_STATS for m in gaussian),
                               msp=False, pooled=any(m not in _DIAGONAL_STATS
                                                     for m in gaussian), **common)
  if len(gaussian) < len(models):
    prepared[True] = _prepare(x, y, full=False, msp=True, pooled=False, **common)
  fitted = {}
  # The models that need the (K, D, D) scatter go first; it is then released (2.4 GB at
  # K = 1000, D = 768) before the others are fitted.
  for m in sorted(models, key=lambda m: m not in _FULL_STATS):
    msp = m in ("msp", "temp_msp")
    fitted[m] = _fit_prepared(prepared[msp], m, key, standard_errors, options.get(m, {}),
                              stacklevel=3)
    if not msp and prepared[False].stats.scatter is not None and not any(
        n in _FULL_STATS and n not in fitted for n in models):
      prep = prepared[False]
      prepared[False] = prep._replace(stats=prep.stats._replace(scatter=None))
      del prep
  return {m: fitted[m] for m in models}


def fit_detectors(x, y, models=DPMM_MODELS + ("rmds",), **kwargs) -> Dict[str, "Detector"]:
  """Fits several models sharing one statistics pass: {model: Detector}.

  See ``fit_detectors_with_info`` for the arguments (per-model options go in
  ``options={model: {...}}``). Use it to compare models on the same data: for the four
  DPMMs and RMDS it reads the training features twice instead of ten times.
  """
  return {m: det for m, (det, _) in fit_detectors_with_info(x, y, models, **kwargs).items()}


# The arguments every model's fit takes (fit_detector passes the rest on as options).
_COMMON_FIT_DEFAULTS = dict(num_classes=None, preprocess=True, num_components=None,
                            chunk_size=65536, key=None, standard_errors=False)
_COMMON_FIT_ARGS = tuple(_COMMON_FIT_DEFAULTS)


@entry_points.public_call
def fit_detector(x, y, model: str = "coupled", **kwargs) -> "Detector":
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
    **options: passed to the model's fit; ``MODEL_OPTIONS[model]`` lists them (e.g.
      ``tol``, ``max_iter`` for EM models). Others raise a TypeError naming the model.
  Returns:
    Detector.
  Raises:
    TypeError, ValueError: invalid inputs or data the model cannot be fitted on (see
      ``docs/failure_modes.md``).
  Warns:
    ConvergenceWarning: EM stopped at ``max_iter`` before meeting its tolerance.
  """
  options = dict(kwargs)
  common = {name: options.pop(name) for name in _COMMON_FIT_ARGS if name in options}
  return _fit_with_info(x, y, model, **{**_COMMON_FIT_DEFAULTS, **common}, stacklevel=2,
                        options=options)[0]


# ----------------------------------------------------------------------- evaluation
# ``score`` and the other evaluation calls invert the full model's Cholesky factors once
# per call (``full.inverse_factors``) rather than once per chunk, when the inverses hold
# at most this many elements (4 GiB in float32; they take as much memory as the factors).
_ONE_INVERSE_PER_CALL_MAX_ELEMENTS = 1 << 30


def _class_and_score(det: Detector, x, inverse=None):
  """(class scores (M, K), OOD score (M,)) for one chunk, in transformed space.
  ``inverse``: the full model's ``full.InverseFactors`` (None: inverted here)."""
  p = det.params
  if det.model in DPMM_MODELS:
    extra = {} if inverse is None else {"inverse": inverse}
    class_lp, prior_lp = _MODULES[det.model].log_predictive(p, x, **extra)
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


@compiler.jit
def _evaluate_chunk(det: Detector, x, inverse=None):
  if det.transform is not None:
    x = preprocess_lib.apply(det.transform, x)
  class_scores, score = _class_and_score(det, x, inverse)
  return class_scores, score


_full_inverse_factors = compiler.jit(full.inverse_factors)


def _inverse_for_all_chunks(det: Detector):
  """The full model's inverted factors for every chunk of one call, or None (other
  models; or inverses above ``_ONE_INVERSE_PER_CALL_MAX_ELEMENTS``: then each chunk
  inverts its blocks of classes, and only one block's inverses are held at a time)."""
  if det.model != "full":
    return None
  num_classes, dim = det.params.class_pred.loc.shape
  if num_classes * dim * dim > _ONE_INVERSE_PER_CALL_MAX_ELEMENTS:
    return None
  return _full_inverse_factors(det.params)


def _check_detector(det):
  if not isinstance(det, Detector):
    raise TypeError(f"Expected a dpmm_jax.Detector (from fit_detector or load), got "
                    f"{type(det).__name__}.")
  return det


# ``score`` and the other evaluation calls pad a small detector's per-class parameters
# (a copy made at each call by ``_pad_class_fields``) only while the padded copy holds at
# most this many elements (1 MB in float32): a bigger copy would cost each call more than
# it saves.
_PADDED_SCORING_MAX_ELEMENTS = 1 << 18


def _padded_for_scoring(det: Detector, num_rows: int) -> Detector:
  """``det`` with its classes padded to ``em.padded_num_classes`` (the fits' buckets:
  8 for K <= 8, then at most 1/4 more), for calls scoring at most
  ``compiler.SMALL_PROBLEM_ELEMENTS`` point x class x dimension triples with per-class
  parameters of at most ``_PADDED_SCORING_MAX_ELEMENTS`` elements once padded; ``det``
  itself for larger calls (where the run, not the compilation, takes the time, and
  padding would add work) and for models without ``CLASS_FIELDS`` (MDS, RMDS, MSP heads).

  Padded classes are copies of class 0 with log count -inf: their class scores are -inf
  and they add nothing to the log-sum-exp of the score, so the scores are those of
  ``det`` (the columns past K are cut off by the caller). Detectors with nearby K then
  share one compiled scorer (the test suite's K = 2-7 detectors, users' fits on class
  subsets), as they share one compiled fit."""
  fields = getattr(_MODULES.get(det.model), "CLASS_FIELDS", None)
  num_classes = det.num_classes
  if fields is None or num_rows * num_classes * det.input_dim > compiler.SMALL_PROBLEM_ELEMENTS:
    return det
  per_class = {f: getattr(det.params, f) for f in fields}
  if compiler.is_traced(per_class):
    return det
  elements = sum(int(np.prod(np.shape(a)[1:])) for a in jax.tree_util.tree_leaves(per_class))
  padded = em.padded_num_classes(num_classes, elements)
  if padded == num_classes or padded * elements > _PADDED_SCORING_MAX_ELEMENTS:
    return det
  return Detector(det.model, padded, det.transform,
                  det.params._replace(**_pad_class_fields(per_class, padded)))


@functools.partial(compiler.jit, static_argnames=("padded",))
def _pad_class_fields(per_class, padded: int):
  """Per-class fields {name: (K, ...) pytree} padded to ``padded`` classes with copies of
  class 0; the padded log counts are -inf. One small program per (model, K, padded):
  padding on the host instead cost each call 0.1-0.4 ms (diag, coupled)."""
  def pad(a):
    return jnp.concatenate([a, jnp.broadcast_to(a[:1], (padded - a.shape[0],) + a.shape[1:])])

  out = jax.tree_util.tree_map(pad, per_class)
  num_classes = per_class["log_counts"].shape[0]
  out["log_counts"] = out["log_counts"].at[num_classes:].set(-jnp.inf)
  return out


def _evaluate(det: Detector, x, chunk_size: int):
  _check_detector(det)
  chunk_size = validation.positive_int(chunk_size, "chunk_size")
  x = validation.features(x, "x", dim=det.input_dim, allow_memmap=True, allow_empty=True)
  n = x.shape[0]
  dtype = validation._float_dtype(x.dtype)
  if n == 0:
    return (jnp.zeros((0, det.num_classes), dtype), jnp.zeros((0,), dtype))
  chunk_size = _chunk_rows(n, chunk_size)
  with _compiled_for(det, n):
    return _evaluate_chunks(_padded_for_scoring(det, n), x, n, chunk_size, dtype,
                            det.num_classes)


def _compiled_for(det: Detector, num_rows: int):
  """The coupled scorer ran 1.06-1.97x slower compiled with compiler.CPU_COMPILER_OPTIONS
  and its first call took 0.7-1.0 s less (K = 100, D = 64, 2,048 points, three runs:
  benchmarks/RESULTS.md, session 25), so a call scoring more than
  compiler.SMALL_PROBLEM_ELEMENTS point x class x dimension triples compiles it with
  XLA's defaults."""
  work = num_rows * det.num_classes * det.input_dim
  if det.model == "coupled" and work > compiler.SMALL_PROBLEM_ELEMENTS:
    return compiler.xla_defaults()
  return contextlib.nullcontext()


def _evaluate_chunks(det: Detector, x, n: int, chunk_size: int, dtype, num_classes: int):
  """(class scores (n, num_classes), scores (n,)); ``det`` may hold padded classes
  beyond ``num_classes`` (``_padded_for_scoring``)."""
  inverse = _inverse_for_all_chunks(det)
  class_parts, score_parts = [], []
  for start in range(0, n, chunk_size):
    xc = validation.check_finite_chunk(x[start:start + chunk_size], "x", start)
    m = xc.shape[0]
    if m < chunk_size:  # pad to one shape: one compilation for all chunks
      xc = np.concatenate([xc, np.repeat(xc[-1:], chunk_size - m, axis=0)])
    cs, s = _evaluate_chunk(det, jnp.asarray(xc, dtype), inverse)
    # Cut and joined on the host: on the device each cut length and each number of
    # chunks would compile a program of its own.
    class_parts.append(np.asarray(cs)[:m, :num_classes])
    score_parts.append(np.asarray(s)[:m])
  class_scores_ = np.concatenate(class_parts) if len(class_parts) > 1 else class_parts[0]
  scores = np.concatenate(score_parts) if len(score_parts) > 1 else score_parts[0]
  finite_classes = np.all(np.isfinite(np.asarray(class_scores_)), axis=-1)
  # Finite class densities and a -inf score: the coupled prior's density is +inf.
  at_prior_mean = np.flatnonzero(finite_classes & np.isneginf(np.asarray(scores))
                                  & (det.model == "coupled"))
  if at_prior_mean.size:
    where = "after the preprocessing, " if det.transform is not None else ""
    raise ValueError(
        f"{at_prior_mean.size} row(s) of x have no finite score (first rows: "
        f"{validation._listed(at_prior_mean)}): {where}they coincide with the coupled "
        "model's prior mean (params.hyper.loc) in so many coordinates that its prior "
        "predictive density is infinite there (the integral over the class scale gamma "
        "diverges as gamma -> 0 when alpha0 + sum of nu0_d / 2 over the other coordinates "
        f"<= half the number of coinciding ones; alpha0 = "
        f"{float(det.params.hyper.gamma_shape):.3g}, D = {det.params.hyper.loc.shape[-1]}"
        "). Under the model such a point is certainly new (outlier probability 1); "
        "score it with another model, or move it off the prior mean.")
  bad = np.flatnonzero(~np.isfinite(np.asarray(scores)) | ~finite_classes)
  if bad.size:
    raise ValueError(
        f"{bad.size} row(s) of x could not be scored in {np.dtype(dtype).name} (first rows: "
        f"{validation._listed(bad)}; largest |x| in them "
        f"{np.max(np.abs(np.asarray(x[bad[:100]]))):.3g}): they are so far from the "
        "training data that their squared distances overflow. Rescale the features or "
        "enable jax_enable_x64.")
  return jnp.asarray(class_scores_), jnp.asarray(scores)


@entry_points.public_call
def score(det: Detector, x, chunk_size: int = 2048):
  """(M,) OOD score, higher = more in-distribution (the DPMM score C~ for DPMM models)."""
  return _evaluate(det, x, chunk_size)[1]


@entry_points.public_call
def class_scores(det: Detector, x, chunk_size: int = 2048):
  """(M, K) per-class scores (log N_k + log p(x | D_k) for DPMM models; -MD_k for MDS,
  RMD_k for RMDS; logits for MSP heads)."""
  return _evaluate(det, x, chunk_size)[0]


@entry_points.public_call
def predict(det: Detector, x, chunk_size: int = 2048):
  """(M,) predicted class index."""
  return jnp.argmax(class_scores(det, x, chunk_size), axis=-1)


@entry_points.public_call
def outlier_probability(det: Detector, x, alpha: float = 1.0, chunk_size: int = 2048):
  """(M,) p(y = K+1 | x) under the DPMM with concentration ``alpha`` (DPMM models only)."""
  _check_detector(det)
  if det.model not in DPMM_MODELS:
    raise ValueError(f"outlier_probability needs a DPMM model {DPMM_MODELS}, "
                     f"got {det.model!r}.")
  validation.positive(alpha, "alpha")
  return scores_lib.outlier_probability(score(det, x, chunk_size), alpha)
