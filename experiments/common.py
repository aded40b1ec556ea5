"""Shared pieces of the experiment binaries: flags, model evaluation, progress logging,
result files and plotting style.

Every binary in ``experiments/`` has a ``run(...)`` function with explicit arguments
(tests and notebooks call it) and a ``main`` that reads the absl flags defined here and
in the binary. Results are written first (JSON / CSV / Markdown); figures are drawn from
the saved files by a separate ``plot(...)`` function, so ``--plot_only`` redraws them
without recomputing.

The flags shared by several binaries are defined once, here, so that importing more than
one binary into the same process (tests, notebooks) does not define a flag twice.
"""
import csv
import json
import math
import os
import sys
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

import dpmm_jax
from dpmm_jax import metrics

# ------------------------------------------------------------------------------ flags
# Flags shared by several binaries. None is defined at import: each binary calls
# ``define_flags(...)`` with the shared flags it reads, which defines them (once per
# process) and makes them key flags of that binary, so its ``--help`` lists them and a
# binary does not accept a shared flag it does not use (``--quick`` is accepted only by
# binaries where it means something). Binary-specific flags are defined in the binary
# and named ``<binary>_<option>``.
FLAGS = flags.FLAGS

_SHARED_FLAGS = {
    "seed": lambda: flags.DEFINE_integer(
        "seed", 0, "Base random seed (seeds used are seed, seed+1, ...)."),
    "num_seeds": lambda: flags.DEFINE_integer(
        "num_seeds", None, "Number of random datasets / repetitions (default: the "
        "binary's)."),
    "float64": lambda: flags.DEFINE_bool(
        "float64", False, "Enable jax_enable_x64 and run every computation in float64."),
    "output_dir": lambda: flags.DEFINE_string(
        "output_dir", None, "Directory for results (JSON/CSV/Markdown) and PNG figures "
        "(default: results/<binary name>)."),
    "plot_only": lambda: flags.DEFINE_bool(
        "plot_only", False, "Redraw the figures (or reprint the table) from the results "
        "saved in --output_dir without recomputing anything."),
    "models": lambda: flags.DEFINE_list(
        "models", list(dpmm_jax.MODELS), "Comma-separated models to run, from "
        f"{', '.join(dpmm_jax.MODELS)}."),
    "quick": lambda: flags.DEFINE_bool(
        "quick", False, "Small, fast version of the experiment (see the binary's "
        "docstring for what it shrinks)."),
    "num_components": lambda: flags.DEFINE_integer(
        "num_components", None, "Principal components kept by the section-8 "
        "preprocessing (default: the binary's; all for benchmark, 64 for "
        "covariance_analysis).", lower_bound=1),
    "fpr_positive": lambda: flags.DEFINE_enum(
        "fpr_positive", "ood", ["ood", "in"], "FPR95 convention: 'ood' = OOD is the "
        "positive class (OpenOOD v1.5, pytorch-ood: share of ID points flagged when 95% "
        "of OOD points are caught); 'in' = ID is the positive class (share of OOD points "
        "accepted when 95% of ID points are accepted)."),
    # Feature-file inputs (benchmark, dim_sweep, covariance_analysis).
    "train": lambda: flags.DEFINE_string(
        "train", None, "Training feature file: a .npz with 'features' and 'labels', or "
        "the prefix/first file of a memory-mapped pair <name>_features.npy + "
        "<name>_labels.npy."),
    "test": lambda: flags.DEFINE_string(
        "test", None, "In-distribution test feature file (with labels)."),
    "near_ood": lambda: flags.DEFINE_list(
        "near_ood", [], "Near-OOD feature files as name=path (or just path; the name is "
        "then the file stem). Labels are not needed."),
    "far_ood": lambda: flags.DEFINE_list(
        "far_ood", [], "Far-OOD feature files as name=path (or path)."),
}
SHARED_FLAGS = tuple(_SHARED_FLAGS)

# The shared flags each accessor below reads (tests check every binary declares the
# flags behind the accessors it calls, and uses every shared flag it declares).
ACCESSOR_FLAGS = {
    "setup_from_flags": ("float64", "output_dir"),
    "seed": ("seed",),
    "seeds": ("seed", "num_seeds"),
    "num_seeds_flag": ("num_seeds",),
    "output_dir_flag": ("output_dir",),
    "plot_only": ("plot_only",),
    "quick": ("quick",),
    "fpr_positive": ("fpr_positive",),
    "models_flag": ("models",),
    "num_components_flag": ("num_components",),
    "train_flag": ("train",),
    "feature_flags": ("train", "test", "near_ood", "far_ood"),
}

# From here on, flags defined (and key flags declared) by this module's functions are
# attributed to the binary that calls them.
flags.disclaim_key_flags()


def define_flags(*names: str) -> None:
  """Defines the shared flags ``names`` as key flags of the calling binary.

  A flag already defined in this process (another binary imported first, in tests or
  notebooks) is only declared as a key flag of the caller.

  Raises:
    ValueError: for a name that is not a shared flag.
  """
  unknown = [n for n in names if n not in _SHARED_FLAGS]
  if unknown:
    raise ValueError(f"Unknown shared flag(s) {unknown}; shared flags are "
                     f"{sorted(_SHARED_FLAGS)}.")
  for name in names:
    if name in FLAGS:
      flags.declare_key_flag(name)
    else:
      _SHARED_FLAGS[name]()


def _value(name: str):
  """The value of a shared flag, with a clear error if the binary did not define it."""
  if name not in FLAGS:
    raise RuntimeError(
        f"The flag --{name} is read but was not defined: add {name!r} to the binary's "
        "common.define_flags(...).")
  return FLAGS[name].value


def setup_from_flags(binary: str) -> str:
  """Applies --float64, warns about known runtime problems, returns the output directory."""
  if _value("float64"):
    jax.config.update("jax_enable_x64", True)
  warn_known_jax_issues()
  return _value("output_dir") or os.path.join("results", binary)


def warn_known_jax_issues() -> None:
  """Logs a warning on jax 0.10.x with the CPU backend.

  jaxlib 0.10 splits batched LAPACK calls (Cholesky, triangular solves, eigh) into chunks
  on XLA's CPU intra-op thread pool and blocks a pool thread until they finish; when as
  many such calls run concurrently as the pool has threads (2 on a 2-core machine), every
  thread waits and the program hangs with no CPU use. Seen here in the full-covariance
  fits at D >= 256 and in the covariance analysis; the same runs finish on jax 0.9.2.
  """
  if jax.__version__.startswith("0.10.") and jax.default_backend() == "cpu":
    logging.warning(
        "jax %s on CPU: batched LAPACK kernels can deadlock the intra-op thread pool "
        "(the run stops using CPU and never finishes), most likely with large D. If that "
        "happens, use jax/jaxlib 0.9.2 (or a release that no longer runs LAPACK batches "
        "on the pool).", jax.__version__)


def seed() -> int:
  return _value("seed")


def seeds(default_num: int) -> List[int]:
  """[seed, seed + 1, ...] of length --num_seeds (or ``default_num``)."""
  n = _value("num_seeds")
  n = default_num if n is None else n
  if n < 1:
    raise ValueError(f"--num_seeds must be >= 1, got {n}.")
  base = _value("seed")
  return [base + i for i in range(n)]


def num_seeds_flag() -> Optional[int]:
  """--num_seeds as given (None: the binary's default)."""
  return _value("num_seeds")


def output_dir_flag() -> Optional[str]:
  return _value("output_dir")


def plot_only() -> bool:
  return _value("plot_only")


def quick() -> bool:
  return _value("quick")


def fpr_positive() -> str:
  return _value("fpr_positive")


def models_flag() -> List[str]:
  return check_models(_value("models"))


def num_components_flag(default: Optional[int] = None) -> Optional[int]:
  """--num_components, or the binary's ``default`` when the flag is not given."""
  n = _value("num_components")
  return default if n is None else n


def train_flag() -> Optional[str]:
  return _value("train")


def feature_flags():
  """(train, test, near {name: path}, far {name: path}) from the feature-file flags."""
  return (_value("train"), _value("test"), parse_named_paths(_value("near_ood")),
          parse_named_paths(_value("far_ood")))


def parse_named_paths(items: Iterable[str]) -> Dict[str, str]:
  """Parses ``name=path`` (or ``path``) items into an ordered ``{name: path}`` dict."""
  out = {}
  for item in items:
    if "=" in item:
      name, path = item.split("=", 1)
    else:
      path = item
      name = os.path.basename(path)
      for suffix in (".npz", ".npy", "_features"):
        if name.endswith(suffix):
          name = name[:-len(suffix)]
    if not name or not path:
      raise ValueError(f"Cannot parse OOD file spec {item!r}; use name=path.")
    if name in out:
      raise ValueError(f"OOD set name {name!r} given twice.")
    out[name] = path
  return out


def check_models(models: Sequence[str]) -> List[str]:
  models = list(models)
  unknown = [m for m in models if m not in dpmm_jax.MODELS]
  if unknown:
    raise ValueError(f"Unknown model(s) {unknown}; choose from {dpmm_jax.MODELS}.")
  if not models:
    raise ValueError("No models given.")
  return models


def float_dtype():
  """float64 when jax_enable_x64 is on (``--float64``), else float32."""
  return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


# --------------------------------------------------------------------------- progress
class Progress:
  """Reports ``done/total``, elapsed and estimated remaining time of a long loop.

  Reports at most every ``every_s`` seconds (and always at the last step): as an absl
  INFO log under ``app.run`` (the binaries), printed to stderr when absl would hide INFO
  logs (a function called from Python or a notebook).
  """

  def __init__(self, total: int, name: str, every_s: float = 10.0):
    self.total = int(total)
    self.name = name
    self.every_s = every_s
    self.done = 0
    self.start = time.perf_counter()
    self._last = -math.inf

  def update(self, n: int = 1, message: str = "") -> None:
    self.done += n
    now = time.perf_counter()
    if now - self._last < self.every_s and self.done < self.total:
      return
    self._last = now
    elapsed = now - self.start
    remaining = elapsed / self.done * (self.total - self.done) if self.done else math.nan
    text = "%s: %d/%d done, %s elapsed, ~%s remaining%s" % (
        self.name, self.done, self.total, format_seconds(elapsed),
        format_seconds(remaining), f" ({message})" if message else "")
    if logging.level_info():
      logging.info(text)
    else:
      # Called from Python or a notebook, where absl shows only warnings unless
      # app.run set it up: print instead, so long runs still report progress.
      print(text, file=sys.stderr, flush=True)


def format_seconds(s: float) -> str:
  if not math.isfinite(s):
    return "?"
  if s < 60:
    return f"{s:.0f}s"
  if s < 3600:
    return f"{int(s // 60)}m{int(s % 60):02d}s"
  return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


# ------------------------------------------------------------------------- evaluation
OOD_METRICS = ("auroc", "fpr95", "aupr_in", "aupr_out")


def check_fpr_positive(positive: str) -> str:
  if positive not in metrics.FPR_CONVENTIONS:
    raise ValueError(f"fpr_positive must be one of {sorted(metrics.FPR_CONVENTIONS)}, "
                     f"got {positive!r}.")
  return positive


def fpr95_label(positive: str = "ood") -> str:
  """Table header of FPR95 naming its convention (see ``dpmm_jax.metrics``)."""
  check_fpr_positive(positive)
  return "FPR95 (OpenOOD) ↓" if positive == "ood" else "FPR95 (ID pos.) ↓"


def fpr95_note(positive: str = "ood") -> str:
  """One sentence defining the FPR95 of a table."""
  if positive == "ood":
    return ("FPR95 (OpenOOD): OOD is the positive class, as in OpenOOD v1.5 and "
            "pytorch-ood; the share of ID points flagged as OOD at the threshold that "
            "catches 95 % of the OOD points.")
  return ("FPR95 (ID pos.): ID is the positive class; the share of OOD points accepted "
          "as ID at the threshold that accepts 95 % of the ID points.")


def evaluate_models(models: Sequence[str], x_train, y_train, x_test, y_test,
                    ood_sets: Mapping[str, Any], *, num_classes: Optional[int] = None,
                    num_components: Optional[int] = None, key=None,
                    progress: Optional[Progress] = None,
                    raise_errors: bool = True,
                    model_options: Optional[Mapping[str, Mapping[str, Any]]] = None,
                    fpr_positive: str = "ood") -> Dict[str, Dict[str, Any]]:
  """Fits every model on the training set and scores the ID test and OOD sets.

  Args:
    models: names from ``dpmm_jax.MODELS``.
    x_train, y_train: (N, D) features and (N,) labels (arrays or memmaps).
    x_test, y_test: ID test features (M, D) and labels (M,).
    ood_sets: ``{name: (M_ood, D) features}``.
    num_classes: K (default max label + 1).
    num_components: keep this many principal components in preprocessing.
    key: PRNG key for the MSP heads.
    progress: a ``Progress`` to advance by one per model.
    raise_errors: re-raise a model's failure; if False, log it and record the message
      under ``"error"`` with NaN metrics.
    model_options: ``{model: {option: value}}`` passed to that model's fit (e.g.
      ``{"tied": {"prior_scale": "total"}}`` for the paper's tied model).
    fpr_positive: FPR95 convention, ``"ood"`` (OpenOOD v1.5, default) or ``"in"``
      (``dpmm_jax.metrics.fpr_at_tpr``).

  Returns:
    ``{model: {"accuracy", "fit_s", "score_s", "converged", "error",
    "ood": {name: {"auroc", "fpr95", "aupr_in", "aupr_out"}}}}``. ``converged`` is None
    for models without EM.
  """
  check_fpr_positive(fpr_positive)
  results = {}
  for model in check_models(models):
    row = {"accuracy": math.nan, "fit_s": math.nan, "score_s": math.nan,
           "converged": None, "error": None,
           "ood": {name: {m: math.nan for m in OOD_METRICS} for name in ood_sets}}
    try:
      t0 = time.perf_counter()
      det, report = dpmm_jax.fit_detector_with_info(
          x_train, y_train, model, num_classes=num_classes,
          num_components=num_components, key=key, **(model_options or {}).get(model, {}))
      jax.block_until_ready(det)
      row["fit_s"] = time.perf_counter() - t0
      conv = getattr(report.em, "converged", None)
      if conv is not None and model in dpmm_jax.DPMM_MODELS:
        row["converged"] = bool(np.all(np.asarray(conv)))
      t0 = time.perf_counter()
      class_scores_in = dpmm_jax.class_scores(det, x_test)
      s_in = dpmm_jax.score(det, x_test)
      s_out = {name: np.asarray(dpmm_jax.score(det, x)) for name, x in ood_sets.items()}
      row["score_s"] = time.perf_counter() - t0
      row["accuracy"] = metrics.accuracy(jnp.argmax(class_scores_in, -1), np.asarray(y_test))
      for name, s in s_out.items():
        row["ood"][name] = metrics.ood_metrics(s_in, s, positive=fpr_positive)
    except Exception as e:  # pylint: disable=broad-except
      if raise_errors:
        raise
      logging.warning("Model %s failed: %s", model, e)
      row["error"] = f"{type(e).__name__}: {e}"
    results[model] = row
    if progress is not None:
      progress.update(message=model)
  return results


def mean_and_se(values: Sequence[float]):
  """(mean, standard error) ignoring NaNs; se is NaN with fewer than two values."""
  v = np.asarray(values, np.float64)
  v = v[np.isfinite(v)]
  if v.size == 0:
    return math.nan, math.nan
  se = float(np.std(v, ddof=1) / np.sqrt(v.size)) if v.size > 1 else math.nan
  return float(np.mean(v)), se


# ----------------------------------------------------------------------- result files
def _jsonable(obj):
  if isinstance(obj, dict):
    return {str(k): _jsonable(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_jsonable(v) for v in obj]
  if isinstance(obj, (np.floating, float)):
    f = float(obj)
    return f if math.isfinite(f) else None
  if isinstance(obj, np.integer):
    return int(obj)
  if isinstance(obj, np.bool_):
    return bool(obj)
  if isinstance(obj, (np.ndarray, jax.Array)):
    return _jsonable(np.asarray(obj).tolist())
  return obj


def save_json(path: str, obj) -> str:
  """Writes ``obj`` as JSON (NaN/inf become null); creates the directory."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(_jsonable(obj), f, indent=1)
  logging.info("Wrote %s", path)
  return path


def load_json(path: str):
  """Reads a JSON results file written by ``save_json`` (nulls become NaN floats where a
  number is expected is left to the caller: use ``nan_if_none``)."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"No saved results at {path}; run without --plot_only first.")
  with open(path) as f:
    return json.load(f)


def nan_if_none(x) -> float:
  return math.nan if x is None else float(x)


def save_csv(path: str, rows: Sequence[Mapping[str, Any]],
             fieldnames: Optional[Sequence[str]] = None) -> str:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  if fieldnames is None:
    fieldnames = list(rows[0].keys()) if rows else []
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fieldnames)
    writer.writeheader()
    for row in rows:
      writer.writerow({k: _csv_value(row.get(k)) for k in fieldnames})
  logging.info("Wrote %s", path)
  return path


def _csv_value(v):
  if isinstance(v, float):
    return "" if not math.isfinite(v) else f"{v:.6g}"
  return "" if v is None else v


def save_text(path: str, text: str) -> str:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
  logging.info("Wrote %s", path)
  return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub-flavoured Markdown table; the first column is left-aligned, others right."""
  def fmt(v):
    if isinstance(v, float):
      return "–" if not math.isfinite(v) else f"{v:.3f}"
    return str(v)
  lines = ["| " + " | ".join(header) + " |",
           "| " + " | ".join([":---"] + ["---:"] * (len(header) - 1)) + " |"]
  lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def fmt_mean_se(mean: float, se: float, digits: int = 3) -> str:
  if not math.isfinite(mean):
    return "–"
  if not math.isfinite(se):
    return f"{mean:.{digits}f}"
  return f"{mean:.{digits}f} ± {se:.{digits}f}"


# --------------------------------------------------------------------------- plotting
MODEL_LABELS = {
    "mds": "MDS",
    "rmds": "RMDS",
    "indep_rmds": "Indep. RMDS",
    "msp": "MSP",
    "temp_msp": "Temp. scale MSP",
    "tied": "DPMM tied",
    "full": "DPMM full",
    "diag": "DPMM diag",
    "coupled": "DPMM coupled",
    "lowrank": "DPMM low-rank",
}
# One colour per model, the same in every figure (tab10 order).
MODEL_COLORS = {
    "rmds": "#000000",
    "mds": "#7f7f7f",
    "indep_rmds": "#8c564b",
    "msp": "#bcbd22",
    "temp_msp": "#17becf",
    "tied": "#1f77b4",
    "full": "#d62728",
    "diag": "#2ca02c",
    "coupled": "#9467bd",
    "lowrank": "#ff7f0e",
}
MODEL_MARKERS = {
    "rmds": "o", "mds": "v", "indep_rmds": "X", "msp": "<", "temp_msp": ">",
    "tied": "s", "full": "D", "diag": "^", "coupled": "P",
    "lowrank": "*",
}
# Baselines dashed, DPMMs solid.
MODEL_LINESTYLES = {m: ("-" if m in dpmm_jax.DPMM_MODELS else "--") for m in dpmm_jax.MODELS}


def pyplot():
  """matplotlib.pyplot with the non-interactive Agg backend and a readable style."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  if not matplotlib.get_backend().lower().startswith(("module://matplotlib_inline",
                                                       "module://ipykernel")):
    matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  plt.rcParams.update({"figure.dpi": 110, "savefig.dpi": 130, "axes.grid": True,
                       "grid.alpha": 0.3, "axes.spines.top": False,
                       "axes.spines.right": False, "font.size": 10,
                       "legend.fontsize": 8})
  return plt


def save_figure(fig, path: str) -> str:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, bbox_inches="tight")
  logging.info("Wrote %s", path)
  return path


def save_and_close(fig, path: str) -> str:
  """``save_figure`` then closes ``fig`` (the experiments write each figure once)."""
  save_figure(fig, path)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  plt.close(fig)
  return path


def line_with_errors(ax, model: str, x, mean, se, **kwargs):
  """One model's mean ± standard error line in its colour and style."""
  mean = np.asarray(mean, np.float64)
  se = np.nan_to_num(np.asarray(se, np.float64))
  ax.errorbar(x, mean, yerr=se, color=MODEL_COLORS[model], marker=MODEL_MARKERS[model],
              linestyle=MODEL_LINESTYLES[model], markersize=4, capsize=2, linewidth=1.3,
              label=MODEL_LABELS[model], **kwargs)
