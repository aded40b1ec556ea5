"""What ``compiler.CPU_COMPILER_OPTIONS`` (XLA:CPU's older fusion emitters) buy in compile
time and cost in run time, per model and problem size, both variants in one process.

For each row the model's jitted EM fit is compiled with XLA's defaults and with the
options (the two variants ``compiler.jit`` holds), each once, with the compilation cache
off; then each runs 5 more times (best kept). Rows at or below
``compiler.SMALL_PROBLEM_ELEMENTS`` statistics elements are the ones the library compiles
with the options. Sizes are K, D, N_k.

    python benchmarks/compiler_options.py [--markdown out.md]
"""
import argparse
import os
import sys
import time

os.environ.setdefault("DPMM_JAX_COMPILATION_CACHE", "0")   # time compilations, not loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

import tables  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpmm_jax import compiler, em  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpmm_jax import stats as stats_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpmm_jax.models import coupled, diag, full  # pylint: disable=g-import-not-at-top,wrong-import-position

PROBLEMS = (("diag", 8, 3, 20), ("full", 8, 3, 20), ("coupled", 8, 3, 20),
            ("full", 104, 64, 50), ("full", 200, 128, 30), ("full", 200, 256, 30),
            ("diag", 200, 256, 30), ("coupled", 200, 256, 30))


def _time_variant(jitted, stats, kwargs, repeats=5):
  start = time.perf_counter()
  out = jax.block_until_ready(jitted(stats, **kwargs))
  first = time.perf_counter() - start
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(jitted(stats, **kwargs))
    best = min(best, time.perf_counter() - start)
  return first, best, int(out[1].num_iters)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--markdown", default=None, help="also write the table here")
  parser.add_argument("--quick", action="store_true", help="the three K = 8 rows only")
  args = parser.parse_args()
  modules = {"diag": diag, "full": full, "coupled": coupled}
  rng = np.random.default_rng(0)
  lines = ["| model | K | D | N_k | stats elements | options used | first call s (default / options) "
           "| warm fit ms (default / options) | run ratio | EM iterations |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  problems = PROBLEMS[:3] if args.quick else PROBLEMS
  for name, k, d, n in problems:
    module = modules[name]
    y = np.repeat(np.arange(k), n)
    x = (rng.normal(size=(k * n, d)) + 2 * rng.normal(size=(k, d))[y]).astype(np.float32)
    stats = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), k, full=name == "full")
    kwargs = dict(max_iter=100, trace_length=em.trace_length(100))
    if name == "coupled":
      kwargs["options"] = coupled.QuadratureOptions()
    plain = _time_variant(module._fit._plain, stats, kwargs)  # pylint: disable=protected-access
    tuned = _time_variant(module._fit._tuned, stats, kwargs)  # pylint: disable=protected-access
    elements = sum(a.size for a in jax.tree_util.tree_leaves(stats))
    lines.append(f"| {name} | {k} | {d} | {n} | {elements / 1e6:.2f} M | "
                 f"{'yes' if compiler.is_small(stats) else 'no'} | "
                 f"{plain[0]:.2f} / {tuned[0]:.2f} | {plain[1] * 1e3:.1f} / {tuned[1] * 1e3:.1f} | "
                 f"{tuned[1] / plain[1]:.2f}x | {plain[2]} / {tuned[2]} |")
    print(lines[-1], flush=True)
  print()
  tables.emit_table(lines, args.markdown)


if __name__ == "__main__":
  main()
