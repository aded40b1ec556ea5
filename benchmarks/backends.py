"""Float32 results on an accelerator against the CPU, and the accelerator's matmul peaks.

    python benchmarks/backends.py --markdown out.md      # on a machine with a GPU/TPU
    python benchmarks/backends.py --classes 6 --dim 8    # CPU only: exercises the path

One process, both backends (jax always has its CPU backend next to an accelerator). For
each model on one synthetic problem (``run.Generator``: K classes in D dimensions, half
of the test points from unseen classes):

* **same detector**: fitted on the CPU, scored on the CPU and, moved to the accelerator,
  scored there. Differences are round-off of the scoring kernels alone;
* **fitted on each**: fitted and scored on each backend. Adds the round-off of the
  statistics and of EM, whose stopping rule (relative tolerance 1e-6 on the marginal
  likelihood) leaves the hyperparameters free within a flat optimum;
* **TF32 (what the library prevents)**: the same detector scored on the accelerator at the
  backend's default matmul precision (``precision.MATMUL_PRECISION = "default"``), i.e.
  TensorFloat-32 on NVIDIA GPUs from Ampere on.

Documented tolerances (BUILD.md, "Accelerators"), with s the float32 OOD scores and
``scale = max |s|`` over the test points:
* same detector: ``max |s_acc - s_cpu| <= 1e-5 scale`` (about 100 float32 ulps of the
  scale) and the same predicted class for every point;
* fitted on each: ``max |s_acc - s_cpu| <= 1e-3 scale``, AUROC within 1e-3, the same
  predicted class for at least 99.9 % of the points.
The script prints each measured difference next to its bound and exits with status 1 if
one is exceeded.

Also measured: the accelerator's float32 matmul rate at Precision.HIGHEST (what the
library uses) and at the default precision, square GEMMs of side 8192 (2048 on CPU).
"""
import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as scale_bench  # pylint: disable=g-import-not-at-top,wrong-import-position

import dpmm_jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpmm_jax import metrics  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpmm_jax import precision  # pylint: disable=g-import-not-at-top,wrong-import-position

MODELS = ("tied", "diag", "coupled", "full", "lowrank", "rmds", "mds")
SAME_DETECTOR_RTOL = 1e-5
SEPARATE_FIT_RTOL = 1e-3
AUROC_ATOL = 1e-3
SEPARATE_FIT_CLASS_AGREEMENT = 0.999


def _on(device, fn, *args, **kwargs):
  with jax.default_device(device):
    return jax.block_until_ready(fn(*args, **kwargs))


def _fit(device, x, y, model):
  return _on(device, dpmm_jax.fit_detector, x, y, model)


def _evaluate(device, det, x):
  det = jax.device_put(det, device)
  scores = np.asarray(_on(device, dpmm_jax.score, det, x))
  classes = np.asarray(_on(device, dpmm_jax.predict, det, x))
  return scores, classes


def _hyper_rel_diffs(a, b):
  """{field: max |a - b| / max |b|} over the EM hyperparameters of two fits (the
  parameters' ``hyper`` field; empty for models without EM). Relative to the field's
  largest entry: a location near 0 gives no meaningless huge ratio. (The H200 run-2
  files in docs/results divided entry by entry, hence their loc ratios of 60-90.)"""
  ha, hb = getattr(a, "hyper", None), getattr(b, "hyper", None)
  if ha is None or not hasattr(ha, "_fields"):
    return {}
  out = {}
  for name in ha._fields:
    u = np.asarray(getattr(ha, name), np.float64)
    v = np.asarray(getattr(hb, name), np.float64)
    if u.dtype.kind == "f" and u.size:
      out[name] = float(np.max(np.abs(u - v)) / max(float(np.max(np.abs(v))), 1e-30))
  return out


def _hyper_summary(params):
  """{field: value, or (min, median, max) of an array} of the fitted hyperparameters."""
  hyper = getattr(params, "hyper", None)
  if hyper is None or not hasattr(hyper, "_fields"):
    return {}
  out = {}
  for name in hyper._fields:
    v = np.asarray(getattr(hyper, name), np.float64)
    if v.dtype.kind == "f" and v.size == 1:
      out[name] = float(v)
    elif v.dtype.kind == "f" and v.ndim == 1:
      out[name] = [float(np.min(v)), float(np.median(v)), float(np.max(v))]
  return out


def compare_model(model, x, y, x_test, num_in, cpu, acc, log):
  row = {"model": model}
  det_cpu = _fit(cpu, x, y, model)
  s_cpu, c_cpu = _evaluate(cpu, det_cpu, x_test)
  scale = float(np.max(np.abs(s_cpu)))
  row["scale"] = scale
  row["auroc_cpu"] = metrics.auroc(s_cpu[:num_in], s_cpu[num_in:])

  s_same, c_same = _evaluate(acc, det_cpu, x_test)
  row["same_max_abs"] = float(np.max(np.abs(s_same - s_cpu)))
  row["same_rel"] = row["same_max_abs"] / scale
  row["same_class_agree"] = float(np.mean(c_same == c_cpu))

  t0 = time.perf_counter()
  det_acc = _fit(acc, x, y, model)
  row["fit_acc_s"] = time.perf_counter() - t0
  s_sep, c_sep = _evaluate(acc, det_acc, x_test)
  row["sep_max_abs"] = float(np.max(np.abs(s_sep - s_cpu)))
  row["sep_rel"] = row["sep_max_abs"] / scale
  row["sep_class_agree"] = float(np.mean(c_sep == c_cpu))
  diffs = _hyper_rel_diffs(det_acc.params, det_cpu.params)
  row["sep_param_rel"] = max(diffs.values()) if diffs else 0.0
  row["hyper_rel_diffs"] = diffs
  row["hyper_cpu"] = _hyper_summary(det_cpu.params)
  row["hyper_acc"] = _hyper_summary(det_acc.params)
  row["auroc_acc"] = metrics.auroc(s_sep[:num_in], s_sep[num_in:])

  saved = precision.MATMUL_PRECISION
  try:
    precision.MATMUL_PRECISION = "default"
    jax.clear_caches()               # the precision is fixed when a program is traced
    s_fast, c_fast = _evaluate(acc, det_cpu, x_test)
  finally:
    precision.MATMUL_PRECISION = saved
    jax.clear_caches()
  row["default_rel"] = float(np.max(np.abs(s_fast - s_cpu))) / scale
  row["default_class_agree"] = float(np.mean(c_fast == c_cpu))
  row["default_auroc"] = metrics.auroc(s_fast[:num_in], s_fast[num_in:])

  row["ok"] = bool(row["same_rel"] <= SAME_DETECTOR_RTOL and row["same_class_agree"] == 1.0
                   and row["sep_rel"] <= SEPARATE_FIT_RTOL
                   and abs(row["auroc_acc"] - row["auroc_cpu"]) <= AUROC_ATOL
                   and row["sep_class_agree"] >= SEPARATE_FIT_CLASS_AGREEMENT)
  log(f"  {model}: same detector {row['same_rel']:.2e} of scale {scale:.3g} "
      f"(bound {SAME_DETECTOR_RTOL:g}), classes {row['same_class_agree']:.4f}; fitted on "
      f"each {row['sep_rel']:.2e} (bound {SEPARATE_FIT_RTOL:g}), "
      f"hyperparameters {row['sep_param_rel']:.1e}, classes {row['sep_class_agree']:.4f}, AUROC "
      f"{row['auroc_cpu']:.4f}/{row['auroc_acc']:.4f}; default precision "
      f"{row['default_rel']:.2e}, classes {row['default_class_agree']:.4f} -> "
      f"{'ok' if row['ok'] else 'OUT OF TOLERANCE'}")
  if diffs:
    log(f"    hyperparameters cpu {row['hyper_cpu']}\n    accelerator {row['hyper_acc']}\n"
        f"    relative differences {diffs}")
  return row


def markdown(info, rates, problem, rows):
  k, d, n_k, m = problem
  lines = [f"Machine: {json.dumps(info)}", ""]
  if rates:
    lines += ["| device | matmul n | Precision.HIGHEST GFLOP/s | default precision GFLOP/s |",
              "|---|---|---|---|"]
    lines += [f"| {r['device']} | {r['n']} | {r['highest']:.0f} | {r['default']:.0f} |"
              for r in rates]
    lines.append("")
  lines += [f"Problem: K = {k}, D = {d}, N_k = {n_k}, M = {m} test points (half unseen "
            "classes). Differences as max |s_acc - s_cpu| / max |s_cpu|; classes = share "
            "of points with the same predicted class.", "",
            "| model | scale | same detector | classes | fitted on each | hyperparameters (rel.) "
            "| classes | AUROC cpu / acc | default precision | classes | AUROC | within "
            "tolerance |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['model']} | {r['scale']:.3g} | {r['same_rel']:.1e} | "
        f"{r['same_class_agree']:.4f} | {r['sep_rel']:.1e} | {r['sep_param_rel']:.1e} | "
        f"{r['sep_class_agree']:.4f} | {r['auroc_cpu']:.4f} / {r['auroc_acc']:.4f} | "
        f"{r['default_rel']:.1e} | {r['default_class_agree']:.4f} | "
        f"{r['default_auroc']:.4f} | {'yes' if r['ok'] else 'NO'} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--classes", type=int, default=100, help="K")
  parser.add_argument("--dim", type=int, default=128, help="D")
  parser.add_argument("--per-class", type=int, default=100, help="training points per class")
  parser.add_argument("--test", type=int, default=4000, help="test points (half OOD)")
  parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models")
  parser.add_argument("--matmul-side", type=int, default=0,
                      help="side of the GEMMs that measure the matmul rates (0: 2048 on "
                      "CPU, 8192 on an accelerator)")
  parser.add_argument("--markdown", default=None, help="also write the tables here")
  parser.add_argument("--json", default=None, help="also write the rows here")
  args = parser.parse_args(argv)

  def log(msg):
    print(msg, flush=True)

  cpu = jax.devices("cpu")[0]
  acc = jax.devices()[0]
  info = {"jax": jax.__version__, "backend": jax.default_backend(),
          "accelerator": str(getattr(acc, "device_kind", acc)), "cpu": str(cpu)}
  log("machine: " + json.dumps(info))
  if acc.platform == "cpu":
    log("no accelerator: comparing the CPU with itself (exercises the code path only)")
  rates = []
  for device in ([acc] if acc.platform == "cpu" else [acc, cpu]):
    n = args.matmul_side or (2048 if device.platform == "cpu" else 8192)
    rates.append({"device": str(getattr(device, "device_kind", device)), "n": n,
                  "highest": scale_bench.matmul_rate(n, jax.lax.Precision.HIGHEST, device,
                                                     reps=10),
                  "default": scale_bench.matmul_rate(n, jax.lax.Precision.DEFAULT, device,
                                                     reps=10)})
    log(f"matmul {rates[-1]}")

  gen = scale_bench.Generator(args.classes, args.dim)
  rng = np.random.default_rng(1)
  y = np.repeat(np.arange(args.classes), args.per_class).astype(np.int32)
  x = gen.sample(rng, y)
  x_test, num_in = gen.test_set(args.test)
  rows = []
  for model in args.models.split(","):
    rows.append(compare_model(model, x, y, x_test, num_in, cpu, acc, log))
  text = markdown(info, rates, (args.classes, args.dim, args.per_class, args.test), rows)
  print(text)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(text)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"info": info, "rates": rates, "rows": rows}, f, indent=1)
  return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
