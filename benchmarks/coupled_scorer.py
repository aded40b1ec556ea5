"""The coupled model's scorer as users call it: compile time of the first ``score`` and the
warm scoring time, at several shapes (issue 14, section 6; benchmarks/RESULTS.md, "The
coupled prior scored by the class branches").

Each shape runs in a fresh process with the compilation cache off: ``fit_detector``
(coupled model, default preprocessing) on K classes of N_k points in D dimensions, then
the first ``score`` of M points (wall seconds and the XLA compile seconds inside it,
from jax's ``backend_compile_duration`` event), then the median of 5 further ``score``
calls, for test points drawn from the training rows ("in") and from a wide Gaussian
("out", 3x the class spread). It measures the checkout it is run from; compare two trees
by running it once from each, alternating ``--repeats`` times.

    python benchmarks/coupled_scorer.py [--shapes 3,4,20,2048;100,64,20,2048] [--markdown out.md]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_flag  # pylint: disable=g-import-not-at-top,wrong-import-position

DEFAULT_SHAPES = "3,4,20,2048;10,512,50,2048;100,64,20,2048;200,256,10,2048"


def _child(num_classes, dim, per_class, num_test):
  """Runs in a fresh process; prints one JSON line of seconds."""
  compiled = compile_flag.compile_seconds_counter()
  import numpy as np  # pylint: disable=g-import-not-at-top
  import dpmm_jax  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  y = np.repeat(np.arange(num_classes), per_class).astype(np.int32)
  scale = np.exp(0.3 * rng.normal(size=num_classes))[y, None]
  x = (rng.normal(size=(len(y), dim)) * scale
       + 2.0 * rng.normal(size=(num_classes, dim))[y]).astype(np.float32)
  near = x[rng.integers(0, len(x), num_test)]
  far = (near + 3.0 * rng.normal(size=near.shape)).astype(np.float32)
  det = dpmm_jax.fit_detector(x, y, model="coupled")
  compiled[0] = 0.0
  start = time.perf_counter()
  dpmm_jax.score(det, near)
  out = {"first_score": time.perf_counter() - start, "score_compile": compiled[0]}
  for name, points in (("in", near), ("out", far)):
    times = []
    for _ in range(5):
      start = time.perf_counter()
      dpmm_jax.score(det, points)
      times.append(time.perf_counter() - start)
    out[name] = statistics.median(times)
  print(json.dumps(out))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                      help="';'-separated K,D,N_k,M shapes")
  parser.add_argument("--repeats", type=int, default=1, help="processes per shape")
  parser.add_argument("--markdown", help="also write the table to this file")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    _child(*(int(v) for v in args.child.split(",")))
    return
  env = dict(os.environ, DPMM_JAX_COMPILATION_CACHE="0")
  lines = ["| K | D | N_k | M | first score s | its compile s | warm score, in s | "
           "warm score, out s |", "|---|---|---|---|---|---|---|---|"]
  print(lines[0], flush=True)
  for shape in args.shapes.split(";"):
    runs = []
    for _ in range(args.repeats):
      done = subprocess.run([sys.executable, __file__, "--child", shape], env=env,
                            capture_output=True, text=True, check=True)
      runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    line = ("| " + " | ".join(shape.split(",")) + f" | {med['first_score']:.2f} | "
            f"{med['score_compile']:.2f} | {med['in']:.3f} | {med['out']:.3f} |")
    lines.append(line)
    print(line, flush=True)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
