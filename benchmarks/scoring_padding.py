"""First and warm ``score`` calls of detectors with nearby class counts.

For each model, in a fresh process with the compilation cache off: fit detectors on the
first K = 2..8 of 8 classes (D = 16, 40 points per class), then time the first
``score`` of 64 points with each (its compilation included), count the scorer programs
compiled (``api._evaluate_chunk``), and time a warm ``score`` of 64 points at K = 5
(mean of 200 calls).

    python benchmarks/scoring_padding.py [--models diag,full,coupled] [--markdown out.md]
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tables  # pylint: disable=g-import-not-at-top,wrong-import-position

_CHILD = """
import json, sys, time
import numpy as np
import dpmm_jax
from dpmm_jax import api
model = sys.argv[1]
rng = np.random.default_rng(0)
y = np.repeat(np.arange(8), 40)
x = (rng.normal(size=(320, 16)) + 3 * rng.normal(size=(8, 16))[y]).astype(np.float32)
xt = rng.normal(size=(64, 16)).astype(np.float32)
dets = [dpmm_jax.fit_detector(x[y < k], y[y < k], model) for k in range(2, 9)]
firsts = []
for det in dets:
  t = time.perf_counter()
  np.asarray(dpmm_jax.score(det, xt))
  firsts.append(time.perf_counter() - t)
det = dets[3]
for _ in range(3):
  np.asarray(dpmm_jax.score(det, xt))
t = time.perf_counter()
for _ in range(200):
  np.asarray(dpmm_jax.score(det, xt))
warm_ms = (time.perf_counter() - t) / 200 * 1e3
print(json.dumps(dict(firsts=firsts, programs=api._evaluate_chunk._cache_size(),
                      warm_ms=warm_ms)))
"""


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="diag,full,coupled", help="comma-separated models")
  parser.add_argument("--markdown", default=None, help="also write the table here")
  args = parser.parse_args(argv)
  table = tables.StreamedTable(["| model | first scores, K = 2..8, s | total s | "
                                 "scorer programs | warm score at K = 5, ms |",
                                 "|---|---|---|---|---|"], args.markdown)
  env = dict(os.environ, DPMM_JAX_COMPILATION_CACHE="0")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  for model in args.models.split(","):
    out = subprocess.run([sys.executable, "-c", _CHILD, model], env=env, check=True,
                         capture_output=True, text=True, timeout=1800)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    table.add(f"| {model} | {' '.join(f'{v:.2f}' for v in r['firsts'])} | "
              f"{sum(r['firsts']):.2f} | {r['programs']} | {r['warm_ms']:.3f} |")
  table.save()


if __name__ == "__main__":
  main()
