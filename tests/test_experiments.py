"""Smoke tests of the experiment binaries at tiny sizes: each run(...) computes, saves its
results, draws its figures from the saved files, and --plot_only redraws them."""
import json
import math
import os

from absl import flags
import numpy as np
import pytest

from dpmm_jax import feature_files
from experiments import (benchmark, common, covariance_analysis, demo, dim_sweep, highdim,
                         synthetic)

FEW_MODELS = ("rmds", "indep_rmds", "tied", "diag")


@pytest.fixture(scope="module", autouse=True)
def _parse_flags():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["test"])


def _png_ok(path):
  assert os.path.getsize(path) > 5000, path
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _check_and_remove_figures(out, names):
  """``_png_ok`` each figure, then delete it (a later redraw must write it again)."""
  for name in names:
    _png_ok(os.path.join(out, name))
    os.remove(os.path.join(out, name))


def test_demo_table():
  res = demo.run(seeds=(0,), models=("rmds", "tied"), num_classes=3,
                 num_train_per_class=6, num_test_per_class=4)
  assert "| RMDS |" in res["table"] and "| DPMM tied |" in res["table"]
  for m in ("rmds", "tied"):
    auroc, _ = res["summary"][m]["auroc"]
    # The summary is the mean of the per-seed AUROCs (one seed here), and the table
    # shows it.
    assert auroc == pytest.approx(res["per_seed"][0][m]["ood"]["ood"]["auroc"]), m
    assert common.fmt_mean_se(*res["summary"][m]["auroc"]) in res["table"], m


def test_synthetic_smoke(tmp_path):
  out = str(tmp_path)
  res = synthetic.run(out, seeds=(0, 1), nu0_values=(4.0, 64.0), nk_values=(5,),
                      models=FEW_MODELS, num_classes=3, num_test_per_class=5)
  # 2 seeds x 3 settings x 4 models, no failures, valid metrics.
  assert len(res["records"]) == 24
  assert not [r for r in res["records"] if r["error"]]
  # The summary rows are the means over seeds of the records, and the paired differences
  # to RMDS are the means of the per-seed differences (recomputed here from the records).
  runs = {(r["sweep"], r["nu0"], r["nk"], r["model"], r["seed"]): r for r in res["records"]}
  for row in res["summary"]:
    key = (row["sweep"], row["nu0"], row["nk"])
    mine = [runs[key + (row["model"], s)] for s in (0, 1)]
    ref = [runs[key + ("rmds", s)] for s in (0, 1)]
    assert row["auroc_mean"] == pytest.approx(np.mean([r["auroc"] for r in mine]))
    assert row["dauroc_vs_rmds_mean"] == pytest.approx(
        np.mean([a["auroc"] - b["auroc"] for a, b in zip(mine, ref)]), abs=1e-12)
  for name in ("synthetic.json", "synthetic_runs.csv", "synthetic_summary.csv",
               "synthetic_summary.md", "synthetic_examples.npz"):
    assert os.path.exists(os.path.join(out, name)), name
  figs = ["synthetic_examples.png", "synthetic_scatter.png", "synthetic_nu0.png",
          "synthetic_nk.png"]
  _check_and_remove_figures(out, figs)
  # Figures redraw from the saved results alone.
  paths = synthetic.plot_results(out)
  assert sorted(os.path.basename(p) for p in paths) == sorted(figs)
  saved = json.load(open(os.path.join(out, "synthetic.json")))
  assert len(saved["records"]) == 24 and saved["config"]["nu0_values"] == [4.0, 64.0]


def test_synthetic_summary_statistics():
  recs = [dict(sweep="nu0", nu0=4.0, nk=20, seed=s, model=m, auroc=a, fpr95=0.5,
               accuracy=0.9) for s, (a_r, a_t) in enumerate([(0.8, 0.9), (0.7, 0.75)])
          for m, a in (("rmds", a_r), ("tied", a_t))]
  rows = {r["model"]: r for r in synthetic.summarize(recs, ["rmds", "tied"])}
  assert rows["tied"]["auroc_mean"] == pytest.approx(0.825)
  assert rows["tied"]["auroc_se"] == pytest.approx(np.std([0.9, 0.75], ddof=1) / np.sqrt(2))
  assert rows["tied"]["dauroc_vs_rmds_mean"] == pytest.approx(0.075)
  assert math.isnan(rows["tied"]["dauroc_vs_indep_rmds_mean"])


def test_synthetic_rejects_bad_nu0():
  with pytest.raises(ValueError, match="nu0 must be > D \\+ 1"):
    synthetic.run(None, seeds=(0,), nu0_values=(3.0,), nk_values=(), models=("rmds",))


def _write_feature_files(tmp_path, npy_pair_train=False):
  p = highdim.make_problem(__import__("jax").random.PRNGKey(0), num_classes=4, dim=6,
                           num_train_per_class=15, num_test_per_class=5, num_ood_classes=3)
  if npy_pair_train:
    train = feature_files.save_npy_pair(str(tmp_path / "train"), p.x_train, p.y_train)
  else:
    train = feature_files.save_npz(str(tmp_path / "train"), p.x_train, p.y_train)
  test = feature_files.save_npz(str(tmp_path / "test"), p.x_test, p.y_test)
  near = feature_files.save_npz(str(tmp_path / "near"), p.x_near)          # no labels
  far = feature_files.save_npz(str(tmp_path / "far"), p.x_far,
                               -np.ones(len(p.x_far), np.int32))          # labels -1
  return train, test, near, far


def test_benchmark_smoke(tmp_path):
  train, test, near, far = _write_feature_files(tmp_path, npy_pair_train=True)
  out = str(tmp_path / "out")
  res = benchmark.run(out, train, test, {"nearset": near}, {"farset": far, "far2": far},
                      models=("rmds", "diag", "msp"), title="tiny")
  for m, r in res["results"].items():
    assert r["error"] is None, (m, r["error"])
    assert 0 <= r["accuracy"] <= 1 and r["fit_s"] >= 0 and r["score_s"] >= 0
    assert r["near_auroc"] == r["ood"]["nearset"]["auroc"]
    assert r["far_auroc"] == pytest.approx(
        (r["ood"]["farset"]["auroc"] + r["ood"]["far2"]["auroc"]) / 2)
    for metric in ("fpr95", "aupr_in", "aupr_out"):
      assert r[f"near_{metric}"] == r["ood"]["nearset"][metric]
      assert r[f"far_{metric}"] == pytest.approx(
          (r["ood"]["farset"][metric] + r["ood"]["far2"][metric]) / 2)
  table = open(os.path.join(out, "benchmark.md")).read()
  assert "| Near AUROC ↑ |" in table and "| Far AUROC ↑ |" in table
  assert "Near OOD: nearset." in table and "Far OOD: farset, far2 (columns: mean" in table
  assert "| Near FPR95 (OpenOOD) ↓ |" in table and "| Far AUPR-out ↑ |" in table
  assert "OpenOOD v1.5" in table  # the convention is defined under the table
  assert "farset AUROC" in table and "far2 AUROC" in table and "| DPMM diag |" in table
  saved = json.load(open(os.path.join(out, "benchmark.json")))
  assert saved["config"]["fpr_positive"] == "ood"
  # The other convention on request; AUROC and AUPR do not depend on it.
  res_in = benchmark.run(None, train, test, {"nearset": near}, {"farset": far},
                         models=("rmds",), fpr_positive="in")
  r_in, r_ood = res_in["results"]["rmds"], res["results"]["rmds"]
  assert "FPR95 (ID pos.) ↓" in res_in["table"]
  assert r_in["ood"]["nearset"]["auroc"] == r_ood["ood"]["nearset"]["auroc"]
  assert r_in["ood"]["nearset"]["aupr_in"] == r_ood["ood"]["nearset"]["aupr_in"]
  with pytest.raises(ValueError, match="fpr_positive"):
    benchmark.run(None, train, test, {"nearset": near}, {}, models=("rmds",),
                  fpr_positive="id")
  assert set(saved["results"]) == {"rmds", "diag", "msp"}
  assert "fit_s" in saved["results"]["rmds"]
  _check_and_remove_figures(out, ["benchmark.png"])
  benchmark.plot_results(out)
  _png_ok(os.path.join(out, "benchmark.png"))


def test_benchmark_input_errors(tmp_path):
  train, test, near, _ = _write_feature_files(tmp_path)
  with pytest.raises(ValueError, match="at least one OOD"):
    benchmark.run(None, train, test, {}, {}, models=("rmds",))
  bad = feature_files.save_npz(str(tmp_path / "bad"), np.zeros((5, 3), np.float32))
  with pytest.raises(ValueError, match="has 3 features but the training file has 6"):
    benchmark.run(None, train, test, {"x": bad}, {}, models=("rmds",))
  with pytest.raises(ValueError, match="Unknown model"):
    benchmark.run(None, train, test, {"x": near}, {}, models=("nope",))


def test_dim_sweep_smoke_builtin(tmp_path):
  out = str(tmp_path)
  res = dim_sweep.run(out, components=(2, 64), models=("rmds", "tied", "diag"),
                      seeds=(0, 1), problem=dict(num_classes=4, dim=8,
                                                 num_train_per_class=12,
                                                 num_test_per_class=4, num_ood_classes=3))
  # 64 > D = 8 is replaced by the full dimension.
  assert res["config"]["components"] == [2, 8]
  assert len(res["records"]) == 2 * 2 * 3
  assert not [r for r in res["records"] if r["error"]]
  # A smoke run at a tiny size (accuracy ~0.3): the metrics exist and are numbers.
  assert all(np.isfinite(r["near_auroc"]) and np.isfinite(r["far_auroc"])
             for r in res["records"])
  _check_and_remove_figures(out, ["dim_sweep.png"])
  dim_sweep.plot_results(out)
  _png_ok(os.path.join(out, "dim_sweep.png"))


def test_dim_sweep_smoke_feature_files(tmp_path):
  train, test, near, far = _write_feature_files(tmp_path)
  res = dim_sweep.run(str(tmp_path / "out"), train=train, test=test,
                      near_ood={"n": near}, far_ood={"f": far}, components=(2, 6),
                      models=("rmds", "tied"), seeds=(3, 4))
  assert res["config"]["seeds"] == [3]
  assert {r["num_components"] for r in res["records"]} == {2, 6}
  assert all(np.isfinite(r["n_auroc"]) for r in res["records"])


def test_common_helpers():
  assert common.parse_named_paths(["a=x/b.npz", "dir/c_features.npy"]) == {
      "a": "x/b.npz", "c": "dir/c_features.npy"}
  with pytest.raises(ValueError, match="given twice"):
    common.parse_named_paths(["a=x", "a=y"])
  m, se = common.mean_and_se([1.0, 2.0, float("nan"), 3.0])
  assert m == 2.0 and se == pytest.approx(1 / np.sqrt(3))
  assert "| a |" in common.markdown_table(["h", "v"], [["a", 0.5]])


def test_highdim_problem_has_scale_factors():
  import jax  # pylint: disable=g-import-not-at-top
  p = highdim.make_problem(jax.random.PRNGKey(1), num_classes=30, dim=5,
                           num_train_per_class=3, num_test_per_class=2, num_ood_classes=2,
                           scale_shape=4.0)
  assert p.x_train.shape == (90, 5) and p.x_near.shape == (4, 5)
  # Class covariances are scaled by gamma_k: log-determinants track D log gamma_k.
  logdet = np.linalg.slogdet(p.covariances)[1]
  assert np.corrcoef(logdet, np.log(p.scales))[0, 1] > 0.8


def test_covariance_analysis_smoke(tmp_path):
  out = str(tmp_path)
  res = covariance_analysis.run(out, num_components=4, seed=0, problem=dict(
      num_classes=6, dim=8, num_train_per_class=30, num_test_per_class=2,
      num_ood_classes=2, scale_shape=2.0))
  s = res["summary"]
  assert s["num_classes"] == 6 and s["dim"] == 4 and s["num_pairs"] == 15
  assert res["arrays"]["fm_real"].shape == (15,) and res["arrays"]["fm_null"].shape == (15,)
  assert np.all(res["arrays"]["fm_real"] > 0) and np.all(np.isfinite(res["arrays"]["fm_null"]))
  # Strong per-class scale factors (shape 2) make the class covariances differ far more
  # than Wishart sampling error, and the estimated s_k track the true gamma_k.
  assert s["fm_real_median"] > s["fm_null_median"]
  assert s["scale_log_sd_real"] > s["scale_log_sd_null"]
  assert s["corr_scale_vs_true_gamma"] > 0.5
  _check_and_remove_figures(out, ("covariance_fm.png", "covariance_scales.png"))
  covariance_analysis.plot_results(out)
  _png_ok(os.path.join(out, "covariance_fm.png"))


def test_covariance_analysis_feature_file_drops_small_classes(tmp_path):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(70, 5)).astype(np.float32)
  y = np.array([0] * 30 + [1] * 30 + [2] * 10, np.int32)   # class 2: only 10 points
  path = feature_files.save_npz(str(tmp_path / "f"), x, y)
  res = covariance_analysis.run(None, train=path, num_components=5)
  # Class 2 has 10 > D = 5 points and is kept; with D = 5 none is dropped.
  assert res["summary"]["num_classes"] == 3
  res = covariance_analysis.run(None, train=path, num_components=5, max_classes=2)
  assert res["summary"]["num_classes"] == 2 and res["summary"]["num_pairs"] == 1
  x2 = np.concatenate([x, rng.normal(size=(4, 5)).astype(np.float32)])
  y2 = np.concatenate([y, np.full(4, 3, np.int32)])          # class 3: 4 <= D points
  path2 = feature_files.save_npz(str(tmp_path / "g"), x2, y2)
  res = covariance_analysis.run(None, train=path2, num_components=5)
  assert res["summary"]["classes_dropped"] == 1 and res["summary"]["num_classes"] == 3
