r"""co-BPM divergence estimation: sanity tests, simulations and a CLINC150 use.

Three parts (``--divergence_parts``):

1. ``sanity``: the paper's two 2-D sanity tests (its Figure 3). Group 1: P = 1 + g,
   Q = 1 - g on the unit square with g = 0.9 sin(2 pi x1) sin(2 pi x2), so (P + Q) / 2 is
   uniform; group 2: two densities constant on dyadic partitions, Q's finer than P's.
   1000 points each; TV posterior and a sampled partition drawn over the points.
2. ``simulation``: the paper's Figures 4-5 (TV, Hellinger, KL, alpha = 2 on beta-mixture
   products, d = 1 and 3, n = 50, 250, 1250) and Figure 6 (KL in d = 3, n = 50..5000 on a
   log grid) against the Perez-Cruz kNN estimator (k = 1, 10); replicates per size, truths
   by Monte Carlo (``experiments/divergence_problems.py``).
3. ``prior`` (not run by default): the prior penalty per box. KL error against sigma
   (the paper's D + 1, then 1 and 0.1) at n = 250 and 1250 on two d = 3 problems (``d3``
   and ``d3_skew``), next to the kNN estimators on the same samples.
4. ``clinc``: every in-distribution CLINC150 intent (data/clinc150_minilm, 100 utterances
   each over train/val/test) is a sample set after projection on 2 principal components;
   pairwise alpha = 0.5 divergences; spectral clustering of intents into the 8 domains and
   9-NN domain classification, against the same pipeline on the Euclidean distance between
   intent means. Domain of label k = k // 15 (the feature files order labels by domain,
   15 intents per domain, in manifest.json's ``id_domains`` order).

Results (JSON/Markdown) are written first; figures are drawn from them.

  python -m experiments.divergence --quick
  python -m experiments.divergence --output_dir=docs/results --divergence_parts=simulation
"""
import json
import math
import os
import time
from typing import Any, Dict, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import divergence as dv
from experiments import common
from experiments import divergence_problems as dp

common.define_flags("seed", "float64", "output_dir", "plot_only", "quick")
_PARTS = flags.DEFINE_list("divergence_parts", ["sanity", "simulation", "clinc"],
                           "Parts to run: sanity, simulation, prior, clinc.")
_DATA_DIR = flags.DEFINE_string("divergence_data_dir", "data/clinc150_minilm",
                                "Directory of the CLINC150 feature files.")
_FIG_DIR = flags.DEFINE_string("divergence_figure_dir", None,
                               "Where figures go (default: the output directory).")

FULL = dict(replicates=10, sizes=(50, 250, 1250), kl_sizes=(50, 158, 500, 1581, 5000),
            burnin=2000, samples=500, mc_draws=10_000_000, sanity_n=1000,
            clinc_burnin=600, clinc_samples=200, clinc_runs=20,
            prior_sizes=(250, 1250), prior_sigmas=(None, 1.0, 0.1), prior_replicates=5)
QUICK = dict(replicates=2, sizes=(50, 250), kl_sizes=(50, 250), burnin=200, samples=100,
             mc_draws=200_000, sanity_n=300, clinc_burnin=100, clinc_samples=50,
             clinc_runs=5, clinc_intents_per_domain=3, prior_sizes=(100,),
             prior_sigmas=(None, 0.1), prior_replicates=2)
MAX_REGIONS = 128
SIM_KINDS = ("tv", "hellinger", "kl", "alpha")


def _chains(xs, ys, vx, vy, key, dim, burnin, samples, max_regions=MAX_REGIONS,
            alpha=2.0, sigma=None):
  """One chain per pair; sigma None: the paper's D + 1."""
  config = dv.Config(max_regions=max_regions, num_burnin=burnin, num_samples=samples)
  run = jax.vmap(dv.run_chain, in_axes=(0, 0, 0, 0, 0, None, None, None, None))
  sigma = dim + 1.0 if sigma is None else float(sigma)
  out = run(jax.random.split(key, xs.shape[0]), jnp.asarray(xs), jnp.asarray(ys),
            jnp.asarray(vx), jnp.asarray(vy), 0.5, sigma, alpha, config)
  return jax.tree_util.tree_map(np.asarray, out)


# ------------------------------------------------------------------ 1. sanity tests

def _sample_group1(n, rng):
  def draw(sign):
    out = []
    while sum(len(o) for o in out) < n:
      u = rng.uniform(size=(4 * n, 2))
      g = 0.9 * np.sin(2 * np.pi * u[:, 0]) * np.sin(2 * np.pi * u[:, 1])
      keep = rng.uniform(size=4 * n) * 1.9 < 1.0 + sign * g
      out.append(u[keep])
    return np.concatenate(out)[:n]
  return draw(1.0), draw(-1.0)


# Group 2: (lower corner, size, mass) of the cells of P and of Q (Q refines P).
GROUP2_P = [((0.0, 0.0), (0.5, 1.0), 0.3), ((0.5, 0.0), (0.5, 1.0), 0.7)]
GROUP2_Q = [((0.0, 0.0), (0.5, 0.5), 0.1), ((0.0, 0.5), (0.5, 0.5), 0.2),
            ((0.5, 0.0), (0.5, 0.5), 0.25), ((0.5, 0.5), (0.25, 0.5), 0.15),
            ((0.75, 0.5), (0.25, 0.5), 0.3)]


def _sample_cells(cells, n, rng):
  masses = np.array([c[2] for c in cells])
  which = rng.choice(len(cells), size=n, p=masses)
  lo = np.array([c[0] for c in cells])[which]
  size = np.array([c[1] for c in cells])[which]
  return lo + size * rng.uniform(size=(n, 2))


def _group2_truth():
  # Common refinement: Q's cells; P's density there is mass_P(cell) * area / area_P_cell.
  p_mass = []
  for lo, size, _ in GROUP2_Q:
    for plo, psize, pm in GROUP2_P:
      if plo[0] <= lo[0] < plo[0] + psize[0]:
        p_mass.append(pm * size[0] * size[1] / (psize[0] * psize[1]))
  p = np.array(p_mass)
  q = np.array([c[2] for c in GROUP2_Q])
  return {"tv": 0.5 * float(np.abs(p - q).sum()),
          "kl": float(np.sum(p * np.log(p / q)))}


def run_sanity(n, burnin, samples, seed):
  rng = np.random.default_rng(seed)
  groups = {"uniform_mixture": _sample_group1(n, rng),
            "nested_partitions": (_sample_cells(GROUP2_P, n, rng),
                                  _sample_cells(GROUP2_Q, n, rng))}
  truths = {"uniform_mixture": {"tv": 0.9 * (2 / math.pi) ** 2},
            "nested_partitions": _group2_truth()}
  out = {}
  for j, (name, (x, y)) in enumerate(groups.items()):
    start = time.perf_counter()
    xs, ys, vx, vy = dp.pad_pairs([(x, y)] * 2)  # two chains
    res = _chains(xs, ys, vx, vy, jax.random.PRNGKey(seed + j), 2, burnin, samples)
    seconds = time.perf_counter() - start
    tv = res.divergences[..., 0]
    fs = jax.tree_util.tree_map(lambda a: a[0], res.final_state)
    l = int(fs.num_regions)
    out[name] = {
        "truth": truths[name], "n": n, "seconds": seconds,
        "tv_mean": float(tv.mean()), "tv_interval": np.quantile(tv, [0.025, 0.975]).tolist(),
        "kl_mean": float(res.divergences[..., 2].mean()),
        "mean_regions": float(res.num_regions.mean()),
        "acceptance_rate": float(res.acceptance_rate.mean()),
        "partition": {"lower": fs.lower[:l].tolist(),
                      "width": np.ldexp(1.0, -fs.level[:l]).tolist(),
                      "count_x": fs.count_x[:l].tolist(), "count_y": fs.count_y[:l].tolist()},
        "x": x.tolist(), "y": y.tolist()}
    logging.info("sanity %s: TV %.3f (truth %.3f), %.1f boxes, %.1fs", name,
                 out[name]["tv_mean"], truths[name]["tv"], out[name]["mean_regions"], seconds)
  return out


# ------------------------------------------------------------------ 2. simulations

def run_simulation(sizes, kl_sizes, replicates, burnin, samples, mc_draws, seed):
  out = {"truth": {}, "rows": []}
  for problem in ("d1", "d3"):
    truth = dp.monte_carlo_truth(problem, mc_draws, np.random.default_rng(seed))
    out["truth"][problem] = truth
    grid = sorted(set(sizes) | (set(kl_sizes) if problem == "d3" else set()))
    for n in grid:
      rng = np.random.default_rng(seed + 1000 * n + (3 if problem == "d3" else 1))
      pairs = [dp.sample_pair(problem, n, rng) for _ in range(replicates)]
      xs, ys, vx, vy = dp.pad_pairs(pairs)
      start = time.perf_counter()
      res = _chains(xs, ys, vx, vy, jax.random.PRNGKey(seed + n), xs.shape[-1], burnin,
                    samples)
      seconds = time.perf_counter() - start
      start = time.perf_counter()
      knn = {k: [dv.knn_kl(x, y, k) for x, y in pairs] for k in (1, 10)}
      knn_seconds = time.perf_counter() - start
      est = res.divergences.mean(axis=1)
      ess = [dv.effective_sample_size(res.divergences[r, :, 0]) for r in range(replicates)]
      out["rows"].append({
          "problem": problem, "n": n, "seconds": seconds, "knn_seconds": knn_seconds,
          "estimates": {kind: est[:, j].tolist() for j, kind in enumerate(SIM_KINDS)},
          "knn1": knn[1], "knn10": knn[10],
          "mean_regions": float(res.num_regions.mean()),
          "acceptance_rate": float(res.acceptance_rate.mean()),
          "ess_tv": float(np.mean(ess))})
      logging.info("simulation %s n=%d: KL %.3f (truth %.3f), kNN1 %.3f, kNN10 %.3f, "
                   "%.1f boxes, %.1fs", problem, n, est[:, 2].mean(), truth["kl"],
                   np.mean(knn[1]), np.mean(knn[10]), res.num_regions.mean(), seconds)
  return out


# ------------------------------------------------------------------ 3. prior penalty

def run_prior(sizes, sigmas, replicates, burnin, samples, mc_draws, seed):
  """KL error of co-BPM for each sigma, and of kNN, on the same d = 3 samples."""
  out = {"truth": {}, "rows": []}
  for problem in ("d3", "d3_skew"):
    truth = dp.monte_carlo_truth(problem, mc_draws, np.random.default_rng(seed))
    out["truth"][problem] = truth
    for n in sizes:
      rng = np.random.default_rng(seed + 1000 * n + 7)
      pairs = [dp.sample_pair(problem, n, rng) for _ in range(replicates)]
      xs, ys, vx, vy = dp.pad_pairs(pairs)
      dim = xs.shape[-1]
      knn = {k: [dv.knn_kl(x, y, k) for x, y in pairs] for k in (1, 10)}
      for sigma in sigmas:
        start = time.perf_counter()
        res = _chains(xs, ys, vx, vy, jax.random.PRNGKey(seed + n), dim, burnin, samples,
                      sigma=sigma)
        seconds = time.perf_counter() - start
        kl = res.divergences[..., 2].mean(axis=1)
        out["rows"].append({
            "problem": problem, "n": n, "sigma": dim + 1.0 if sigma is None else float(sigma),
            "kl": kl.tolist(), "knn1": knn[1], "knn10": knn[10], "seconds": seconds,
            "mean_regions": float(res.num_regions.mean()),
            "at_max_regions": float(np.mean(res.num_regions >= MAX_REGIONS))})
        logging.info("prior %s n=%d sigma=%s: KL %.3f (truth %.3f), kNN1 %.3f, %.1f boxes",
                     problem, n, sigma, kl.mean(), truth["kl"], np.mean(knn[1]),
                     res.num_regions.mean())
  return out


# ------------------------------------------------------------------ 4. CLINC150

def _load_clinc(data_dir):
  if not os.path.isabs(data_dir) and not os.path.isdir(data_dir):
    # Relative to the repository root (notebooks run from notebooks/).
    data_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            data_dir)
  feats, labels = [], []
  for split in ("train", "val", "test"):
    z = np.load(os.path.join(data_dir, f"{split}.npz"))
    feats.append(z["features"].astype(np.float32))
    labels.append(z["labels"])
  with open(os.path.join(data_dir, "manifest.json")) as f:
    manifest = json.load(f)
  return np.concatenate(feats), np.concatenate(labels), manifest


def _pca2(x):
  centred = x - x.mean(axis=0)
  _, _, vt = np.linalg.svd(centred, full_matrices=False)
  return centred @ vt[:2].T


def _spectral_accuracy(dist, domains, num_clusters, seed):
  from sklearn.cluster import SpectralClustering  # pylint: disable=g-import-not-at-top
  scale = np.median(dist[np.triu_indices_from(dist, 1)])
  affinity = np.exp(-dist / max(scale, 1e-12))
  labels = SpectralClustering(num_clusters, affinity="precomputed",
                              random_state=seed).fit_predict(affinity)
  accs = []
  for c in np.unique(labels):
    members = domains[labels == c]
    accs.append(np.bincount(members).max() / len(members))
  return float(np.mean(accs))


def _knn_accuracy(dist, domains, train, test, k=9):
  correct = 0
  for t in test:
    nearest = train[np.argsort(dist[t, train], kind="stable")[:k]]
    votes = np.bincount(domains[nearest], minlength=domains.max() + 1)
    correct += int(np.argmax(votes) == domains[t])
  return correct / len(test)


def run_clinc(data_dir, burnin, samples, runs, seed, intents_per_domain=None,
              batch=256):
  x, y, manifest = _load_clinc(data_dir)
  num_domains = len(manifest["id_domains"])
  per_domain = manifest["num_classes"] // num_domains
  intents = np.unique(y)
  if intents_per_domain is not None:
    intents = np.array([i for i in intents if i % per_domain < intents_per_domain])
  z = _pca2(x)
  sets = [z[y == i] for i in intents]
  domains = intents // per_domain
  k_int = len(intents)
  pairs = [(a, b) for a in range(k_int) for b in range(a + 1, k_int)]
  dist = np.zeros((k_int, k_int))
  start = time.perf_counter()
  progress = common.Progress(len(pairs), "clinc pairs")
  for s in range(0, len(pairs), batch):
    chunk = pairs[s:s + batch]
    rescaled = [dv.rescale(sets[a], sets[b]) for a, b in chunk]
    while len(rescaled) < batch:  # fixed batch shape: one compilation
      rescaled.append(rescaled[0])
    xs, ys, vx, vy = dp.pad_pairs(rescaled)
    res = _chains(xs, ys, vx, vy, jax.random.PRNGKey(seed + s), 2, burnin, samples,
                  alpha=0.5)
    est = res.divergences[:len(chunk), :, 3].mean(axis=1)
    for (a, b), e in zip(chunk, est):
      dist[a, b] = dist[b, a] = e
    progress.update(len(chunk))
  seconds = time.perf_counter() - start
  means2 = np.stack([s.mean(axis=0) for s in sets])
  means384 = np.stack([x[y == i].mean(axis=0) for i in intents])
  dists = {"co-BPM alpha=0.5 (2 PCs)": dist,
           "Euclidean, intent means (2 PCs)": np.linalg.norm(
               means2[:, None] - means2[None], axis=-1),
           "Euclidean, intent means (384-D)": np.linalg.norm(
               means384[:, None] - means384[None], axis=-1)}
  rng = np.random.default_rng(seed)
  results = {name: {"clustering": [], "knn9": []} for name in dists}
  per = np.bincount(domains)
  num_train = max(1, int(round(per.min() * 2 / 3)))
  for r in range(runs):
    # A random 2/3 of each domain's intents: cluster them / use them as 9-NN training set.
    train = np.concatenate([rng.permutation(np.flatnonzero(domains == d))[:num_train]
                            for d in range(num_domains)])
    test = np.setdiff1d(np.arange(k_int), train)
    for name, d in dists.items():
      sub = d[np.ix_(train, train)]
      results[name]["clustering"].append(
          _spectral_accuracy(sub, domains[train], num_domains, seed + r))
      results[name]["knn9"].append(_knn_accuracy(d, domains, train, test,
                                                 k=min(9, len(train))))
  return {"num_intents": int(k_int), "num_pairs": len(pairs), "seconds": seconds,
          "points_per_intent": int(np.median([len(s) for s in sets])),
          "num_train_intents_per_domain": num_train,
          "results": results, "distance": dist.tolist(), "domains": domains.tolist(),
          "domain_names": manifest["id_domains"]}


# ------------------------------------------------------------------ driver

def run(output_dir: Optional[str], *, quick: bool = False, seed: int = 0,
        parts: Sequence[str] = ("sanity", "simulation", "clinc"),
        data_dir: str = "data/clinc150_minilm", figure_dir: Optional[str] = None,
        plot: bool = True, **overrides) -> Dict[str, Any]:
  """Runs the chosen parts; writes divergence_<part>.json/.md and figures.

  Args:
    output_dir: directory of the results (None: nothing written).
    quick: small sizes (seconds to a few minutes).
    seed: base seed.
    parts: subset of ("sanity", "simulation", "prior", "clinc").
    data_dir: CLINC150 feature files.
    figure_dir: where figures go (default output_dir).
    plot: draw the figures.
    **overrides: entries of FULL / QUICK (e.g. replicates=3).
  Returns:
    {part: results}.
  """
  cfg = dict(FULL)
  if quick:
    cfg.update(QUICK)
  cfg.update(overrides)
  unknown = set(parts) - {"sanity", "simulation", "prior", "clinc"}
  if unknown:
    raise ValueError(f"Unknown parts {sorted(unknown)}.")
  results = {}
  if "sanity" in parts:
    results["sanity"] = run_sanity(cfg["sanity_n"], cfg["burnin"], cfg["samples"], seed)
  if "simulation" in parts:
    results["simulation"] = run_simulation(cfg["sizes"], cfg["kl_sizes"], cfg["replicates"],
                                           cfg["burnin"], cfg["samples"], cfg["mc_draws"],
                                           seed)
  if "prior" in parts:
    results["prior"] = run_prior(cfg["prior_sizes"], cfg["prior_sigmas"],
                                 cfg["prior_replicates"], cfg["burnin"], cfg["samples"],
                                 cfg["mc_draws"], seed)
  if "clinc" in parts:
    results["clinc"] = run_clinc(data_dir, cfg["clinc_burnin"], cfg["clinc_samples"],
                                 cfg["clinc_runs"], seed,
                                 cfg.get("clinc_intents_per_domain"))
  if output_dir is not None:
    os.makedirs(output_dir, exist_ok=True)
    for part, res in results.items():
      common.save_json(os.path.join(output_dir, f"divergence_{part}.json"),
                       {"config": cfg, "quick": quick, "seed": seed, "results": res})
      common.save_text(os.path.join(output_dir, f"divergence_{part}.md"),
                       markdown(part, res, cfg, quick))
    if plot:
      plot_results(output_dir, figure_dir or output_dir, parts=list(results))
  return results


def _mean_sd(v):
  v = np.asarray(v, np.float64)
  return f"{v.mean():.3f} ± {v.std():.3f}"


def markdown(part, res, cfg, quick):
  note = ("Run times on a shared 2-core CPU machine under heavy load from other jobs "
          "(jax CPU, float32); they overstate the cost on an idle machine.")
  size = " (quick run)" if quick else ""
  if part == "sanity":
    rows = [[name, r["n"], f"{r['truth']['tv']:.3f}", f"{r['tv_mean']:.3f}",
             f"[{r['tv_interval'][0]:.3f}, {r['tv_interval'][1]:.3f}]",
             f"{r['mean_regions']:.1f}", f"{r['acceptance_rate']:.3f}", f"{r['seconds']:.1f}"]
            for name, r in res.items()]
    return (f"# co-BPM sanity tests{size}\n\n" + common.markdown_table(
        ["group", "n each", "true TV", "posterior mean TV", "95% interval", "mean boxes",
         "acceptance", "seconds"], rows) + f"\nChain: {cfg['burnin']} burn-in sweeps, "
            f"{cfg['samples']} kept, 2 chains.\n\n{note}\n")
  if part == "simulation":
    lines = [f"# co-BPM simulations (paper's Figures 4-6){size}\n",
             "Mean absolute error over replicates (± sd of the error); truth by Monte Carlo "
             f"with {cfg['mc_draws']:.0e} draws. kNN = Perez-Cruz KL estimator (KL only).\n"]
    for problem in ("d1", "d3"):
      truth = res["truth"][problem]
      lines.append(f"\n## {problem} (truth: " + ", ".join(
          f"{k} {truth[k]:.4f}" for k in SIM_KINDS) + ")\n")
      rows = []
      for r in res["rows"]:
        if r["problem"] != problem:
          continue
        errs = [_mean_sd(np.abs(np.array(r["estimates"][k]) - truth[k])) for k in SIM_KINDS]
        rows.append([r["n"], *errs, _mean_sd(np.abs(np.array(r["knn1"]) - truth["kl"])),
                     _mean_sd(np.abs(np.array(r["knn10"]) - truth["kl"])),
                     f"{r['mean_regions']:.1f}", f"{r['acceptance_rate']:.3f}",
                     f"{r['ess_tv']:.0f}", f"{r['seconds']:.1f}"])
      lines.append(common.markdown_table(
          ["n", "TV", "Hellinger", "KL", "alpha=2", "KL kNN k=1", "KL kNN k=10",
           "mean boxes", "accept.", "ESS (TV)", "co-BPM s"], rows))
    lines.append(f"\n{len(res['rows'][0]['knn1'])} replicates per n; one chain per "
                 f"replicate, {cfg['burnin']} burn-in sweeps, {cfg['samples']} kept draws, "
                 f"max {MAX_REGIONS} boxes. Seconds: all replicates of one n together "
                 f"(vmapped), compilation included.\n\n{note}\n")
    return "\n".join(lines)
  if part == "prior":
    rows = []
    for r in res["rows"]:
      kl = res["truth"][r["problem"]]["kl"]
      rows.append([r["problem"], f"{kl:.4f}", r["n"], f"{r['sigma']:g}",
                   _mean_sd(np.abs(np.array(r["kl"]) - kl)),
                   _mean_sd(np.abs(np.array(r["knn1"]) - kl)),
                   _mean_sd(np.abs(np.array(r["knn10"]) - kl)),
                   f"{r['mean_regions']:.1f}", f"{r['at_max_regions']:.2f}",
                   f"{r['seconds']:.1f}"])
    return (f"# co-BPM: the prior penalty per box (sigma) and the KL error in d = 3{size}\n\n"
            "Mean absolute error of the KL estimate over "
            f"{len(res['rows'][0]['kl'])} replicates (± sd); the same samples for every "
            "sigma and for kNN. sigma = 4 is the paper's D + 1. Prior: "
            "p(A_l, l) propto exp(-sigma l) / ((l - 1)! D^(l - 1)) (see "
            "dpmm_jax/divergence.py). Truth by Monte Carlo with "
            f"{cfg['mc_draws']:.0e} draws. Chains: {cfg['burnin']} burn-in sweeps, "
            f"{cfg['samples']} kept draws, max {MAX_REGIONS} boxes.\n\n"
            + common.markdown_table(
                ["problem", "true KL", "n", "sigma", "co-BPM KL error", "kNN k=1",
                 "kNN k=10", "mean boxes", "share at max boxes", "co-BPM s"], rows)
            + "\nRun times: this 2-core CPU machine, compilation included.\n")
  if part == "clinc":
    rows = [[name, _mean_sd(r["clustering"]), _mean_sd(r["knn9"])]
            for name, r in res["results"].items()]
    return (f"# CLINC150 intents as sample sets: domain clustering{size}\n\n"
            f"{res['num_intents']} intents ({res['points_per_intent']} utterances each, "
            f"train+val+test), projected on 2 principal components of the embeddings of "
            f"all 120 in-distribution intents; {res['num_pairs']} pairwise co-BPM alpha=0.5 divergences in "
            f"{res['seconds']:.0f} s. Each run takes a random "
            f"{res['num_train_intents_per_domain']} intents per domain: spectral clustering "
            "of them into the domains (affinity exp(-D / median D); accuracy = mean over "
            "clusters of the majority-domain fraction), and 9-NN domain classification of "
            f"the remaining intents. Mean ± sd over {len(rows and next(iter(res['results'].values()))['knn9'])} runs.\n\n"
            + common.markdown_table(["dissimilarity", "clustering accuracy",
                                     "9-NN accuracy"], rows) + f"\n{note}\n")
  raise ValueError(part)


def plot_results(output_dir, figure_dir, parts=("sanity", "simulation", "prior", "clinc")):
  plt = common.pyplot()
  os.makedirs(figure_dir, exist_ok=True)
  for part in parts:
    path = os.path.join(output_dir, f"divergence_{part}.json")
    if not os.path.exists(path):
      continue
    res = common.load_json(path)["results"]
    if part == "sanity":
      fig, axes = plt.subplots(1, 2, figsize=(10, 5))
      for ax, (name, r) in zip(axes, res.items()):
        x, y = np.array(r["x"]), np.array(r["y"])
        ax.scatter(x[:, 0], x[:, 1], s=3, alpha=0.5, label="X (P)")
        ax.scatter(y[:, 0], y[:, 1], s=3, alpha=0.5, label="Y (Q)")
        # Boxes live in the rescaled cube; map back with the pooled rescaling.
        lo_all = np.minimum(x.min(0), y.min(0))
        span = np.maximum(x.max(0), y.max(0)) - lo_all
        lo0 = lo_all - span / (len(x) + len(y))
        scale = span * (1 + 2 / (len(x) + len(y)))
        for lo, w in zip(r["partition"]["lower"], r["partition"]["width"]):
          lo = lo0 + np.array(lo) * scale
          w = np.array(w) * scale
          ax.add_patch(plt.Rectangle(lo, w[0], w[1], fill=False, lw=0.8, color="k"))
        ax.set_title(f"{name}: TV {r['tv_mean']:.3f} (true {r['truth']['tv']:.3f})")
        ax.set_xlabel("x1")
        ax.set_ylabel("x2")
        ax.legend(loc="upper right", markerscale=3)
      fig.suptitle("co-BPM sanity tests: last sampled partition of one chain")
      common.save_and_close(fig, os.path.join(figure_dir, "divergence_sanity.png"))
    if part == "simulation":
      truth = res["truth"]
      fig, axes = plt.subplots(2, 4, figsize=(15, 7))
      for row, problem in enumerate(("d1", "d3")):
        rows = [r for r in res["rows"] if r["problem"] == problem]
        ns = np.array([r["n"] for r in rows])
        for col, kind in enumerate(SIM_KINDS):
          ax = axes[row, col]
          err = np.array([np.abs(np.array(r["estimates"][kind]) - truth[problem][kind])
                          for r in rows])
          ax.errorbar(ns, err.mean(1), yerr=err.std(1), marker="o", capsize=2,
                      label="co-BPM")
          if kind == "kl":
            for k, style in ((1, "--"), (10, ":")):
              e = np.array([np.abs(np.array(r[f"knn{k}"]) - truth[problem]["kl"])
                            for r in rows])
              ax.errorbar(ns, e.mean(1), yerr=e.std(1), marker="s", ls=style, capsize=2,
                          label=f"kNN k={k}")
          ax.set_xscale("log")
          ax.set_yscale("log")
          ax.set_xlabel("n per sample")
          ax.set_ylabel("|estimate - truth|")
          ax.set_title(f"{problem}: {kind}" + (" (alpha=2)" if kind == "alpha" else ""))
          ax.legend()
      fig.suptitle("co-BPM vs kNN: mean absolute error (± sd) over replicates")
      fig.tight_layout()
      common.save_and_close(fig, os.path.join(figure_dir, "divergence_simulation.png"))
    if part == "prior":
      truth = res["truth"]
      problems = list(truth)
      fig, axes = plt.subplots(1, len(problems), figsize=(5.5 * len(problems), 4.2))
      for ax, problem in zip(np.atleast_1d(axes), problems):
        rows = [r for r in res["rows"] if r["problem"] == problem]
        for n in sorted({r["n"] for r in rows}):
          sel = sorted((r for r in rows if r["n"] == n), key=lambda r: r["sigma"])
          sig = [r["sigma"] for r in sel]
          err = [np.mean(np.abs(np.array(r["kl"]) - truth[problem]["kl"])) for r in sel]
          line, = ax.plot(sig, err, marker="o", label=f"co-BPM, n={n}")
          for k, style in ((1, "--"), (10, ":")):
            e = np.mean(np.abs(np.array(sel[0][f"knn{k}"]) - truth[problem]["kl"]))
            ax.axhline(e, ls=style, color=line.get_color(), lw=1,
                       label=f"kNN k={k}, n={n}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sigma (prior penalty per box; paper: D + 1 = 4)")
        ax.set_ylabel("mean |KL estimate - truth|")
        ax.set_title(f"{problem} (true KL {truth[problem]['kl']:.3f})")
        ax.legend(fontsize=7)
      fig.suptitle("co-BPM KL error against the prior penalty, d = 3")
      fig.tight_layout()
      common.save_and_close(fig, os.path.join(figure_dir, "divergence_prior.png"))
    if part == "clinc":
      fig, axes = plt.subplots(1, 2, figsize=(11, 4))
      names = list(res["results"])
      for ax, metric, title in ((axes[0], "clustering", "spectral clustering accuracy"),
                                (axes[1], "knn9", "9-NN domain accuracy")):
        ax.boxplot([res["results"][n][metric] for n in names])
        ax.set_xticks(range(1, len(names) + 1))
        ax.set_xticklabels([n.replace(", ", ",\n") for n in names], fontsize=7)
        ax.set_ylabel("accuracy")
        ax.set_title(title)
      fig.suptitle(f"CLINC150: {res['num_intents']} intents into "
                   f"{len(res['domain_names'])} domains")
      common.save_and_close(fig, os.path.join(figure_dir, "divergence_clinc.png"))


def main(argv):
  del argv
  output_dir = common.setup_from_flags("divergence")
  if common.plot_only():
    plot_results(output_dir, _FIG_DIR.value or output_dir, parts=_PARTS.value)
    return
  run(output_dir, quick=common.quick(), seed=common.seed(), parts=_PARTS.value,
      data_dir=_DATA_DIR.value, figure_dir=_FIG_DIR.value)


if __name__ == "__main__":
  app.run(main)
