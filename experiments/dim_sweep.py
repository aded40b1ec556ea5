r"""Figure 4 of the paper: Near / Far AUROC and ID accuracy against the number of retained
principal components (section 6.3), for every model.

The section-8 preprocessing keeps the top ``n`` principal components for n = 2, 4, ...,
512 (values above the feature dimension are dropped; the full dimension is added). On
feature files (``--train``, ``--test``, ``--near_ood``, ``--far_ood``; see
``dpmm_jax.feature_files``) or, with no file given, on the built-in high-dimensional
problem of ``experiments.highdim`` (class covariances that differ by per-class scale
factors and partial pooling, near OOD = new classes from the same prior, far OOD = new
classes further out).

Outputs under --output_dir: ``dim_sweep.json``, ``dim_sweep_runs.csv``,
``dim_sweep_summary.csv``, ``dim_sweep_summary.md`` and ``dim_sweep.png``.

  python -m experiments.dim_sweep                                  # built-in problem
  python -m experiments.dim_sweep --train=tr.npz --test=te.npz --near_ood=a=a.npz \
      --far_ood=b=b.npz
  python -m experiments.dim_sweep --plot_only
"""
import os
import textwrap
from typing import Any, Dict, List, Mapping, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

import dpmm_jax
from dpmm_jax import feature_files
from experiments import common
from experiments import highdim

PAPER_COMPONENTS = (2, 4, 8, 16, 32, 64, 128, 256, 512)

common.define_flags("train", "test", "near_ood", "far_ood", "output_dir", "plot_only",
                    "float64", "models", "seed", "num_seeds", "quick", "fpr_positive")
_COMPONENTS = flags.DEFINE_list(
    "dim_sweep_components", None, "Numbers of principal components to keep (default 2,4,...,512, "
    "capped at the feature dimension; --quick: 2,8,32).")
_HD_CLASSES = flags.DEFINE_integer("highdim_num_classes", 50,
                                   "Built-in problem: number of classes K.")
_HD_DIM = flags.DEFINE_integer("highdim_dim", 256, "Built-in problem: feature dimension D.")
_HD_NK = flags.DEFINE_integer("highdim_num_train_per_class", 100,
                              "Built-in problem: training points per class.")
_HD_NTEST = flags.DEFINE_integer("highdim_num_test_per_class", 20,
                                 "Built-in problem: test points per ID / OOD class.")
QUICK_PROBLEM = dict(num_classes=8, dim=32, num_train_per_class=40, num_test_per_class=10,
                     num_ood_classes=8)
QUICK_COMPONENTS = (2, 8, 32)
METRIC_KEYS = ("accuracy",) + tuple(f"{g}_{m}" for g in ("near", "far")
                                    for m in ("auroc", "fpr95", "aupr_in", "aupr_out"))


def _components_for(dim: int, components: Sequence[int]) -> List[int]:
  comps = sorted({int(c) for c in components if 1 <= int(c) <= dim})
  if any(int(c) > dim for c in components) and dim not in comps:
    comps.append(dim)
  if not comps:
    raise ValueError(f"No number of components in {list(components)} fits D = {dim}.")
  return comps


def _datasets(train, test, near_ood, far_ood, seeds, problem):
  """Yields (seed, x_train, y_train, x_test, y_test, {name: (group, x)}, description)."""
  if train:
    tr = feature_files.load(train)
    te = feature_files.load(test, dim=tr.dim)
    ood = {}
    for group, files in (("near", near_ood), ("far", far_ood)):
      for name, path in files.items():
        ood[name] = (group, feature_files.load(path, require_labels=False, dim=tr.dim).features)
    yield seeds[0], tr.features, tr.labels, te.features, te.labels, ood
    return
  for seed in seeds:
    p = highdim.make_problem(jax.random.PRNGKey(seed), dtype=common.float_dtype(), **problem)
    yield seed, p.x_train, p.y_train, p.x_test, p.y_test, {"near": ("near", p.x_near),
                                                           "far": ("far", p.x_far)}


def run(output_dir: Optional[str], *, train: Optional[str] = None,
        test: Optional[str] = None, near_ood: Mapping[str, str] = None,
        far_ood: Mapping[str, str] = None, components: Sequence[int] = PAPER_COMPONENTS,
        models: Sequence[str] = dpmm_jax.MODELS, seeds: Sequence[int] = (0,),
        problem: Optional[Dict[str, Any]] = None, plot: bool = True,
        fpr_positive: str = "ood") -> Dict[str, Any]:
  """Sweeps the number of principal components for every model.

  Args:
    output_dir: where results and the figure go (None: no files).
    train, test, near_ood, far_ood: feature files (``{name: path}`` for OOD sets). With
      no ``train`` the built-in problem is used.
    components: numbers of principal components to keep.
    models: names from ``dpmm_jax.MODELS``.
    seeds: built-in problem: one dataset per seed; feature files: the first seed is the
      PRNG seed of the MSP heads.
    problem: keyword arguments of ``experiments.highdim.make_problem``.
    plot: draw ``dim_sweep.png`` from the saved results.
    fpr_positive: FPR95 convention of the ``*_fpr95`` columns, ``"ood"`` (OpenOOD v1.5,
      default) or ``"in"``.

  Returns:
    ``{"config", "records", "summary", "table"}``.
  """
  models = common.check_models(models)
  common.check_fpr_positive(fpr_positive)
  near_ood, far_ood = dict(near_ood or {}), dict(far_ood or {})
  if train and not test:
    raise ValueError("A training file needs an ID test file too.")
  if train and not (near_ood or far_ood):
    raise ValueError("Give at least one OOD file (near_ood or far_ood).")
  problem = dict(highdim.DEFAULTS, **(problem or {}))
  seeds = [int(s) for s in seeds][:1] if train else [int(s) for s in seeds]
  records = []
  progress = None
  dim = None
  comps = None
  for seed, x_tr, y_tr, x_te, y_te, ood in _datasets(train, test, near_ood, far_ood, seeds,
                                                     problem):
    dim = x_tr.shape[1]
    comps = _components_for(dim, components)
    if progress is None:
      progress = common.Progress(len(seeds) * len(comps) * len(models), "dim_sweep")
    groups = {name: g for name, (g, _) in ood.items()}
    for n in comps:
      res = common.evaluate_models(
          models, x_tr, y_tr, x_te, y_te, {name: x for name, (_, x) in ood.items()},
          num_components=n, key=jax.random.PRNGKey(seed), progress=progress,
          raise_errors=False, fpr_positive=fpr_positive)
      for model, r in res.items():
        rec = dict(seed=seed, num_components=n, model=model, accuracy=r["accuracy"],
                   fit_s=r["fit_s"], score_s=r["score_s"], converged=r["converged"],
                   error=r["error"])
        for g in ("near", "far"):
          for metric in common.OOD_METRICS:
            vals = [r["ood"][name][metric] for name in r["ood"] if groups[name] == g]
            rec[f"{g}_{metric}"] = float(np.mean(vals)) if vals else float("nan")
        for name in r["ood"]:
          rec[f"{name}_auroc"] = r["ood"][name]["auroc"]
        records.append(rec)
  summary = []
  for n in comps:
    for model in models:
      rs = [r for r in records if r["num_components"] == n and r["model"] == model]
      row = dict(num_components=n, model=model, num_seeds=len(rs))
      for k in METRIC_KEYS + ("fit_s",):
        row[f"{k}_mean"], row[f"{k}_se"] = common.mean_and_se([r[k] for r in rs])
      summary.append(row)
  source = (f"feature files (train {train})" if train else
            "built-in problem (experiments.highdim): " +
            ", ".join(f"{k}={v}" for k, v in problem.items()))
  config = dict(source=source, train=train, test=test, near_ood=near_ood, far_ood=far_ood,
                dim=dim, components=comps, models=models, seeds=seeds,
                problem=None if train else problem, fpr_positive=fpr_positive)
  result = {"config": config, "records": records, "summary": summary}
  result["table"] = markdown(result)
  if output_dir:
    common.save_json(os.path.join(output_dir, "dim_sweep.json"), result)
    common.save_csv(os.path.join(output_dir, "dim_sweep_runs.csv"), records,
                    fieldnames=list(records[0].keys()))
    common.save_csv(os.path.join(output_dir, "dim_sweep_summary.csv"), summary)
    common.save_text(os.path.join(output_dir, "dim_sweep_summary.md"), result["table"])
    if plot:
      plot_results(output_dir)
  return result


def markdown(result) -> str:
  cfg = result["config"]
  models = cfg["models"]
  lookup = {(r["num_components"], r["model"]): r for r in result["summary"]}
  out = [f"Source: {cfg['source']}. Mean ± s.e. over {len(cfg['seeds'])} seed(s).\n"]
  for key, title in (("near_auroc", "Near-OOD AUROC ↑"), ("far_auroc", "Far-OOD AUROC ↑"),
                     ("accuracy", "ID accuracy ↑")):
    body = [[str(n)] + [common.fmt_mean_se(lookup[(n, m)][f"{key}_mean"],
                                           lookup[(n, m)][f"{key}_se"]) for m in models]
            for n in cfg["components"]]
    out.append(f"**{title}**\n\n" + common.markdown_table(
        ["PCs"] + [common.MODEL_LABELS[m] for m in models], body))
  return "\n".join(out)


def plot_results(output_dir: str) -> str:
  """Near / Far AUROC and ID accuracy against the number of PCs, from ``dim_sweep.json``."""
  result = common.load_json(os.path.join(output_dir, "dim_sweep.json"))
  cfg = result["config"]
  plt = common.pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
  for model in cfg["models"]:
    rows = sorted([r for r in result["summary"] if r["model"] == model],
                  key=lambda r: r["num_components"])
    x = [r["num_components"] for r in rows]
    for ax, key in zip(axes, ("near_auroc", "far_auroc", "accuracy")):
      common.line_with_errors(ax, model, x, [common.nan_if_none(r[f"{key}_mean"]) for r in rows],
                              [common.nan_if_none(r[f"{key}_se"]) for r in rows])
  for ax, label in zip(axes, ("Near-OOD AUROC ↑", "Far-OOD AUROC ↑", "ID accuracy ↑")):
    ax.set_xscale("log", base=2)
    ax.set_xticks(cfg["components"])
    ax.set_xticklabels([str(c) for c in cfg["components"]])
    ax.minorticks_off()
    ax.set_xlabel("principal components kept (log scale)")
    ax.set_ylabel(label)
    ax.set_title(label.replace(" ↑", "") + (f", mean ± s.e. over {len(cfg['seeds'])} seeds"
                                             if len(cfg["seeds"]) > 1 else ""))
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="upper center", ncol=len(cfg["models"]), frameon=False,
             bbox_to_anchor=(0.5, 1.06))
  fig.text(0.5, -0.02, "\n".join(textwrap.wrap(cfg["source"], 190)), ha="center",
           va="top", fontsize=8)
  fig.tight_layout()
  path = common.save_and_close(fig, os.path.join(output_dir, "dim_sweep.png"))
  return path


def main(argv):
  del argv
  output_dir = common.setup_from_flags("dim_sweep")
  if common.plot_only():
    plot_results(output_dir)
    return
  train, test, near, far = common.feature_flags()
  quick = common.quick()
  components = ([int(c) for c in _COMPONENTS.value] if _COMPONENTS.value else
                (QUICK_COMPONENTS if quick else PAPER_COMPONENTS))
  problem = QUICK_PROBLEM if quick else dict(
      num_classes=_HD_CLASSES.value, dim=_HD_DIM.value,
      num_train_per_class=_HD_NK.value, num_test_per_class=_HD_NTEST.value)
  result = run(output_dir, train=train, test=test, near_ood=near, far_ood=far,
               components=components, models=common.models_flag(),
               seeds=common.seeds(1 if quick or train else 3), problem=problem,
               fpr_positive=common.fpr_positive())
  print(result["table"])
  print(f"Results in {output_dir}/")


if __name__ == "__main__":
  app.run(main)
