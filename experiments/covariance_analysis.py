r"""Figures 1 and 2 of the paper: do the class covariances differ, and how? (appendix 9)

1. Förstner–Moonen (FM) distances between all pairs of per-class empirical covariances,
   against the null model in which every class shares the pooled covariance and the
   estimates differ by sampling error only: ``Sigma_hat_k ~ W(N_bar, Sigma_hat / N_bar)``.
2. Per-class diagonal scale factors ``s_k`` (geometric mean over dimensions of a class's
   variance over the pooled variance) and the mean pairwise correlation across dimensions
   of the log variance ratios: if a class's variances are jointly larger or smaller than
   average (the coupled model's ``gamma_k``), the correlation is positive.

The features are first put through the section-8 preprocessing keeping the top
``--num_components`` (default 64) principal components (the paper kept 128 of ImageNet's
768). Classes with no more points than dimensions have singular covariances and are
left out. Input: a labelled feature file (``--train``) or, with none, the built-in problem
of ``experiments.highdim``.

Outputs under --output_dir: ``covariance_analysis.json`` (config and summary),
``covariance_analysis.md``, ``covariance_arrays.npz`` (distances, scale factors, log
variance ratios) and the figures ``covariance_fm.png`` and ``covariance_scales.png``.

  python -m experiments.covariance_analysis
  python -m experiments.covariance_analysis --train=feats/train.npz
  python -m experiments.covariance_analysis --plot_only
"""
import os
import time
from typing import Any, Dict, Optional

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import analysis
from dpmm_jax import feature_files
from dpmm_jax import preprocess
from dpmm_jax import stats as stats_lib
from experiments import common
from experiments import highdim

common.define_flags("train", "output_dir", "plot_only", "float64", "seed", "quick",
                    "num_components")
DEFAULT_NUM_COMPONENTS = 64  # the paper used 128
_MAX_CLASSES = flags.DEFINE_integer(
    "covariance_max_classes", 1000, "Use at most this many classes (the first ones); the "
    "number of pairs grows as K^2.")
_CA_NK = flags.DEFINE_integer(
    "covariance_num_train_per_class", 200, "Built-in problem: points per class.")
QUICK_PROBLEM = dict(num_classes=10, dim=16, num_train_per_class=40, num_test_per_class=2,
                     num_ood_classes=2)


def _class_statistics(x, y, num_classes, num_components, dtype, chunk_size=65536):
  """Section-8 transform (top PCs), then full per-class statistics in that space."""
  chunk_size = int(min(chunk_size, x.shape[0]))
  diag_stats = stats_lib.from_arrays(x, y, num_classes, full=False, chunk_size=chunk_size,
                                     dtype=dtype)
  transform = preprocess.fit(diag_stats, num_components)

  def chunks():
    for start in range(0, x.shape[0], chunk_size):
      xc = jnp.asarray(np.asarray(x[start:start + chunk_size]), dtype)
      yield preprocess.apply(transform, xc), np.asarray(y[start:start + chunk_size])

  return stats_lib.from_chunks(chunks(), num_classes, full=True, chunk_size=chunk_size,
                               dtype=dtype)


def run(output_dir: Optional[str], *, train: Optional[str] = None,
        num_components: int = 64, max_classes: int = 1000, seed: int = 0,
        problem: Optional[Dict[str, Any]] = None, plot: bool = True) -> Dict[str, Any]:
  """Computes the FM distances (real and null) and the diagonal scale statistics.

  Args:
    output_dir: where results and figures go (None: no files).
    train: a labelled feature file; None uses the built-in problem.
    num_components: principal components kept (D of the analysis).
    max_classes: analyse at most this many classes (the first ones).
    seed: PRNG seed of the Wishart null samples (and of the built-in problem).
    problem: keyword arguments of ``experiments.highdim.make_problem``.
    plot: draw the figures from the saved results.

  Returns:
    ``{"config", "summary", "arrays", "table"}``; ``arrays`` holds ``fm_real``,
    ``fm_null``, ``scales_real``, ``scales_null``, ``log_ratio`` (K, D), ``counts``.
  """
  t0 = time.perf_counter()
  dtype = common.float_dtype()
  if train:
    fs = feature_files.load(train)
    x, y, source = fs.features, fs.labels, f"feature file {fs.path}"
    true_scales = None
  else:
    problem = dict(highdim.DEFAULTS, **dict(dict(num_train_per_class=200), **(problem or {})))
    p = highdim.make_problem(jax.random.PRNGKey(seed), dtype=dtype, **problem)
    x, y, true_scales = p.x_train, p.y_train, p.scales
    source = "built-in problem (experiments.highdim): " + ", ".join(
        f"{k}={v}" for k, v in problem.items() if k not in ("num_test_per_class",
                                                          "num_ood_classes"))
  num_classes = int(np.max(y)) + 1
  st = _class_statistics(x, y, num_classes, num_components, dtype)
  dim = st.dim
  counts = np.asarray(st.count)
  keep = np.flatnonzero(counts > dim)[:max_classes]
  if keep.size < 2:
    raise ValueError(f"Need at least 2 classes with more than D = {dim} points; reduce "
                     "num_components.")
  dropped = int(np.sum(counts <= dim))
  if dropped:
    logging.warning("%d classes have <= D = %d points (singular covariance); left out.",
                    dropped, dim)
  class_covs = stats_lib.class_covariances(st)[keep]
  pooled = stats_lib.pooled_covariance(st)
  n_bar = float(np.mean(counts[keep]))
  logging.info("Covariances: %d classes, D = %d, N_bar = %.1f (%.1fs); FM distances for %d"
               " pairs", keep.size, dim, n_bar, time.perf_counter() - t0,
               keep.size * (keep.size - 1) // 2)
  # The null uses N_bar - 1 degrees of freedom: class covariances are centred on the
  # class mean (the paper writes N_bar; the difference is one point per class).
  null_dof = max(n_bar - 1.0, dim)
  null_covs = analysis.wishart_null_covariances(jax.random.PRNGKey(seed + 1), pooled,
                                                null_dof, keep.size)
  fm_real = np.asarray(analysis.pairwise_forstner_moonen(class_covs))
  fm_null = np.asarray(analysis.pairwise_forstner_moonen(null_covs))
  pooled_var = jnp.diagonal(pooled)
  scales_real = np.asarray(analysis.diagonal_scale_factors(class_covs, pooled_var))
  scales_null = np.asarray(analysis.diagonal_scale_factors(null_covs, pooled_var))
  corr_real = analysis.diagonal_scale_correlation(class_covs, pooled_var)
  corr_null = analysis.diagonal_scale_correlation(null_covs, pooled_var)
  corr_null_sd = 1.0 / np.sqrt((keep.size - 1) * dim * (dim - 1) / 2)
  log_ratio = np.asarray(jnp.log(jnp.diagonal(class_covs, axis1=-2, axis2=-1))
                         - jnp.log(pooled_var))
  null_q95 = float(np.quantile(fm_null, 0.95))
  summary = dict(
      num_classes=int(keep.size), dim=int(dim), n_bar=n_bar, null_dof=null_dof,
      classes_dropped=dropped, num_pairs=int(fm_real.size),
      fm_real_median=float(np.median(fm_real)), fm_null_median=float(np.median(fm_null)),
      fm_real_mean=float(np.mean(fm_real)), fm_null_mean=float(np.mean(fm_null)),
      fm_null_q95=null_q95, frac_real_above_null_q95=float(np.mean(fm_real > null_q95)),
      scale_log_sd_real=float(np.std(np.log(scales_real))),
      scale_log_sd_null=float(np.std(np.log(scales_null))),
      scale_corr_real=corr_real, scale_corr_null=corr_null,
      scale_corr_null_sd=float(corr_null_sd))
  if true_scales is not None:
    summary["corr_scale_vs_true_gamma"] = float(
        np.corrcoef(np.log(scales_real), np.log(np.asarray(true_scales)[keep]))[0, 1])
  config = dict(source=source, train=train, num_components=num_components,
                max_classes=max_classes, seed=seed, problem=None if train else problem)
  arrays = dict(fm_real=fm_real, fm_null=fm_null, scales_real=scales_real,
                scales_null=scales_null, log_ratio=log_ratio, counts=counts[keep])
  result = {"config": config, "summary": summary, "arrays": arrays}
  result["table"] = markdown(result)
  if output_dir:
    os.makedirs(output_dir, exist_ok=True)
    common.save_json(os.path.join(output_dir, "covariance_analysis.json"),
                     {"config": config, "summary": summary, "table": result["table"]})
    np.savez(os.path.join(output_dir, "covariance_arrays.npz"), **arrays)
    common.save_text(os.path.join(output_dir, "covariance_analysis.md"), result["table"])
    if plot:
      plot_results(output_dir)
  return result


def markdown(result) -> str:
  s = result["summary"]
  rows = [
      ["median FM distance", f"{s['fm_real_median']:.3f}", f"{s['fm_null_median']:.3f}"],
      ["mean FM distance", f"{s['fm_real_mean']:.3f}", f"{s['fm_null_mean']:.3f}"],
      ["pairs above the null's 95th percentile",
       f"{100 * s['frac_real_above_null_q95']:.1f}%", "5% (by definition)"],
      ["sd of log scale factor s_k", f"{s['scale_log_sd_real']:.3f}",
       f"{s['scale_log_sd_null']:.3f}"],
      ["mean pairwise corr. of log variance ratios", f"{s['scale_corr_real']:.3f}",
       f"{s['scale_corr_null']:.3f} (sd {s['scale_corr_null_sd']:.3f})"],
  ]
  head = (f"Source: {result['config']['source']}. {s['num_classes']} classes, "
          f"D = {s['dim']} principal components, N_bar = {s['n_bar']:.1f} points per "
          f"class, {s['num_pairs']} pairs; null: W(N_bar - 1, Sigma_hat / (N_bar - 1)).\n\n")
  text = head + common.markdown_table(["statistic", "classes", "Wishart null"], rows)
  if "corr_scale_vs_true_gamma" in s:
    text += (f"\nCorrelation of log s_k with the true log gamma_k of the built-in problem: "
             f"{s['corr_scale_vs_true_gamma']:.3f}\n")
  return text


def plot_results(output_dir: str):
  """Figures 1 and 2 from ``covariance_analysis.json`` and ``covariance_arrays.npz``."""
  saved = common.load_json(os.path.join(output_dir, "covariance_analysis.json"))
  arr = np.load(os.path.join(output_dir, "covariance_arrays.npz"))
  s = saved["summary"]
  plt = common.pyplot()
  real_c, null_c = "#d62728", "#7f7f7f"

  fig, ax = plt.subplots(figsize=(6.5, 4))
  both = np.concatenate([arr["fm_real"], arr["fm_null"]])
  bins = np.linspace(both.min() * 0.95, both.max() * 1.02, 60)
  ax.hist(arr["fm_null"], bins, density=True, alpha=0.6, color=null_c,
          label=f"Wishart null W(N̄−1, Σ̂/(N̄−1)) (median {s['fm_null_median']:.2f})")
  ax.hist(arr["fm_real"], bins, density=True, alpha=0.6, color=real_c,
          label=f"pairs of class covariances (median {s['fm_real_median']:.2f})")
  ax.axvline(s["fm_null_q95"], color="k", ls="--", lw=1,
             label=f"null 95th percentile ({100 * s['frac_real_above_null_q95']:.0f}% of "
                   "pairs above)")
  ax.set_xlabel("Förstner–Moonen distance between covariance matrices (dimensionless)")
  ax.set_ylabel("density")
  ax.set_title(f"Class covariances differ more than sampling error explains\n"
               f"{s['num_classes']} classes, D = {s['dim']} PCs, N̄ = {s['n_bar']:.0f}",
               fontsize=10)
  ax.legend(fontsize=7, loc="upper right")
  fig.tight_layout()
  paths = [common.save_and_close(fig, os.path.join(output_dir, "covariance_fm.png"))]

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2),
                           gridspec_kw={"width_ratios": [1.4, 1, 1]})
  lr = arr["log_ratio"]
  order = np.argsort(np.mean(lr, axis=1))
  shown = lr[order][:, :min(lr.shape[1], 128)] / np.log(2)
  lim = np.quantile(np.abs(shown), 0.98)
  im = axes[0].imshow(shown, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim,
                      interpolation="nearest")
  axes[0].set_xlabel("dimension (principal component, after section-8 rotation)")
  axes[0].set_ylabel("class (sorted by scale factor s_k)")
  axes[0].set_title("log2 (class variance / pooled variance)")
  fig.colorbar(im, ax=axes[0], fraction=0.04, pad=0.02, label="log2 ratio")
  both = np.concatenate([arr["scales_real"], arr["scales_null"]])
  bins = np.geomspace(both.min() * 0.95, both.max() * 1.05, 40)
  axes[1].hist(arr["scales_null"], bins, alpha=0.6, color=null_c, label="Wishart null")
  axes[1].hist(arr["scales_real"], bins, alpha=0.6, color=real_c, label="classes")
  axes[1].set_xscale("log")
  axes[1].set_xlabel("diagonal scale factor s_k (geometric-mean variance ratio, log scale)")
  axes[1].set_ylabel("number of classes")
  axes[1].set_title(f"sd of log s_k: classes {s['scale_log_sd_real']:.2f}, "
                    f"null {s['scale_log_sd_null']:.2f}", fontsize=10)
  axes[1].legend()
  # Two example dimensions against each other: a common factor shows as a diagonal cloud.
  d1, d2 = lr.shape[1] // 3, 2 * lr.shape[1] // 3
  axes[2].scatter(lr[:, d1] / np.log(2), lr[:, d2] / np.log(2), s=10, color=real_c,
                  alpha=0.7)
  axes[2].set_xlabel(f"log2 variance ratio, dimension {d1}")
  axes[2].set_ylabel(f"log2 variance ratio, dimension {d2}")
  axes[2].set_title(f"mean corr. across dimension pairs: {s['scale_corr_real']:.2f} "
                    f"(null {s['scale_corr_null']:.2f} ± {s['scale_corr_null_sd']:.2f})",
                    fontsize=10)
  fig.suptitle("A class's variances are jointly larger or smaller than average "
               "(motivates the coupled model's gamma_k)", fontsize=11)
  fig.tight_layout()
  paths.append(common.save_and_close(fig, os.path.join(output_dir, "covariance_scales.png")))
  return paths


def main(argv):
  del argv
  output_dir = common.setup_from_flags("covariance_analysis")
  if common.plot_only():
    plot_results(output_dir)
    return
  train = common.train_flag()
  quick = common.quick()
  problem = QUICK_PROBLEM if quick else dict(num_train_per_class=_CA_NK.value)
  result = run(output_dir, train=train,
               num_components=common.num_components_flag(
                   8 if quick else DEFAULT_NUM_COMPONENTS),
               max_classes=_MAX_CLASSES.value, seed=common.seed(), problem=problem)
  print(result["table"])
  print(f"Results in {output_dir}/")


if __name__ == "__main__":
  app.run(main)
