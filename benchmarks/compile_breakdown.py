"""Where the EM fits' and the coupled scorer's compile time goes (issue 14, sections 4 and 6).

Each row compiles one program in a fresh process with the persistent compilation cache
off (``DPMM_JAX_COMPILATION_CACHE=0``) and reports lowering and XLA compile seconds and
the optimised HLO's line count. Variants leave out one part of the program, by swapping
a library function for a reduced one in that process only, to price the part:

* ``fit_hyper``: EM alone (``em.run``), without the predictive parameters;
* ``no boundary``: ``em.run`` without the boundary (cap) proposal (``caps``; until
  session 15 its candidate EM steps were a second, vmapped copy of the step in the
  compiled loop, now the loop's own step probes them);
* ``no SQUAREM``, ``neither``: without the extrapolation, without both;
* ``step``, ``log marginal``, ``params``: one EM step, the log marginal likelihood terms,
  ``params_from_hyper`` alone;
* coupled ``log_predictive`` (since session 17 the prior is scored by the classes'
  compiled branches, as pseudo-classes; the variants that priced a separate prior block
  until then are gone).

Programs compile with the library's small-problem options (``compiler.CPU_COMPILER_OPTIONS``,
what ``fit_detector`` uses for them) unless ``--xla-defaults`` is given.

    python benchmarks/compile_breakdown.py [--classes 3] [--dim 4] [--xla-defaults]
        [--markdown out.md]
"""
import argparse
import json
import os
import subprocess
import sys
import time

FIT_VARIANTS = ("fit_hyper", "no boundary", "no SQUAREM", "neither", "step", "log marginal",
                "params")
SCORE_VARIANTS = ("log_predictive",)


def _child(model: str, variant: str, num_classes: int, dim: int, options: bool) -> dict:
  """Compiles one program in this process (with the library's compile options if
  ``options`` and this jaxlib takes them); returns its timings."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  from dpmm_jax import compiler
  from dpmm_jax import em
  from dpmm_jax import stats as stats_lib
  from dpmm_jax.models import coupled, diag, full

  compiler_options = compiler.options() if options else None
  module = {"diag": diag, "coupled": coupled, "full": full}[model]
  rng = np.random.default_rng(0)
  y = np.repeat(np.arange(num_classes), 20).astype(np.int32)
  x = (rng.normal(size=(len(y), dim)) + y[:, None]).astype(np.float32)
  stats = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), num_classes,
                                full=model == "full")
  run = em.run
  leave_out = {"no boundary": ("caps",), "no SQUAREM": ("extrapolate",),
               "neither": ("caps", "extrapolate")}.get(variant, ())

  def reduced_run(*args, **kwargs):
    for name in leave_out:
      kwargs[name] = None
    return run(*args, **kwargs)

  em.run = reduced_run
  hyper = module.init_hyper(stats)
  args = (stats,)
  if variant in ("fit_hyper", "no boundary", "no SQUAREM", "neither"):
    fn = lambda s: module.fit_hyper(s)
  elif variant == "step":
    fn = lambda s: module.em_step(hyper, s)
  elif variant == "log marginal":
    if model == "full":
      return {}
    fn = lambda s: module.log_marginal_terms(hyper, s)
  elif variant == "params":
    fn = lambda s: module.params_from_hyper(hyper, s)
  else:   # the coupled scorer
    params, _ = coupled.fit(stats)
    test_x = jnp.asarray(3.0 * rng.normal(size=(64, dim)).astype(np.float32))
    fn = coupled.log_predictive     # the fitted parameters are an argument, as in the API
    args = (params, test_x)
  t0 = time.perf_counter()
  lowered = jax.jit(fn, compiler_options=compiler_options).lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return {"lower_s": t1 - t0, "compile_s": t2 - t1,
          "hlo_lines": len(compiled.as_text().splitlines())}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--classes", type=int, default=3, help="K")
  parser.add_argument("--dim", type=int, default=4, help="D")
  parser.add_argument("--models", default="diag,coupled,full", help="comma-separated")
  parser.add_argument("--markdown", default=None, help="also write the table here")
  parser.add_argument("--xla-defaults", action="store_true",
                      help="compile with XLA's defaults, not the library's small-problem "
                           "options")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    model, variant = args.child.split(":", 1)
    print(json.dumps(_child(model, variant, args.classes, args.dim, not args.xla_defaults)))
    return 0
  env = dict(os.environ, DPMM_JAX_COMPILATION_CACHE="0")
  jobs = [(m, v) for m in args.models.split(",") for v in FIT_VARIANTS]
  if "coupled" in args.models.split(","):
    jobs += [("coupled", v) for v in SCORE_VARIANTS]
  lines = [f"Compile time by part, K = {args.classes}, D = {args.dim}, float32, one fresh "
           "process per row, persistent cache off, "
           + ("XLA's defaults." if args.xla_defaults else "the library's compile options."), "",
           "| model | program | lower s | XLA compile s | optimised HLO lines |",
           "|---|---|---|---|---|"]
  for model, variant in jobs:
    out = subprocess.run([sys.executable, __file__, "--classes", str(args.classes), "--dim",
                          str(args.dim), "--child", f"{model}:{variant}"]
                         + (["--xla-defaults"] if args.xla_defaults else []),
                         env=env, capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    if not row:
      continue
    line = (f"| {model} | {variant} | {row['lower_s']:.2f} | {row['compile_s']:.2f} | "
            f"{row['hlo_lines']} |")
    print(line, flush=True)
    lines.append(line)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write("\n".join(lines) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
