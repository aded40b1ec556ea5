"""dpmm_jax.save / load: pickle-free .npz + JSON format, atomic writes, validation of
truncated / corrupted / tampered / wrong-version files, bit-identical round trips."""
import functools
import io
import json
import os
import warnings
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmm_jax
from dpmm_jax import serialization
from dpmm_jax.models import coupled

K, D, NK = 3, 4, 20


@functools.lru_cache(maxsize=None)
def _data():
  rng = np.random.default_rng(11)
  means = 4.0 * rng.normal(size=(K, D))
  y = np.repeat(np.arange(K), NK).astype(np.int32)
  x = means[y] + rng.normal(size=(len(y), D))
  x_test = np.concatenate([x[::7] + 0.3 * rng.normal(size=(len(y[::7]), D)),
                           10.0 * rng.normal(size=(8, D))])
  return x.astype(np.float32), y, x_test.astype(np.float32)


@functools.lru_cache(maxsize=None)
def _detector(model, preprocess=True):
  x, y, _ = _data()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", dpmm_jax.ConvergenceWarning)
    return dpmm_jax.fit_detector(x, y, model, preprocess=preprocess,
                                 key=jax.random.PRNGKey(1))


def _outputs(det, x):
  out = {"score": dpmm_jax.score(det, x), "class_scores": dpmm_jax.class_scores(det, x),
         "predict": dpmm_jax.predict(det, x)}
  if det.model in dpmm_jax.DPMM_MODELS:
    out["outlier_probability"] = dpmm_jax.outlier_probability(det, x, alpha=0.5)
  return {k: np.asarray(v) for k, v in out.items()}


def _assert_bit_identical(a, b):
  for leaf_a, leaf_b in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    leaf_a, leaf_b = np.asarray(leaf_a), np.asarray(leaf_b)
    assert leaf_a.dtype == leaf_b.dtype and leaf_a.shape == leaf_b.shape
    assert leaf_a.tobytes() == leaf_b.tobytes()


# ------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("model", dpmm_jax.MODELS)
def test_round_trip_gives_bit_identical_scores(model, tmp_path):
  det = _detector(model)
  path = tmp_path / f"{model}.npz"
  dpmm_jax.save(det, path)
  loaded = dpmm_jax.load(path)
  assert isinstance(loaded, dpmm_jax.Detector)
  assert (loaded.model, loaded.num_classes, loaded.input_dim) == (model, K, D)
  assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(det)
  _assert_bit_identical(det, loaded)
  _, _, x_test = _data()
  want, got = _outputs(det, x_test), _outputs(loaded, x_test)
  for name in want:
    assert want[name].tobytes() == got[name].tobytes(), name


@pytest.mark.parametrize("model", ["rmds", "diag"])
def test_round_trip_without_preprocessing(model, tmp_path):
  det = _detector(model, preprocess=False)
  dpmm_jax.save(det, str(tmp_path / "d.npz"))
  loaded = dpmm_jax.load(str(tmp_path / "d.npz"))
  assert loaded.transform is None
  _assert_bit_identical(det, loaded)
  assert serialization.read_metadata(tmp_path / "d.npz")["preprocessing"] == {
      "applied": False, "input_dim": D, "output_dim": D}


def test_coupled_with_non_default_quadrature_round_trips(tmp_path):
  x, y, x_test = _data()
  options = coupled.QuadratureOptions(score_nodes=7, prior_nodes=33)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", dpmm_jax.ConvergenceWarning)
    det = dpmm_jax.fit_detector(x, y, "coupled", options=options)
  dpmm_jax.save(det, tmp_path / "c.npz")
  meta = serialization.read_metadata(tmp_path / "c.npz")
  assert meta["structure"] == {"score_nodes": 7, "prior_nodes": 33}
  loaded = dpmm_jax.load(tmp_path / "c.npz")
  _assert_bit_identical(det, loaded)
  assert (np.asarray(dpmm_jax.score(det, x_test)).tobytes()
          == np.asarray(dpmm_jax.score(loaded, x_test)).tobytes())


def test_the_file_is_an_open_npz_with_json_metadata(tmp_path):
  det = _detector("full")
  path = tmp_path / "full.npz"
  dpmm_jax.save(det, path)
  with np.load(path, allow_pickle=False) as npz:     # plain numpy, no pickle
    meta = json.loads(npz["metadata.json"])
    arrays = {k: npz[k] for k in npz.files if k != "metadata.json"}
  assert meta["format"] == "dpmm_jax.detector" and meta["format_version"] == 1
  assert meta["library_version"] == dpmm_jax.__version__
  assert (meta["model"], meta["num_classes"], meta["input_dim"], meta["model_dim"]) == (
      "full", K, D, D)
  assert meta["preprocessing"] == {"applied": True, "input_dim": D, "output_dim": D}
  assert meta["dtype"] == "float32"
  keys = [e["key"] for e in meta["arrays"]]
  assert keys == [jax.tree_util.keystr(p).lstrip(".")
                  for p, _ in jax.tree_util.tree_flatten_with_path(det)[0]]
  assert "transform.projection" in keys and "params.hyper.df" in keys
  for entry in meta["arrays"]:
    assert list(arrays[entry["key"]].shape) == entry["shape"]
    assert str(arrays[entry["key"]].dtype) == entry["dtype"]
  np.testing.assert_array_equal(arrays["params.hyper.df"], np.asarray(det.params.hyper.df))
  assert meta["sha256"] == serialization.payload_digest(
      meta, [(k, arrays[k]) for k in keys])
  assert len(meta["sha256"]) == 64


def test_save_overwrites_an_existing_file(tmp_path):
  path = tmp_path / "d.npz"
  dpmm_jax.save(_detector("tied"), path)
  dpmm_jax.save(_detector("rmds"), path)
  assert dpmm_jax.load(path).model == "rmds"
  assert os.listdir(tmp_path) == ["d.npz"]


# --------------------------------------------------------------------- atomic writes
class _Interrupted(BaseException):
  pass


@pytest.mark.parametrize("exc", [OSError("disk full"), _Interrupted()],
                         ids=["oserror", "interrupt"])
def test_an_interrupted_save_leaves_no_partial_file(exc, tmp_path, monkeypatch):
  path = tmp_path / "d.npz"
  real_write = np.lib.format.write_array
  calls = []

  def failing_write(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:          # in the middle of the archive
      raise exc
    return real_write(*args, **kwargs)

  monkeypatch.setattr(np.lib.format, "write_array", failing_write)
  with pytest.raises(type(exc)):
    dpmm_jax.save(_detector("diag"), path)
  assert os.listdir(tmp_path) == []            # no final file, no temporary left

  # An existing file is left exactly as it was.
  monkeypatch.setattr(np.lib.format, "write_array", real_write)
  dpmm_jax.save(_detector("tied"), path)
  before = path.read_bytes()
  calls.clear()
  monkeypatch.setattr(np.lib.format, "write_array", failing_write)
  with pytest.raises(type(exc)):
    dpmm_jax.save(_detector("diag"), path)
  assert path.read_bytes() == before and os.listdir(tmp_path) == ["d.npz"]
  assert dpmm_jax.load(path).model == "tied"


def test_a_failing_rename_leaves_the_old_file(tmp_path, monkeypatch):
  path = tmp_path / "d.npz"
  dpmm_jax.save(_detector("tied"), path)
  before = path.read_bytes()

  def no_replace(src, dst):
    raise OSError("rename failed")

  monkeypatch.setattr(os, "replace", no_replace)
  with pytest.raises(OSError, match="rename failed"):
    dpmm_jax.save(_detector("rmds"), path)
  assert path.read_bytes() == before and os.listdir(tmp_path) == ["d.npz"]


def test_save_into_a_missing_directory_fails_cleanly(tmp_path):
  with pytest.raises(FileNotFoundError):
    dpmm_jax.save(_detector("tied"), tmp_path / "nope" / "d.npz")
  assert os.listdir(tmp_path) == []


def test_save_rejects_non_detectors_and_traced_detectors(tmp_path):
  det = _detector("tied")
  with pytest.raises(TypeError, match="Detector"):
    dpmm_jax.save(det.params, tmp_path / "d.npz")

  @jax.jit
  def save_inside_jit(d):
    dpmm_jax.save(d, tmp_path / "d.npz")
    return 0

  with pytest.raises(TypeError, match="traced"):
    save_inside_jit(det)
  assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------- damaged files
def _saved(tmp_path, model="rmds"):
  path = tmp_path / f"{model}.npz"
  dpmm_jax.save(_detector(model), path)
  return path


def _members(path):
  with zipfile.ZipFile(path) as archive:
    return {name: archive.read(name) for name in archive.namelist()}


def _write_members(path, members):
  with zipfile.ZipFile(path, "w") as archive:
    for name, data in members.items():
      archive.writestr(name, data)


def _rewrite(path, edit_metadata=None, edit_arrays=None, resign=True):
  """Rewrites a detector file (a valid archive) after editing its metadata / arrays,
  optionally with a correct checksum (a forged but self-consistent file)."""
  with np.load(path, allow_pickle=False) as npz:
    meta = json.loads(npz["metadata.json"])
    arrays = {e["key"]: npz[e["key"]] for e in meta["arrays"]}
  if edit_arrays:
    edit_arrays(arrays)
    meta["arrays"] = [{"key": k, "shape": list(a.shape), "dtype": str(a.dtype)}
                      for k, a in arrays.items()]
  if edit_metadata:
    edit_metadata(meta)
  if resign:
    meta["sha256"] = serialization.payload_digest(meta, list(arrays.items()))
  members = {"metadata.json": json.dumps(meta).encode()}
  for key, arr in arrays.items():
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=arr.dtype == object)
    members[key + ".npy"] = buf.getvalue()
  _write_members(path, members)
  return path


@pytest.mark.parametrize("keep", [0, 10, 0.5, -1], ids=["empty", "10B", "half", "1Bshort"])
def test_truncated_files_are_rejected(keep, tmp_path):
  path = _saved(tmp_path)
  data = path.read_bytes()
  n = int(len(data) * keep) if isinstance(keep, float) else (
      len(data) + keep if keep < 0 else keep)
  path.write_bytes(data[:n])
  with pytest.raises(dpmm_jax.DetectorFileError, match="truncated or corrupted"):
    dpmm_jax.load(path)


def test_a_flipped_byte_in_the_array_data_is_detected(tmp_path):
  path = _saved(tmp_path)
  data = bytearray(path.read_bytes())
  with zipfile.ZipFile(path) as archive:
    info = archive.getinfo("params.means.npy")
  # The member's data follows its local header: 30 bytes + name + extra field.
  offset = info.header_offset
  name_len = int.from_bytes(data[offset + 26:offset + 28], "little")
  extra_len = int.from_bytes(data[offset + 28:offset + 30], "little")
  start = offset + 30 + name_len + extra_len
  data[start + info.file_size - 3] ^= 0x40          # inside the array payload
  path.write_bytes(bytes(data))
  with pytest.raises(dpmm_jax.DetectorFileError, match="corrupted"):
    dpmm_jax.load(path)


def test_an_edited_array_in_a_valid_archive_fails_the_checksum(tmp_path):
  path = _saved(tmp_path)

  def nudge(arrays):
    arrays["params.means"] = arrays["params.means"].copy()
    arrays["params.means"][0, 0] = np.nextafter(arrays["params.means"][0, 0], np.inf)

  _rewrite(path, edit_arrays=nudge, resign=False)
  with pytest.raises(dpmm_jax.DetectorFileError, match="checksum mismatch"):
    dpmm_jax.load(path)


def test_edited_metadata_fails_the_checksum(tmp_path):
  # rmds and mds detectors have the same arrays: only the checksum catches the swap.
  path = _saved(tmp_path)
  _rewrite(path, edit_metadata=lambda m: m.update(model="mds"), resign=False)
  with pytest.raises(dpmm_jax.DetectorFileError, match="checksum mismatch"):
    dpmm_jax.load(path)
  # With the checksum recomputed the file is a valid mds detector.
  _rewrite(path, edit_metadata=lambda m: m.update(model="mds"))
  assert dpmm_jax.load(path).model == "mds"


@pytest.mark.parametrize("version, match", [(2, "version 2.*upgrade dpmm_jax"),
                                            (0, "version 0"), ("1", "version '1'")])
def test_other_format_versions_are_rejected(version, match, tmp_path):
  path = _rewrite(_saved(tmp_path), edit_metadata=lambda m: m.update(format_version=version))
  with pytest.raises(dpmm_jax.DetectorFileError, match=match):
    dpmm_jax.load(path)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(format="something.else"), "not a dpmm_jax detector"),
    (lambda m: m.update(model="gmm"), "unknown model 'gmm'"),
    (lambda m: m.update(num_classes=K + 1), "params.means has shape"),
    (lambda m: m.update(model_dim=D + 1), "inconsistent sizes"),
    (lambda m: m.pop("dtype"), "field 'dtype'"),
    (lambda m: m.update(dtype="int8"), "unsupported dtype"),
    (lambda m: m.update(model="indep_rmds"), "do not form a indep_rmds detector"),
])
def test_forged_but_self_consistent_metadata_must_match_the_model(edit, match, tmp_path):
  path = _rewrite(_saved(tmp_path), edit_metadata=edit)
  with pytest.raises(dpmm_jax.DetectorFileError, match=match):
    dpmm_jax.load(path)


@pytest.mark.parametrize("edit, match", [
    (lambda a: a.pop("params.loc0"), "do not form a rmds detector"),
    (lambda a: a.update({"params.means": a["params.means"][:, :2]}), "params.means has shape"),
    (lambda a: a.update({"params.means": a["params.means"].astype(np.float64)}),
     "dtype float64"),
    (lambda a: a.update({"params.means": np.full_like(a["params.means"], np.nan)}), "NaN"),
])
def test_forged_but_self_consistent_arrays_must_match_the_model(edit, match, tmp_path):
  path = _rewrite(_saved(tmp_path), edit_arrays=edit)
  with pytest.raises(dpmm_jax.DetectorFileError, match=match):
    dpmm_jax.load(path)


def test_a_float64_file_needs_x64(tmp_path):
  def to_f64(arrays):
    for key in arrays:
      arrays[key] = arrays[key].astype(np.float64)

  path = _rewrite(_saved(tmp_path), edit_arrays=to_f64,
                  edit_metadata=lambda m: m.update(dtype="float64"))
  with pytest.raises(dpmm_jax.DetectorFileError, match="jax_enable_x64"):
    dpmm_jax.load(path)


def test_pickled_members_are_never_unpickled(tmp_path):
  path = _saved(tmp_path)
  evil = np.empty(2, dtype=object)
  evil[:] = [os.system, "touch pwned"]

  def add_pickle(arrays):
    arrays["params.means"] = evil

  _rewrite(path, edit_arrays=add_pickle)
  with pytest.raises(dpmm_jax.DetectorFileError, match="corrupted"):
    dpmm_jax.load(path)
  assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("content", [b"", b"hello", b"PK\x03\x04 not really a zip"])
def test_non_archives_are_rejected(content, tmp_path):
  path = tmp_path / "d.npz"
  path.write_bytes(content)
  with pytest.raises(dpmm_jax.DetectorFileError, match="not a readable dpmm_jax detector"):
    dpmm_jax.load(path)


def test_other_npz_files_are_rejected(tmp_path):
  np.savez(tmp_path / "other.npz", a=np.zeros(3))
  with pytest.raises(dpmm_jax.DetectorFileError, match="no metadata.json"):
    dpmm_jax.load(tmp_path / "other.npz")
  _write_members(tmp_path / "bad.npz", {"metadata.json": b"{not json"})
  with pytest.raises(dpmm_jax.DetectorFileError, match="corrupted metadata"):
    dpmm_jax.load(tmp_path / "bad.npz")
  _write_members(tmp_path / "list.npz", {"metadata.json": b"[1, 2]"})
  with pytest.raises(dpmm_jax.DetectorFileError, match="not a JSON object"):
    dpmm_jax.load(tmp_path / "list.npz")


def test_members_must_match_the_metadata(tmp_path):
  path = _saved(tmp_path)
  members = _members(path)
  members["extra.npy"] = members["params.means.npy"]
  _write_members(path, members)
  with pytest.raises(dpmm_jax.DetectorFileError, match="extra"):
    dpmm_jax.load(path)


def test_a_missing_file_is_a_file_not_found_error(tmp_path):
  with pytest.raises(FileNotFoundError):
    dpmm_jax.load(tmp_path / "missing.npz")


def test_detector_file_error_is_a_value_error():
  assert issubclass(dpmm_jax.DetectorFileError, ValueError)
