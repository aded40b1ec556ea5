r"""LDDP image segmentation (seed paper 002): synthetic scenes and two sample photographs.

(1) Synthetic scenes with known segments: piecewise-smooth bands (level sets of a smooth
random field, so segments are non-convex and often disconnected) whose colour
distributions overlap (segment means ``separation`` noise standard deviations apart), so
that colour alone cannot separate them but location can. Rand index of
  LDDP (K0 = true number of segments, and K0 = 100), LDDP with f = 0 (the finite Bayesian
  GMM it reduces to), a GMM on colour (scikit-learn EM), k-means on 5-D RGB + xy, and
  spectral clustering (scikit-learn, nearest-neighbour affinity on RGB + xy),
over several seeds.
(2) The two photographs that ship with scikit-learn (``load_sample_image``: china.jpg,
flower.jpg), downscaled to 128 x 128: segmentations for a figure like the paper's Figure 2
(k-means on RGB + xy with 5 clusters, GMM on colour, LDDP K0 = 5 and K0 = 100) and the
sorted cluster-usage histogram of its Figure 3 for K0 = 100, with run time per sweep and
per image (ahead-of-time compilation timed separately).

Colours are scaled to [0, 1], pixel coordinates to [0, 1] (so the paper's s_l = 0.1,
s_f = 1 apply); Nystrom with an even grid of about 5 % of the pixels.

Outputs under --output_dir: lddp_synthetic.json / _runs.csv / .md, lddp_photos.json /
.md, lddp_labels.npz; figures (--lddp_figure_dir, default the same): lddp_synthetic.png,
lddp_photos.png, lddp_usage.png, lddp_bound.png.

  python -m experiments.lddp --output_dir=docs/results --lddp_figure_dir=docs/figures
  python -m experiments.lddp --quick
  python -m experiments.lddp --plot_only --output_dir=docs/results \
      --lddp_figure_dir=docs/figures
"""
import os
import time
from typing import Dict, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

from dpmm_jax import lddp
from experiments import common

common.define_flags("seed", "num_seeds", "float64", "output_dir", "plot_only", "quick")
_FIGURE_DIR = flags.DEFINE_string(
    "lddp_figure_dir", None, "Directory for the PNG figures (default: --output_dir).")
_SCENE_SIZE = flags.DEFINE_integer("lddp_scene_size", None,
                                   "Side of the synthetic scenes in pixels (default 64; "
                                   "--quick 24).")
_NUM_SEGMENTS = flags.DEFINE_integer("lddp_num_segments", 4, "Segments per synthetic scene.")
_SEPARATION = flags.DEFINE_float(
    "lddp_separation", 2.0, "Distance between segment colour means in noise standard deviations.")
_PHOTO_SIZE = flags.DEFINE_integer("lddp_photo_size", None,
                                   "Side of the downscaled photographs (default 128; "
                                   "--quick 32).")
_MAX_ITER = flags.DEFINE_integer("lddp_max_iter", None,
                                 "Cap on LDDP sweeps (default 1000 as in the paper; "
                                 "--quick 60).")
_TOL = flags.DEFINE_float("lddp_tol", 1e-6, "Relative change of the bound that stops the sweeps.")

PHOTOS = ("china.jpg", "flower.jpg")
METHODS = ("lddp", "lddp_k100", "lddp_f0", "gmm", "kmeans_xy", "spectral")
METHOD_LABELS = {
    "lddp": "LDDP (K0 = true)",
    "lddp_k100": "LDDP (K0 = {big_k})",
    "lddp_f0": "LDDP with f = 0 (Bayesian GMM)",
    "gmm": "GMM on colour (sklearn EM)",
    "kmeans_xy": "k-means on RGB + xy",
    "spectral": "spectral clustering (RGB + xy)",
}


# ------------------------------------------------------------------------------ data
def _simplex(k: int) -> np.ndarray:
  """(k, 3) points with unit pairwise distances for k <= 4 (a regular simplex); for k > 4
  the centred standard basis of R^k projected on its top 3 principal axes."""
  e = np.eye(k) / np.sqrt(2.0)
  e = e - e.mean(0)
  u, s, _ = np.linalg.svd(e, full_matrices=False)
  out = np.zeros((k, 3))
  r = min(3, k - 1)
  out[:, :r] = u[:, :r] * s[:r]
  return out


def pixel_locations(height: int, width: int) -> np.ndarray:
  """(H W, 2) pixel (row, column) coordinates scaled to [0, 1], row-major."""
  rows, cols = np.meshgrid(np.linspace(0.0, 1.0, height), np.linspace(0.0, 1.0, width),
                           indexing="ij")
  return np.stack([rows.ravel(), cols.ravel()], -1)


def synthetic_scene(seed: int, size: int = 64, num_segments: int = 4,
                    separation: float = 2.0, noise: float = 0.1, num_bumps: int = 6,
                    bump_width: float = 0.25):
  """A piecewise-smooth scene with known segments and overlapping colour distributions.

  Segments are the ``num_segments`` quantile bands of a smooth random field (a sum of
  Gaussian bumps with random signs), so they are non-convex and can be disconnected.
  Segment colour means sit on a randomly rotated regular simplex, ``separation`` noise
  standard deviations apart; within a segment the mean varies smoothly (a linear shade)
  and each pixel adds isotropic noise of standard deviation ``noise``.

  Returns:
    image (size, size, 3) float, labels (size, size) int.
  """
  rng = np.random.default_rng(seed)
  loc = pixel_locations(size, size)
  centres = rng.uniform(-0.1, 1.1, (num_bumps, 2))
  weights = rng.normal(size=num_bumps)
  d2 = ((loc[None] - centres[:, None]) ** 2).sum(-1)
  field = (weights[:, None] * np.exp(-d2 / bump_width ** 2)).sum(0)
  cuts = np.quantile(field, np.linspace(0.0, 1.0, num_segments + 1)[1:-1])
  labels = np.searchsorted(cuts, field)
  rotation = np.linalg.qr(rng.normal(size=(3, 3)))[0]
  means = 0.5 + separation * noise * _simplex(num_segments) @ rotation
  shade = rng.normal(size=(num_segments, 2, 3)) * 0.3 * noise
  mu = means[labels] + np.einsum("np,npc->nc", loc - 0.5, shade[labels])
  x = mu + noise * rng.normal(size=mu.shape)
  return x.reshape(size, size, 3), labels.reshape(size, size)


def load_photo(name: str, size: int = 128) -> np.ndarray:
  """A scikit-learn sample image downscaled (antialiased) to (size, size, 3) in [0, 1]."""
  from sklearn.datasets import load_sample_image  # pylint: disable=g-import-not-at-top
  img = np.asarray(load_sample_image(name), np.float32) / 255.0
  out = jax.image.resize(img, (size, size, 3), method="linear", antialias=True)
  return np.clip(np.asarray(out), 0.0, 1.0)


# -------------------------------------------------------------------------- methods
def rand_index(a, b) -> float:
  from sklearn.metrics import rand_score  # pylint: disable=g-import-not-at-top
  return float(rand_score(np.asarray(a).ravel(), np.asarray(b).ravel()))


def run_lddp(x, loc, num_clusters: int, seed: int, *, max_iter: int, tol: float,
             update_field: bool = True):
  """Fits the LDDP (compiled ahead of time); returns labels and timing / diagnostics."""
  start = time.perf_counter()
  fit = lddp.compile_fit(np.asarray(x, np.float32), np.asarray(loc, np.float32), num_clusters,
                         key=jax.random.key(seed), max_iter=max_iter, tol=tol,
                         update_field=update_field)
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  res = jax.block_until_ready(fit())
  run_s = time.perf_counter() - start
  iters = int(res.num_iters)
  trace = np.asarray(res.bound_trace)[:iters + 1]
  usage = np.asarray(lddp.cluster_usage(res))
  return np.asarray(res.assignments), dict(
      compile_s=compile_s, run_s=run_s, sweep_s=run_s / max(iters, 1), iterations=iters,
      converged=bool(res.converged), clusters_used=int(np.sum(usage > 0)),
      usage=usage.tolist(), bound_trace=trace.tolist(),
      bound_min_step=float(np.min(np.diff(trace))) if iters else float("nan"))


def run_gmm(x, num_clusters: int, seed: int):
  from sklearn.mixture import GaussianMixture  # pylint: disable=g-import-not-at-top
  return GaussianMixture(num_clusters, covariance_type="full",
                         random_state=seed).fit(x).predict(x)


def run_kmeans_xy(x, loc, num_clusters: int, seed: int):
  from sklearn.cluster import KMeans  # pylint: disable=g-import-not-at-top
  return KMeans(num_clusters, n_init=4, random_state=seed).fit_predict(np.hstack([x, loc]))


def run_spectral(x, loc, num_clusters: int, seed: int):
  from sklearn.cluster import SpectralClustering  # pylint: disable=g-import-not-at-top
  model = SpectralClustering(num_clusters, affinity="nearest_neighbors", n_neighbors=10,
                             assign_labels="cluster_qr", random_state=seed)
  return model.fit_predict(np.hstack([x, loc]))


# ------------------------------------------------------------------------------- run
def run(output_dir: Optional[str], *, seeds: Sequence[int] = (0, 1, 2, 3, 4),
        scene_size: int = 64, num_segments: int = 4, separation: float = 2.0,
        photos: Sequence[str] = PHOTOS, photo_size: int = 128,
        photo_clusters: Sequence[int] = (5, 100), max_iter: int = 1000, tol: float = 1e-6,
        big_k: int = 100, figure_dir: Optional[str] = None, plot: bool = True) -> Dict:
  """Runs both parts, writes the results (and figures) and returns them."""
  records = []
  labels_out = {}
  progress = common.Progress(len(seeds), "synthetic scenes")
  for seed in seeds:
    img, truth = synthetic_scene(seed, scene_size, num_segments, separation)
    x = img.reshape(-1, 3)
    loc = pixel_locations(scene_size, scene_size)
    preds, info = {}, {}
    preds["lddp"], info["lddp"] = run_lddp(x, loc, num_segments, seed, max_iter=max_iter,
                                           tol=tol)
    preds["lddp_k100"], info["lddp_k100"] = run_lddp(x, loc, big_k, seed, max_iter=max_iter,
                                                     tol=tol)
    preds["lddp_f0"], info["lddp_f0"] = run_lddp(x, loc, num_segments, seed,
                                                 max_iter=max_iter, tol=tol,
                                                 update_field=False)
    for name, fn in (("gmm", lambda: run_gmm(x, num_segments, seed)),
                     ("kmeans_xy", lambda: run_kmeans_xy(x, loc, num_segments, seed)),
                     ("spectral", lambda: run_spectral(x, loc, num_segments, seed))):
      start = time.perf_counter()
      preds[name] = fn()
      info[name] = dict(run_s=time.perf_counter() - start)
    for m in METHODS:
      rec = dict(seed=seed, method=m, rand_index=rand_index(truth, preds[m]),
                 run_s=info[m]["run_s"])
      for key in ("compile_s", "sweep_s", "iterations", "converged", "clusters_used",
                  "bound_min_step"):
        rec[key] = info[m].get(key)
      records.append(rec)
    if seed == seeds[0]:
      labels_out["scene_image"] = img
      labels_out["scene_truth"] = truth
      for m in METHODS:
        labels_out[f"scene_{m}"] = np.asarray(preds[m]).reshape(truth.shape)
    progress.update(message=f"seed {seed}: LDDP RI {records[-6]['rand_index']:.3f}")
  summary = []
  for m in METHODS:
    ri = [r["rand_index"] for r in records if r["method"] == m]
    diff = [r["rand_index"] - o["rand_index"] for r in records if r["method"] == "lddp"
            for o in records if o["method"] == m and o["seed"] == r["seed"]]
    mean, se = common.mean_and_se(ri)
    dmean, dse = common.mean_and_se(diff)
    summary.append(dict(method=m, rand_index_mean=mean, rand_index_se=se,
                        lddp_minus_mean=dmean, lddp_minus_se=dse,
                        lddp_wins=int(sum(d > 0 for d in diff)), num_seeds=len(ri)))

  photo_rows = []
  for name in photos:
    img = load_photo(name, photo_size)
    x = img.reshape(-1, 3)
    loc = pixel_locations(photo_size, photo_size)
    stem = os.path.splitext(name)[0]
    labels_out[f"{stem}_image"] = img
    start = time.perf_counter()
    labels_out[f"{stem}_kmeans_xy"] = run_kmeans_xy(x, loc, 5, 0).reshape(img.shape[:2])
    kmeans_s = time.perf_counter() - start
    start = time.perf_counter()
    labels_out[f"{stem}_gmm"] = run_gmm(x, 5, 0).reshape(img.shape[:2])
    gmm_s = time.perf_counter() - start
    for k in photo_clusters:
      lab, info = run_lddp(x, loc, k, 0, max_iter=max_iter, tol=tol)
      labels_out[f"{stem}_lddp_k{k}"] = lab.reshape(img.shape[:2])
      photo_rows.append(dict(photo=name, num_clusters=k, pixels=x.shape[0],
                             inducing=lddp.default_num_per_dim(x.shape[0], 2) ** 2,
                             kmeans_xy_s=kmeans_s, gmm_s=gmm_s, **info))
      logging.info("%s K0=%d: %d sweeps, %.3f s/sweep, %d clusters used", name, k,
                   info["iterations"], info["sweep_s"], info["clusters_used"])

  config = dict(seeds=list(seeds), scene_size=scene_size, num_segments=num_segments,
                separation=separation, photos=list(photos), photo_size=photo_size,
                photo_clusters=list(photo_clusters), max_iter=max_iter, tol=tol, big_k=big_k,
                jax_version=jax.__version__, backend=jax.default_backend(),
                cpu_count=os.cpu_count())
  result = dict(config=config, records=records, summary=summary, photos=photo_rows)
  if output_dir:
    save(output_dir, result, labels_out)
    if plot:
      plot_results(output_dir, figure_dir or output_dir)
  result["tables"] = tables(result)
  return result


# --------------------------------------------------------------------------- outputs
def tables(result) -> Dict[str, str]:
  cfg = result["config"]
  label = lambda m: METHOD_LABELS[m].format(big_k=cfg["big_k"])
  rows = [[label(s["method"]),
           common.fmt_mean_se(s["rand_index_mean"], s["rand_index_se"]),
           "–" if s["method"] == "lddp" else common.fmt_mean_se(s["lddp_minus_mean"],
                                                                s["lddp_minus_se"]),
           "–" if s["method"] == "lddp" else f"{s['lddp_wins']}/{s['num_seeds']}"]
          for s in result["summary"]]
  synth = (f"Synthetic scenes {cfg['scene_size']}x{cfg['scene_size']}, "
           f"{cfg['num_segments']} segments, colour means {cfg['separation']} noise sd apart, "
           f"{len(cfg['seeds'])} seeds (mean ± standard error).\n\n"
           + common.markdown_table(["method", "Rand index", "LDDP minus method",
                                    "LDDP better"], rows))
  lddp_recs = [r for r in result["records"] if r["method"].startswith("lddp")]
  trows = []
  for m in ("lddp", "lddp_k100", "lddp_f0"):
    recs = [r for r in lddp_recs if r["method"] == m]
    warm = recs[1:] if len(recs) > 1 else recs
    trows.append([label(m), f"{np.median([r['iterations'] for r in recs]):.0f}",
                  f"{sum(r['converged'] for r in recs)}/{len(recs)}",
                  f"{1e3 * np.median([r['sweep_s'] for r in warm]):.2f}",
                  f"{np.median([r['run_s'] for r in warm]):.2f}",
                  f"{recs[0]['compile_s']:.1f}",
                  f"{np.median([r['clusters_used'] for r in recs]):.0f}"])
  synth += ("\nLDDP runs (medians over seeds; times per sweep and per scene from the seeds "
            "after the first, whose shapes were already compiled):\n\n"
            + common.markdown_table(["fit", "sweeps", "converged", "ms / sweep",
                                     "s / scene", "compile s (first seed)", "clusters used"],
                                     trows))
  prow = [[r["photo"], r["num_clusters"], r["pixels"], r["inducing"], r["iterations"],
           "yes" if r["converged"] else "no", f"{1e3 * r['sweep_s']:.1f}",
           f"{r['run_s']:.1f}", f"{r['compile_s']:.1f}", r["clusters_used"]]
          for r in result["photos"]]
  photos = (f"Photographs downscaled to {cfg['photo_size']}x{cfg['photo_size']}, LDDP with "
            f"s_l = 0.1, s_f = 1, tol = {cfg['tol']}, at most {cfg['max_iter']} sweeps.\n\n"
            + common.markdown_table(["photo", "K0", "pixels", "inducing", "sweeps",
                                     "converged", "ms / sweep", "s / image", "compile s",
                                     "clusters used"], prow))
  return dict(synthetic=synth, photos=photos)


def save(output_dir: str, result, labels) -> None:
  common.save_json(os.path.join(output_dir, "lddp_synthetic.json"),
                   dict(config=result["config"], records=result["records"],
                        summary=result["summary"]))
  common.save_json(os.path.join(output_dir, "lddp_photos.json"),
                   dict(config=result["config"], photos=result["photos"]))
  common.save_csv(os.path.join(output_dir, "lddp_synthetic_runs.csv"), result["records"])
  np.savez_compressed(os.path.join(output_dir, "lddp_labels.npz"), **labels)
  t = tables(result)
  env = (f"\nMachine: {result['config']['backend']} backend, {result['config']['cpu_count']} "
         f"cores, jax {result['config']['jax_version']}; the machine was shared with other "
         "jobs while this ran, so times are upper bounds.\n")
  common.save_text(os.path.join(output_dir, "lddp_synthetic.md"),
                   "# LDDP on synthetic scenes\n\n" + t["synthetic"] + env)
  common.save_text(os.path.join(output_dir, "lddp_photos.md"),
                   "# LDDP on the scikit-learn sample photographs\n\n" + t["photos"] + env)


def _segment_colours(image, labels):
  """Each segment painted with its mean colour."""
  flat = image.reshape(-1, 3)
  lab = labels.ravel()
  k = int(lab.max()) + 1
  counts = np.bincount(lab, minlength=k)[:, None]
  means = np.stack([np.bincount(lab, weights=flat[:, c], minlength=k) for c in range(3)], -1)
  means = means / np.maximum(counts, 1)
  return means[lab].reshape(image.shape)


def plot_results(output_dir: str, figure_dir: Optional[str] = None):
  """Draws the figures from the saved results; returns their paths."""
  figure_dir = figure_dir or output_dir
  plt = common.pyplot()
  synth = common.load_json(os.path.join(output_dir, "lddp_synthetic.json"))
  photos = common.load_json(os.path.join(output_dir, "lddp_photos.json"))
  labels = np.load(os.path.join(output_dir, "lddp_labels.npz"))
  paths = []

  # Synthetic example (first seed) with each method's Rand index.
  seed0 = synth["config"]["seeds"][0]
  ri = {r["method"]: r["rand_index"] for r in synth["records"] if r["seed"] == seed0}
  panels = [("image", None), ("truth", None)] + [(m, ri[m]) for m in METHODS]
  fig, axes = plt.subplots(1, len(panels), figsize=(2.1 * len(panels), 2.6))
  for ax, (name, score) in zip(axes, panels):
    key = f"scene_{name}"
    if name == "image":
      ax.imshow(np.clip(labels[key], 0, 1))
      ax.set_title("scene (RGB)", fontsize=8)
    else:
      ax.imshow(labels[key], cmap="tab20", interpolation="nearest")
      title = ("true segments" if name == "truth" else METHOD_LABELS[name].format(
          big_k=synth["config"]["big_k"]).replace(" (", "\n("))
      ax.set_title(title if score is None else f"{title}\nRI {score:.3f}", fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
  fig.suptitle(f"Synthetic scene (seed {seed0}): segments found by each method", fontsize=10)
  paths.append(common.save_and_close(fig, os.path.join(figure_dir, "lddp_synthetic.png")))

  # Photographs: a figure like the paper's Figure 2 (segments in their mean colour).
  names = photos["config"]["photos"]
  ks = photos["config"]["photo_clusters"]
  rows = [("image", "image"), ("kmeans_xy", "k-means RGB+xy (5)"), ("gmm", "GMM colour (5)")]
  rows += [(f"lddp_k{k}", f"LDDP K0 = {k}") for k in ks]
  fig, axes = plt.subplots(len(rows), len(names), figsize=(3.0 * len(names), 2.8 * len(rows)),
                           squeeze=False)
  for j, name in enumerate(names):
    stem = os.path.splitext(name)[0]
    img = labels[f"{stem}_image"]
    for i, (key, title) in enumerate(rows):
      ax = axes[i, j]
      if key == "image":
        ax.imshow(img)
      else:
        ax.imshow(_segment_colours(img, labels[f"{stem}_{key}"]))
      used = "" if key == "image" else f" ({len(np.unique(labels[f'{stem}_{key}']))} used)"
      ax.set_title(f"{name}: {title}{used}", fontsize=8)
      ax.set_xticks([])
      ax.set_yticks([])
      ax.grid(False)
  fig.suptitle("Segmentations, each segment in its mean colour", fontsize=10)
  fig.tight_layout(rect=(0, 0, 1, 0.98))
  paths.append(common.save_and_close(fig, os.path.join(figure_dir, "lddp_photos.png")))

  # Sorted cluster usage for the largest K0 (paper's Figure 3).
  big = max(ks)
  fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.0), squeeze=False)
  for j, name in enumerate(names):
    row = [r for r in photos["photos"] if r["photo"] == name and r["num_clusters"] == big][0]
    usage = np.sort(np.asarray(row["usage"]))[::-1]
    ax = axes[0, j]
    ax.bar(np.arange(1, usage.size + 1), usage, width=1.0, color="#1f77b4")
    ax.set_xlabel("cluster (sorted by size)")
    ax.set_ylabel("pixels assigned")
    ax.set_title(f"{name}, K0 = {big}: {int(np.sum(usage > 0))} clusters used", fontsize=9)
  paths.append(common.save_and_close(fig, os.path.join(figure_dir, "lddp_usage.png")))

  # Bound traces of the photograph fits (never decreasing).
  fig, ax = plt.subplots(figsize=(5.5, 3.4))
  for row in photos["photos"]:
    trace = np.asarray(row["bound_trace"], np.float64)
    ax.plot(np.arange(trace.size), trace / row["pixels"],
            label=f"{row['photo']}, K0 = {row['num_clusters']}")
  ax.set_xlabel("sweep")
  ax.set_ylabel("evidence lower bound / pixel")
  ax.set_xscale("symlog", linthresh=10)
  ax.set_title("LDDP bound over CAVI sweeps (photographs)")
  ax.legend()
  paths.append(common.save_and_close(fig, os.path.join(figure_dir, "lddp_bound.png")))
  return paths


def main(argv):
  del argv
  output_dir = common.setup_from_flags("lddp")
  figure_dir = _FIGURE_DIR.value or output_dir
  if common.plot_only():
    plot_results(output_dir, figure_dir)
    return
  quick = common.quick()
  seeds = common.seeds(2 if quick else 5)
  result = run(output_dir, seeds=seeds,
               scene_size=_SCENE_SIZE.value or (24 if quick else 64),
               num_segments=_NUM_SEGMENTS.value, separation=_SEPARATION.value,
               photo_size=_PHOTO_SIZE.value or (32 if quick else 128),
               photo_clusters=(5, 20) if quick else (5, 100),
               big_k=20 if quick else 100,
               max_iter=_MAX_ITER.value or (60 if quick else 1000), tol=_TOL.value,
               figure_dir=figure_dir)
  print(result["tables"]["synthetic"])
  print(result["tables"]["photos"])


if __name__ == "__main__":
  app.run(main)
