r"""Demo: every model on the paper's synthetic data (section 6.1), one table.

K = 10 classes in D = 2 dimensions with N_k = 20 training points per class, drawn from
the hierarchical normal-inverse-Wishart model with nu0 = 4 (class covariances differ a
lot) and kappa0 = 1/25; each OOD point comes from its own fresh cluster. Prints the mean
± standard error over seeds of AUROC, FPR@95%TPR (OpenOOD convention by default) and ID
accuracy for every model.

  python -m experiments.demo
  python -m experiments.demo --num_seeds=5 --demo_nu0=16
"""
from typing import Any, Dict, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

import dpmm_jax
from dpmm_jax import synthetic
from experiments import common

common.define_flags("output_dir", "plot_only", "float64", "models", "seed", "num_seeds",
                    "fpr_positive")
_NU0 = flags.DEFINE_float("demo_nu0", 4.0, "nu0 of the generating NIW prior (> D + 1).")
_NK = flags.DEFINE_integer("demo_num_train_per_class", 20,
                           "Training points per class (N_k).")


def run(seeds: Sequence[int] = (0, 1, 2), models: Sequence[str] = dpmm_jax.MODELS, *,
        nu0: float = 4.0, num_classes: int = 10, dim: int = 2,
        num_train_per_class: int = 20, num_test_per_class: int = 20,
        kappa0: float = 1 / 25, output_dir: Optional[str] = None,
        fpr_positive: str = "ood") -> Dict[str, Any]:
  """Fits every model on one synthetic dataset per seed.

  Args:
    seeds: one dataset per seed.
    models: model names from ``dpmm_jax.MODELS``.
    nu0, kappa0: the generating NIW prior (mu0 = 0, Sigma0 = I).
    num_classes, dim: K and D.
    num_train_per_class, num_test_per_class: N_k for training and ID test.
    output_dir: if given, writes ``demo.json`` and ``demo.md`` there.
    fpr_positive: FPR95 convention, ``"ood"`` (OpenOOD v1.5, default) or ``"in"``.

  Returns:
    ``{"config": ..., "per_seed": [{model: metrics}], "summary": {model: {"auroc":
    (mean, se), "fpr95": (mean, se), "accuracy": (mean, se)}}, "table": str}``.
  """
  models = common.check_models(models)
  dtype = common.float_dtype()
  progress = common.Progress(len(seeds) * len(models), "demo", every_s=5)
  per_seed = []
  for s in seeds:
    data = synthetic.make_dataset(
        jax.random.PRNGKey(s), num_classes=num_classes, dim=dim, nu0=nu0, kappa0=kappa0,
        num_train_per_class=num_train_per_class, num_test_per_class=num_test_per_class,
        dtype=dtype)
    per_seed.append(common.evaluate_models(
        models, np.asarray(data.x_train), np.asarray(data.y_train),
        np.asarray(data.x_test), np.asarray(data.y_test), {"ood": np.asarray(data.x_ood)},
        num_classes=num_classes, key=jax.random.PRNGKey(s), progress=progress,
        fpr_positive=fpr_positive))
  summary = {}
  for m in models:
    summary[m] = {
        "auroc": common.mean_and_se([r[m]["ood"]["ood"]["auroc"] for r in per_seed]),
        "fpr95": common.mean_and_se([r[m]["ood"]["ood"]["fpr95"] for r in per_seed]),
        "accuracy": common.mean_and_se([r[m]["accuracy"] for r in per_seed]),
    }
  rows = [[common.MODEL_LABELS[m], common.fmt_mean_se(*summary[m]["auroc"]),
           common.fmt_mean_se(*summary[m]["fpr95"]),
           common.fmt_mean_se(*summary[m]["accuracy"])] for m in models]
  table = common.markdown_table(
      ["model", "AUROC ↑", common.fpr95_label(fpr_positive), "ID accuracy ↑"], rows)
  table += "\n" + common.fpr95_note(fpr_positive) + "\n"
  config = dict(seeds=list(seeds), nu0=nu0, kappa0=kappa0, num_classes=num_classes,
                dim=dim, num_train_per_class=num_train_per_class,
                num_test_per_class=num_test_per_class, fpr_positive=fpr_positive)
  result = {"config": config, "per_seed": per_seed, "summary": summary, "table": table}
  if output_dir:
    common.save_json(f"{output_dir}/demo.json", result)
    common.save_text(f"{output_dir}/demo.md", table)
  return result


def main(argv):
  del argv
  common.setup_from_flags("demo")
  output_dir = common.output_dir_flag()  # the demo saves only when asked to
  if common.plot_only():  # the demo draws no figure: reprint the saved table
    print(common.load_json(f"{output_dir or 'results/demo'}/demo.json")["table"])
    return
  seeds = common.seeds(3)
  result = run(seeds, common.models_flag(), nu0=_NU0.value,
               num_train_per_class=_NK.value, output_dir=output_dir,
               fpr_positive=common.fpr_positive())
  c = result["config"]
  print(f"\nSynthetic data (paper section 6.1): K={c['num_classes']}, D={c['dim']}, "
        f"N_k={c['num_train_per_class']}, nu0={c['nu0']:g}, kappa0={c['kappa0']:g}; "
        f"mean ± s.e. over {len(seeds)} seeds.\n")
  print(result["table"])
  logging.info("done")


if __name__ == "__main__":
  app.run(main)
