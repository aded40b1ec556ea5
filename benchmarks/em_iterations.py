"""EM iterations with and without SQUAREM acceleration, on the problems people fit.

Every fit of the full, diag and coupled models is run twice from the same compiled
program (``accelerate`` is a traced flag, so the second run costs no compilation): plain
EM and accelerated EM, and both are recorded (iterations, convergence, final log marginal
likelihood). Iteration counts do not depend on the machine.

    # the synthetic experiment's problems (experiments.synthetic, --quick grid by default)
    python benchmarks/em_iterations.py [--full_grid] [--json out.json] [--markdown out.md]

    # every EM fit made by some test files, as a pytest plugin (results as JSON lines)
    DPMM_EM_ITERATIONS_LOG=/tmp/em.jsonl python -m pytest -p benchmarks.em_iterations \
        tests/test_api.py -p no:xdist -q
    python benchmarks/em_iterations.py --summarize /tmp/em.jsonl
"""
import argparse
import collections
import functools
import json
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dpmm_jax.models import coupled, diag, full  # pylint: disable=wrong-import-position

MODULES = {"full": full, "diag": diag, "coupled": coupled}
_RECORDS = []


def _summary(info):
  n = int(info.num_iters)
  trace = np.asarray(info.log_marginal_trace, np.float64)
  return dict(iters=n, converged=bool(info.converged), lml=float(trace[n]))


def _wrap(name, fit):
  @functools.wraps(fit)
  def wrapped(stats, **kwargs):
    requested = kwargs.pop("accelerate", True)
    out = {}
    for acc in (False, True):
      out[acc] = fit(stats, accelerate=acc, **kwargs)
    rec = dict(model=name, K=int(stats.num_classes), D=int(stats.dim),
               n_per_class=float(np.mean(np.asarray(stats.count))),
               max_iter=int(kwargs.get("max_iter", 100)), tol=float(kwargs.get("tol", 1e-6)),
               where=os.environ.get("PYTEST_CURRENT_TEST", _CONTEXT[0]).split(" (")[0])
    rec["plain"] = _summary(out[False][1])
    rec["accelerated"] = _summary(out[True][1])
    _RECORDS.append(rec)
    path = os.environ.get("DPMM_EM_ITERATIONS_LOG")
    if path:
      with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return out[bool(requested)]
  return wrapped


_CONTEXT = [""]


def install():
  """Makes full.fit, diag.fit and coupled.fit run and record both variants."""
  for name, module in MODULES.items():
    if not hasattr(module.fit, "__wrapped__"):
      module.fit = _wrap(name, module.fit)


def pytest_configure(config):  # pytest plugin hook (-p benchmarks.em_iterations)
  del config
  install()


def table(records):
  """Markdown: one row per (where, model, K, D, N_k) group of fits."""
  groups = collections.OrderedDict()
  for r in records:
    key = (r["where"], r["model"], r["K"], r["D"], round(r["n_per_class"], 1), r["max_iter"])
    groups.setdefault(key, []).append(r)
  lines = ["| where | model | K | D | N_k | max_iter | fits | plain iters (mean / max) | "
           "plain at max_iter | accelerated iters (mean / max) | accelerated at max_iter | "
           "(L_acc - L_plain) / (tol |L|), min / max |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for (where, model, k, d, nk, max_iter), rs in groups.items():
    p = np.array([r["plain"]["iters"] for r in rs])
    a = np.array([r["accelerated"]["iters"] for r in rs])
    p_cap = sum(not r["plain"]["converged"] for r in rs)
    a_cap = sum(not r["accelerated"]["converged"] for r in rs)
    gaps = [(r["accelerated"]["lml"] - r["plain"]["lml"])
            / (r["tol"] * max(1.0, abs(r["plain"]["lml"]))) for r in rs]
    lines.append(f"| {where} | {model} | {k} | {d} | {nk:g} | {max_iter} | {len(rs)} | "
                 f"{p.mean():.1f} / {p.max()} | {p_cap} | {a.mean():.1f} / {a.max()} | "
                 f"{a_cap} | {min(gaps):+.2g} / {max(gaps):+.2g} |")
  return "\n".join(lines) + "\n"


def synthetic_problems(full_grid=False, num_seeds=None):
  """Runs the hierarchical models of experiments.synthetic on its grid (recorded)."""
  from experiments import synthetic  # pylint: disable=g-import-not-at-top
  install()
  if full_grid:
    nu0, nk, seeds = synthetic.FULL_NU0, synthetic.FULL_NK, synthetic.FULL_NUM_SEEDS
  else:
    nu0, nk, seeds = synthetic.QUICK_NU0, synthetic.QUICK_NK, synthetic.QUICK_NUM_SEEDS
  seeds = num_seeds or seeds
  label = "experiments.synthetic" + ("" if full_grid else " --quick")
  make_dataset = synthetic.synthetic.make_dataset

  def labelled(*args, **kwargs):
    _CONTEXT[0] = f"{label}, nu0 = {kwargs['nu0']:g}"
    return make_dataset(*args, **kwargs)

  synthetic.synthetic.make_dataset = labelled
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    synthetic.run(None, seeds=range(seeds), nu0_values=nu0, nk_values=nk,
                  models=("full", "diag", "coupled"), plot=False)
  synthetic.synthetic.make_dataset = make_dataset
  return list(_RECORDS)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--full_grid", action="store_true",
                      help="the synthetic experiment's full grid (default: --quick grid)")
  parser.add_argument("--num_seeds", type=int, default=None, help="seeds per setting")
  parser.add_argument("--summarize", default=None,
                      help="only print the table of a JSON-lines log from the plugin")
  parser.add_argument("--json", default=None, help="write the records here")
  parser.add_argument("--markdown", default=None, help="write the table here")
  args = parser.parse_args(argv)
  if args.summarize:
    with open(args.summarize) as f:
      text = f.read()
    records = (json.loads(text) if text.lstrip().startswith("[")
               else [json.loads(line) for line in text.splitlines() if line.strip()])
  else:
    records = synthetic_problems(args.full_grid, args.num_seeds)
  text = table(records)
  print(text)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(records, f, indent=1)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(text)
  return records


if __name__ == "__main__":
  main()
