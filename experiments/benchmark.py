r"""Table 1 runner: every model on feature files, ID accuracy and AUROC / FPR95 / AUPR-in /
AUPR-out per OOD set.

FPR95 follows OpenOOD v1.5 by default (OOD is the positive class: the share of ID points
flagged when 95 % of the OOD points are caught); ``--fpr_positive=in`` gives the older
ID-positive convention. Each table header names the convention.

Every model is deterministic given the features (the MSP heads start at zero and train
full-batch on a convex loss, so the seed does not enter), so one run per row reproduces
the table exactly.

Inputs are feature files (``dpmm_jax.feature_files``): a ``.npz`` with ``features`` and
``labels``, or a memory-mapped pair ``<name>_features.npy`` + ``<name>_labels.npy``. A
training file and an ID test file (both labelled) and any number of named OOD files
(labels not needed) grouped as near and far.

Outputs under --output_dir: ``benchmark.json`` (everything, including per-model fit and
score seconds), ``benchmark.md`` (the Markdown table, also printed), ``benchmark.csv``
(one row per model) and ``benchmark.png`` (Near / Far AUROC and ID accuracy per model).

  python -m experiments.benchmark --train=feats/train.npz --test=feats/test.npz \
      --near_ood=ssb=feats/ssb.npz,ninco=feats/ninco.npz \
      --far_ood=inat=feats/inat.npz --output_dir=results/benchmark
  python -m experiments.benchmark --output_dir=results/benchmark --plot_only
"""
import os
import time
from typing import Any, Dict, Mapping, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

import dpmm_jax
from dpmm_jax import feature_files
from experiments import common

common.define_flags("train", "test", "near_ood", "far_ood", "output_dir", "plot_only",
                    "float64", "models", "seed", "num_components", "fpr_positive")
_TITLE = flags.DEFINE_string("benchmark_title", None, "Title of the table and figure.")


def _load_all(train, test, near, far):
  tr = feature_files.load(train)
  te = feature_files.load(test, dim=tr.dim)
  num_classes = int(tr.labels.max()) + 1
  if te.labels.max() >= num_classes:
    raise ValueError(f"{te.path}: ID test labels go up to {int(te.labels.max())} but the "
                     f"training file has only {num_classes} classes.")
  ood = {}
  for group, files in (("near", near), ("far", far)):
    for name, path in files.items():
      if name in ood:
        raise ValueError(f"OOD set name {name!r} appears in both near and far.")
      ood[name] = (group, feature_files.load(path, require_labels=False, dim=tr.dim))
  return tr, te, num_classes, ood


def run(output_dir: Optional[str], train: str, test: str, near_ood: Mapping[str, str],
        far_ood: Mapping[str, str], *, models: Sequence[str] = dpmm_jax.MODELS,
        num_components: Optional[int] = None, seed: int = 0, title: Optional[str] = None,
        plot: bool = True, fpr_positive: str = "ood") -> Dict[str, Any]:
  """Fits every model on ``train`` and evaluates on the ID test and OOD files.

  Args:
    output_dir: where to save results and the figure (None: no files).
    train, test: labelled feature files (paths or ``.npy``-pair prefixes).
    near_ood, far_ood: ``{name: path}`` of OOD feature files.
    models: names from ``dpmm_jax.MODELS``.
    num_components: principal components kept in preprocessing (None: all).
    seed: PRNG seed (MSP heads).
    title: shown above the table and figure.
    plot: draw ``benchmark.png`` from the saved results.
    fpr_positive: FPR95 convention, ``"ood"`` (OpenOOD v1.5, default) or ``"in"``.

  Returns:
    ``{"config", "results": {model: {...}}, "table"}``; each model has ``accuracy``,
    ``fit_s``, ``score_s``, ``ood: {name: {"auroc", "fpr95", "aupr_in", "aupr_out"}}``
    and ``near_<metric>``, ``far_<metric>`` for each of those metrics (averages over the
    group's sets).
  """
  models = common.check_models(models)
  common.check_fpr_positive(fpr_positive)
  if not near_ood and not far_ood:
    raise ValueError("Give at least one OOD file (near_ood or far_ood).")
  t0 = time.perf_counter()
  tr, te, num_classes, ood = _load_all(train, test, dict(near_ood), dict(far_ood))
  logging.info("Loaded train %s, test %s and %d OOD sets in %.1fs (K=%d, D=%d)",
               tr.features.shape, te.features.shape, len(ood), time.perf_counter() - t0,
               num_classes, tr.dim)
  progress = common.Progress(len(models), "benchmark", every_s=0)
  results = common.evaluate_models(
      models, tr.features, tr.labels, te.features, te.labels,
      {name: fs.features for name, (_, fs) in ood.items()}, num_classes=num_classes,
      num_components=num_components, key=jax.random.PRNGKey(seed), progress=progress,
      raise_errors=False, fpr_positive=fpr_positive)
  groups = {name: g for name, (g, _) in ood.items()}
  for r in results.values():
    for g in ("near", "far"):
      for metric in common.OOD_METRICS:
        vals = [r["ood"][n][metric] for n in r["ood"] if groups[n] == g]
        r[f"{g}_{metric}"] = float(np.mean(vals)) if vals else float("nan")
  config = dict(train=tr.path, test=te.path, num_train=tr.num_points,
                num_test=te.num_points, dim=tr.dim, num_classes=num_classes,
                num_components=num_components, seed=seed, models=models, title=title,
                fpr_positive=fpr_positive,
                ood={name: {"group": g, "path": fs.path, "num_points": fs.num_points}
                     for name, (g, fs) in ood.items()})
  result = {"config": config, "results": results}
  result["table"] = markdown(result)
  if output_dir:
    common.save_json(os.path.join(output_dir, "benchmark.json"), result)
    common.save_text(os.path.join(output_dir, "benchmark.md"), result["table"])
    common.save_csv(os.path.join(output_dir, "benchmark.csv"), csv_rows(result))
    if plot:
      plot_results(output_dir)
  return result


def _ood_names(config, group):
  return [n for n, v in config["ood"].items() if v["group"] == group]


def csv_rows(result):
  rows = []
  cfg = result["config"]
  for model, r in result["results"].items():
    row = dict(model=model, accuracy=r["accuracy"])
    for g in ("near", "far"):
      if _ood_names(cfg, g):
        for metric in common.OOD_METRICS:
          row[f"{g}_{metric}"] = r[f"{g}_{metric}"]
    for name in cfg["ood"]:
      for metric in common.OOD_METRICS:
        row[f"{name}_{metric}"] = r["ood"][name][metric]
    row.update(fit_s=r["fit_s"], score_s=r["score_s"], converged=r["converged"],
               error=r["error"], fpr_positive=cfg.get("fpr_positive", "in"))
    rows.append(row)
  return rows


def markdown(result) -> str:
  """The Table-1 layout: ID accuracy; per OOD group (Near, Far) the average AUROC, FPR95
  (its convention in the header), AUPR-in and AUPR-out over the group's sets; per set
  (when a group has several) the four values in one cell; then fit and score seconds.
  Everything in %."""
  cfg = result["config"]
  # Results saved before the convention was recorded used the ID-positive FPR95.
  positive = cfg.get("fpr_positive", "in")
  fpr = common.fpr95_label(positive)
  near, far = _ood_names(cfg, "near"), _ood_names(cfg, "far")
  pct = lambda v: common.nan_if_none(v) * 100  # pylint: disable=g-long-lambda
  metric_headers = ["AUROC ↑", fpr, "AUPR-in ↑", "AUPR-out ↑"]
  header = ["model", "ID acc. ↑"]
  for group, names in (("Near", near), ("Far", far)):
    if not names:
      continue
    if len(names) > 1:
      header += [f"{n} " + " / ".join(metric_headers) for n in names]
    header += [f"{group} {h}" for h in metric_headers]
  header += ["fit s", "score s"]
  rows = []
  for model, r in result["results"].items():
    row = [common.MODEL_LABELS.get(model, model), f"{pct(r['accuracy']):.1f}"]
    for group, names in (("near", near), ("far", far)):
      if not names:
        continue
      if len(names) > 1:
        for n in names:
          row.append(" / ".join(f"{pct(r['ood'][n].get(m)):.1f}"
                                for m in common.OOD_METRICS))
      for m in common.OOD_METRICS:
        v = f"{pct(r.get(f'{group}_{m}')):.1f}"
        row.append(f"**{v}**" if m == "auroc" else v)
    row += [f"{common.nan_if_none(r['fit_s']):.2f}", f"{common.nan_if_none(r['score_s']):.2f}"]
    rows.append(row)
  text = ""
  if cfg.get("title"):
    text += f"**{cfg['title']}**\n\n"
  text += (f"Train {cfg['num_train']} points, K = {cfg['num_classes']}, D = {cfg['dim']}"
           + (f" (top {cfg['num_components']} PCs)" if cfg.get("num_components") else "")
           + f"; ID test {cfg['num_test']} points. "
           + " ".join(f"{g} OOD: {', '.join(n)}" + (" (columns: mean over the sets)."
                                                   if len(n) > 1 else ".")
                      for g, n in (("Near", near), ("Far", far)) if n)
           + " Values in %. "
           + common.fpr95_note(positive)
           + " AUPR-in / AUPR-out: average precision with ID / OOD as the positive class."
           + " Every model is deterministic given the features (one run per row).\n\n")
  text += common.markdown_table(header, rows)
  failed = [(m, r["error"]) for m, r in result["results"].items() if r.get("error")]
  for m, e in failed:
    text += f"\n{m} failed: {e}\n"
  return text


def plot_results(output_dir: str) -> str:
  """Near / Far AUROC and ID accuracy per model, from ``benchmark.json``."""
  result = common.load_json(os.path.join(output_dir, "benchmark.json"))
  cfg, res = result["config"], result["results"]
  plt = common.pyplot()
  models = [m for m in cfg["models"] if m in res]
  panels = [(f"{g.capitalize()} OOD AUROC (%) ↑", f"{g}_auroc")
            for g in ("near", "far") if _ood_names(cfg, g)]
  panels.append(("ID accuracy (%) ↑", "accuracy"))
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
  for ax, (label, key) in zip(axes[0], panels):
    vals = np.array([common.nan_if_none(res[m][key]) * 100 for m in models])
    ax.bar(range(len(models)), np.nan_to_num(vals),
           color=[common.MODEL_COLORS[m] for m in models])
    finite = vals[np.isfinite(vals)]
    if finite.size:
      lo = max(0.0, finite.min() - 0.15 * (finite.max() - finite.min() + 1))
      ax.set_ylim(lo, min(100, finite.max() + 0.1 * (finite.max() - lo + 1)))
    for i, v in enumerate(vals):
      if np.isfinite(v):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels([common.MODEL_LABELS[m] for m in models], rotation=45, ha="right")
    ax.set_ylabel(label)
  fig.suptitle(cfg.get("title") or f"Benchmark: K = {cfg['num_classes']}, D = {cfg['dim']}")
  fig.tight_layout()
  path = common.save_and_close(fig, os.path.join(output_dir, "benchmark.png"))
  return path


def main(argv):
  del argv
  output_dir = common.setup_from_flags("benchmark")
  if common.plot_only():
    plot_results(output_dir)
    return
  train, test, near, far = common.feature_flags()
  if not train or not test:
    raise app.UsageError("--train and --test are required (feature files).")
  result = run(output_dir, train, test, near, far, models=common.models_flag(),
               num_components=common.num_components_flag(), seed=common.seed(),
               title=_TITLE.value, fpr_positive=common.fpr_positive())
  print(result["table"])
  print(f"Results in {output_dir}/")


if __name__ == "__main__":
  app.run(main)
