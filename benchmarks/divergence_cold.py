"""First and second ``divergence.estimate`` call, as a user meets them.

Each row runs in fresh processes with the user's environment: the first process starts
with an empty compilation cache (a new directory), the second finds the cache the first
filled. In each process the first call pays compilation, the second (another key, same
shapes) only the chain, and the third changes only the chain's length (1,000 burn-in
steps, every 2nd step kept), which is a loop bound of the compiled chain, not a new
program. Default settings (4 chains, 2,000 burn-in steps, 1,000 draws,
max_regions 128) on two Beta samples of N points in D dimensions.

    python benchmarks/divergence_cold.py [--dims 1,2,3] [--n 1000] [--markdown out.md]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tables  # pylint: disable=g-import-not-at-top,wrong-import-position

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np, jax
from dpmm_jax import divergence
imported = time.perf_counter() - t0
dim, n = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
x, y = rng.beta(2, 5, size=(n, dim)), rng.beta(5, 2, size=(n, dim))
times = []
for seed, length in ((0, {}), (1, {}), (2, dict(num_burnin=1000, thin=2))):
  t0 = time.perf_counter()
  res = divergence.estimate(x, y, "tv", key=jax.random.PRNGKey(seed), **length)
  res.mean.block_until_ready()
  times.append(time.perf_counter() - t0)
print(json.dumps(dict(import_s=imported, first_s=times[0], second_s=times[1],
                      other_length_s=times[2], tv=float(res.mean))))
"""


def _child(dim, n, cache):
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["DPMM_JAX_COMPILATION_CACHE"] = cache
  out = subprocess.run([sys.executable, "-c", _CHILD, str(dim), str(n)], env=env,
                       capture_output=True, text=True, timeout=3600, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dims", default="1,2,3", help="comma-separated dimensions D")
  parser.add_argument("--n", type=int, default=1000, help="points per sample")
  parser.add_argument("--markdown", default=None, help="also write the table here")
  args = parser.parse_args(argv)
  table = tables.StreamedTable(["| D | N | process | first call s | second call s | "
                                 "third call (burn-in 1,000, thin 2) s | TV |",
                                 "|---|---|---|---|---|---|---|"], args.markdown)
  rows = []
  for dim in [int(d) for d in args.dims.split(",")]:
    with tempfile.TemporaryDirectory() as cache:
      for label in ("empty cache", "second process"):
        r = _child(dim, args.n, cache)
        rows.append(dict(dim=dim, n=args.n, process=label, **r))
        table.add(f"| {dim} | {args.n} | {label} | {r['first_s']:.2f} | "
                  f"{r['second_s']:.2f} | {r['other_length_s']:.2f} | {r['tv']:.3f} |")
  table.save()
  return rows


if __name__ == "__main__":
  main()
