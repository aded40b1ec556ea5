r"""LRVB (paper 004): corrected covariances of a Gaussian mixture against Gibbs.

Three parts, all in float64 (the LRVB Hessian is taken at a CAVI solution converged to
1e-12 and polished by Newton steps):

1. ``simulation``: the paper's simulation (K = 2, P = 2, N = 10,000; means (0,0), (1,1),
   Sigma_k = sqrt(k) 0.25 diag(1, 1.5)^2 / 2.25, weights (3/7, 4/7)). For each data
   set: CAVI, LRVB and mean-field (MFVB) standard deviations of the means, precisions
   and log weights, against a blocked Gibbs sampler (chains vmapped) with effective
   sample sizes. Scatter of LRVB and MFVB sds against Gibbs.
2. ``digits``: a real case in place of the paper's MNIST 0 vs 1 (not available
   offline): scikit-learn's digits, classes 0 and 1, PCA to 25 dimensions (whitened), K = 2.
3. ``timing``: run time of CAVI + LRVB against Gibbs, and the scaling of each in N
   (at P = 2) and in P (at fixed N); the log-log slope is reported. Compile time is
   excluded (every shape is run twice and the second run is timed).
4. ``hyper_coverage``: coverage of nominal 95 % intervals of the EB hyperparameters of
   the full model (``eb_uncertainty``), conditional on the plug-in Sigma0 and with the
   sandwich correction, on data sets simulated from the paper-000 prior.

Outputs under --output_dir: ``lrvb_<part>.json`` / ``.csv`` / ``.md`` and figures
``lrvb_simulation.png``, ``lrvb_digits.png``, ``lrvb_timing.png``.

  python -m experiments.lrvb --quick
  python -m experiments.lrvb --output_dir=docs/results --num_seeds=20
  python -m experiments.lrvb --plot_only --output_dir=docs/results
"""
import json
import os
import time
from typing import Dict, List, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common

common.define_flags("seed", "num_seeds", "float64", "output_dir", "plot_only", "quick")
_PARTS = flags.DEFINE_list("lrvb_parts", ["simulation", "digits", "timing", "hyper_coverage"],
                           "Parts to run: simulation, digits, timing, hyper_coverage.")
_NUM_POINTS = flags.DEFINE_integer("lrvb_num_points", 10_000,
                                   "Points per simulated data set (the paper: 10,000).")
_NUM_DRAWS = flags.DEFINE_integer("lrvb_gibbs_draws", 1000, "Gibbs draws kept per chain.")
_NUM_CHAINS = flags.DEFINE_integer("lrvb_gibbs_chains", 4, "Gibbs chains (vmapped).")

# The paper's data-generating process (rgiordan/MVNMixtureLRVB GenerateSampleParams with
# k=2, p=2, vars.scale=0.5, anisotropy=1): means (0,0) and (1,1),
# Sigma_k = sqrt(k) 0.25 diag(1, 1.5)^2 / 2.25, weights (3/7, 4/7).
PAPER_MEANS = ((0.0, 0.0), (1.0, 1.0))
PAPER_WEIGHTS = (3.0 / 7.0, 4.0 / 7.0)
FUNCTIONALS = ("means", "precisions", "log_weights")


def paper_covariances(dtype=None):
  base = 0.25 * jnp.diag(jnp.array([1.0, 1.5], dtype) ** 2) / 2.25
  return jnp.stack([jnp.sqrt(float(k + 1)) * base for k in range(2)])


def paper_data(key, num_points: int):
  """(N, 2) draws from the paper's two-component simulation."""
  k_z, k_e = jax.random.split(key)
  dtype = jnp.zeros(()).dtype
  covs = paper_covariances(dtype)
  means = jnp.asarray(PAPER_MEANS, dtype)
  z = jax.random.choice(k_z, 2, (num_points,), p=jnp.asarray(PAPER_WEIGHTS, dtype))
  e = jax.random.normal(k_e, (num_points, 2), dtype)
  return means[z] + jnp.einsum("nij,nj->ni", jnp.linalg.cholesky(covs)[z], e)


def _compare(x, prior, key, num_draws, num_chains, burn_in, polish=2):
  """CAVI + LRVB + MFVB + Gibbs on one data set; per-coordinate rows and timings."""
  from dpmm_jax import gmm, mcmc
  t0 = time.perf_counter()
  tol = 1e-12 if x.dtype == jnp.float64 else 1e-7
  state, info = gmm.fit_gmm(x, prior.concentration.shape[0], prior=prior, tol=tol,
                            max_iter=5000, key=key, num_restarts=4)
  jax.block_until_ready(state)
  t_vb = time.perf_counter() - t0
  t0 = time.perf_counter()
  res = gmm.lrvb_covariance(state, prior, x, polish=polish)
  jax.block_until_ready(res.cov)
  t_lr = time.perf_counter() - t0
  t0 = time.perf_counter()
  samples = gmm.gibbs(jax.random.fold_in(key, 1), prior, x, res.state,
                      num_samples=num_draws, num_chains=num_chains, burn_in=burn_in)
  jax.block_until_ready(samples)
  t_gibbs = time.perf_counter() - t0
  rows = []
  for name in FUNCTIONALS:
    draws = np.asarray(gmm.sample_functional(samples, name))
    flat = draws.reshape(-1, draws.shape[-1])
    ess = mcmc.effective_sample_size(draws)
    lr = np.sqrt(np.diag(np.asarray(res.block(name))))
    mf = np.sqrt(np.diag(np.asarray(gmm.mean_field_covariance(res.state, name))))
    vb_mean = np.asarray(gmm.functional(res.state, name))
    for i in range(lr.size):
      rows.append(dict(functional=name, index=i, lrvb_sd=float(lr[i]), mfvb_sd=float(mf[i]),
                       gibbs_sd=float(flat[:, i].std()), gibbs_ess=float(ess[i]),
                       vb_mean=float(vb_mean[i]), gibbs_mean=float(flat[:, i].mean())))
  timing = dict(vb_s=t_vb, lrvb_s=t_lr, gibbs_s=t_gibbs, cavi_iters=int(info.num_iters),
                grad_norm=float(res.info.grad_norm), hessian_dim=res.info.dim)
  return rows, timing


def _summary(rows, min_ess):
  out = {}
  for name in FUNCTIONALS:
    sel = [r for r in rows if r["functional"] == name and r["gibbs_ess"] >= min_ess]
    if not sel:
      continue
    lr = np.array([r["lrvb_sd"] / r["gibbs_sd"] for r in sel])
    mf = np.array([r["mfvb_sd"] / r["gibbs_sd"] for r in sel])
    out[name] = dict(n=len(sel), lr_ratio_median=float(np.median(lr)),
                     lr_ratio_min=float(lr.min()), lr_ratio_max=float(lr.max()),
                     lr_within_10pct=float(np.mean(np.abs(lr - 1) <= 0.10)),
                     mf_ratio_median=float(np.median(mf)), mf_ratio_min=float(mf.min()),
                     mf_ratio_max=float(mf.max()))
  return out


def run_simulation(output_dir, num_seeds=10, seed=0, num_points=10_000, num_draws=1000,
                   num_chains=4, burn_in=100, min_ess=200):
  from dpmm_jax import gmm
  prior = gmm.make_prior(2, 2, dtype=jnp.zeros(()).dtype)
  rows, timings = [], []
  for s in range(num_seeds):
    key = jax.random.PRNGKey(seed + s)
    x = paper_data(key, num_points)
    r, t = _compare(x, prior, jax.random.fold_in(key, 7), num_draws, num_chains, burn_in)
    for row in r:
      row["dataset"] = s
    rows += r
    timings.append(t)
    logging.info("simulation %d/%d: vb %.2fs lrvb %.2fs gibbs %.2fs", s + 1, num_seeds,
                 t["vb_s"], t["lrvb_s"], t["gibbs_s"])
  config = dict(num_seeds=num_seeds, seed=seed, num_points=num_points, num_draws=num_draws,
                num_chains=num_chains, burn_in=burn_in, min_ess=min_ess)
  result = dict(config=config, summary=_summary(rows, min_ess), rows=rows, timings=timings)
  common_write(output_dir, "lrvb_simulation", result, rows)
  return result


def digits_data(num_components=25):
  """scikit-learn digits, classes 0 and 1, PCA to ``num_components`` whitened dims."""
  from sklearn.datasets import load_digits
  x, y = load_digits(return_X_y=True)
  keep = (y == 0) | (y == 1)
  x, y = x[keep].astype(np.float64), y[keep]
  x = x - x.mean(0)
  u, s, vt = np.linalg.svd(x, full_matrices=False)
  z = x @ vt[:num_components].T / (s[:num_components] / np.sqrt(x.shape[0]))
  return z, y


def run_digits(output_dir, seed=0, num_components=25, num_draws=1000, num_chains=4,
               burn_in=100, min_ess=200):
  from dpmm_jax import gmm
  z, y = digits_data(num_components)
  x = jnp.asarray(z, jnp.zeros(()).dtype)
  prior = gmm.make_prior(2, num_components, dtype=x.dtype)
  rows, timing = _compare(x, prior, jax.random.PRNGKey(seed), num_draws, num_chains,
                          burn_in)
  from dpmm_jax import gmm as g
  state, _ = g.fit_gmm(x, 2, prior=prior, tol=1e-12 if x.dtype == jnp.float64 else 1e-7,
                       max_iter=5000, key=jax.random.PRNGKey(seed), num_restarts=4)
  labels = np.asarray(jnp.argmax(g.responsibilities(state, x), -1))
  acc = max(np.mean(labels == y), np.mean(labels != y))
  config = dict(seed=seed, num_points=int(x.shape[0]), dim=num_components,
                num_draws=num_draws, num_chains=num_chains, burn_in=burn_in, min_ess=min_ess)
  result = dict(config=config, summary=_summary(rows, min_ess), rows=rows, timing=timing,
                cluster_accuracy=float(acc))
  common_write(output_dir, "lrvb_digits", result, rows)
  return result


def _slope(xs, ys):
  return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def run_timing(output_dir, seed=0, sizes=(1000, 4000, 16000, 64000), dims=(2, 4, 8, 16),
               dim_points=4000, num_draws=200, timed_reps=3):
  from dpmm_jax import gmm
  rows = []
  load_before = os.getloadavg()[0]
  grid = [(n, 2) for n in sizes] + [(dim_points, d) for d in dims if d != 2]
  for n, d in grid:
    key = jax.random.PRNGKey(seed + n + d)
    means = jnp.stack([jnp.zeros(d), jnp.full(d, 1.5)])
    z = jax.random.bernoulli(key, 0.4, (n,)).astype(jnp.int32)
    x = means[z] + 0.5 * jax.random.normal(jax.random.fold_in(key, 1), (n, d))
    prior = gmm.make_prior(2, d, dtype=x.dtype)
    _compare(x, prior, key, num_draws, 1, 0)      # compiles; not timed
    runs = [_compare(x, prior, key, num_draws, 1, 0)[1] for _ in range(timed_reps)]
    t = {name: (float(np.median([r[name] for r in runs])) if name.endswith("_s")
                else runs[0][name]) for name in runs[0]}    # medians of the timed runs
    per_draw = t["gibbs_s"] / num_draws
    rows.append(dict(num_points=n, dim=d, vb_s=t["vb_s"], lrvb_s=t["lrvb_s"],
                     vb_lrvb_s=t["vb_s"] + t["lrvb_s"], gibbs_per_draw_s=per_draw,
                     gibbs_1000_draws_s=1000 * per_draw, hessian_dim=t["hessian_dim"],
                     cavi_iters=t["cavi_iters"]))
    logging.info("timing N=%d P=%d: vb %.3fs lrvb %.3fs gibbs %.4fs/draw", n, d, t["vb_s"],
                 t["lrvb_s"], per_draw)
  by_n = [r for r in rows if r["dim"] == 2]
  by_p = [r for r in rows if r["num_points"] == dim_points]
  slopes = dict(
      lrvb_vs_n=_slope([r["num_points"] for r in by_n], [r["lrvb_s"] for r in by_n]),
      vb_vs_n=_slope([r["num_points"] for r in by_n], [r["vb_s"] for r in by_n]),
      gibbs_vs_n=_slope([r["num_points"] for r in by_n],
                        [r["gibbs_per_draw_s"] for r in by_n]))
  if len(by_p) > 1:
    slopes.update(
        lrvb_vs_p=_slope([r["dim"] for r in by_p], [r["lrvb_s"] for r in by_p]),
        vb_vs_p=_slope([r["dim"] for r in by_p], [r["vb_s"] for r in by_p]),
        gibbs_vs_p=_slope([r["dim"] for r in by_p], [r["gibbs_per_draw_s"] for r in by_p]))
  config = dict(seed=seed, sizes=list(sizes), dims=list(dims), dim_points=dim_points,
                num_draws=num_draws, timed_reps=timed_reps, cpu_count=os.cpu_count(),
                load_average_before_after=[round(load_before, 2),
                                           round(os.getloadavg()[0], 2)])
  result = dict(config=config, slopes=slopes, rows=rows)
  common_write(output_dir, "lrvb_timing", result, rows)
  return result


def run_hyper_coverage(output_dir, num_seeds=40, seed=0, num_classes=50, dim=2,
                       num_per_class=20, nu0=6.0, kappa0=1 / 25):
  from dpmm_jax import eb_uncertainty, synthetic
  from dpmm_jax import stats as stats_lib
  from dpmm_jax.models import full
  truth = np.array([np.log(nu0 - dim - 1.0), np.log(kappa0)])
  rows = []
  for s in range(num_seeds):
    ds = synthetic.make_dataset(jax.random.PRNGKey(seed + s), num_classes=num_classes,
                                dim=dim, nu0=nu0, kappa0=kappa0,
                                num_train_per_class=num_per_class,
                                dtype=jnp.zeros(()).dtype)
    st = stats_lib.from_labels(ds.x_train, ds.y_train, num_classes, full=True)
    params, info = full.fit(st, tol=1e-10, max_iter=1000)
    for method, moments in (("plug-in Sigma0", False), ("sandwich (mu0, Sigma0)", True)):
      res = eb_uncertainty.hyperparameter_standard_errors("full", st, params.hyper,
                                                          prior_moments=moments)
      for i, name in enumerate(res.names):
        rows.append(dict(dataset=s, method=method, parameter=name, truth=float(truth[i]),
                         estimate=float(res.estimate[i]), se=float(res.standard_error[i]),
                         covered=bool(abs(res.estimate[i] - truth[i])
                                      <= 1.959964 * res.standard_error[i]),
                         at_cap=bool(res.at_cap[i]), converged=bool(info.converged)))
    logging.info("hyper coverage %d/%d", s + 1, num_seeds)
  summary = []
  for method in ("plug-in Sigma0", "sandwich (mu0, Sigma0)"):
    for name in ("log(nu0-D-1)", "log kappa0"):
      sel = [r for r in rows if r["method"] == method and r["parameter"] == name]
      est = np.array([r["estimate"] for r in sel])
      se = np.array([r["se"] for r in sel])
      finite = np.isfinite(se)
      summary.append(dict(method=method, parameter=name, n=len(sel),
                          mean_estimate=float(est.mean()), truth=sel[0]["truth"],
                          sd_estimate=float(est.std(ddof=1)),
                          median_se=float(np.median(se[finite])) if finite.any() else None,
                          se_over_sd=float(np.median(se[finite]) / est.std(ddof=1))
                          if finite.any() else None,
                          coverage_95=float(np.mean([r["covered"] for r in sel])),
                          num_at_cap=int(sum(r["at_cap"] for r in sel))))
  config = dict(num_seeds=num_seeds, seed=seed, num_classes=num_classes, dim=dim,
                num_per_class=num_per_class, nu0=nu0, kappa0=kappa0)
  result = dict(config=config, summary=summary, rows=rows)
  common_write(output_dir, "lrvb_hyper_coverage", result, rows)
  return result


# ------------------------------------------------------------------------ writing
def common_write(output_dir, name, result, rows):
  os.makedirs(output_dir, exist_ok=True)
  with open(os.path.join(output_dir, name + ".json"), "w") as f:
    json.dump(result, f, indent=1)
  if rows:
    keys = list(rows[0])
    with open(os.path.join(output_dir, name + ".csv"), "w") as f:
      f.write(",".join(keys) + "\n")
      for r in rows:
        f.write(",".join(str(r[k]) for k in keys) + "\n")
  with open(os.path.join(output_dir, name + ".md"), "w") as f:
    f.write(_markdown(name, result))


def _fmt(v):
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def _table(rows: Sequence[Dict], keys: Sequence[str]) -> str:
  lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
  for r in rows:
    lines.append("| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |")
  return "\n".join(lines) + "\n"


def _markdown(name, result):
  cfg = json.dumps(result["config"])
  if name in ("lrvb_simulation", "lrvb_digits"):
    summ = [dict(functional=k, **v) for k, v in result["summary"].items()]
    text = (f"# {name}\n\nConfig: `{cfg}`\n\nRatios of standard deviations to the Gibbs "
            "ones, over coordinates whose Gibbs ESS >= min_ess.\n\n")
    text += _table(summ, ["functional", "n", "lr_ratio_median", "lr_ratio_min",
                          "lr_ratio_max", "lr_within_10pct", "mf_ratio_median",
                          "mf_ratio_min", "mf_ratio_max"])
    if name == "lrvb_digits":
      text += f"\nCluster accuracy (0 vs 1): {result['cluster_accuracy']:.4f}\n"
      text += f"\nTiming: `{json.dumps(result['timing'])}`\n"
    else:
      t = result["timings"]
      text += ("\nMedian times per data set (s): VB %.3g, LRVB %.3g, Gibbs %.3g "
               "(first data set includes compilation).\n" % (
                   np.median([x["vb_s"] for x in t]), np.median([x["lrvb_s"] for x in t]),
                   np.median([x["gibbs_s"] for x in t])))
    return text
  if name == "lrvb_timing":
    text = f"# {name}\n\nConfig: `{cfg}`\n\n"
    text += _table(result["rows"], ["num_points", "dim", "hessian_dim", "cavi_iters",
                                    "vb_s", "lrvb_s", "vb_lrvb_s", "gibbs_per_draw_s",
                                    "gibbs_1000_draws_s"])
    text += "\nLog-log slopes: " + ", ".join(
        f"{k} {v:.2f}" for k, v in result["slopes"].items()) + "\n"
    return text
  text = f"# {name}\n\nConfig: `{cfg}`\n\n"
  return text + _table(result["summary"], ["method", "parameter", "n", "truth",
                                           "mean_estimate", "sd_estimate", "median_se",
                                           "se_over_sd", "coverage_95", "num_at_cap"])


# ------------------------------------------------------------------------ plotting
def plot(output_dir, figure_dir=None):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure_dir = figure_dir or output_dir
  os.makedirs(figure_dir, exist_ok=True)
  for name in ("lrvb_simulation", "lrvb_digits"):
    path = os.path.join(output_dir, name + ".json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      result = json.load(f)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, func in zip(axes, FUNCTIONALS):
      sel = [r for r in result["rows"] if r["functional"] == func]
      g = np.array([r["gibbs_sd"] for r in sel])
      ax.scatter(g, [r["lrvb_sd"] for r in sel], s=14, label="LRVB", color="C0")
      ax.scatter(g, [r["mfvb_sd"] for r in sel], s=14, marker="x", label="MFVB",
                 color="C3")
      lim = [0.0, 1.1 * max(g.max(), max(r["lrvb_sd"] for r in sel))]
      ax.plot(lim, lim, "k--", lw=1)
      ax.set_xlim(lim)
      ax.set_ylim(lim)
      ax.set_xlabel("Gibbs posterior sd")
      ax.set_ylabel("variational sd")
      ax.set_title(func)
      ax.legend()
    title = ("Paper simulation (K=2, P=2, N=%d, %d data sets)" % (
        result["config"]["num_points"], result["config"]["num_seeds"])
             if name == "lrvb_simulation" else "Digits 0 vs 1, PCA 25, K=2")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.path.join(figure_dir, name + ".png"), dpi=110)
    plt.close(fig)
  path = os.path.join(output_dir, "lrvb_timing.json")
  if os.path.exists(path):
    with open(path) as f:
      result = json.load(f)
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, sel in ((axes[0], "num_points", [r for r in rows if r["dim"] == 2]),
                         (axes[1], "dim", [r for r in rows if r["num_points"] ==
                                           result["config"]["dim_points"]])):
      xs = [r[key] for r in sel]
      ax.loglog(xs, [r["vb_s"] for r in sel], "o-", label="CAVI")
      ax.loglog(xs, [r["lrvb_s"] for r in sel], "s-", label="LRVB (polish + Hessian)")
      ax.loglog(xs, [r["gibbs_1000_draws_s"] for r in sel], "^-", label="Gibbs, 1000 draws")
      ax.set_xlabel("N (P = 2)" if key == "num_points" else
                    "P (N = %d)" % result["config"]["dim_points"])
      cpus = result["config"].get("cpu_count")
      ax.set_ylabel(f"seconds (median; {cpus}-core CPU)" if cpus else "seconds (loaded CPU)")
      ax.set_xticks(xs)
      ax.set_xticklabels([str(v) for v in xs])
      ax.minorticks_off()
      ax.legend()
    axes[0].set_title("Scaling in N")
    axes[1].set_title("Scaling in P")
    fig.tight_layout()
    fig.savefig(os.path.join(figure_dir, "lrvb_timing.png"), dpi=110)
    plt.close(fig)


def run(output_dir, parts=("simulation", "digits", "timing", "hyper_coverage"), quick=False,
        num_seeds=None, seed=0, num_points=10_000, num_draws=1000, num_chains=4,
        figure_dir=None):
  """Runs the selected parts, writes results, draws figures; returns the results."""
  out = {}
  if "simulation" in parts:
    out["simulation"] = run_simulation(
        output_dir, num_seeds=num_seeds or (2 if quick else 10), seed=seed,
        num_points=1000 if quick else num_points, num_draws=200 if quick else num_draws,
        num_chains=2 if quick else num_chains, burn_in=50 if quick else 100,
        min_ess=50 if quick else 200)
  if "digits" in parts:
    out["digits"] = run_digits(output_dir, seed=seed, num_components=5 if quick else 25,
                               num_draws=200 if quick else num_draws,
                               num_chains=2 if quick else num_chains,
                               burn_in=50 if quick else 100, min_ess=50 if quick else 200)
  if "timing" in parts:
    out["timing"] = run_timing(output_dir, seed=seed,
                               sizes=(500, 1000) if quick else (1000, 4000, 16000, 64000),
                               dims=(2, 3) if quick else (2, 4, 8, 16),
                               dim_points=500 if quick else 4000,
                               num_draws=20 if quick else 200,
                               timed_reps=1 if quick else 3)
  if "hyper_coverage" in parts:
    out["hyper_coverage"] = run_hyper_coverage(
        output_dir, num_seeds=num_seeds or (3 if quick else 40), seed=seed)
  plot(output_dir, figure_dir)
  return out


def main(argv):
  del argv
  output_dir = common.setup_from_flags("lrvb")
  if not jax.config.jax_enable_x64:
    logging.info("LRVB experiments run in float64 (Hessians at a converged CAVI "
                 "solution); enabling jax_enable_x64.")
    jax.config.update("jax_enable_x64", True)
  if common.plot_only():
    plot(output_dir)
    return
  run(output_dir, parts=tuple(_PARTS.value), quick=common.quick(),
      num_seeds=common.num_seeds_flag(), seed=common.seed(),
      num_points=_NUM_POINTS.value, num_draws=_NUM_DRAWS.value,
      num_chains=_NUM_CHAINS.value)


if __name__ == "__main__":
  app.run(main)
