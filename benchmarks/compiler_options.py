"""What ``compiler.CPU_COMPILER_OPTIONS`` (XLA:CPU's older fusion emitters) buy in compile
time and cost in run time, per program and problem size, both variants in one process.

Each row calls one jitted program of the library with XLA's defaults and with the
options (the two variants ``compiler.jit`` holds, or ``jax.jit`` with and without
``compiler_options`` for programs the library keeps on the defaults), with the
compilation cache off: the first call (compilation included), then the best of 5 warm
calls. Programs: the EM fits (K, D, N_k), the scorer of one 2,048-point chunk
(``api._evaluate_chunk``), the in-memory statistics (``stats.from_labels``) and
co-BPM's chain (4 chains, 1,500 steps, n = 300, D = 2). "options used" says whether the
library compiles that call with the options.

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
    plain = _time_call(module._fit._plain, stats, **kwargs)  # pylint: disable=protected-access
    tuned = _time_call(module._fit._tuned, stats, **kwargs)  # pylint: disable=protected-access
    iters = [int(variant(stats, **kwargs)[1].num_iters)
             for variant in (module._fit._plain, module._fit._tuned)]  # pylint: disable=protected-access
    elements = sum(a.size for a in jax.tree_util.tree_leaves(stats))
    lines.append(f"| {name} | {k} | {d} | {n} | {elements / 1e6:.2f} M | "
                 f"{'yes' if compiler.is_small(stats) else 'no'} | "
                 f"{plain[0]:.2f} / {tuned[0]:.2f} | {plain[1] * 1e3:.1f} / {tuned[1] * 1e3:.1f} | "
                 f"{tuned[1] / plain[1]:.2f}x | {iters[0]} / {iters[1]} |")
    print(lines[-1], flush=True)
  if not args.quick:
    lines += _other_programs(rng)
  print()
  tables.emit_table(lines, args.markdown)


def _row(name, size, used, plain, tuned):
  return (f"| {name} | {size} | {'yes' if used else 'no'} | {plain[0]:.2f} / {tuned[0]:.2f} | "
          f"{plain[1] * 1e3:.1f} / {tuned[1] * 1e3:.1f} | {tuned[1] / plain[1]:.2f}x |")


def _time_call(fn, *args, repeats=5, **kwargs):
  start = time.perf_counter()
  jax.block_until_ready(fn(*args, **kwargs))
  first = time.perf_counter() - start
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args, **kwargs))
    best = min(best, time.perf_counter() - start)
  return first, best


def _other_programs(rng):
  """Scorer, statistics and chain rows (a second table)."""
  import dpmm_jax  # pylint: disable=g-import-not-at-top
  from dpmm_jax import api, divergence  # pylint: disable=g-import-not-at-top
  lines = ["", "| program | size | options used | first call s (default / options) | "
           "warm call ms (default / options) | run ratio |", "|---|---|---|---|---|---|"]
  for model, k, d, n in (("coupled", 100, 64, 20), ("diag", 100, 64, 20), ("full", 100, 64, 80)):
    y = np.repeat(np.arange(k), n)
    x = (rng.normal(size=(k * n, d)) + 2 * rng.normal(size=(k, d))[y]).astype(np.float32)
    det = dpmm_jax.fit_detector(x, y, model)
    chunk = jnp.asarray(rng.normal(size=(2048, d)).astype(np.float32))
    inverse = api._inverse_for_all_chunks(det)  # pylint: disable=protected-access
    evaluate = api._evaluate_chunk  # pylint: disable=protected-access
    used = compiler.is_small((det, chunk, inverse)) and model != "coupled"
    lines.append(_row(f"score, {model}", f"K {k}, D {d}, 2,048 points", used,
                      _time_call(evaluate._plain, det, chunk, inverse),  # pylint: disable=protected-access
                      _time_call(evaluate._tuned, det, chunk, inverse)))  # pylint: disable=protected-access
    print(lines[-1], flush=True)
  for n, d, k in ((20000, 128, 100), (32768, 64, 100)):
    x = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, k, n))
    fl = stats_lib.from_labels
    lines.append(_row("stats.from_labels (full)", f"N {n}, D {d}, K {k}",
                      compiler.is_small((x, y)), _time_call(fl._plain, x, y, k, True),  # pylint: disable=protected-access
                      _time_call(fl._tuned, x, y, k, True)))  # pylint: disable=protected-access
    print(lines[-1], flush=True)
  u = rng.beta(2, 5, size=(300, 2)).astype(np.float32)
  v = rng.beta(5, 2, size=(300, 2)).astype(np.float32)
  size = divergence.padded_size(300)
  pad = lambda a: jnp.asarray(np.concatenate([a, np.zeros((size - len(a), 2), np.float32)]))
  valid = jnp.asarray(np.arange(size) < 300)
  config = divergence.Config(max_regions=64, num_burnin=1000, num_samples=500)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  chain = divergence.run_chain      # a plain function: jitted whole here, config static
  variants = [jax.vmap(jax.jit(chain, static_argnames="config", **kw),
                       in_axes=(0,) + (None,) * 8)
              for kw in ({}, {"compiler_options": compiler.CPU_COMPILER_OPTIONS})]
  args = (keys, pad(u), pad(v), valid, valid, 0.5, 3.0, 2.0, config)
  lines.append(_row("divergence.run_chain", "4 chains x 1,500 steps, n 300, D 2", False,
                    _time_call(variants[0], *args, repeats=2),
                    _time_call(variants[1], *args, repeats=2)))
  print(lines[-1], flush=True)
  return lines


if __name__ == "__main__":
  main()
