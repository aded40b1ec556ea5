r"""Novelty discovery with VBrand (paper 001): simulation study 1 and a CLINC150 case.

Simulation study 1 (paper section 4.1): seven Gaussians in 2-D, the first three known.
Means (-5,5), (-4,-4), (4,4), (0,0), (5,-10), (5,-10), (-10,-10); covariances
[[1,.9],[.9,1]], I, I, [[1,-.75],[-.75,1]], [[1,.9],[.9,1]], [[1,-.9],[-.9,1]], 0.01 I;
training sizes 300/300/400 and test sizes 200/200/250/90/100/100/60, all times q; p - 2
extra iid N(0, 1) dimensions. The paper's configuration: T = 20, gamma = 5, alpha = 0.1
for every Dirichlet entry, rho_0 = (0, nu0 = p + 2, lambda0 = 0.1, 10 I), known-class priors
from per-class MCD estimates at strength 50 (NIW(mu^, 50, 50 + p + 1, 50 Sigma^)),
tolerance 1e-5, in the raw feature space (``fit_detector(..., preprocess=False)``);
initialisation from the detector (``dpmm_jax.discover``'s default). Metrics: ARI, AMI
(max normalisation, as the paper's R code) and FMI of argmax phi against the truth; the
run time of ``discover`` (compiled: each scenario's shapes are compiled by a warm-up call).

CLINC150 (``data/clinc150_minilm``, 384-d sentence embeddings): two of the eight training
domains (30 intents) are held out of training; the test batch is the whole ID test split
(90 known + 30 held-out intents). The diagonal (NIX) variant runs on the 384-d features.
Reported: ARI over the batch, ARI of the discovered clusters on the held-out points
against their intents, how many novel clusters were found, the novelty rates.

Outputs (``--output_dir``, default results/discovery): discovery_ss1_runs.csv,
discovery_ss1_summary.{csv,md}, discovery_clinc150.{json,md}, discovery.json and the figures
discovery_ss1_metrics.png, discovery_ss1_time.png.

  python -m experiments.discovery --quick          # a few minutes on 2 CPU cores
  python -m experiments.discovery --num_seeds=50   # the paper's 50 replications
  python -m experiments.discovery --plot_only
"""
import os
import time
from typing import Any, Dict, List, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import numpy as np

import dpmm_jax
from dpmm_jax import discovery
from experiments import common

common.define_flags("seed", "num_seeds", "float64", "output_dir", "plot_only", "quick")
_QS = flags.DEFINE_list("discovery_qs", None,
                        "Sample-size multipliers q of simulation study 1 (default: the "
                        "paper's 0.5,1,2.5,5,10; --quick: 0.5,1).")
_PS = flags.DEFINE_list("discovery_ps", None,
                        "Dimensions p of simulation study 1 (default 2,3,5,7,10; --quick: 2,5).")
_CLINC_DIR = flags.DEFINE_string("discovery_clinc_dir", "data/clinc150_minilm",
                                 "Directory of the CLINC150 feature files ('' skips the case).")

PAPER_QS = (0.5, 1.0, 2.5, 5.0, 10.0)
PAPER_PS = (2, 3, 5, 7, 10)
QUICK_QS = (0.5, 1.0)
QUICK_PS = (2, 5)
SS1_MEANS = np.array([[-5, 5], [-4, -4], [4, 4], [0, 0], [5, -10], [5, -10], [-10, -10]], float)
SS1_COVS = np.array([[[1, .9], [.9, 1]], np.eye(2), np.eye(2), [[1, -.75], [-.75, 1]],
                     [[1, .9], [.9, 1]], [[1, -.9], [-.9, 1]], 0.01 * np.eye(2)], float)
SS1_TRAIN = (300, 300, 400)
SS1_TEST = (200, 200, 250, 90, 100, 100, 60)
PAPER_OPTIONS = dict(max_new_classes=20, alpha=0.1, gamma=5.0, class_weights=0.1,
                     known_strength=50.0, novelty_prior="paper", tol=1e-5, max_iter=1000)
# Training domains held out in the CLINC150 case (indices into the 8 ID domains).
CLINC_HELD_OUT_DOMAINS = (6, 7)
CLINC_INTENTS_PER_DOMAIN = 15


def make_ss1(rng, q: float, p: int):
  """(x_train, y_train, x_test, y_test) of simulation study 1 at size q, dimension p."""
  def sample(counts):
    xs, ys = [], []
    for k, n in enumerate(counts):
      n = int(round(q * n))
      x = rng.multivariate_normal(SS1_MEANS[k], SS1_COVS[k], n)
      xs.append(np.concatenate([x, rng.normal(size=(n, p - 2))], 1))
      ys.append(np.full(n, k))
    return np.concatenate(xs), np.concatenate(ys)
  x_train, y_train = sample(SS1_TRAIN)
  x_test, y_test = sample(SS1_TEST)
  return x_train, y_train, x_test, y_test


def clustering_metrics(truth, labels) -> Dict[str, float]:
  from sklearn import metrics as skm   # test/experiment dependency
  return dict(ari=skm.adjusted_rand_score(truth, labels),
              ami=skm.adjusted_mutual_info_score(truth, labels, average_method="max"),
              fmi=skm.fowlkes_mallows_score(truth, labels))


def _discover_paper(det, x_train, y_train, x_test):
  return dpmm_jax.discover(det, x_test, robust_data=(x_train, y_train), **PAPER_OPTIONS)


def run_ss1(qs: Sequence[float], ps: Sequence[int], num_reps: int, seed: int) -> List[Dict]:
  """One record per (q, p, replication)."""
  records = []
  progress = common.Progress(len(qs) * len(ps) * num_reps, "simulation study 1")
  for p in ps:
    for q in qs:
      for rep in range(num_reps):
        rng = np.random.default_rng([seed, rep, int(10 * q), p])
        x_train, y_train, x_test, y_test = make_ss1(rng, q, p)
        det = dpmm_jax.fit_detector(x_train, y_train, model="full", preprocess=False)
        if rep == 0:   # compile this scenario's shapes outside the timing
          _discover_paper(det, x_train, y_train, x_test).assignments.block_until_ready()
        start = time.perf_counter()
        res = _discover_paper(det, x_train, y_train, x_test)
        res.assignments.block_until_ready()
        seconds = time.perf_counter() - start
        rec = dict(q=q, p=p, rep=rep, m=int(x_test.shape[0]), seconds=seconds,
                   iterations=int(res.iterations), converged=bool(res.converged),
                   num_novel_clusters=res.num_novel_clusters,
                   **clustering_metrics(y_test, np.asarray(res.assignments)))
        records.append(rec)
        progress.update(message=f"q={q} p={p} ARI={rec['ari']:.3f}")
  return records


def summarize_ss1(records: List[Dict]) -> List[Dict[str, Any]]:
  rows = []
  for p in sorted({r["p"] for r in records}):
    for q in sorted({r["q"] for r in records}):
      cell = [r for r in records if r["p"] == p and r["q"] == q]
      if not cell:
        continue
      row = dict(p=p, q=q, m=cell[0]["m"], reps=len(cell))
      for key in ("ari", "ami", "fmi", "seconds", "iterations", "num_novel_clusters"):
        vals = [r[key] for r in cell]
        row[key + "_mean"], row[key + "_se"] = common.mean_and_se(vals)
        row[key + "_min"] = float(np.min(vals))
      row["converged"] = float(np.mean([r["converged"] for r in cell]))
      rows.append(row)
  return rows


def ss1_markdown(summary: List[Dict[str, Any]]) -> str:
  header = ["p", "q", "M", "reps", "ARI", "AMI", "FMI", "min ARI / AMI / FMI",
            "novel clusters", "CAVI iters", "converged", "time s"]
  rows = [[r["p"], r["q"], r["m"], r["reps"],
           common.fmt_mean_se(r["ari_mean"], r["ari_se"]),
           common.fmt_mean_se(r["ami_mean"], r["ami_se"]),
           common.fmt_mean_se(r["fmi_mean"], r["fmi_se"]),
           f"{r['ari_min']:.3f} / {r['ami_min']:.3f} / {r['fmi_min']:.3f}",
           f"{r['num_novel_clusters_mean']:.1f}", f"{r['iterations_mean']:.0f}",
           f"{r['converged']:.2f}", f"{r['seconds_mean']:.2f}"] for r in summary]
  return common.markdown_table(header, rows)


# ------------------------------------------------------------------------ CLINC150
def _load(path):
  with np.load(path) as f:
    return np.asarray(f["features"], np.float32), np.asarray(f["labels"], np.int64)


def run_clinc(clinc_dir: str, max_new_classes: int = 40, num_restarts: int = 4,
              seed: int = 0) -> Dict[str, Any]:
  """Two training domains held out; discovery on the full ID test split (diag model)."""
  x_train, y_train = _load(os.path.join(clinc_dir, "train.npz"))
  x_test, y_test = _load(os.path.join(clinc_dir, "test.npz"))
  held = np.concatenate([np.arange(d * CLINC_INTENTS_PER_DOMAIN,
                                   (d + 1) * CLINC_INTENTS_PER_DOMAIN)
                         for d in CLINC_HELD_OUT_DOMAINS])
  is_held_train = np.isin(y_train, held)
  known_ids = np.setdiff1d(np.unique(y_train), held)
  relabel = {c: i for i, c in enumerate(known_ids)}
  xk = x_train[~is_held_train]
  yk = np.array([relabel[c] for c in y_train[~is_held_train]])
  start = time.perf_counter()
  det = dpmm_jax.fit_detector(xk, yk, model="diag")
  fit_s = time.perf_counter() - start
  start = time.perf_counter()
  res = dpmm_jax.discover(det, x_test, max_new_classes, num_restarts=num_restarts,
                          key=__import__("jax").random.PRNGKey(seed))
  res.assignments.block_until_ready()
  discover_s = time.perf_counter() - start
  labels = np.asarray(res.assignments)
  num_known = len(known_ids)
  truth = np.array([relabel.get(c, num_known + int(np.searchsorted(held, c))) for c in y_test])
  is_novel = truth >= num_known
  metrics_all = clustering_metrics(truth, labels)
  metrics_novel = clustering_metrics(truth[is_novel], labels[is_novel])
  novel_clusters = np.unique(labels[labels >= num_known])
  sizes = np.bincount(labels[labels >= num_known] - num_known, minlength=max_new_classes)
  # k-means on the held-out points with the true number of intents (an oracle reference)
  from sklearn.cluster import KMeans
  km = KMeans(n_clusters=len(held), n_init=10, random_state=seed).fit(
      np.asarray(discovery._to_model_space(det, x_test[is_novel])))
  return dict(
      held_out_domains=list(CLINC_HELD_OUT_DOMAINS), num_known_intents=int(num_known),
      num_held_out_intents=int(len(held)), num_test=int(len(y_test)),
      num_test_held_out=int(is_novel.sum()), max_new_classes=max_new_classes,
      ari_all=metrics_all["ari"], ami_all=metrics_all["ami"], fmi_all=metrics_all["fmi"],
      ari_held_out=metrics_novel["ari"], ami_held_out=metrics_novel["ami"],
      fmi_held_out=metrics_novel["fmi"],
      kmeans_oracle_ari_held_out=clustering_metrics(truth[is_novel], km.labels_)["ari"],
      num_novel_clusters=int(len(novel_clusters)),
      num_novel_clusters_ge5=int(np.sum(sizes >= 5)),
      held_out_flagged_novel=float(np.mean(labels[is_novel] >= num_known)),
      known_flagged_novel=float(np.mean(labels[~is_novel] >= num_known)),
      known_accuracy=float(np.mean(labels[~is_novel] == truth[~is_novel])),
      iterations=int(res.iterations), converged=bool(res.converged),
      fit_seconds=fit_s, discover_seconds=discover_s)


def clinc_markdown(r: Dict[str, Any]) -> str:
  rows = [["held-out intents (2 domains) / known intents", f"{r['num_held_out_intents']} / "
           f"{r['num_known_intents']}"],
          ["test batch (held-out points)", f"{r['num_test']} ({r['num_test_held_out']})"],
          ["novel clusters found (with >= 5 points), T", f"{r['num_novel_clusters']} "
           f"({r['num_novel_clusters_ge5']}), {r['max_new_classes']}"],
          ["ARI / AMI / FMI, held-out points vs their intents",
           f"{r['ari_held_out']:.3f} / {r['ami_held_out']:.3f} / {r['fmi_held_out']:.3f}"],
          ["k-means with the true k = 30 on the held-out points (oracle), ARI",
           f"{r['kmeans_oracle_ari_held_out']:.3f}"],
          ["ARI / AMI / FMI, whole batch", f"{r['ari_all']:.3f} / {r['ami_all']:.3f} / "
           f"{r['fmi_all']:.3f}"],
          ["held-out points assigned to a novel cluster", f"{r['held_out_flagged_novel']:.3f}"],
          ["known points assigned to a novel cluster", f"{r['known_flagged_novel']:.3f}"],
          ["known points assigned to their own class", f"{r['known_accuracy']:.3f}"],
          ["CAVI sweeps (converged)", f"{r['iterations']} ({r['converged']})"],
          ["fit / discover seconds (incl. compilation, loaded 2-core CPU)",
           f"{r['fit_seconds']:.1f} / {r['discover_seconds']:.1f}"]]
  return common.markdown_table(["CLINC150, diag (NIX) variant, D = 384", "value"], rows)


# ------------------------------------------------------------------------------- run
def run(output_dir: str, *, qs: Sequence[float] = PAPER_QS, ps: Sequence[int] = PAPER_PS,
        num_reps: int = 5, seed: int = 0, clinc_dir: Optional[str] = None,
        plot: bool = True) -> Dict[str, Any]:
  """Runs simulation study 1 (and the CLINC150 case if ``clinc_dir``); writes results."""
  start = time.perf_counter()
  records = run_ss1(qs, ps, num_reps, seed)
  summary = summarize_ss1(records)
  result = dict(config=dict(qs=list(qs), ps=list(ps), num_reps=num_reps, seed=seed,
                            options=PAPER_OPTIONS, ss1_seconds=time.perf_counter() - start),
                ss1_records=records, ss1_summary=summary, ss1_table=ss1_markdown(summary))
  common.save_csv(os.path.join(output_dir, "discovery_ss1_runs.csv"), records)
  common.save_csv(os.path.join(output_dir, "discovery_ss1_summary.csv"), summary)
  common.save_text(os.path.join(output_dir, "discovery_ss1_summary.md"), result["ss1_table"])
  if clinc_dir:
    clinc = run_clinc(clinc_dir, seed=seed)
    result["clinc150"] = clinc
    result["clinc150_table"] = clinc_markdown(clinc)
    common.save_json(os.path.join(output_dir, "discovery_clinc150.json"), clinc)
    common.save_text(os.path.join(output_dir, "discovery_clinc150.md"), result["clinc150_table"])
  common.save_json(os.path.join(output_dir, "discovery.json"), result)
  if plot:
    result["figures"] = plot_results(output_dir)
  return result


def plot_results(output_dir: str) -> List[str]:
  result = common.load_json(os.path.join(output_dir, "discovery.json"))
  records = result["ss1_records"]
  plt = common.pyplot()
  ps = sorted({r["p"] for r in records})
  qs = sorted({r["q"] for r in records})
  cells = [(p, q) for p in ps for q in qs
           if any(r["p"] == p and r["q"] == q for r in records)]
  fig, axes = plt.subplots(3, 1, figsize=(max(6.0, 0.55 * len(cells) + 2), 8.5), sharex=True)
  for ax, key, name in zip(axes, ("ari", "ami", "fmi"), ("ARI", "AMI", "FMI")):
    data = [[r[key] for r in records if r["p"] == p and r["q"] == q] for p, q in cells]
    ax.boxplot(data, widths=0.6)
    ax.axhline(0.7, color="tab:red", ls="--", lw=1, label="0.7 (paper: all scenarios above)")
    ax.set_ylabel(name)
    ax.set_ylim(min(0.5, min(min(d) for d in data) - 0.02), 1.01)
  axes[0].legend(loc="lower left")
  axes[-1].set_xticks(range(1, len(cells) + 1))
  axes[-1].set_xticklabels([f"p={p}\nq={q:g}" for p, q in cells], fontsize=7)
  axes[-1].set_xlabel("scenario (dimension p, size multiplier q)")
  reps = result["config"]["num_reps"]
  axes[0].set_title(f"VBrand on simulation study 1 ({reps} replications per scenario)")
  paths = [common.save_and_close(fig, os.path.join(output_dir, "discovery_ss1_metrics.png"))]
  fig, ax = plt.subplots(figsize=(6, 4))
  for p in ps:
    qp = [q for q in qs if (p, q) in cells]
    ms = [np.median([r["m"] for r in records if r["p"] == p and r["q"] == q]) for q in qp]
    ts = [np.median([r["seconds"] for r in records if r["p"] == p and r["q"] == q]) for q in qp]
    ax.plot(ms, ts, marker="o", label=f"p = {p}")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("test-set size M")
  ax.set_ylabel("discover() seconds (median, compiled)")
  ax.set_title("VBrand run time vs M (4 restarts, loaded 2-core CPU)")
  ax.legend()
  paths.append(common.save_and_close(fig, os.path.join(output_dir, "discovery_ss1_time.png")))
  return paths


def main(argv):
  del argv
  output_dir = common.setup_from_flags("discovery")
  if common.plot_only():
    plot_results(output_dir)
    return
  quick = common.quick()
  qs = [float(v) for v in _QS.value] if _QS.value else (QUICK_QS if quick else PAPER_QS)
  ps = [int(v) for v in _PS.value] if _PS.value else (QUICK_PS if quick else PAPER_PS)
  num_reps = len(common.seeds(2 if quick else 5))
  result = run(output_dir, qs=qs, ps=ps, num_reps=num_reps, seed=common.seed(),
               clinc_dir=_CLINC_DIR.value or None)
  print(result["ss1_table"])
  if "clinc150_table" in result:
    print(result["clinc150_table"])
  print(f"Results and figures in {output_dir}/")


if __name__ == "__main__":
  app.run(main)
