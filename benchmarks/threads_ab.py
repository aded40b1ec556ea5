"""A/B of the public API's thread handling: fresh processes, environments interleaved.

    python benchmarks/threads_ab.py --classes 200 --dim 768 --per_class 100 --busy

Each variant runs in its own fresh Python process (what a user gets), fits the full
model with ``dpmm_jax.fit_detector`` and scores 2,000 points with ``dpmm_jax.score``
twice each, and reports the second (compiled) call. It then scores the same points with
the model's pure ``log_predictive`` under the user's own ``jax.jit`` (the functional
layer, which leaves thread pools alone), again twice. Variants:

* ``default``: no thread variable set (the library limits the BLAS/LAPACK pools to one
  thread inside the API, see dpmm_jax/threads.py);
* ``pinned``: ``OPENBLAS_NUM_THREADS=1`` set by the user (the library leaves it);
* ``unmanaged``: ``DPMM_JAX_BLAS_THREADS=keep``, i.e. no thread control (the behaviour
  before dpmm_jax.threads: OpenBLAS's default of one thread per core).

With ``--busy`` a CPU-bound process (``while True: pass``) runs beside every variant.
Variants are interleaved round by round so that slow drifts of the machine's load hit
them alike.
"""
import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, warnings
import numpy as np
import jax
import dpmm_jax
k, d, nk, m, model = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rng = np.random.default_rng(0)
means = 3.0 * rng.normal(size=(k, d)).astype(np.float32)
scale = rng.uniform(0.5, 2.0, (k, d)).astype(np.float32)
y = np.repeat(np.arange(k), nk).astype(np.int32)
x = means[y] + scale[y] * rng.standard_normal((len(y), d), dtype=np.float32)
xt = means[rng.integers(0, k, m)] + rng.standard_normal((m, d), dtype=np.float32)
out = {}
with warnings.catch_warnings():
  warnings.simplefilter("ignore")
  for rep in range(2):
    t = time.perf_counter(); det = dpmm_jax.fit_detector(x, y, model); out[f"fit{rep}"] = time.perf_counter() - t
    t = time.perf_counter(); s = np.asarray(dpmm_jax.score(det, xt)); out[f"score{rep}"] = time.perf_counter() - t
import importlib
from dpmm_jax import preprocess
scorer = jax.jit(importlib.import_module("dpmm_jax.models." + model).log_predictive)
xp = xt if det.transform is None else preprocess.apply(det.transform, jax.numpy.asarray(xt))
for rep in range(2):
  t = time.perf_counter(); jax.block_until_ready(scorer(det.params, xp)); out[f"functional{rep}"] = time.perf_counter() - t
from threadpoolctl import threadpool_info
out["blas_threads_after"] = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
print("RESULT " + json.dumps(out))
"""

VARIANTS = {
    "default": {},
    "pinned": {"OPENBLAS_NUM_THREADS": "1"},
    "unmanaged": {"DPMM_JAX_BLAS_THREADS": "keep"},
}
_CLEARED = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS",
            "BLIS_NUM_THREADS", "DPMM_JAX_BLAS_THREADS")


def run_variant(name, args):
  env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
  env.update(VARIANTS[name])
  root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  busy = None
  if args.busy:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  try:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(args.classes), str(args.dim),
                           str(args.per_class), str(args.num_test), args.model],
                          env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
  finally:
    if busy is not None:
      busy.kill()
      busy.wait()
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if not lines:
    raise RuntimeError(f"variant {name} failed:\n{proc.stderr[-3000:]}")
  res = json.loads(lines[-1][len("RESULT "):])
  res.update(variant=name, busy=bool(args.busy), process_s=wall, load=os.getloadavg()[0])
  return res


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--classes", type=int, default=200)
  parser.add_argument("--dim", type=int, default=768)
  parser.add_argument("--per_class", type=int, default=100)
  parser.add_argument("--num_test", type=int, default=2000)
  parser.add_argument("--model", default="full")
  parser.add_argument("--busy", action="store_true", help="a CPU-bound process beside")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--variants", default="default,pinned,unmanaged")
  parser.add_argument("--timeout", type=float, default=1200)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  results = []
  for r in range(args.rounds):
    for name in args.variants.split(","):
      res = run_variant(name, args)
      results.append(res)
      print(f"round {r} {name:10s} busy={args.busy} fit {res['fit1']:.2f} s "
            f"(first {res['fit0']:.1f} s), score {res['score1']:.2f} s "
            f"(first {res['score0']:.1f} s), own jit of log_predictive {res['functional1']:.2f} s, "
            f"load {res['load']:.2f}, "
            f"BLAS threads after {res['blas_threads_after']}", flush=True)
  print("\n| variant | busy | fit s (second call, per round) | score s (second call, per round) "
        "| own jit of log_predictive s (second call, per round) |")
  print("|---|---|---|---|---|")
  for name in args.variants.split(","):
    rs = [r for r in results if r["variant"] == name]
    print(f"| {name} | {args.busy} | " + " / ".join(f"{r['fit1']:.2f}" for r in rs) + " | "
          + " / ".join(f"{r['score1']:.2f}" for r in rs) + " | "
          + " / ".join(f"{r['functional1']:.2f}" for r in rs) + " |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(config=vars(args), results=results), f, indent=1)
  return results


if __name__ == "__main__":
  main()
