"""Saving and loading fitted detectors in an open, pickle-free format.

File format (version 1)
-----------------------
A detector file is a standard ``.npz`` archive (a ZIP file) that ``numpy.load(path,
allow_pickle=False)`` opens. It holds

* one ``.npy`` member per array of the detector pytree, named by its key path
  (``jax.tree_util.keystr`` without the leading dot, e.g. ``params.hyper.loc`` or
  ``transform.projection``), and
* a member ``metadata.json`` (UTF-8 JSON) with::

    format            "dpmm_jax.detector"
    format_version    1
    library_version   dpmm_jax.__version__ of the writer (informative)
    model             one of dpmm_jax.MODELS
    num_classes       K
    input_dim         D of the features the detector scores
    model_dim         D' after the preprocessing (= D without it)
    preprocessing     {"applied": bool, "input_dim": D, "output_dim": D'}
    dtype             "float32" or "float64"
    structure         model-specific sizes that the arrays' shapes do not imply
                      (the coupled model's quadrature node counts, the lowrank
                      model's max_rank)
    arrays            [{"key", "shape", "dtype"}, ...] in pytree order
    sha256            SHA-256 (hex) of the canonical JSON of every other metadata field
                      followed by, for each array in order, its key, dtype, shape and
                      little-endian C-order bytes (``payload_digest``)

Loading never unpickles and never imports by name: the detector's structure is rebuilt
from the model name alone (an abstract, fitting-free evaluation of the model's own
constructor on statistics of the recorded shapes, ``jax.eval_shape``), and the file must
match it exactly (key paths, shapes, dtypes). Truncated, corrupted or edited files, other
format versions and structural mismatches raise ``DetectorFileError`` (a ``ValueError``). A round trip reproduces
the arrays bit for bit, hence bit-identical scores.

Writes are atomic: the archive is written to a temporary file in the target directory,
flushed to disk and moved over the target with ``os.replace``, so an interrupted save
never leaves a partial file under the final name (an existing file stays intact).
"""
import hashlib
import io
import json
import os
import tempfile
import zipfile
from typing import Any, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import api
from dpmm_jax import preprocess as preprocess_lib
from dpmm_jax import stats as stats_lib
from dpmm_jax.models import coupled, diag, full, linear, lowrank, mahalanobis, tied

FORMAT = "dpmm_jax.detector"
FORMAT_VERSION = 1
METADATA_NAME = "metadata.json"
_DTYPES = ("float32", "float64")
# Non-float leaves a model may hold (e.g. precomputed indices).
_OTHER_DTYPES = ("int32", "int64", "bool")


class DetectorFileError(ValueError):
  """A detector file that cannot be loaded: truncated, corrupted, edited, of another
  format version, or not matching its model."""


def _library_version() -> str:
  import dpmm_jax  # pylint: disable=import-outside-toplevel
  return dpmm_jax.__version__


# ------------------------------------------------------------------------- structure
def _structure(det: api.Detector) -> Dict[str, Any]:
  """Sizes that the template needs but (K, D, D') do not determine."""
  if det.model == "coupled":
    return {"score_nodes": int(det.params.class_log_weights.shape[-1]),
            "prior_nodes": int(det.params.prior_log_weights.shape[-1])}
  if det.model == "lowrank":
    return {"max_rank": int(det.params.factors.shape[1])}
  return {}


def _template(model: str, num_classes: int, input_dim: int, model_dim: int,
              preprocessed: bool, dtype, structure: Dict[str, Any]) -> api.Detector:
  """Abstract detector (``jax.ShapeDtypeStruct`` leaves) of the given model and sizes,
  built by evaluating the model's own constructors on abstract statistics."""
  k, d = num_classes, model_dim
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  stats = stats_lib.SufficientStats(
      sds(k), sds(k, d), sds(k, d), sds(k, d, d) if model in api._FULL_STATS else None,
      sds(d, d))
  if model in ("mds", "rmds"):
    params = jax.eval_shape(mahalanobis.fit, stats)
  elif model == "indep_rmds":
    params = jax.eval_shape(lambda s: mahalanobis.fit(s, independent=True), stats)
  elif model == "tied":
    params = jax.eval_shape(tied.fit, stats)
  elif model == "full":
    params = jax.eval_shape(lambda s: full.params_from_hyper(full.init_hyper(s), s), stats)
  elif model == "diag":
    params = jax.eval_shape(lambda s: diag.params_from_hyper(diag.init_hyper(s), s), stats)
  elif model == "coupled":
    try:
      options = coupled.QuadratureOptions(score_nodes=int(structure["score_nodes"]),
                                          prior_nodes=int(structure["prior_nodes"]))
    except (KeyError, TypeError, ValueError):
      raise ValueError("The coupled model's metadata lacks its quadrature sizes "
                       "(structure.score_nodes / prior_nodes).") from None
    params = jax.eval_shape(
        lambda s: coupled.params_from_hyper(coupled.init_hyper(s), s, options), stats)
  elif model == "lowrank":
    try:
      max_rank = int(structure["max_rank"])
    except (KeyError, TypeError, ValueError):
      raise ValueError("The lowrank model's metadata lacks its rank (structure.max_rank)."
                       ) from None
    params = jax.eval_shape(
        lambda s: lowrank.params_from_hyper(full.init_hyper(s), s, max_rank), stats)
  elif model in ("msp", "temp_msp"):
    params = linear.LinearHeadParams(sds(d, k), sds(k))
  else:
    raise ValueError(f"Unknown model {model!r}; a detector file must name one of "
                     f"{api.MODELS}.")
  transform = (preprocess_lib.Transform(sds(input_dim), sds(input_dim, d))
               if preprocessed else None)
  return api.Detector(model, num_classes, transform, params)


def _key(path) -> str:
  return jax.tree_util.keystr(path).lstrip(".")


def _leaves(tree) -> List:
  return [(_key(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _canonical_array(arr: np.ndarray) -> np.ndarray:
  """Little-endian, C-ordered (np.ascontiguousarray would turn a 0-d array into 1-d)."""
  return np.asarray(arr).astype(arr.dtype.newbyteorder("<"), order="C", copy=False)


def payload_digest(metadata: Dict[str, Any], arrays: List) -> str:
  """SHA-256 over the metadata (without its ``sha256`` field) and the arrays.

  Args:
    metadata: the metadata dictionary.
    arrays: [(key, numpy array), ...] in the order of ``metadata["arrays"]``.
  Returns:
    Hex digest.
  """
  digest = hashlib.sha256()
  header = {k: v for k, v in metadata.items() if k != "sha256"}
  digest.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
  for key, arr in arrays:
    arr = _canonical_array(np.asarray(arr))
    digest.update(key.encode() + b"\0")
    digest.update(arr.dtype.str.encode() + b"\0")
    digest.update(json.dumps(list(arr.shape)).encode() + b"\0")
    digest.update(arr.tobytes())
  return digest.hexdigest()


# ----------------------------------------------------------------------------- save
def _metadata(det: api.Detector, arrays: List) -> Dict[str, Any]:
  dtypes = {str(arr.dtype) for _, arr in arrays}
  floats = dtypes & set(_DTYPES)
  if len(floats) != 1 or not dtypes <= set(_DTYPES + _OTHER_DTYPES):
    raise TypeError(f"A detector's float arrays must all be float32 or all float64 (other "
                    f"arrays {_OTHER_DTYPES}), got {sorted(dtypes)}.")
  model_dim = int(api._model_dim(det))
  preprocessed = det.transform is not None
  metadata = {
      "format": FORMAT,
      "format_version": FORMAT_VERSION,
      "library_version": _library_version(),
      "model": det.model,
      "num_classes": int(det.num_classes),
      "input_dim": int(det.input_dim),
      "model_dim": model_dim,
      "preprocessing": {"applied": preprocessed, "input_dim": int(det.input_dim),
                        "output_dim": model_dim},
      "dtype": floats.pop(),
      "structure": _structure(det),
      "arrays": [{"key": key, "shape": list(arr.shape), "dtype": str(arr.dtype)}
                 for key, arr in arrays],
  }
  metadata["sha256"] = payload_digest(metadata, arrays)
  return metadata


def save(det: api.Detector, path) -> None:
  """Writes a fitted detector to ``path`` (atomically; see the module docstring).

  Args:
    det: a ``Detector`` from ``fit_detector`` (or ``load``).
    path: file name (str or ``os.PathLike``); its directory must exist. The name is used
      as given (``.npz`` is a good suffix). An existing file is replaced.
  Raises:
    TypeError: not a Detector, or arrays of an unsupported dtype or traced values.
    OSError: the file cannot be written (the target is then unchanged).
  """
  if not isinstance(det, api.Detector):
    raise TypeError(f"save expects a dpmm_jax.Detector, got {type(det).__name__}.")
  if det.model not in api.MODELS:
    raise ValueError(f"Unknown model {det.model!r}.")
  path = os.fspath(path)
  arrays = []
  for key, leaf in _leaves(det):
    if isinstance(leaf, jax.core.Tracer):
      raise TypeError(f"Cannot save a traced detector (leaf {key}); call save outside "
                      "jax.jit.")
    if not isinstance(leaf, (jax.Array, np.ndarray)):
      raise TypeError(f"Detector leaf {key} is a {type(leaf).__name__}, not an array.")
    arrays.append((key, _canonical_array(np.asarray(leaf))))
  metadata = _metadata(det, arrays)

  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                             dir=directory)
  try:
    with os.fdopen(fd, "wb") as f:
      with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(METADATA_NAME, json.dumps(metadata, indent=1, sort_keys=True))
        for key, arr in arrays:
          with archive.open(key + ".npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, arr, allow_pickle=False)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise
  try:  # make the rename durable (best effort; not every platform can open a directory)
    dir_fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(dir_fd)
  except OSError:
    pass
  finally:
    os.close(dir_fd)


# ----------------------------------------------------------------------------- load
def _fail(path, problem: str):
  return DetectorFileError(f"{path}: {problem}")


def read_metadata(path) -> Dict[str, Any]:
  """The metadata of a detector file (checks only that it is a readable archive)."""
  path = os.fspath(path)
  try:
    with zipfile.ZipFile(path) as archive:
      raw = archive.read(METADATA_NAME)
  except KeyError:
    raise _fail(path, f"not a dpmm_jax detector file (no {METADATA_NAME}).") from None
  except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile) as err:
    raise _fail(path, f"not a readable dpmm_jax detector file (truncated or corrupted: "
                      f"{err}).") from None
  try:
    metadata = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as err:
    raise _fail(path, f"corrupted metadata ({err}).") from None
  if not isinstance(metadata, dict):
    raise _fail(path, "corrupted metadata (not a JSON object).")
  return metadata


def _check_header(path, metadata):
  if metadata.get("format") != FORMAT:
    raise _fail(path, f"not a dpmm_jax detector file (format {metadata.get('format')!r}).")
  version = metadata.get("format_version")
  if version != FORMAT_VERSION:
    newer = isinstance(version, int) and version > FORMAT_VERSION
    raise _fail(path, f"unsupported detector file format version {version!r} (this is "
                      f"dpmm_jax {_library_version()}, which reads version "
                      f"{FORMAT_VERSION}){'; upgrade dpmm_jax' if newer else ''}.")
  required = {"model": str, "num_classes": int, "input_dim": int, "model_dim": int,
              "preprocessing": dict, "dtype": str, "structure": dict, "arrays": list,
              "sha256": str}
  for name, kind in required.items():
    if not isinstance(metadata.get(name), kind) or isinstance(metadata.get(name), bool):
      raise _fail(path, f"corrupted metadata (field {name!r} missing or not a "
                        f"{kind.__name__}).")
  if metadata["model"] not in api.MODELS:
    raise _fail(path, f"unknown model {metadata['model']!r}.")
  sizes = (metadata["num_classes"], metadata["input_dim"], metadata["model_dim"])
  if (sizes[0] < 2 or sizes[1] < 1 or sizes[2] < 1 or sizes[2] > sizes[1]
      or (not metadata["preprocessing"].get("applied") and sizes[2] != sizes[1])):
    raise _fail(path, f"inconsistent sizes in the metadata (num_classes, input_dim, "
                      f"model_dim) = {sizes}.")
  if metadata["dtype"] not in _DTYPES:
    raise _fail(path, f"unsupported dtype {metadata['dtype']!r}.")
  if metadata["dtype"] == "float64" and not jax.config.jax_enable_x64:
    raise _fail(path, "the detector holds float64 arrays but jax_enable_x64 is off; enable "
                      "it before loading (jax.config.update('jax_enable_x64', True)).")


def load(path) -> api.Detector:
  """Reads a detector written by ``save``; validates it completely.

  Args:
    path: file name (str or ``os.PathLike``).
  Returns:
    The Detector (its scores are bit-identical to the saved detector's).
  Raises:
    FileNotFoundError: no such file.
    DetectorFileError (a ValueError): truncated, corrupted or edited file (checksum
      mismatch), another format version, a float64 file while x64 is off, or arrays
      that do not match the model.
  """
  path = os.fspath(path)
  metadata = read_metadata(path)
  _check_header(path, metadata)
  entries = metadata["arrays"]
  for entry in entries:
    if not (isinstance(entry, dict) and isinstance(entry.get("key"), str)
            and isinstance(entry.get("shape"), list) and isinstance(entry.get("dtype"), str)):
      raise _fail(path, f"corrupted metadata (array entry {entry!r}).")
  arrays = []
  try:
    with np.load(path, allow_pickle=False) as npz:
      names = set(npz.files)
      expected = {entry["key"] for entry in entries} | {METADATA_NAME}
      if len(expected) != len(entries) + 1 or names != expected:
        raise _fail(path, f"its members (extra {sorted(names - expected)[:3]}, missing "
                          f"{sorted(expected - names)[:3]}) do not match its metadata.")
      for entry in entries:
        key = entry["key"]
        arr = npz[key]
        if list(arr.shape) != entry["shape"] or str(arr.dtype) != entry["dtype"]:
          raise _fail(path, f"array {key} has shape {arr.shape} and dtype {arr.dtype}, the "
                            f"metadata says {entry['shape']} and {entry['dtype']}.")
        arrays.append((key, arr))
  except DetectorFileError:
    raise
  except FileNotFoundError:
    raise
  except (ValueError, zipfile.BadZipFile, EOFError, OSError, KeyError) as err:
    raise _fail(path, f"truncated or corrupted array data ({type(err).__name__}: "
                      f"{err}).") from None
  if payload_digest(metadata, arrays) != metadata["sha256"]:
    raise _fail(path, "checksum mismatch: the file was modified or corrupted after it was "
                      "written.")

  preprocessing = metadata["preprocessing"]
  try:
    template = _template(metadata["model"], metadata["num_classes"], metadata["input_dim"],
                         metadata["model_dim"], bool(preprocessing.get("applied")),
                         jnp.dtype(metadata["dtype"]), metadata["structure"])
  except ValueError as err:
    raise _fail(path, str(err)) from None
  except (TypeError, AttributeError) as err:  # e.g. non-positive sizes
    raise _fail(path, f"inconsistent metadata ({err}).") from None
  expected = _leaves(template)
  treedef = jax.tree_util.tree_structure(template)
  if [k for k, _ in expected] != [k for k, _ in arrays]:
    raise _fail(path, f"its arrays {[k for k, _ in arrays]} do not form a "
                      f"{metadata['model']} detector (expected {[k for k, _ in expected]}).")
  for (key, want), (_, arr) in zip(expected, arrays):
    if tuple(want.shape) != arr.shape or jnp.dtype(want.dtype) != arr.dtype:
      raise _fail(path, f"array {key} has shape {arr.shape} and dtype {arr.dtype}; a "
                        f"{metadata['model']} detector with these sizes needs "
                        f"{tuple(want.shape)} and {want.dtype}.")
    if np.issubdtype(arr.dtype, np.inexact) and np.any(np.isnan(arr)):
      raise _fail(path, f"array {key} holds NaN values.")
  return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(arr) for _, arr in arrays])
