"""Compile and run time of co-BPM's chain (``divergence.run_chain``) at a few shapes.

For each shape (chains vmapped together, points per sample, dimension D, burn-in steps,
kept draws; max_regions 128), in this process with the compilation cache off: seconds to
trace and lower, to compile, and to run once compiled (second call), and the mean of
each divergence column over chains and draws (to check that two trees draw the same
chain). Two Beta samples, as in ``divergence_cold.py``.

    DPMM_JAX_COMPILATION_CACHE=0 python benchmarks/divergence_compile.py [--markdown out.md]
"""
import argparse
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from dpmm_jax import divergence as dv
from experiments import divergence_problems as dp
import tables  # pylint: disable=g-import-not-at-top,wrong-import-order

# (chains, points per sample, D, burn-in, draws): the divergence notebook's quick
# sanity and simulation shapes, and a larger one.
SHAPES = ((2, 150, 2, 30, 20), (1, 50, 3, 30, 20), (4, 250, 3, 200, 100))


def measure(chains, n, dim, burnin, samples):
  rng = np.random.default_rng(0)
  pairs = [(rng.beta(2, 5, (n, dim)), rng.beta(5, 2, (n, dim))) for _ in range(chains)]
  xs, ys, vx, vy = (jnp.asarray(a) for a in dp.pad_pairs(pairs))
  config = dv.Config(max_regions=128, num_burnin=burnin, num_samples=samples)
  run = jax.jit(jax.vmap(dv.run_chain, in_axes=(0, 0, 0, 0, 0, None, None, None, None)),
                static_argnums=8)
  args = (jax.random.split(jax.random.PRNGKey(0), chains), xs, ys, vx, vy, 0.5, dim + 1.0,
          2.0)
  t0 = time.perf_counter()
  lowered = run.lower(*args, config)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  t3 = time.perf_counter()
  out = jax.block_until_ready(compiled(*args))
  t4 = time.perf_counter()
  means = np.asarray(out.divergences).mean(axis=(0, 1))
  return dict(lower_s=t1 - t0, compile_s=t2 - t1, run_s=t4 - t3, means=means)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--markdown", default=None, help="also write the table here")
  args = parser.parse_args(argv)
  table = tables.StreamedTable(
      ["| chains | N | D | burn-in + draws | lower s | compile s | run s | "
       "mean tv, hellinger, kl, alpha |", "|---|---|---|---|---|---|---|---|"], args.markdown)
  for chains, n, dim, burnin, samples in SHAPES:
    r = measure(chains, n, dim, burnin, samples)
    table.add(f"| {chains} | {n} | {dim} | {burnin} + {samples} | {r['lower_s']:.2f} | "
              f"{r['compile_s']:.2f} | {r['run_s']:.2f} | "
              f"{', '.join(f'{v:.6g}' for v in r['means'])} |")
  table.save()


if __name__ == "__main__":
  main()
