r"""Figure 3 of the paper: where do hierarchical DPMMs beat RMDS? (section 6.1)

Data come from the hierarchical normal-inverse-Wishart model with mu0 = 0, Sigma0 = I,
kappa0 = 1/25 (``dpmm_jax.synthetic.make_dataset``); every OOD point is drawn from its own
fresh cluster. Two sweeps, every model, several seeds:

(a) nu0 of the generating prior at D = 2, K = 10, N_k = 20: small nu0 makes the class
    covariances differ a lot; large nu0 ties them (every model should meet RMDS);
(b) N_k at nu0 = 4: the hierarchical models against independent-covariance RMDS.

The same seed gives the same cluster draws across a sweep (common random numbers), so the
paired differences between models and settings are less noisy than the raw AUROCs.

Outputs under --output_dir: ``synthetic.json`` (config, per-seed records, summary),
``synthetic_runs.csv`` (one row per seed, setting and model), ``synthetic_summary.csv`` and
``synthetic_summary.md`` (mean ± standard error), ``synthetic_examples.npz`` (two example
datasets) and the figures ``synthetic_examples.png``, ``synthetic_scatter.png``,
``synthetic_nu0.png``, ``synthetic_nk.png``.

  python -m experiments.synthetic --quick            # < 2 minutes on 2 CPU cores
  python -m experiments.synthetic                    # the full experiment (20 seeds)
  python -m experiments.synthetic --plot_only        # redraw from saved results
"""
import math
import os
from typing import Any, Dict, List, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

import dpmm_jax
from dpmm_jax import synthetic
from experiments import common

PAPER_NU0 = (4, 6, 8, 10, 12, 14, 16)
FULL_NU0 = PAPER_NU0 + (32, 64, 256, 1024)
FULL_NK = (5, 10, 15, 20, 40, 100)
QUICK_NU0 = (4, 8, 16, 64, 1024)
QUICK_NK = (5, 20, 100)
FULL_NUM_SEEDS = 20
QUICK_NUM_SEEDS = 3

common.define_flags("output_dir", "plot_only", "float64", "models", "seed", "num_seeds",
                    "quick", "fpr_positive")
_NU0_VALUES = flags.DEFINE_list(
    "synthetic_nu0_values", None, "nu0 values of sweep (a) (default: 4,6,...,16,32,64,256,1024; "
    "--quick: 4,8,16,64,1024).")
_NK_VALUES = flags.DEFINE_list(
    "synthetic_nk_values", None, "Training points per class of sweep (b) (default: 5,10,15,20,40,100;"
    " --quick: 5,20,100).")
_NK_NU0 = flags.DEFINE_float("synthetic_nk_sweep_nu0", 4.0, "nu0 used in the N_k sweep (b).")
_NU0_NK = flags.DEFINE_integer("synthetic_nu0_sweep_nk", 20, "N_k used in the nu0 sweep (a).")
_NUM_TEST = flags.DEFINE_integer(
    "synthetic_num_test_per_class", 50, "ID test points per class; the OOD set has as many points.")

METRICS = ("auroc", "fpr95", "accuracy")
# Paired differences are reported against these references.
REFERENCES = ("rmds", "indep_rmds")


# Figure 3 reproduces the paper, whose tied model uses Sigma0 = total covariance (the
# library's default is the empirical-Bayes Sigma0; see dpmm_jax/models/tied.py).
PAPER_OPTIONS = {"tied": {"prior_scale": "total"}}


def _settings(nu0_values, nk_values, nu0_sweep_nk, nk_sweep_nu0):
  return ([("nu0", float(v), int(nu0_sweep_nk)) for v in nu0_values] +
          [("nk", float(nk_sweep_nu0), int(n)) for n in nk_values])


def run(output_dir: Optional[str], *, seeds: Sequence[int] = tuple(range(FULL_NUM_SEEDS)),
        nu0_values: Sequence[float] = FULL_NU0, nk_values: Sequence[int] = FULL_NK,
        models: Sequence[str] = dpmm_jax.MODELS, num_classes: int = 10, dim: int = 2,
        kappa0: float = 1 / 25, nu0_sweep_nk: int = 20, nk_sweep_nu0: float = 4.0,
        num_test_per_class: int = 50, plot: bool = True,
        fpr_positive: str = "ood") -> Dict[str, Any]:
  """Runs both sweeps, saves the results, then (optionally) draws the figures.

  Args:
    output_dir: where results and figures go (None: keep in memory, no files, no plots).
    seeds: one dataset per seed and setting.
    nu0_values: nu0 values of sweep (a), each > D + 1.
    nk_values: training points per class of sweep (b).
    models: names from ``dpmm_jax.MODELS``.
    num_classes, dim, kappa0: K, D and the prior's mean concentration.
    nu0_sweep_nk: N_k in sweep (a).
    nk_sweep_nu0: nu0 in sweep (b).
    num_test_per_class: ID test points per class; the OOD set has K times as many.
    plot: draw the PNG figures from the saved results.
    fpr_positive: FPR95 convention, ``"ood"`` (OpenOOD v1.5, default) or ``"in"``.

  Returns:
    ``{"config", "records", "summary", "table"}``: ``records`` has one dict per seed,
    setting and model; ``summary`` one per setting and model with ``<metric>_mean`` /
    ``<metric>_se`` and paired AUROC differences to RMDS and independent RMDS.
  """
  models = common.check_models(models)
  common.check_fpr_positive(fpr_positive)
  seeds = [int(s) for s in seeds]
  if not seeds:
    raise ValueError("Need at least one seed.")
  for v in nu0_values:
    if not v > dim + 1:
      raise ValueError(f"Every nu0 must be > D + 1 = {dim + 1}, got {v}.")
  if not nk_sweep_nu0 > dim + 1:
    raise ValueError(f"nk_sweep_nu0 must be > D + 1 = {dim + 1}, got {nk_sweep_nu0}.")
  for n in list(nk_values) + [nu0_sweep_nk]:
    if int(n) < 2:
      raise ValueError(f"Need at least 2 training points per class, got {n}.")
  dtype = common.float_dtype()
  settings = _settings(nu0_values, nk_values, nu0_sweep_nk, nk_sweep_nu0)
  config = dict(seeds=seeds, nu0_values=[float(v) for v in nu0_values],
                nk_values=[int(n) for n in nk_values], models=models,
                num_classes=num_classes, dim=dim, kappa0=kappa0, mu0=0.0, sigma0="identity",
                nu0_sweep_nk=int(nu0_sweep_nk), nk_sweep_nu0=float(nk_sweep_nu0),
                num_test_per_class=num_test_per_class,
                num_ood=num_classes * num_test_per_class, float64=dtype == np.float64,
                fpr_positive=fpr_positive)
  logging.info("Synthetic sweeps: %d settings x %d seeds x %d models", len(settings),
               len(seeds), len(models))
  progress = common.Progress(len(settings) * len(seeds) * len(models), "synthetic")
  records = []
  for seed in seeds:
    for sweep, nu0, nk in settings:
      data = synthetic.make_dataset(
          jax.random.PRNGKey(seed), num_classes=num_classes, dim=dim, nu0=nu0,
          kappa0=kappa0, num_train_per_class=nk, num_test_per_class=num_test_per_class,
          dtype=dtype)
      res = common.evaluate_models(
          models, np.asarray(data.x_train), np.asarray(data.y_train),
          np.asarray(data.x_test), np.asarray(data.y_test), {"ood": np.asarray(data.x_ood)},
          num_classes=num_classes, key=jax.random.PRNGKey(seed), progress=progress,
          raise_errors=False, model_options=PAPER_OPTIONS, fpr_positive=fpr_positive)
      for model, r in res.items():
        records.append(dict(sweep=sweep, nu0=nu0, nk=nk, seed=seed, model=model,
                            auroc=r["ood"]["ood"]["auroc"], fpr95=r["ood"]["ood"]["fpr95"],
                            accuracy=r["accuracy"], fit_s=r["fit_s"],
                            converged=r["converged"], error=r["error"]))
  errors = [r for r in records if r["error"]]
  if errors:
    logging.warning("%d fits failed, e.g. %s", len(errors), errors[0])
  summary = summarize(records, models)
  table = summary_markdown(summary, models, fpr_positive)
  result = {"config": config, "records": records, "summary": summary, "table": table}
  if output_dir:
    save(output_dir, result)
    _save_examples(output_dir, num_classes, dim, kappa0, nu0_sweep_nk, num_test_per_class,
                   seeds[0], (min(nu0_values), max(nu0_values)), dtype)
    if plot:
      plot_results(output_dir)
  return result


def summarize(records: List[Dict[str, Any]], models: Sequence[str]) -> List[Dict[str, Any]]:
  """Mean ± standard error over seeds for every (sweep, setting, model), with paired AUROC
  and FPR95 differences to the reference models (same seed, same data)."""
  by_key = {}
  for r in records:
    by_key.setdefault((r["sweep"], r["nu0"], r["nk"]), {}).setdefault(r["model"], {})[
        r["seed"]] = r
  summary = []
  for (sweep, nu0, nk), per_model in by_key.items():
    for model in models:
      runs = per_model.get(model, {})
      row = dict(sweep=sweep, nu0=nu0, nk=nk, model=model, num_seeds=len(runs))
      for metric in METRICS:
        row[f"{metric}_mean"], row[f"{metric}_se"] = common.mean_and_se(
            [runs[s][metric] for s in runs])
      for ref in REFERENCES:
        ref_runs = per_model.get(ref, {})
        for metric in ("auroc", "fpr95"):
          diffs = [runs[s][metric] - ref_runs[s][metric] for s in runs if s in ref_runs]
          row[f"d{metric}_vs_{ref}_mean"], row[f"d{metric}_vs_{ref}_se"] = (
              common.mean_and_se(diffs))
      summary.append(row)
  return summary


def summary_markdown(summary: List[Dict[str, Any]], models: Sequence[str],
                     fpr_positive: str = "ood") -> str:
  """Markdown tables, rows = settings, columns = models, mean ± s.e. over seeds: AUROC,
  FPR95 and the paired AUROC difference to the sweep's reference (RMDS for the nu0 sweep,
  independent RMDS for the N_k sweep)."""
  out = []
  for sweep, label, ref in (("nu0", "nu0 (N_k = {nk})", "rmds"),
                            ("nk", "N_k (nu0 = {nu0:g})", "indep_rmds")):
    rows = [r for r in summary if r["sweep"] == sweep]
    if not rows:
      continue
    keys = sorted({(r["nu0"], r["nk"]) for r in rows}, key=lambda k: k if sweep == "nu0"
                  else (k[1], k[0]))
    lookup = {(r["nu0"], r["nk"], r["model"]): r for r in rows}
    first = lookup[keys[0] + (models[0],)]
    n = first["num_seeds"]
    tables = [("auroc", f"AUROC ↑, sweep over {sweep}", models),
              ("fpr95", f"{common.fpr95_label(fpr_positive)}, sweep over {sweep}", models)]
    if ref in models:
      tables.append((f"dauroc_vs_{ref}",
                     f"AUROC − {common.MODEL_LABELS[ref]} AUROC (paired, same data), "
                     f"sweep over {sweep}", [m for m in models if m != ref]))
    for metric, title, cols in tables:
      header = [label.format(nk=first["nk"], nu0=first["nu0"])] + [
          common.MODEL_LABELS[m] for m in cols]
      body = []
      for k in keys:
        setting = f"{k[0]:g}" if sweep == "nu0" else f"{k[1]}"
        cells = []
        for m in cols:
          mean, se = lookup[k + (m,)][f"{metric}_mean"], lookup[k + (m,)][f"{metric}_se"]
          cells.append(f"{mean:+.3f} ± {se:.3f}" if metric.startswith("d")
                       else common.fmt_mean_se(mean, se))
        body.append([setting] + cells)
      out.append(f"**{title} (mean ± s.e. over {n} seeds)**\n\n"
                 + common.markdown_table(header, body))
  out.append(common.fpr95_note(fpr_positive) + "\n")
  return "\n".join(out)


def save(output_dir: str, result: Dict[str, Any]) -> None:
  common.save_json(os.path.join(output_dir, "synthetic.json"), result)
  common.save_csv(os.path.join(output_dir, "synthetic_runs.csv"), result["records"])
  common.save_csv(os.path.join(output_dir, "synthetic_summary.csv"), result["summary"])
  common.save_text(os.path.join(output_dir, "synthetic_summary.md"), result["table"])


def _save_examples(output_dir, num_classes, dim, kappa0, nk, num_test_per_class, seed,
                   nu0_pair, dtype):
  """Two example datasets (the smallest and the largest nu0), for panels A and B."""
  if dim != 2:
    return
  arrays = {}
  for tag, nu0 in zip(("a", "b"), nu0_pair):
    d = synthetic.make_dataset(jax.random.PRNGKey(seed), num_classes=num_classes, dim=dim,
                               nu0=nu0, kappa0=kappa0, num_train_per_class=nk,
                               num_test_per_class=num_test_per_class, dtype=dtype)
    arrays.update({f"{tag}_nu0": np.asarray(nu0), f"{tag}_x_train": np.asarray(d.x_train),
                   f"{tag}_y_train": np.asarray(d.y_train), f"{tag}_x_ood": np.asarray(d.x_ood),
                   f"{tag}_means": np.asarray(d.means),
                   f"{tag}_covariances": np.asarray(d.covariances)})
  path = os.path.join(output_dir, "synthetic_examples.npz")
  np.savez(path, **arrays)
  logging.info("Wrote %s", path)


# --------------------------------------------------------------------------- figures
def _ellipse(mean, cov, radius=2.0, num=100):
  t = np.linspace(0, 2 * np.pi, num)
  chol = np.linalg.cholesky(cov)
  return mean[:, None] + radius * chol @ np.stack([np.cos(t), np.sin(t)])


def _plot_examples(plt, output_dir) -> Optional[str]:
  path = os.path.join(output_dir, "synthetic_examples.npz")
  if not os.path.exists(path):
    return None
  ex = np.load(path)
  fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
  cmap = plt.get_cmap("tab10")
  for ax, tag, letter in zip(axes, ("a", "b"), "AB"):
    x, y = ex[f"{tag}_x_train"], ex[f"{tag}_y_train"]
    for k in range(int(y.max()) + 1):
      c = cmap(k % 10)
      ax.scatter(*x[y == k].T, s=8, color=c, alpha=0.8)
      ax.plot(*_ellipse(ex[f"{tag}_means"][k], ex[f"{tag}_covariances"][k]), color=c, lw=1)
    ood = ex[f"{tag}_x_ood"]
    ax.scatter(*ood.T, s=9, marker="x", color="black", alpha=0.3, linewidths=0.8,
               label="OOD (one fresh cluster each)")
    lim = np.percentile(np.abs(np.concatenate([x, ood])), 97) * 1.15
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_aspect("equal")
    ax.set_title(f"{letter}: nu0 = {float(ex[f'{tag}_nu0']):g} "
                 f"({'covariances differ' if tag == 'a' else 'nearly tied'})")
    ax.set_xlabel("x1 (units of sqrt(Sigma0), Sigma0 = I)")
    ax.set_ylabel("x2 (units of sqrt(Sigma0))")
    ax.legend(loc="lower right")
  fig.suptitle("Example training sets (dots, 2-sd ellipses of the true class covariances)"
               " and OOD points (x)")
  fig.tight_layout()
  out = common.save_and_close(fig, os.path.join(output_dir, "synthetic_examples.png"))
  return out


def _records(result, sweep, model):
  return [r for r in result["records"] if r["sweep"] == sweep and r["model"] == model]


def _plot_scatter(plt, result, output_dir) -> Optional[str]:
  """Paper's Fig. 3C/3D: DPMM AUROC against the reference's, one dot per seed."""
  models = result["config"]["models"]
  dpmms = [m for m in dpmm_jax.DPMM_MODELS if m in models]
  panels = []
  if "rmds" in models and result["config"]["nu0_values"]:
    panels.append(("nu0", "rmds", "nu0 of the generating prior"))
  if "indep_rmds" in models and result["config"]["nk_values"]:
    panels.append(("nk", "indep_rmds", "training points per class N_k"))
  if not dpmms or not panels:
    return None
  from matplotlib import colors as mcolors  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(len(panels), len(dpmms), figsize=(3.2 * len(dpmms),
                                                             3.2 * len(panels)),
                           squeeze=False)
  for row, (sweep, ref, clabel) in enumerate(panels):
    ref_by_key = {(r["seed"], r["nu0"], r["nk"]): common.nan_if_none(r["auroc"])
                  for r in _records(result, sweep, ref)}
    values = sorted({r[sweep] for r in result["records"] if r["sweep"] == sweep})
    norm = mcolors.LogNorm(min(values), max(values)) if min(values) > 0 and len(values) > 1 \
        else None
    cmap = plt.get_cmap("viridis")
    points = {}
    for model in dpmms:
      recs = _records(result, sweep, model)
      xs = np.array([ref_by_key.get((r["seed"], r["nu0"], r["nk"]), math.nan) for r in recs])
      ys = np.array([common.nan_if_none(r["auroc"]) for r in recs])
      points[model] = (xs, ys, np.array([r[sweep] for r in recs], np.float64))
    finite = np.concatenate([v[np.isfinite(v)] for xs, ys, _ in points.values()
                             for v in (xs, ys)])
    lo, hi = (finite.min(), finite.max()) if finite.size else (0.5, 1.0)
    pad = 0.03 * (hi - lo + 1e-3)
    lo, hi = lo - pad, hi + pad
    for col, model in enumerate(dpmms):
      ax = axes[row, col]
      xs, ys, cs = points[model]
      sc = ax.scatter(xs, ys, c=cs, cmap=cmap, norm=norm, s=10, alpha=0.8,
                      edgecolors="none")
      ax.plot([lo, hi], [lo, hi], color="0.3", lw=0.8, ls="--")
      ax.set_xlim(lo, hi)
      ax.set_ylim(lo, hi)
      ax.set_aspect("equal")
      ok = np.isfinite(xs) & np.isfinite(ys)
      above = np.mean(ys[ok] > xs[ok]) if ok.any() else math.nan
      ax.set_title(f"{common.MODEL_LABELS[model]}: {above:.0%} above diagonal",
                   color=common.MODEL_COLORS[model], fontsize=9)
      ax.set_xlabel(f"{common.MODEL_LABELS[ref]} AUROC")
      if col == 0:
        ax.set_ylabel("DPMM AUROC (model in panel title)")
    cb = fig.colorbar(sc, ax=list(axes[row]), fraction=0.02, pad=0.01)
    cb.set_label(clabel)
  fig.suptitle("Synthetic data: DPMM AUROC against the baseline, one dot per seed and "
               "setting\n(row 1: nu0 sweep vs RMDS; row 2: N_k sweep at nu0 = "
               f"{result['config']['nk_sweep_nu0']:g} vs independent RMDS)", fontsize=10)
  out = common.save_and_close(fig, os.path.join(output_dir, "synthetic_scatter.png"))
  return out


def _plot_sweep(plt, result, output_dir, sweep) -> Optional[str]:
  cfg = result["config"]
  rows = [r for r in result["summary"] if r["sweep"] == sweep]
  if not rows:
    return None
  models = cfg["models"]
  ref = "rmds" if sweep == "nu0" else "indep_rmds"
  if ref not in models:
    ref = None
  fig, axes = plt.subplots(1, 3 if ref else 2, figsize=(15 if ref else 10, 4.3))
  xlabel = ("nu0 of the generating NIW prior (log scale; large = tied covariances)"
            if sweep == "nu0" else "training points per class N_k (log scale)")
  # The MSP heads sit at or below chance on these data (far-away OOD points get confident
  # softmax outputs); drawing them would squash every other curve. They are in the tables.
  shown = [m for m in models if m not in ("msp", "temp_msp")]
  for model in shown:
    mrows = sorted([r for r in rows if r["model"] == model], key=lambda r: r[sweep])
    x = [r[sweep] for r in mrows]
    get = lambda k: [common.nan_if_none(r[k]) for r in mrows]  # pylint: disable=cell-var-from-loop
    common.line_with_errors(axes[0], model, x, get("auroc_mean"), get("auroc_se"))
    common.line_with_errors(axes[-1], model, x, get("fpr95_mean"), get("fpr95_se"))
    if ref:
      common.line_with_errors(axes[1], model, x, get(f"dauroc_vs_{ref}_mean"),
                              get(f"dauroc_vs_{ref}_se"))
  axes[0].set_ylabel("AUROC (ID vs OOD) ↑")
  axes[0].set_title("AUROC, mean ± s.e. over seeds")
  # Results saved before the convention was recorded used the ID-positive FPR95.
  positive = cfg.get("fpr_positive", "in")
  axes[-1].set_ylabel("FPR at 95% TPR ↓ (" + ("OOD positive, OpenOOD" if positive == "ood"
                                             else "ID positive") + ")")
  axes[-1].set_title(f"{common.fpr95_label(positive)[:-2]}, mean ± s.e. over seeds")
  if ref:
    axes[1].axhline(0, color=common.MODEL_COLORS[ref], lw=1)
    axes[1].set_ylabel(f"AUROC − {common.MODEL_LABELS[ref]} AUROC (same data)")
    axes[1].set_title(f"Paired AUROC gain over {common.MODEL_LABELS[ref]}")
  for ax in axes:
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ticks = _log_ticks(sorted({r[sweep] for r in rows}))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{v:g}" for v in ticks])
    ax.minorticks_off()
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="upper center", ncol=len(shown), frameon=False,
             bbox_to_anchor=(0.5, 1.06))
  fixed = (f"N_k = {cfg['nu0_sweep_nk']}" if sweep == "nu0"
           else f"nu0 = {cfg['nk_sweep_nu0']:g}")
  fig.text(0.5, -0.04, f"Synthetic data, K = {cfg['num_classes']}, D = {cfg['dim']}, "
           f"{fixed}, kappa0 = {cfg['kappa0']:g}; {len(cfg['seeds'])} seeds; "
           f"{cfg['num_test_per_class'] * cfg['num_classes']} ID test and "
           f"{cfg['num_ood']} OOD points per seed. MSP heads (AUROC < 0.5 here) are "
           "left out of the plot; see the tables.", ha="center", fontsize=9)
  fig.tight_layout()
  out = common.save_and_close(fig, os.path.join(output_dir, f"synthetic_{sweep}.png"))
  return out


def _log_ticks(values, min_ratio=1.45):
  """The sweep values, thinned so that neighbouring labels on a log axis do not overlap."""
  ticks = []
  for v in values:
    if not ticks or v / ticks[-1] >= min_ratio or v == values[-1]:
      if ticks and v == values[-1] and v / ticks[-1] < min_ratio:
        ticks.pop()
      ticks.append(v)
  return ticks


def plot_results(output_dir: str) -> List[str]:
  """Draws every figure from the results saved in ``output_dir``; returns the paths."""
  result = common.load_json(os.path.join(output_dir, "synthetic.json"))
  plt = common.pyplot()
  paths = [_plot_examples(plt, output_dir), _plot_scatter(plt, result, output_dir),
           _plot_sweep(plt, result, output_dir, "nu0"),
           _plot_sweep(plt, result, output_dir, "nk")]
  return [p for p in paths if p]


def main(argv):
  del argv
  output_dir = common.setup_from_flags("synthetic")
  if common.plot_only():
    plot_results(output_dir)
    return
  quick = common.quick()
  nu0_values = ([float(v) for v in _NU0_VALUES.value] if _NU0_VALUES.value else
                (QUICK_NU0 if quick else FULL_NU0))
  nk_values = ([int(v) for v in _NK_VALUES.value] if _NK_VALUES.value else
               (QUICK_NK if quick else FULL_NK))
  seeds = common.seeds(QUICK_NUM_SEEDS if quick else FULL_NUM_SEEDS)
  result = run(output_dir, seeds=seeds, nu0_values=nu0_values, nk_values=nk_values,
               models=common.models_flag(), nu0_sweep_nk=_NU0_NK.value,
               nk_sweep_nu0=_NK_NU0.value, num_test_per_class=_NUM_TEST.value,
               fpr_positive=common.fpr_positive())
  print(result["table"])
  print(f"Results and figures in {output_dir}/")


if __name__ == "__main__":
  app.run(main)
