"""Scale benchmark: statistics, EM and scoring over a grid of (M, K, D, N); prints tables.

    python benchmarks/run.py --quick          # small grid, a few minutes
    python benchmarks/run.py                  # + the ImageNet-sized row (N = 1.28M,
                                              #   K = 1000, D = 768, M = 10,000)
    python benchmarks/run.py --markdown out.md

For every row the synthetic training features are generated chunk by chunk into a .npy
file (--workdir, default a temporary directory; never loaded whole) and read back through
``np.load(mmap_mode="r")``. Per row it measures

* statistics: ``stats.from_arrays`` over the memory map (full per-class scatter), as
  effective GFLOP/s = 2 N D^2 / run time, against the float32 matmul peak measured in the
  same run (a square GEMM) and against one X^T X GEMM of a chunk (the least any
  per-class scatter pass can cost);
* preprocessing (the public API's default): the raw pass that fits the section-8
  transform, the fit, and the transform applied to every training row, as components;
* EM for tied (closed form), diag, coupled and full: iterations, seconds per iteration,
  total (the full model split into its one-time spectral reduction, the O(K D)
  iterations and the per-class Cholesky factors of the predictive);
* scoring M test points (half in-distribution, half from unseen classes) against K
  classes in chunks: points/s, ns per (point, class, dimension), achieved GFLOP/s of the
  full model's matrix products, the coupled model's cost relative to the diagonal one
  and the expansion orders it chose, and the AUROC as a sanity check;
* compile time apart from run time: the fits are compiled ahead of time
  (``jit(...).lower(...).compile()``) and then run; statistics and scoring are first
  called on one chunk (compilation plus that one chunk) and then timed over all chunks;
  and the peak resident memory (VmHWM) of the process;
* EM before/after acceleration: the same compiled fit run with ``accelerate=False``
  (plain EM): iterations and seconds of both;
* end to end through the public API, in a fresh process with the user's environment
  (not this script's OPENBLAS_NUM_THREADS=1): ``fit_detector`` from the memory-mapped
  file with the default preprocessing, then ``score``, for rmds, tied, diag, coupled and
  full, alone and once more with a CPU-bound process running beside it
  (``--end-to-end``), with the ratio to the component rows (without and with the
  preprocessing rows) and the whole job's time;
* cold start (K = 100, D = 64, N_k = 50): the first ``fit_detector`` / ``score`` in a
  fresh process with an empty compilation cache, and in a second process after the
  first filled it (``--no-cold-start`` skips it).

Speed numbers are wall-clock on whatever else the machine is running: the load average
before and after each row is printed with it. OPENBLAS_NUM_THREADS defaults to 1 (jaxlib's
LAPACK calls go through scipy's OpenBLAS, whose spinning threads collapse on a loaded
machine); set it yourself to override.
"""
import os

# The environment the user started us with: the end-to-end and cold-start children get
# it unchanged (a user's default environment), the component rows run pinned.
USER_ENV = dict(os.environ)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # pylint: disable=g-import-not-at-top,wrong-import-position
import collections
import datetime
import functools
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

from dpmm_jax import em  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpmm_jax import metrics
from dpmm_jax import preprocess
from dpmm_jax import scores as scores_lib
from dpmm_jax import stats as stats_lib
from dpmm_jax.models import coupled, diag, full, tied

# (M test points, K classes, D dims, N training points)
QUICK_GRID = ((2000, 10, 64, 20_000), (2000, 100, 128, 100_000), (2000, 100, 384, 128_000))
IMAGENET_ROW = (10_000, 1000, 768, 1_281_167)


# ------------------------------------------------------------------- instrumentation
def timed(fn, *args, **kwargs):
  """(result, wall seconds) with the result ready."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args, **kwargs))
  return out, time.perf_counter() - t0


def compiled_run(jitted, *args, **kwargs):
  """(result, run seconds, compile seconds) of a jitted function: compiled ahead of time
  (trace, lower, compile) and then run, so the two are measured apart exactly."""
  out, run_s, compile_s, _ = compiled_run_exec(jitted, *args, **kwargs)
  return out, run_s, compile_s


def compiled_run_exec(jitted, *args, **kwargs):
  """compiled_run, also returning ``rerun(**changes)`` -> (result, seconds): the same
  executable run again with some dynamic keyword arguments changed."""
  t0 = time.perf_counter()
  executable = jitted.lower(*args, **kwargs).compile()
  compile_s = time.perf_counter() - t0
  # Static arguments are baked into the executable; pass only the array arguments.
  dynamic = {k: v for k, v in kwargs.items() if k not in STATIC_KWARGS}
  out, run_s = timed(executable, *args, **dynamic)

  def rerun(*new_args, **changes):
    return timed(executable, *(new_args or args), **dict(dynamic, **changes))
  return out, run_s, compile_s, rerun


STATIC_KWARGS = ("trace_length", "options")


def rss_gb(field="VmHWM"):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 2 ** 20
  return float("nan")


def load_average():
  return "/".join(f"{v:.2f}" for v in os.getloadavg())


def machine():
  info = {"python": platform.python_version(), "jax": jax.__version__,
          "backend": jax.default_backend(), "devices": str(jax.devices()),
          "cores": os.cpu_count()}
  try:
    with open("/proc/cpuinfo") as f:
      names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    info["cpu"] = names[0] if names else platform.processor()
    with open("/proc/meminfo") as f:
      info["memory_gb"] = round(int(f.readline().split()[1]) / 2 ** 20, 1)
  except OSError:
    pass
  info["OPENBLAS_NUM_THREADS"] = os.environ.get("OPENBLAS_NUM_THREADS")
  return info


def matmul_rate(n=None, precision=jax.lax.Precision.HIGHEST, device=None, reps=5):
  """Best float32 GFLOP/s of an (n, n) x (n, n) jitted matmul on ``device`` (default: the
  default device) at ``precision``; n defaults to 2048 on CPU, 8192 on an accelerator (a
  2048 GEMM takes ~0.3 ms there, too short to time)."""
  device = device or jax.devices()[0]
  n = n or (2048 if device.platform == "cpu" else 8192)
  a = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32), device)
  f = jax.jit(lambda a: jnp.matmul(a, a, precision=precision))
  jax.block_until_ready(f(a))
  best = min(timed(f, a)[1] for _ in range(reps))
  return 2.0 * n ** 3 / best / 1e9


def matmul_peak():
  """The float32 matmul rate at Precision.HIGHEST, the precision of every library product
  (dpmm_jax.precision), on the default device."""
  return matmul_rate()


def gram_throughput(rows, dim, reps=3):
  """Best GFLOP/s of X^T X for one (rows, D) chunk: the floor of any scatter pass."""
  x = jax.random.normal(jax.random.PRNGKey(1), (rows, dim), jnp.float32)
  f = jax.jit(lambda x: jnp.matmul(x.T, x, precision=jax.lax.Precision.HIGHEST))
  jax.block_until_ready(f(x))
  best = min(timed(f, x)[1] for _ in range(reps))
  return 2.0 * rows * dim ** 2 / best / 1e9


# ------------------------------------------------------------------------- synthetic
class Generator:
  """Class-structured features: x = mu_k + sqrt(gamma_k) (s * j_k) * e + F^T u.

  mu_k ~ N(0, 4 I / D^0.5-ish), gamma_k ~ Gamma(20, 1/20) (the coupled model's scale),
  s a per-dimension spread, j_k a per-class per-dimension jitter, and a shared rank-8
  factor F so that covariances are not diagonal. Unseen classes (OOD) come from the same
  process with fresh parameters.
  """

  def __init__(self, num_classes, dim, seed=0):
    rng = np.random.default_rng(seed)
    self.dim = dim
    self.spread = rng.uniform(0.5, 2.0, dim).astype(np.float32)
    self.factor = (rng.normal(size=(8, dim)) * 0.5).astype(np.float32)
    self.params = self._classes(rng, num_classes)

  def _classes(self, rng, num_classes):
    means = (rng.normal(size=(num_classes, self.dim)) * 1.5).astype(np.float32)
    gamma = rng.gamma(20.0, 1.0 / 20.0, num_classes).astype(np.float32)
    jitter = rng.gamma(30.0, 1.0 / 30.0, (num_classes, self.dim)).astype(np.float32)
    return means, np.sqrt(gamma)[:, None] * self.spread * jitter

  def sample(self, rng, labels, params=None):
    means, scale = self.params if params is None else params
    e = rng.standard_normal((labels.shape[0], self.dim), dtype=np.float32)
    u = rng.standard_normal((labels.shape[0], 8), dtype=np.float32)
    return means[labels] + scale[labels] * e + u @ self.factor

  def write(self, path_x, path_y, n, chunk=65536, seed=1):
    """Writes (n, D) float32 features and (n,) labels in random class order, chunkwise."""
    rng = np.random.default_rng(seed)
    num_classes = self.params[0].shape[0]
    header = {"descr": "<f4", "fortran_order": False, "shape": (n, self.dim)}
    ys = []
    with open(path_x, "wb") as f:
      np.lib.format.write_array_header_2_0(f, header)
      for start in range(0, n, chunk):
        y = rng.integers(0, num_classes, min(chunk, n - start)).astype(np.int32)
        self.sample(rng, y).tofile(f)
        ys.append(y)
    np.save(path_y, np.concatenate(ys))

  def test_set(self, m, seed=2):
    rng = np.random.default_rng(seed)
    num_classes = self.params[0].shape[0]
    x_in = self.sample(rng, rng.integers(0, num_classes, m // 2))
    unseen = self._classes(rng, max(2, num_classes // 10))
    x_out = self.sample(rng, rng.integers(0, unseen[0].shape[0], m - m // 2), unseen)
    return np.concatenate([x_in, x_out]), m // 2


def preprocessing(px, py, k, chunk, block_size):
  """The default preprocessing's work as components (``fit_detector(..., preprocess=True)``):
  the pass over the raw features whose statistics fit the transform (no per-class
  scatter), the fit, and the transform applied to every training row, which the public
  API's statistics pass does on top of the statistics row. Compiled on one chunk first."""
  xm, ym = np.load(px, mmap_mode="r"), np.load(py, mmap_mode="r")
  kwargs = dict(full=False, chunk_size=chunk, block_size=block_size)
  jax.block_until_ready(preprocess.apply(
      preprocess.fit(stats_lib.from_arrays(xm[:chunk], ym[:chunk], k, **kwargs)), xm[:chunk]))
  raw, raw_s = timed(stats_lib.from_arrays, xm, ym, k, **kwargs)
  transform, fit_s = timed(preprocess.fit, raw)

  def apply_all():
    for xc, _ in stats_lib.iterate_chunks(xm, ym, chunk):
      jax.block_until_ready(preprocess.apply(transform, xc))
  _, apply_s = timed(apply_all)
  return dict(pre_raw_s=raw_s, pre_fit_s=fit_s, pre_apply_s=apply_s,
              pre_s=raw_s + fit_s + apply_s)


# -------------------------------------------------------------------------- one row
@functools.lru_cache(maxsize=None)
def _chunk_scorer(log_predictive):
  @jax.jit
  def chunk_score(p, xc):
    class_lp, prior_lp = log_predictive(p, xc)
    return scores_lib.dpmm_score(p.log_counts, class_lp, prior_lp)
  return chunk_score


def _score_all(log_predictive, params, x, chunk):
  """DPMM scores of all rows, chunk by chunk (one compiled shape; last chunk padded)."""
  chunk_score = _chunk_scorer(log_predictive)
  out = []
  for start in range(0, x.shape[0], chunk):
    xc = x[start:start + chunk]
    n = xc.shape[0]
    if n < chunk:
      xc = np.concatenate([xc, np.repeat(xc[-1:], chunk - n, 0)])
    out.append(np.asarray(chunk_score(params, jnp.asarray(xc)))[:n])
  return np.concatenate(out)


def run_row(m, k, d, n, workdir, chunk_rows, block_size, score_chunk, peak, log,
            e2e_runs=(False, True)):
  row = collections.OrderedDict(M=m, K=k, D=d, N=n, load_before=load_average())
  gen = Generator(k, d)
  px, py = os.path.join(workdir, f"x_{n}_{d}.npy"), os.path.join(workdir, f"y_{n}_{d}.npy")
  t0 = time.perf_counter()
  gen.write(px, py, n)
  row["generate_s"] = time.perf_counter() - t0
  log(f"  generated {n} x {d} features ({os.path.getsize(px) / 2**30:.2f} GiB) "
      f"in {row['generate_s']:.1f} s")
  x_test, num_in = gen.test_set(m)

  # The default preprocessing's passes, before the statistics (whose (K, D, D) scatter
  # would otherwise be held while they run).
  chunk = min(chunk_rows, n)
  row.update(preprocessing(px, py, k, chunk, block_size))
  log(f"  preprocessing: raw pass {row['pre_raw_s']:.1f} s, fit {row['pre_fit_s']:.2f} s, "
      f"applied to every row {row['pre_apply_s']:.1f} s")
  # Statistics from the memory map.
  xm, ym = np.load(px, mmap_mode="r"), np.load(py, mmap_mode="r")
  row["gram_gflops"] = gram_throughput(chunk, d)
  # Compile on the first chunk (same padded shape as every chunk), then time the pass.
  _, comp = timed(stats_lib.from_arrays, xm[:chunk], ym[:chunk], k, full=True,
                     chunk_size=chunk, block_size=block_size)
  st, run = timed(stats_lib.from_arrays, xm, ym, k, full=True, chunk_size=chunk,
                     block_size=block_size)
  del xm, ym
  row.update(stats_s=run, stats_compile_s=comp,
             stats_gflops=2.0 * n * d * d / run / 1e9)
  row["stats_pct_peak"] = 100.0 * row["stats_gflops"] / peak
  row["stats_pct_gram"] = 100.0 * row["stats_gflops"] / row["gram_gflops"]
  row["rss_after_stats_gb"] = rss_gb("VmRSS")
  log(f"  stats: {run:.1f} s run + {comp:.1f} s compile, {row['stats_gflops']:.1f} GFLOP/s "
      f"= {row['stats_pct_peak']:.0f}% of matmul peak, {row['stats_pct_gram']:.0f}% of X^T X; "
      f"RSS {row['rss_after_stats_gb']:.2f} GB")

  models = collections.OrderedDict()
  # tied: closed form.
  p, run, comp = compiled_run(jax.jit(tied.fit), st)
  models["tied"] = dict(params=p, fit_s=run, fit_compile_s=comp, iters=0, module=tied)
  # diag and coupled: EM in one jit (the models' own jitted fit).
  em_options = dict(df=None, mean_concentration=None, tol=1e-6, max_iter=100, df_cap=1e6,
                    trace_length=em.trace_length(100))
  for name, module, extra in (("diag", diag, {}),
                              ("coupled", coupled, dict(gamma_shape=None,
                                                        options=coupled.QuadratureOptions()))):
    (p, info), run, comp, rerun = compiled_run_exec(module._fit, st, **em_options, **extra,
                                                    accelerate=True)
    (_, plain_info), plain_run = rerun(accelerate=False)    # plain EM, same executable
    iters = int(info.num_iters)
    models[name] = dict(params=p, fit_s=run, fit_compile_s=comp, iters=iters,
                        converged=bool(info.converged), module=module,
                        per_iter_s=run / max(iters, 1), plain_iters=int(plain_info.num_iters),
                        plain_converged=bool(plain_info.converged), plain_fit_s=plain_run)
  # full: one-time spectral reduction, O(K D) iterations, predictive factors.
  h0 = full.init_hyper(st)
  summary, w1, c1 = compiled_run(jax.jit(full.spectral_summary), st, h0.loc, h0.mean_cov)

  @jax.jit
  def full_em(summary, h0, accelerate):
    step, lml = full.spectral_em_functions(h0.mean_cov, d)
    return em.run(step, lml, h0, summary, tol=1e-6, max_iter=100,
                  extrapolate=full.extrapolation_bounds(d), accelerate=accelerate)

  (hyper, info), w2, c2, rerun = compiled_run_exec(full_em, summary, h0, True)
  (_, plain_info), plain_w2 = rerun(summary, h0, False)
  del rerun
  del summary
  p, w3, c3 = compiled_run(jax.jit(full.params_from_hyper), hyper, st)
  iters = int(info.num_iters)
  models["full"] = dict(params=p, fit_s=w1 + w2 + w3, fit_compile_s=c1 + c2 + c3,
                        iters=iters, converged=bool(info.converged), module=full,
                        per_iter_s=w2 / max(iters, 1), reduce_s=w1, predictive_s=w3,
                        plain_iters=int(plain_info.num_iters), em_s=w2,
                        plain_converged=bool(plain_info.converged), plain_fit_s=plain_w2)
  del st
  row["rss_after_fit_gb"] = rss_gb("VmRSS")
  for name, r in models.items():
    log(f"  fit {name}: {r['fit_s']:.2f} s run + {r['fit_compile_s']:.1f} s compile, "
        f"{r['iters']} iterations" + (f", {r['per_iter_s'] * 1e3:.2f} ms/iteration"
                                      if "per_iter_s" in r else "")
        + (f"; plain EM {r['plain_iters']} iterations, {r['plain_fit_s']:.2f} s"
           + ("" if r["plain_converged"] else " (stopped at max_iter)")
           if "plain_iters" in r else ""))
  log(f"    full: spectral reduction {models['full']['reduce_s']:.1f} s, predictive "
      f"Cholesky factors {models['full']['predictive_s']:.1f} s")

  # Scoring.
  score_rows = min(score_chunk, m)
  for name, r in models.items():
    module = r["module"]
    # Compile apart: one chunk of the right shape.
    lp_fn = module.log_predictive
    _, comp = timed(_score_all, lp_fn, r["params"], x_test[:score_rows], score_rows)
    scores, run = timed(_score_all, lp_fn, r["params"], x_test, score_rows)
    r.update(score_s=run, score_compile_s=comp, points_per_s=m / run,
             ns_per_element=run / (m * k * d) * 1e9,
             auroc=metrics.auroc(scores[:num_in], scores[num_in:]))
    if name == "full":
      num_chunks = -(-m // score_rows)       # padded chunks, inverses per chunk
      r["score_gflops"] = num_chunks * full.scoring_flops(score_rows, k, d) / run / 1e9
      r["score_pct_peak"] = 100.0 * r["score_gflops"] / peak
    if name == "coupled":
      orders = np.asarray(coupled.scoring_orders(r["params"]))
      values, counts = np.unique(orders, return_counts=True)
      r["orders"] = ", ".join(f"{'all P' if v < 0 else 'J=' + str(v)}: {c}"
                              for v, c in zip(values, counts))
    log(f"  score {name}: {run:.2f} s run + {r['score_compile_s']:.1f} s compile, "
        f"{r['points_per_s']:.0f} points/s, {r['ns_per_element']:.3f} ns/(m,k,d)"
        + (f", {r['score_gflops']:.1f} GFLOP/s = {r['score_pct_peak']:.0f}% of peak"
           if name == "full" else "") + f", AUROC {r['auroc']:.3f}")
  if "coupled" in models and "diag" in models:
    row["coupled_over_diag"] = models["coupled"]["score_s"] / models["diag"]["score_s"]
  row["peak_rss_gb"] = rss_gb("VmHWM")
  row["load_after"] = load_average()
  for r in models.values():
    del r["params"], r["module"]
  row["models"] = models
  row["e2e"] = [end_to_end(px, py, x_test, workdir, busy, log) for busy in e2e_runs]
  os.remove(px)
  os.remove(py)
  return row


# ------------------------------------------------------- public API, fresh processes
E2E_MODELS = ("rmds", "tied", "diag", "coupled", "full")
COLD_MODELS = ("full", "diag", "coupled")
COLD_PROBLEM = (100, 64, 50)          # K, D, N_k of the cold-start rows

_E2E_CHILD = r"""
import json, sys, time, warnings
import numpy as np
import dpmm_jax
px, py, pt, models = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
x, y = np.load(px, mmap_mode="r"), np.load(py, mmap_mode="r")
xt = np.load(pt, mmap_mode="r")
k = int(np.max(y)) + 1
warm = min(len(y), 65536)            # same chunk shapes as the full run
out = {"models": {}}
with warnings.catch_warnings():
  warnings.simplefilter("ignore")
  t = time.perf_counter()
  if len(np.unique(y[:warm])) == k:  # compile everything on a slice (same shapes)
    for det in dpmm_jax.fit_detectors(x[:warm], y[:warm], models, num_classes=k).values():
      dpmm_jax.score(det, xt[:2048])
  out["warmup_s"] = time.perf_counter() - t
  t_job = time.perf_counter()
  fitted = dpmm_jax.fit_detectors_with_info(x, y, models, num_classes=k)
  out["fit_all_s"] = time.perf_counter() - t_job
  for model, (det, rep) in fitted.items():
    t = time.perf_counter()
    np.asarray(dpmm_jax.score(det, xt))    # to the host: what a user waits for
    out["models"][model] = dict(score_s=time.perf_counter() - t, iters=rep.num_iters,
                                converged=rep.converged)
  out["job_s"] = time.perf_counter() - t_job
with open("/proc/self/status") as f:
  out["peak_rss_gb"] = [int(l.split()[1]) / 2**20 for l in f if l.startswith("VmHWM")][0]
print("RESULT " + json.dumps(out))
"""

_COLD_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import dpmm_jax
import_s = time.perf_counter() - t0
k, d, nk, model = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(0)
means = 3.0 * rng.normal(size=(k, d)).astype(np.float32)
y = np.repeat(np.arange(k), nk).astype(np.int32)
x = means[y] + rng.uniform(0.5, 2.0, (k, d)).astype(np.float32)[y] * rng.standard_normal(
    (len(y), d), dtype=np.float32)
xt = x[::7] + 0.1
out = {"import_s": import_s}
for rep in range(2):
  t = time.perf_counter(); det = dpmm_jax.fit_detector(x, y, model); out[f"fit{rep}"] = time.perf_counter() - t
  t = time.perf_counter(); np.asarray(dpmm_jax.score(det, xt)); out[f"score{rep}"] = time.perf_counter() - t
print("RESULT " + json.dumps(out))
"""


def _child_env(**extra):
  """The user's own environment (not this script's OPENBLAS_NUM_THREADS=1), plus the
  repository on the path."""
  env = dict(USER_ENV)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.update(extra)
  return env


def _run_child(code, argv, env, busy=False, timeout=3600):
  hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
  try:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code] + [str(a) for a in argv], env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
  finally:
    if hog is not None:
      hog.kill()
      hog.wait()
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if not lines:
    raise RuntimeError(f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
  out = json.loads(lines[-1][len("RESULT "):])
  out["process_s"] = wall
  return out


def end_to_end(px, py, x_test, workdir, busy, log, models=E2E_MODELS):
  """fit_detector from the memory-mapped file (default preprocessing) and score, for every
  model, in a fresh process with the user's environment; after a warm-up on a slice with
  the same shapes (compilation is reported by the cold-start rows)."""
  pt = os.path.join(workdir, "x_test.npy")
  np.save(pt, x_test)
  out = _run_child(_E2E_CHILD, [px, py, pt, ",".join(models)], _child_env(), busy=busy)
  os.remove(pt)
  out["busy"] = busy
  out["load"] = load_average()
  log(f"  end-to-end ({'CPU-bound process beside' if busy else 'alone'}): job "
      f"{out['job_s']:.1f} s (warm-up {out['warmup_s']:.1f} s), peak RSS "
      f"{out['peak_rss_gb']:.2f} GB; fit_detectors {out['fit_all_s']:.1f} s; " + ", ".join(
          f"{m} ({r['iters']} it) score {r['score_s']:.1f} s"
          for m, r in out["models"].items()))
  return out


def cold_start(log, models=COLD_MODELS, problem=COLD_PROBLEM):
  """First fit_detector / score in a fresh process: with an empty compilation cache
  (cold), then in a second process with the cache the first one filled (warm)."""
  k, d, nk = problem
  rows = []
  for model in models:
    cache = tempfile.mkdtemp(prefix="dpmm_cache_")
    env = _child_env(DPMM_JAX_COMPILATION_CACHE=cache)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cold = _run_child(_COLD_CHILD, [k, d, nk, model], env)
    warm = _run_child(_COLD_CHILD, [k, d, nk, model], env)
    shutil.rmtree(cache, ignore_errors=True)
    row = dict(model=model, K=k, D=d, N_k=nk, cold_fit_s=cold["fit0"],
               cold_score_s=cold["score0"], warm_fit_s=warm["fit0"],
               warm_score_s=warm["score0"], in_process_fit_s=cold["fit1"],
               in_process_score_s=cold["score1"], import_s=cold["import_s"],
               load=load_average())
    rows.append(row)
    log(f"  cold start {model}: first fit {row['cold_fit_s']:.1f} s (empty cache), "
        f"{row['warm_fit_s']:.1f} s (second process, cache filled), "
        f"{row['in_process_fit_s']:.2f} s (second call); first score "
        f"{row['cold_score_s']:.1f} / {row['warm_score_s']:.1f} s")
  return rows


# -------------------------------------------------------------------------- reporting
def markdown_public(rows, cold_rows):
  """End-to-end and cold-start tables."""
  lines = []
  if any(r.get("e2e") for r in rows):
    lines += ["", "### End to end through the public API (fresh process, user's environment)",
              "", "`fit_detectors` (one statistics pass shared by every model) from the "
              "memory-mapped .npy with the default preprocessing, then `score` of the M test "
              "points by each model, in one process, after a warm-up on a 65,536-row slice "
              "(same compiled shapes). Component = statistics + fit + scoring rows above "
              "(pinned OPENBLAS_NUM_THREADS=1, full scatter statistics, no preprocessing); "
              "RMDS has no component row, so the job ratio counts its fit and scoring on "
              "the public side only. The last ratio adds the preprocessing rows (the raw "
              "pass, the transform's fit, the transform applied to every training row) to "
              "the components: the public job does that work too.",
              "", "| M | K | D | N | beside | fit_detectors s | model | score s | "
              "score public / component | EM iters | job s | job public / component | "
              "job public / component with preprocessing | peak RSS GB | load |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
      for e in r.get("e2e", []):
        comp_models = [m for m in e["models"] if m in r["models"]]
        comp_total = r["stats_s"] + sum(r["models"][m]["fit_s"] + r["models"][m]["score_s"]
                                        for m in comp_models)
        job_ratio = f"{e['job_s'] / comp_total:.2f}"
        pre_ratio = f"{e['job_s'] / (comp_total + r['pre_s']):.2f}"
        for model, mr in e["models"].items():
          comp = r["models"].get(model)
          ratio = f"{mr['score_s'] / comp['score_s']:.2f}" if comp else "-"
          lines.append(f"| {r['M']} | {r['K']} | {r['D']} | {r['N']} | "
                       f"{'CPU-bound job' if e['busy'] else 'nothing'} | "
                       f"{e['fit_all_s']:.1f} | {model} | {mr['score_s']:.2f} | {ratio} | "
                       f"{mr['iters']} | {e['job_s']:.1f} | {job_ratio} | {pre_ratio} | "
                       f"{e['peak_rss_gb']:.2f} | {e['load']} |")
  if cold_rows:
    lines += ["", "### Cold start: first call in a fresh process", "",
              "First `fit_detector` / `score` in a new process with an empty compilation "
              "cache (cold), in a second process after the first filled the cache (warm), "
              "and the second call in the first process (compiled).", "",
              "| model | K | D | N_k | import s | first fit s cold / warm | second fit s | "
              "first score s cold / warm | second score s | load |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cold_rows:
      lines.append(f"| {c['model']} | {c['K']} | {c['D']} | {c['N_k']} | {c['import_s']:.1f} | "
                   f"{c['cold_fit_s']:.2f} / {c['warm_fit_s']:.2f} | {c['in_process_fit_s']:.3f} | "
                   f"{c['cold_score_s']:.2f} / {c['warm_score_s']:.2f} | "
                   f"{c['in_process_score_s']:.3f} | {c['load']} |")
  return "\n".join(lines) + "\n"


def markdown(rows, info, peak):
  lines = [f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}", "",
           "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()),
           "Measured float32 matmul peak (jitted square GEMM at Precision.HIGHEST, side 2048 "
           f"on CPU, 8192 on an accelerator, best of 5): {peak:.1f} GFLOP/s",
           "", "### Statistics (full per-class scatter, streamed from a memory-mapped .npy)", "",
           "| M | K | D | N | stats s | compile s | GFLOP/s | % matmul peak | % X^T X | "
           "preprocessing s: raw pass + fit + apply | peak RSS GB | load before / after |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['M']} | {r['K']} | {r['D']} | {r['N']} | {r['stats_s']:.1f} | "
                 f"{r['stats_compile_s']:.1f} | {r['stats_gflops']:.1f} | "
                 f"{r['stats_pct_peak']:.0f} | {r['stats_pct_gram']:.0f} | "
                 f"{r['pre_raw_s']:.1f} + {r['pre_fit_s']:.2f} + {r['pre_apply_s']:.1f} | "
                 f"{r['peak_rss_gb']:.2f} | {r['load_before']} / {r['load_after']} |")
  lines += ["", "### EM and scoring per model", "",
            "| M | K | D | model | EM iters | plain EM iters | EM s (accelerated / plain) | "
            "s / iter | fit s | fit compile s | "
            "score s | score compile s | points/s | ns/(m,k,d) | notes | AUROC |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    for name, mr in r["models"].items():
      notes = ""
      if name == "full":
        notes = (f"reduce {mr['reduce_s']:.1f} s, predictive {mr['predictive_s']:.1f} s; "
                 f"scoring {mr['score_gflops']:.1f} GFLOP/s = {mr['score_pct_peak']:.0f}% peak")
      elif name == "coupled":
        notes = f"{r['coupled_over_diag']:.1f}x diag; orders {mr['orders']}"
      per_iter = f"{mr['per_iter_s'] * 1e3:.2f} ms" if "per_iter_s" in mr else "-"
      plain = "-"
      em_s = "-"
      if "plain_iters" in mr:
        plain = f"{mr['plain_iters']}" + ("" if mr["plain_converged"] else " (max_iter)")
        em_s = f"{mr.get('em_s', mr['fit_s']):.3f} / {mr['plain_fit_s']:.3f}"
      lines.append(f"| {r['M']} | {r['K']} | {r['D']} | {name} | {mr['iters']} | "
                   f"{plain} | {em_s} | {per_iter} | {mr['fit_s']:.2f} | {mr['fit_compile_s']:.1f} | "
                   f"{mr['score_s']:.2f} | {mr['score_compile_s']:.1f} | "
                   f"{mr['points_per_s']:.0f} | {mr['ns_per_element']:.3f} | {notes} | "
                   f"{mr['auroc']:.3f} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small grid only")
  parser.add_argument("--imagenet-only", action="store_true", help="only the big row")
  parser.add_argument("--cold-only", action="store_true",
                      help="only the cold-start rows (no grid, no ImageNet-sized row)")
  parser.add_argument("--workdir", default=None, help="where the .npy files go")
  parser.add_argument("--chunk-rows", type=int, default=262144,
                      help="training rows per statistics chunk")
  parser.add_argument("--block-size", type=int, default=256,
                      help="rows per per-class scatter window")
  parser.add_argument("--score-chunk", type=int, default=2500, help="test rows per chunk")
  parser.add_argument("--markdown", default=None, help="also write the tables here")
  parser.add_argument("--grid", default=None,
                      help="rows 'M,K,D,N;M,K,D,N' instead of the built-in grid")
  parser.add_argument("--end-to-end", default="alone,busy",
                      help="public-API runs per row: 'alone', 'busy' (a CPU-bound process "
                      "beside), both comma-separated, or 'none'")
  parser.add_argument("--no-cold-start", action="store_true",
                      help="skip the cold-start rows (K=100, D=64, N_k=50)")
  parser.add_argument("--cold-problem", default=",".join(map(str, COLD_PROBLEM)),
                      help="K,D,N_k of the cold-start problem")
  parser.add_argument("--cold-models", default=",".join(COLD_MODELS),
                      help="comma-separated models of the cold-start rows")
  args = parser.parse_args(argv)
  e2e_runs = tuple(v == "busy" for v in args.end_to_end.split(",") if v in ("alone", "busy"))

  def log(msg):
    print(msg, flush=True)

  info = machine()
  log("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
  peak = matmul_peak()
  log(f"float32 matmul peak (Precision.HIGHEST): {peak:.1f} GFLOP/s (load {load_average()})")
  if args.cold_only:
    grid = []
  elif args.grid:
    grid = [tuple(int(v) for v in row.split(",")) for row in args.grid.split(";")]
  else:
    grid = [] if args.imagenet_only else list(QUICK_GRID)
    if not args.quick:
      grid.append(IMAGENET_ROW)
  workdir = args.workdir or tempfile.mkdtemp(prefix="dpmm_bench_")
  os.makedirs(workdir, exist_ok=True)
  rows = []
  for m, k, d, n in grid:
    log(f"row M={m} K={k} D={d} N={n} (load {load_average()})")
    rows.append(run_row(m, k, d, n, workdir, args.chunk_rows, args.block_size,
                        args.score_chunk, peak, log, e2e_runs))
    log(f"  peak RSS so far {rows[-1]['peak_rss_gb']:.2f} GB (load {load_average()})")
  cold_rows = []
  if not args.no_cold_start:
    cold_problem = tuple(int(v) for v in args.cold_problem.split(","))
    log(f"cold start K={cold_problem[0]} D={cold_problem[1]} N_k={cold_problem[2]} "
        f"(load {load_average()})")
    cold_rows = cold_start(log, tuple(args.cold_models.split(",")), cold_problem)
  text = markdown(rows, info, peak) + markdown_public(rows, cold_rows)
  print(text)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(text)
  return rows


if __name__ == "__main__":
  main()
