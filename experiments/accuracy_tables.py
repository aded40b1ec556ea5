r"""Re-measures the model-choice tables with the library's defaults (issue 12).

Two real-feature problems:

* CLINC150 intents embedded with all-MiniLM-L6-v2 (``data/clinc150_minilm/``, D = 384,
  K = 120; near OOD = two held-out domains, far OOD = out-of-scope queries).
* scikit-learn's 8x8 digits (D = 64 pixels): digits 0-4 in distribution (half of their
  images for training, half for the ID test), near OOD = the held-out digits 5-9, far OOD
  = those held-out images with their pixels shuffled by one fixed permutation (same
  intensities, no stroke structure). ``write_digits`` writes them as feature files.

* issue 12's synthetic problem: the section-6.1 generative process at K = 100, D = 64,
  N_k = 50, nu0 = 74, kappa0 = 4, with 2000 points of unseen classes as the OOD set.

Each problem runs through ``experiments.benchmark`` (every model), and a small table
compares the tied model's prior scale (empirical Bayes vs the paper's total covariance)
with RMDS. Outputs: ``<output_dir>/benchmark_{clinc150,digits,synthetic}.{json,md,csv}``,
``<output_dir>/accuracy_tied_prior.{json,md}`` and figures in ``--accuracy_figure_dir``.

The one command that regenerates the tables (1.5 and 2.3 min in two runs on 2 CPU cores
with a filled compilation cache):

  python -m experiments.accuracy_tables --output_dir=docs/results \
      --accuracy_figure_dir=docs/figures
"""
import os
import shutil
import tempfile
from typing import Any, Dict, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import numpy as np

import dpmm_jax
from dpmm_jax import feature_files
from dpmm_jax import metrics
from experiments import benchmark
from experiments import common

common.define_flags("seed", "output_dir", "quick", "models")
_FIGURE_DIR = flags.DEFINE_string("accuracy_figure_dir", None, "Where to put the figures "
                                  "(default: --output_dir).")
_CLINC_DIR = flags.DEFINE_string("accuracy_clinc_dir", "data/clinc150_minilm",
                                 "Directory of the CLINC150 feature files.")

CLINC_FILES = dict(train="train.npz", test="test.npz",
                   near={"heldout_domains": "ood_near_heldout_domains.npz"},
                   far={"oos": "ood_far_oos.npz"})


def write_digits(out_dir: str, seed: int = 0) -> Dict[str, Any]:
  """Writes the digits problem as feature files; returns the paths for the benchmark."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  x, y = load_digits(return_X_y=True)
  x = x.astype(np.float32)
  rng = np.random.default_rng(seed)
  ident = y < 5
  train = np.zeros(len(y), bool)
  for k in range(5):
    idx = rng.permutation(np.flatnonzero(y == k))
    train[idx[: len(idx) // 2]] = True
  test = ident & ~train
  perm = rng.permutation(x.shape[1])
  os.makedirs(out_dir, exist_ok=True)
  paths = dict(
      train=feature_files.save_npz(os.path.join(out_dir, "train.npz"), x[train],
                                   y[train].astype(np.int32)),
      test=feature_files.save_npz(os.path.join(out_dir, "test.npz"), x[test],
                                  y[test].astype(np.int32)),
      near={"heldout_digits": feature_files.save_npz(
          os.path.join(out_dir, "ood_near_heldout_digits.npz"), x[~ident])},
      far={"shuffled_pixels": feature_files.save_npz(
          os.path.join(out_dir, "ood_far_shuffled_pixels.npz"), x[~ident][:, perm])})
  return paths


def write_synthetic(out_dir: str, seed: int = 0) -> Dict[str, Any]:
  """Writes issue 12's synthetic problem (section-6.1 generative process, K = 100,
  D = 64, N_k = 50, nu0 = D + 10, kappa0 = 4: class means spread half as far as the
  within-class noise) as feature files: the OOD set is one point from each of 2000 fresh
  classes of the same prior (unseen classes), listed as far OOD."""
  import jax  # pylint: disable=g-import-not-at-top
  from dpmm_jax import synthetic  # pylint: disable=g-import-not-at-top
  ds = synthetic.make_dataset(jax.random.PRNGKey(seed), num_classes=100, dim=64,
                              nu0=74.0, kappa0=4.0, num_train_per_class=50,
                              num_test_per_class=20,
                              num_ood=2000)
  os.makedirs(out_dir, exist_ok=True)
  save = lambda name, x, y=None: feature_files.save_npz(  # noqa: E731
      os.path.join(out_dir, name), np.asarray(x),
      None if y is None else np.asarray(y).astype(np.int32))
  return dict(train=save("train.npz", ds.x_train, ds.y_train),
              test=save("test.npz", ds.x_test, ds.y_test), near={},
              far={"unseen_classes": save("ood_unseen_classes.npz", ds.x_ood)})


def _tied_prior_table(problems: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
  """AUROC (ID test vs every OOD set) of RMDS and the tied model with both Sigma0."""
  rows = []
  for name, files in problems.items():
    tr = feature_files.load(files["train"])
    te = feature_files.load(files["test"])
    ood = np.concatenate([feature_files.load(p, require_labels=False).features
                          for p in list(files["near"].values()) + list(files["far"].values())])
    row = {"problem": name}
    scores = {}
    for label, model, opts in (("rmds", "rmds", {}),
                               ("tied_empirical_bayes", "tied", {}),
                               ("tied_total", "tied", {"prior_scale": "total"})):
      det = dpmm_jax.fit_detector(tr.features, tr.labels, model, **opts)
      s_in, s_out = dpmm_jax.score(det, te.features), dpmm_jax.score(det, ood)
      row[label] = metrics.auroc(s_in, s_out)
      scores[label] = np.concatenate([np.asarray(s_in), np.asarray(s_out)])
    from scipy import stats as sps  # pylint: disable=g-import-not-at-top
    for label in ("tied_empirical_bayes", "tied_total"):
      row[f"spearman_{label}_vs_rmds"] = float(sps.spearmanr(scores[label], scores["rmds"])[0])
    rows.append(row)
  header = ["problem", "RMDS", "tied, Sigma0 = empirical Bayes (default)",
            "tied, Sigma0 = total (paper)", "Spearman(tied EB, RMDS)",
            "Spearman(tied total, RMDS)"]
  table = common.markdown_table(header, [[
      r["problem"], f"{100 * r['rmds']:.1f}", f"{100 * r['tied_empirical_bayes']:.1f}",
      f"{100 * r['tied_total']:.1f}", f"{r['spearman_tied_empirical_bayes_vs_rmds']:.4f}",
      f"{r['spearman_tied_total_vs_rmds']:.4f}"] for r in rows])
  return {"rows": rows, "table": "AUROC (%), ID test vs all OOD sets together.\n\n" + table}


def run(output_dir: Optional[str], *,
        problems: Sequence[str] = ("digits", "clinc150", "synthetic"),
        clinc_dir: str = "data/clinc150_minilm", figure_dir: Optional[str] = None,
        models: Sequence[str] = dpmm_jax.MODELS, seed: int = 0) -> Dict[str, Any]:
  """Runs the benchmark on each problem and the tied prior-scale comparison.

  Args:
    output_dir: where the tables go (None: nothing is written).
    problems: subset of ("digits", "clinc150", "synthetic").
    clinc_dir: CLINC150 feature files.
    figure_dir: where the figures go (default output_dir).
    models: models for the benchmark tables.
    seed: digits split seed and MSP seed.
  Returns:
    {"benchmarks": {problem: benchmark.run result}, "tied_prior": {...}}.
  """
  work = tempfile.mkdtemp(prefix="accuracy_tables_")
  try:
    files = {}
    if "digits" in problems:
      files["digits"] = write_digits(os.path.join(work, "digits"), seed)
    if "synthetic" in problems:
      files["synthetic"] = write_synthetic(os.path.join(work, "synthetic"), seed)
    if "clinc150" in problems:
      files["clinc150"] = dict(
          train=os.path.join(clinc_dir, CLINC_FILES["train"]),
          test=os.path.join(clinc_dir, CLINC_FILES["test"]),
          near={k: os.path.join(clinc_dir, v) for k, v in CLINC_FILES["near"].items()},
          far={k: os.path.join(clinc_dir, v) for k, v in CLINC_FILES["far"].items()})
    titles = {"digits": "scikit-learn digits (8x8 pixels, D = 64): digits 0-4 ID, 5-9 OOD",
              "clinc150": "CLINC150 (all-MiniLM-L6-v2 features, D = 384, K = 120)",
              "synthetic": "Synthetic (section-6.1 process, K = 100, D = 64, N_k = 50, "
                           "nu0 = 74, kappa0 = 4): OOD = points of 2000 unseen classes"}
    out = {"benchmarks": {}}
    for name, f in files.items():
      logging.info("Benchmark on %s", name)
      bench_dir = os.path.join(work, "bench_" + name)
      out["benchmarks"][name] = benchmark.run(
          bench_dir if output_dir else None, f["train"], f["test"], f["near"], f["far"],
          models=models, seed=seed, title=titles[name], plot=output_dir is not None)
      if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        for ext in ("json", "md", "csv"):
          shutil.copy(os.path.join(bench_dir, f"benchmark.{ext}"),
                      os.path.join(output_dir, f"benchmark_{name}.{ext}"))
        fig_dir = figure_dir or output_dir
        os.makedirs(fig_dir, exist_ok=True)
        shutil.copy(os.path.join(bench_dir, "benchmark.png"),
                    os.path.join(fig_dir, f"benchmark_{name}.png"))
    out["tied_prior"] = _tied_prior_table(files)
    if output_dir:
      common.save_json(os.path.join(output_dir, "accuracy_tied_prior.json"), out["tied_prior"])
      common.save_text(os.path.join(output_dir, "accuracy_tied_prior.md"),
                       out["tied_prior"]["table"])
    print(out["tied_prior"]["table"])
    return out
  finally:
    shutil.rmtree(work, ignore_errors=True)


def main(argv):
  del argv
  problems = ("digits",) if common.quick() else ("digits", "clinc150", "synthetic")
  run(common.output_dir_flag(), problems=problems, clinc_dir=_CLINC_DIR.value,
      figure_dir=_FIGURE_DIR.value,
      models=common.models_flag(),
      seed=common.seed())


if __name__ == "__main__":
  app.run(main)
