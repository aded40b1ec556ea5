r"""Why the hierarchical models trail RMDS on CLINC150, and what the low-rank model changes.

CLINC150 (``data/clinc150_minilm/``): K = 120 intents with N_k = 50 training points in
D = 381 dimensions after the default preprocessing, so every class scatter is rank 49.
Each row is one fit with the library's defaults except what the row names; the metrics
are ID accuracy and AUROC of the ID test against the near (held-out domains) and far
(out-of-scope) sets.

1. **full**: EM's nu0 against larger fixed nu0 (more weight on Sigma0), kappa0 as fitted.
2. **class evidence**: per class, the directions of the Sigma0-whitened evidence B_k above
   the Marchenko-Pastur noise edge, and how many pooled-basis coordinates each one spreads
   over (participation ratio ``1 / sum_i v_i^4``; 1 = one coordinate, D = all evenly).
3. **lowrank**: the noise-edge rule (default) with caps, and fixed ranks (``edge_scale=0``).
4. **diag**: the fitted per-coordinate nu0_d and kappa0_d scaled.

Outputs ``<output_dir>/lowrank_study.{json,md}``. 105 s on 2 CPU cores (the run behind
docs/results); ``--quick`` runs a 6-class, 16-component version with fewer rows (smoke tests).

  python -m experiments.lowrank_study --output_dir=docs/results
"""
import os
import time
from typing import Any, Dict, Optional

from absl import app
from absl import flags
import jax.numpy as jnp
import numpy as np

import dpmm_jax
from dpmm_jax import feature_files
from dpmm_jax import metrics
from dpmm_jax import preprocess
from dpmm_jax import stats as stats_lib
from dpmm_jax.models import diag, full
from experiments import common

common.define_flags("output_dir", "quick")
_CLINC_DIR = flags.DEFINE_string("lowrank_clinc_dir", "data/clinc150_minilm",
                                 "Directory of the CLINC150 feature files.")

_FILES = {"train": "train.npz", "test": "test.npz", "near": "ood_near_heldout_domains.npz",
          "far": "ood_far_oos.npz"}


def _load(clinc_dir: str, quick: bool):
  data = {name: feature_files.load(os.path.join(clinc_dir, f), require_labels=name in
                                   ("train", "test")) for name, f in _FILES.items()}
  x, y = data["train"].features, data["train"].labels
  x_test, y_test = data["test"].features, data["test"].labels
  near, far = data["near"].features, data["far"].features
  if quick:   # the first 6 intents; OOD sets cut to match
    x, y = x[y < 6], y[y < 6]
    x_test, y_test = x_test[y_test < 6], y_test[y_test < 6]
    near, far = near[:200], far[:200]
  return (np.asarray(x, np.float32), np.asarray(y), np.asarray(x_test, np.float32),
          np.asarray(y_test), np.asarray(near, np.float32), np.asarray(far, np.float32))


def _evaluate(det, x_test, y_test, near, far) -> Dict[str, float]:
  s_in = np.asarray(dpmm_jax.score(det, x_test))
  return {"accuracy": metrics.accuracy(np.asarray(dpmm_jax.predict(det, x_test)), y_test),
          "near_auroc": metrics.auroc(s_in, np.asarray(dpmm_jax.score(det, near))),
          "far_auroc": metrics.auroc(s_in, np.asarray(dpmm_jax.score(det, far)))}


def _row(study: str, setting: str, det, data, **extra) -> Dict[str, Any]:
  row = {"study": study, "setting": setting, **_evaluate(det, *data[2:]), **extra}
  print(f"{study:8s} {setting:42s} acc {100 * row['accuracy']:5.1f}  near "
        f"{100 * row['near_auroc']:5.1f}  far {100 * row['far_auroc']:5.1f}", flush=True)
  return row


def _evidence_spectra(det) -> Dict[str, Any]:
  """Directions above the noise edge per class and their spread over the pooled basis."""
  factors = np.asarray(det.params.factors, np.float64)
  spikes = np.asarray(det.params.num_spikes)
  ratios, loadings = [], []
  for k in range(factors.shape[0]):
    for j in range(min(int(spikes[k]), factors.shape[1])):
      v = factors[k, j] / np.linalg.norm(factors[k, j])
      ratios.append(1.0 / np.sum(v ** 4))
      loadings.append(np.max(v * v))
  q = lambda a: [float(v) for v in np.quantile(a, [0.1, 0.5, 0.9])] if len(a) else []  # noqa: E731
  return {"dim": int(factors.shape[2]), "spikes_mean": float(spikes.mean()),
          "spikes_median": float(np.median(spikes)), "spikes_min": int(spikes.min()),
          "spikes_max": int(spikes.max()), "participation_ratio_q10_50_90": q(ratios),
          "largest_squared_loading_q10_50_90": q(loadings)}


def run(output_dir: Optional[str], clinc_dir: str = "data/clinc150_minilm",
        quick: bool = False) -> Dict[str, Any]:
  """Runs the four studies; returns {"rows": [...], "spectra": {...}, "config": {...}}."""
  start = time.time()
  data = _load(clinc_dir, quick)
  x, y = data[0], data[1]
  num_components = 16 if quick else None
  fit = lambda model, **kw: dpmm_jax.fit_detector_with_info(  # noqa: E731
      x, y, model, num_components=num_components, **kw)
  rows = []
  rmds, _ = fit("rmds")
  rows.append(_row("baseline", "RMDS", rmds, data))

  # 1. full: EM's nu0 against larger ones.
  full_det, full_report = fit("full")
  hyper = full_det.params.hyper
  dim = int(hyper.loc.shape[0])
  stats = stats_lib.from_arrays(preprocess.apply(full_det.transform, x), jnp.asarray(y),
                                full_det.num_classes, full=True)
  excess = float(hyper.df) - dim - 1.0
  rows.append(_row("full", f"EM: nu0 - D - 1 = {excess:.1f}, kappa0 = "
                   f"{float(hyper.mean_concentration):.3g}", full_det, data,
                   nu0_excess=excess, em_iters=full_report.num_iters))
  for fixed in ((150.0,) if quick else (50.0, 150.0, 500.0, 2000.0)):
    params = full.params_from_hyper(hyper._replace(df=jnp.asarray(dim + 1.0 + fixed,
                                                                  hyper.df.dtype)), stats)
    det = dpmm_jax.Detector("full", full_det.num_classes, full_det.transform, params)
    rows.append(_row("full", f"nu0 - D - 1 = {fixed:g} (fixed)", det, data,
                     nu0_excess=fixed))

  # 2.-3. lowrank: the class evidence above the noise edge.
  low_det, _ = fit("lowrank")
  spectra = _evidence_spectra(low_det)
  rows.append(_row("lowrank", "default (noise edge, max_rank 32)", low_det, data))
  for max_rank in ((0, 5) if quick else (0, 2, 5, 10, 20)):
    det, _ = fit("lowrank", max_rank=max_rank, edge_scale=0.0)
    rows.append(_row("lowrank", f"fixed rank {max_rank} (edge_scale 0)", det, data))
  for max_rank in (() if quick else (4, 8)):
    det, _ = fit("lowrank", max_rank=max_rank)
    rows.append(_row("lowrank", f"noise edge, max_rank {max_rank}", det, data))

  # 4. diag: per-coordinate class variances and mean prior.
  diag_det, _ = fit("diag")
  dh = diag_det.params.hyper
  diag_stats = stats._replace(scatter=None)
  at_cap = float(np.mean(np.asarray(dh.mean_concentration) >= 0.999 * diag.KAPPA_CAP))
  rows.append(_row("diag", "EM", diag_det, data, kappa0_at_cap_share=at_cap,
                   nu0_quantiles=[float(v) for v in np.quantile(np.asarray(dh.df),
                                                                [0.0, 0.5, 1.0])]))
  for nu_factor, kappa_factor in (((25, 1),) if quick else
                                  ((5, 1), (25, 1), (1000, 1), (1, 0.2), (25, 0.2))):
    params = diag.params_from_hyper(dh._replace(df=dh.df * nu_factor,
                                                mean_concentration=dh.mean_concentration
                                                * kappa_factor), diag_stats)
    det = dpmm_jax.Detector("diag", diag_det.num_classes, diag_det.transform, params)
    rows.append(_row("diag", f"nu0_d x {nu_factor:g}, kappa0_d x {kappa_factor:g}", det,
                     data))
  result = {"rows": rows, "spectra": spectra,
            "config": {"clinc_dir": clinc_dir, "quick": quick, "dim": dim,
                       "num_classes": int(full_det.num_classes),
                       "points_per_class": int(np.bincount(y).min()),
                       "seconds": round(time.time() - start, 1)}}
  if output_dir:
    os.makedirs(output_dir, exist_ok=True)
    common.save_json(os.path.join(output_dir, "lowrank_study.json"), result)
    common.save_text(os.path.join(output_dir, "lowrank_study.md"), markdown(result))
  return result


def markdown(result) -> str:
  cfg, sp = result["config"], result["spectra"]
  table = common.markdown_table(
      ["study", "setting", "ID acc.", "near AUROC", "far AUROC"],
      [[r["study"], r["setting"], f"{100 * r['accuracy']:.1f}",
        f"{100 * r['near_auroc']:.1f}", f"{100 * r['far_auroc']:.1f}"]
       for r in result["rows"]])
  pr, ld = sp["participation_ratio_q10_50_90"], sp["largest_squared_loading_q10_50_90"]
  spectra = (
      f"Class evidence above the noise edge (lowrank default): {sp['spikes_mean']:.2f} "
      f"directions per class on average (median {sp['spikes_median']:g}, range "
      f"{sp['spikes_min']}-{sp['spikes_max']}). Each spreads over many pooled-basis "
      f"coordinates: participation ratio (10/50/90 %) "
      + "/".join(f"{v:.0f}" for v in pr) + f" of D = {sp['dim']}; largest squared "
      "loading " + "/".join(f"{v:.3f}" for v in ld) + ".")
  diag_em = next((r for r in result["rows"] if "nu0_quantiles" in r), None)
  if diag_em is not None:
    lo, mid, hi = diag_em["nu0_quantiles"]
    spectra += (f"\n\ndiag, EM: nu0_d min / median / max {lo:.1f} / {mid:.1f} / {hi:.1f}; "
                f"kappa0_d at its cap in {100 * diag_em['kappa0_at_cap_share']:.0f} % of the "
                "directions.")
  return (f"CLINC150 (K = {cfg['num_classes']}, N_k = {cfg['points_per_class']}, D = "
          f"{cfg['dim']} after preprocessing){' (quick)' if cfg['quick'] else ''}. Values "
          f"in %. One fit per row; {cfg['seconds']} s in all.\n\n{table}\n\n{spectra}\n")


def main(argv):
  del argv
  common.warn_known_jax_issues()
  run(common.output_dir_flag() or os.path.join("results", "lowrank_study"), _CLINC_DIR.value,
      common.quick())


if __name__ == "__main__":
  app.run(main)
