"""Warm EM fits with and without padding the classes (issue 14, sections 4 and 6: one
compiled fit for nearby class counts).

``models.*.fit`` pads the statistics with empty classes to ``em.padded_num_classes(K)``
so that nearby K share one compiled fit. For each shape and model this script fits the
same statistics padded and unpadded (``em.PADDED_STATS_MAX_ELEMENTS`` set to 0 for the
latter), alternating, ``--repeats`` times, in one process after one warm-up call each;
the table gives the best times, their ratio, the EM iterations of both, and how far apart
their log marginal likelihood traces and hyperparameters end (float32 sums over K and
over the padded K round differently; along EM's flat directions, nu0 above all, a
round-off difference in L moves the end point by much more).

    python benchmarks/class_padding.py [--repeats 5] [--markdown out.md]
"""
import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tables  # pylint: disable=g-import-not-at-top

from dpmm_jax import em  # pylint: disable=g-import-not-at-top
from dpmm_jax import stats as stats_lib
from dpmm_jax.models import coupled, diag, full

# (K, D, points per class, models)
SHAPES = ((1000, 768, 20, (diag, coupled)), (100, 64, 50, (diag, coupled, full)),
          (17, 16, 30, (diag, coupled, full)))


def _statistics(num_classes, dim, per_class, with_scatter, seed=0):
  """Classes with different means and scales."""
  rng = np.random.default_rng(seed)
  y = np.repeat(np.arange(num_classes), per_class)
  scale = rng.uniform(0.5, 2.0, size=(num_classes, 1))
  x = rng.normal(size=(y.size, dim)) * scale[y] + rng.normal(size=(num_classes, dim))[y]
  return stats_lib.from_arrays(x.astype(np.float32), y, num_classes, full=with_scatter)


def _timed_fit(module, stats, padded, limit):
  em.PADDED_STATS_MAX_ELEMENTS = limit if padded else 0
  t0 = time.perf_counter()
  params, info = jax.block_until_ready(module.fit(stats))
  return time.perf_counter() - t0, params, info


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5, help="alternating timed fits per way")
  parser.add_argument("--markdown", default=None, help="also write the table here")
  args = parser.parse_args()
  limit = em.PADDED_STATS_MAX_ELEMENTS
  lines = ["| model | K | padded to | D | padded ms | unpadded ms | ratio | EM iterations "
           "padded / unpadded | max rel. difference of L along the trace | max rel. "
           "difference of a hyperparameter |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  try:
    for k, d, per_class, modules in SHAPES:
      stats = _statistics(k, d, per_class, full in modules)
      for module in modules:
        per_class_elements = 1 + 2 * d + (d * d if module is full else 0)
        em.PADDED_STATS_MAX_ELEMENTS = limit
        padded_k = em.padded_num_classes(k, per_class_elements)
        times = {True: [], False: []}
        results = {}
        for padded in (True, False):                     # warm-up (compiles)
          _, params, info = _timed_fit(module, stats, padded, limit)
          results[padded] = (params.hyper, info)
        for _ in range(args.repeats):
          for padded in (True, False):
            times[padded].append(_timed_fit(module, stats, padded, limit)[0])
        (hyper_p, info_p), (hyper_u, info_u) = results[True], results[False]
        iters = f"{int(info_p.num_iters)} / {int(info_u.num_iters)}"
        n = min(int(info_p.num_iters), int(info_u.num_iters)) + 1
        trace_p, trace_u = (np.asarray(i.log_marginal_trace[:n], np.float64)
                            for i in (info_p, info_u))
        trace_diff = np.max(np.abs(trace_p - trace_u) / np.abs(trace_u))
        hyper_diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - b)
                                      / np.maximum(np.abs(np.asarray(b, np.float64)), 1e-30)))
                         for a, b in zip(hyper_p, hyper_u))
        tp, tu = min(times[True]), min(times[False])
        name = module.__name__.rsplit(".", 1)[-1]
        lines.append(f"| {name} | {k} | {padded_k} | {d} | {1e3 * tp:.1f} | {1e3 * tu:.1f} | "
                     f"{tp / tu:.2f} | {iters} | {trace_diff:.1e} | {hyper_diff:.1e} |")
        print(lines[-1], flush=True)
  finally:
    em.PADDED_STATS_MAX_ELEMENTS = limit
  tables.emit_table(lines, args.markdown)


if __name__ == "__main__":
  main()
