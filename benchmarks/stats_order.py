"""The per-class statistics update with its two ways of ordering rows by class (issue 14,
section 2: statistics at small D).

``stats._update`` sorts each chunk's rows by class before its windowed per-class
products. ``stats.stable_key_order`` sorts one packed uint32 key (``class * n + row``);
the alternative is ``jnp.argsort(key, stable=True)``, which sorts (key, row) pairs. For
each shape both jitted updates run on the same chunk, alternating, ``--repeats`` times,
in one process; the table gives the medians, their ratio, the update's GFLOP/s
(2 N D^2 flops) and, for scale, X^T X of the chunk and the square-GEMM peak measured in
the same run. Both updates must give identical statistics (checked).

    python benchmarks/stats_order.py [--repeats 9] [--markdown out.md]
"""
import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as scale_benchmark  # pylint: disable=g-import-not-at-top
import tables  # pylint: disable=g-import-not-at-top

from dpmm_jax import stats as stats_lib  # pylint: disable=g-import-not-at-top

SHAPES = ((10, 20_000, 64), (100, 65_536, 64), (100, 100_000, 128), (1000, 65_536, 128),
          (1000, 65_536, 256), (1000, 65_536, 768))


def _compiled_update(order_fn, stats, x, y):
  """The update compiled for these arguments with ``order_fn`` as the class order."""
  original = stats_lib.stable_key_order
  stats_lib.stable_key_order = order_fn
  try:
    update = lambda s, a, b: stats_lib._update(s, a, b, 128)  # pylint: disable=protected-access
    return jax.jit(update).lower(stats, x, y).compile()
  finally:
    stats_lib.stable_key_order = original


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=9, help="alternating timed calls per way")
  parser.add_argument("--markdown", default=None, help="also write the table here")
  args = parser.parse_args()
  peak = scale_benchmark.matmul_peak()
  lines = [f"Measured float32 matmul peak: {peak:.1f} GFLOP/s", "",
           "| K | rows | D | argsort ms | packed sort ms | ratio | packed GFLOP/s | "
           "% peak | X^T X GFLOP/s | identical |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for k, n, d in SHAPES:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32) + 3.0)
    y = jnp.asarray(rng.integers(0, k, n).astype(np.int32))
    start = stats_lib.update(stats_lib.empty(k, d), 0.5 * x[::-1], y)   # Welford path
    argsort_update = _compiled_update(lambda key, _: jnp.argsort(key, stable=True),
                                      start, x, y)
    packed_update = _compiled_update(stats_lib.stable_key_order, start, x, y)
    a, b = argsort_update(start, x, y), packed_update(start, x, y)
    identical = all(bool(jnp.array_equal(u, v)) for u, v in zip(a, b) if u is not None)
    times = {"argsort": [], "packed": []}
    for _ in range(args.repeats):
      for name, fn in (("argsort", argsort_update), ("packed", packed_update)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(start, x, y))
        times[name].append(time.perf_counter() - t0)
    ta, tb = (statistics.median(times[m]) for m in ("argsort", "packed"))
    gflops = 2.0 * n * d * d / tb / 1e9
    gram = scale_benchmark.gram_throughput(n, d)
    lines.append(f"| {k} | {n} | {d} | {1e3 * ta:.1f} | {1e3 * tb:.1f} | {ta / tb:.2f} | "
                 f"{gflops:.0f} | {100 * gflops / peak:.0f} | {gram:.0f} | {identical} |")
    print(lines[-1], flush=True)
  tables.emit_table(lines, args.markdown)


if __name__ == "__main__":
  main()
