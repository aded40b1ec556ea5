"""What XLA:CPU's older fusion emitters (``--xla_cpu_use_fusion_emitters=false``) buy
in compile time and cost in run time (issue 14, section 6: measured as a library default
in session 16 and not adopted; benchmarks/RESULTS.md, "XLA:CPU's older fusion emitters").

For each model, fresh processes with the compilation cache off fit and score a K = 100,
D = 64, N_k = 50 problem once with ``XLA_FLAGS=--xla_cpu_use_fusion_emitters=false`` and
once with XLA's default, alternating, ``--repeats`` times (``--xla-flag`` compares
another setting). Each reports the first
``fit_detector`` and ``score`` (wall seconds, and the XLA compile seconds inside them from
jax's ``backend_compile_duration`` event), then the compiled programs' run time (best
of 3 further calls) on that problem and on a larger one (``--big``: K, D, N_k, test
points), where the flag could only cost speed. The table gives the median per setting
and the ratio flag / no flag.

    python benchmarks/compile_flag.py [--repeats 3] [--xla-flag ...] [--markdown out.md]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = ("full", "diag", "coupled")
FLAG = "--xla_cpu_use_fusion_emitters=false"
COLUMNS = ("first_fit", "fit_compile", "first_score", "score_compile", "fit", "score",
           "big_fit", "big_score")


def _problem(num_classes, dim, per_class, num_test, seed=0):
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  y = np.repeat(np.arange(num_classes), per_class).astype(np.int32)
  x = (rng.normal(size=(num_classes * per_class, dim))
       + 0.5 * rng.normal(size=(num_classes, dim))[y]).astype(np.float32)
  return x, y, rng.normal(size=(num_test, dim)).astype(np.float32)


def compile_seconds_counter():
  """A one-element list that from now on sums this process's XLA backend compile
  seconds (jax's ``backend_compile_duration`` event); set [0] = 0.0 to restart it."""
  import jax  # pylint: disable=g-import-not-at-top
  compiled = [0.0]

  def listen(event, duration, **kwargs):
    del kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      compiled[0] += duration
  jax.monitoring.register_event_duration_secs_listener(listen)
  return compiled


def _child(model, big):
  """Runs in a fresh process; prints one JSON line of seconds."""
  import jax  # pylint: disable=g-import-not-at-top
  compiled = compile_seconds_counter()
  import numpy as np  # pylint: disable=g-import-not-at-top
  import dpmm_jax  # pylint: disable=g-import-not-at-top
  out = {"flags": os.environ.get("XLA_FLAGS")}
  x, y, xt = _problem(100, 64, 50, 1000)

  def timed(fn):
    start = time.perf_counter()
    value = jax.block_until_ready(fn())
    return value, time.perf_counter() - start
  det, out["first_fit"] = timed(lambda: dpmm_jax.fit_detector(x, y, model=model))
  out["fit_compile"], compiled[0] = compiled[0], 0.0
  _, out["first_score"] = timed(lambda: dpmm_jax.score(det, xt))
  out["score_compile"] = compiled[0]
  out["fit"] = min(timed(lambda: dpmm_jax.fit_detector(x, y, model=model))[1]
                   for _ in range(3))
  out["score"] = min(timed(lambda: dpmm_jax.score(det, xt))[1] for _ in range(3))
  k, d, n, m = big
  x, y, xt = _problem(k, d, n, m)
  det = dpmm_jax.fit_detector(x, y, model=model)
  np.asarray(dpmm_jax.score(det, xt))
  out["big_fit"] = min(timed(lambda: dpmm_jax.fit_detector(x, y, model=model))[1]
                       for _ in range(3))
  out["big_score"] = min(timed(lambda: dpmm_jax.score(det, xt))[1] for _ in range(3))
  print(json.dumps(out))


def _run_child(model, big, flag_on, flag=FLAG):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["DPMM_JAX_COMPILATION_CACHE"] = "0"
  if flag_on:
    env["XLA_FLAGS"] = flag
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model,
                        "--big", ",".join(map(str, big))], env=env, capture_output=True,
                       text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=3, help="processes per setting")
  parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
  parser.add_argument("--big", default="200,256,100,5000",
                      help="K,D,N_k,test points of the run-time-only problem")
  parser.add_argument("--xla-flag", default=FLAG,
                      help="the XLA_FLAGS setting to compare with XLA's defaults")
  parser.add_argument("--markdown", default=None, help="also write the table here")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  big = tuple(int(v) for v in args.big.split(","))
  if args.child:
    _child(args.child, big)
    return
  import jax  # pylint: disable=g-import-not-at-top
  lines = [f"jax {jax.__version__}, {os.cpu_count()} cores, load before "
           f"{os.getloadavg()[0]:.2f}; medians of {args.repeats} fresh processes per "
           f"setting; big problem K, D, N_k, M = {big}; flag: {args.xla_flag}", "",
           "| model | XLA flag | " + " | ".join(c.replace("_", " ") + " s" for c in COLUMNS)
           + " |", "|---|---|" + "---|" * len(COLUMNS)]
  for model in args.models.split(","):
    runs = {True: [], False: []}
    for rep in range(args.repeats):
      for flag_on in ((True, False) if rep % 2 == 0 else (False, True)):
        runs[flag_on].append(_run_child(model, big, flag_on, args.xla_flag))
        print(f"{model} rep {rep + 1} flag {'on' if flag_on else 'off'}: "
              + " ".join(f"{c}={runs[flag_on][-1][c]:.3f}" for c in COLUMNS), flush=True)
    med = {f: {c: statistics.median(r[c] for r in runs[f]) for c in COLUMNS} for f in runs}
    for flag_on, name in ((False, "off (XLA default)"), (True, "on")):
      lines.append(f"| {model} | {name} | "
                   + " | ".join(f"{med[flag_on][c]:.3f}" for c in COLUMNS) + " |")
    lines.append(f"| {model} | on / off | "
                 + " | ".join(f"{med[True][c] / med[False][c]:.2f}" for c in COLUMNS) + " |")
  lines.append(f"\nload after {os.getloadavg()[0]:.2f}")
  print("\n".join(lines))
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
