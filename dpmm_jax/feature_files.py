"""Feature files: embeddings and labels on disk, checked on the way in.

Two formats are read:

* ``<name>.npz`` with arrays ``features`` (N, D) and, optionally, ``labels`` (N,). The
  whole file is loaded into memory (``.npz`` members cannot be memory-mapped).
* a pair of ``.npy`` files ``<name>_features.npy`` (N, D) and ``<name>_labels.npy`` (N,),
  opened memory-mapped (``np.memmap``), so training sets larger than memory stream
  through ``dpmm_jax.fit_detector`` in chunks. Give either the prefix ``<name>`` or the
  path of the features file.

Labels are integers in 0..K-1 for training and ID test sets; OOD sets need no labels
(a ``labels`` array of -1 is accepted there and ignored). The checks are those of
``dpmm_jax.validation`` (the same as ``fit_detector``'s), with the file name in every
message: ``TypeError`` for non-numeric features or non-integer labels, ``ValueError``
for missing arrays, shape mismatches, negative labels and rows with NaN or inf values
(with their count and the first row indices, scanned in chunks for memory-mapped
files). Features keep their stored dtype (converted when fitting or scoring).
"""
import os
from typing import NamedTuple, Optional

import numpy as np

from dpmm_jax import validation

__all__ = ["FeatureSet", "load", "resolve", "save_npz", "save_npy_pair"]

_SCAN_ROWS = 65536


class FeatureSet(NamedTuple):
  """features: (N, D) numpy array or ``np.memmap``; labels: (N,) int array or None;
  path: the file the features came from."""
  features: np.ndarray
  labels: Optional[np.ndarray]
  path: str

  @property
  def num_points(self) -> int:
    return int(self.features.shape[0])

  @property
  def dim(self) -> int:
    return int(self.features.shape[1])


def resolve(path: str):
  """Which format ``path`` names: ``("npz", file)`` or ``("npy", features, labels)``.

  Raises:
    ValueError: nothing matching ``path`` exists.
  """
  if path.endswith(".npz"):
    if not os.path.isfile(path):
      raise ValueError(f"Feature file {path!r} does not exist.")
    return ("npz", path)
  if os.path.isfile(path + ".npz"):
    return ("npz", path + ".npz")
  prefix = path
  for suffix in ("_features.npy", "_labels.npy"):
    if path.endswith(suffix):
      prefix = path[:-len(suffix)]
  features = prefix + "_features.npy"
  if os.path.isfile(features):
    return ("npy", features, prefix + "_labels.npy")
  raise ValueError(
      f"No feature file for {path!r}: expected {path}.npz (or a .npz path) with arrays "
      f"'features' and 'labels', or the pair {features} + {prefix}_labels.npy.")


def load(path: str, *, require_labels: bool = True, check_finite: bool = True,
         dim: Optional[int] = None) -> FeatureSet:
  """Loads and checks a feature file.

  Args:
    path: a ``.npz`` file, or the prefix / features file of a ``.npy`` pair.
    require_labels: labels must be present, integer and >= 0 (training and ID test
      sets). If False (OOD sets) labels are optional and returned as given (or None).
    check_finite: scan for rows with NaN or inf values.
    dim: expected feature dimension D (e.g. that of the training file).

  Returns:
    FeatureSet.

  Raises:
    ValueError: see the module docstring.
  """
  kind = resolve(path)
  if kind[0] == "npz":
    name = kind[1]
    try:
      with np.load(name, allow_pickle=False) as archive:
        keys = set(archive.files)
        if "features" not in keys:
          raise ValueError(f"{name}: no 'features' array (found {sorted(keys)}); save "
                           "with np.savez(path, features=X, labels=y).")
        features = archive["features"]
        labels = archive["labels"] if "labels" in keys else None
    except ValueError as e:
      if "allow_pickle" in str(e) or "Object arrays" in str(e):
        raise ValueError(f"{name}: holds object (pickled) arrays; store 'features' as a "
                         "numeric array and 'labels' as integers.") from e
      raise
  else:
    _, name, labels_name = kind
    features = np.load(name, mmap_mode="r", allow_pickle=False)
    labels = (np.load(labels_name, mmap_mode="r", allow_pickle=False)
              if os.path.isfile(labels_name) else None)
    if labels is None and require_labels:
      raise ValueError(f"{name}: the labels file {labels_name} is missing.")
  features = _check_features(features, name, dim)
  if labels is None:
    if require_labels:
      raise ValueError(f"{name}: no 'labels' array; training and ID test files need "
                       "integer labels 0..K-1.")
  else:
    labels = _check_labels(labels, features.shape[0], name, require_labels)
  if check_finite:
    _check_finite(features, name)
  return FeatureSet(features, labels, name)


def _check_features(x, name, dim):
  return validation.features(x, f"{name}: features", dim=dim, allow_memmap=True,
                             dim_source="the training file has", convert=False)


def _check_labels(y, num_points, name, require_valid):
  if require_valid:
    return validation.label_array(y, num_points, f"{name}: labels")
  # OOD sets: the labels are not used; any integer values (e.g. -1) are kept as given.
  if y.ndim != 1 or y.shape[0] != num_points:
    raise ValueError(f"{name}: labels must have shape ({num_points},) to match the "
                     f"features, got {y.shape}.")
  return np.asarray(y) if np.issubdtype(y.dtype, np.integer) else None


def _check_finite(x, name):
  validation.check_finite_rows(x, f"{name}: features", _SCAN_ROWS)


def save_npz(path: str, features, labels=None) -> str:
  """Writes ``features`` (and ``labels``) to ``path`` (``.npz`` appended if missing)."""
  if not path.endswith(".npz"):
    path += ".npz"
  arrays = {"features": np.asarray(features)}
  if labels is not None:
    arrays["labels"] = np.asarray(labels)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  np.savez(path, **arrays)
  return path


def save_npy_pair(prefix: str, features, labels=None) -> str:
  """Writes ``<prefix>_features.npy`` (and ``<prefix>_labels.npy``); returns the prefix."""
  os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
  np.save(prefix + "_features.npy", np.asarray(features))
  if labels is not None:
    np.save(prefix + "_labels.npy", np.asarray(labels))
  return prefix
