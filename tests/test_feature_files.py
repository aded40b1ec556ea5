"""Tests for dpmm_jax.feature_files: both formats round-trip; bad files fail clearly."""
import numpy as np
import pytest

import dpmm_jax
from dpmm_jax import feature_files


def _data(n=12, d=3, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


def test_npz_round_trip(tmp_path):
  x, y = _data()
  path = feature_files.save_npz(str(tmp_path / "train"), x, y)
  assert path.endswith(".npz")
  for spec in (path, str(tmp_path / "train")):
    fs = feature_files.load(spec)
    np.testing.assert_array_equal(fs.features, x)
    np.testing.assert_array_equal(fs.labels, y)
    assert (fs.num_points, fs.dim) == (12, 3)


def test_npy_pair_is_memory_mapped(tmp_path):
  x, y = _data()
  prefix = feature_files.save_npy_pair(str(tmp_path / "train"), x, y)
  for spec in (prefix, prefix + "_features.npy", prefix + "_labels.npy"):
    fs = feature_files.load(spec)
    assert isinstance(fs.features, np.memmap)
    np.testing.assert_array_equal(np.asarray(fs.features), x)
    np.testing.assert_array_equal(fs.labels, y)


def test_memmapped_features_fit_a_detector(tmp_path):
  x, y = _data(n=60, d=2)
  prefix = feature_files.save_npy_pair(str(tmp_path / "train"), x, y)
  fs = feature_files.load(prefix)
  det = dpmm_jax.fit_detector(fs.features, fs.labels, model="rmds")
  assert np.all(np.isfinite(np.asarray(dpmm_jax.score(det, x[:5]))))


def test_ood_file_without_labels(tmp_path):
  x, _ = _data()
  fs = feature_files.load(feature_files.save_npz(str(tmp_path / "ood"), x),
                          require_labels=False)
  assert fs.labels is None
  prefix = feature_files.save_npy_pair(str(tmp_path / "ood2"), x)
  assert feature_files.load(prefix, require_labels=False).labels is None
  # OOD files may carry labels -1; they are accepted there.
  fs = feature_files.load(feature_files.save_npz(str(tmp_path / "ood3"), x,
                                                 -np.ones(12, np.int32)),
                          require_labels=False)
  assert fs.labels.min() == -1


def test_missing_file(tmp_path):
  with pytest.raises(ValueError, match="No feature file"):
    feature_files.load(str(tmp_path / "nothing"))
  with pytest.raises(ValueError, match="does not exist"):
    feature_files.load(str(tmp_path / "nothing.npz"))


def test_missing_keys(tmp_path):
  x, y = _data()
  np.savez(tmp_path / "a.npz", feats=x, labels=y)
  with pytest.raises(ValueError, match="no 'features' array.*feats"):
    feature_files.load(str(tmp_path / "a.npz"))
  np.savez(tmp_path / "b.npz", features=x)
  with pytest.raises(ValueError, match="no 'labels' array"):
    feature_files.load(str(tmp_path / "b.npz"))
  np.save(tmp_path / "c_features.npy", x)
  with pytest.raises(ValueError, match="labels file .*c_labels.npy is missing"):
    feature_files.load(str(tmp_path / "c"))


def test_shape_mismatches(tmp_path):
  x, y = _data()
  np.savez(tmp_path / "a.npz", features=x, labels=y[:-1])
  with pytest.raises(ValueError, match=r"labels must have shape \(12,\) to match"):
    feature_files.load(str(tmp_path / "a.npz"))
  np.savez(tmp_path / "b.npz", features=x[:, 0], labels=y)
  with pytest.raises(ValueError, match="must be 2-D"):
    feature_files.load(str(tmp_path / "b.npz"))
  np.savez(tmp_path / "c.npz", features=x, labels=y[:, None])
  with pytest.raises(ValueError, match=r"labels must have shape \("):
    feature_files.load(str(tmp_path / "c.npz"))
  np.savez(tmp_path / "d.npz", features=x, labels=y)
  with pytest.raises(ValueError, match="has 3 features but the training file has 5"):
    feature_files.load(str(tmp_path / "d.npz"), dim=5)
  np.savez(tmp_path / "e.npz", features=np.zeros((0, 3), np.float32),
           labels=np.zeros(0, np.int32))
  with pytest.raises(ValueError, match="empty"):
    feature_files.load(str(tmp_path / "e.npz"))


@pytest.mark.parametrize("fmt", ["npz", "npy"])
def test_nan_rows_reported_with_count_and_first_indices(tmp_path, fmt):
  x, y = _data(n=20)
  x[[3, 7, 19]] = np.nan
  x[11, 1] = np.inf
  if fmt == "npz":
    spec = feature_files.save_npz(str(tmp_path / "bad"), x, y)
  else:
    spec = feature_files.save_npy_pair(str(tmp_path / "bad"), x, y)
  with pytest.raises(ValueError, match=r"4 row\(s\) with NaN or inf values out of 20.*\[3, 7, 11, 19\]"):
    feature_files.load(spec)
  assert feature_files.load(spec, check_finite=False).num_points == 20


def test_label_dtype(tmp_path):
  x, y = _data()
  np.savez(tmp_path / "a.npz", features=x, labels=y.astype(np.float32))
  with pytest.raises(TypeError, match="integer class labels, got dtype float32"):
    feature_files.load(str(tmp_path / "a.npz"))
  np.savez(tmp_path / "b.npz", features=x, labels=np.array(["cat"] * 12))
  with pytest.raises(TypeError, match="integer class labels"):
    feature_files.load(str(tmp_path / "b.npz"))
  np.savez(tmp_path / "c.npz", features=x, labels=np.where(y == 0, -1, y))
  with pytest.raises(ValueError, match="negative label"):
    feature_files.load(str(tmp_path / "c.npz"))
  np.savez(tmp_path / "d.npz", features=np.full((12, 3), "a"), labels=y)
  with pytest.raises(TypeError, match="features must be a real numeric array"):
    feature_files.load(str(tmp_path / "d.npz"))


def test_object_arrays_rejected(tmp_path):
  x, y = _data()
  np.savez(tmp_path / "a.npz", features=x, labels=np.array([object()] * 12, dtype=object))
  with pytest.raises(ValueError, match="object"):
    feature_files.load(str(tmp_path / "a.npz"))
