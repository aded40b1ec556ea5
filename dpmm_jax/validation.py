"""Input checks at the public boundary: clear errors instead of silent NaNs.

Every public entry point converts its inputs here. Accepted feature dtypes: any float
(float16 and bfloat16 are upcast to float32), integers and bools (converted to float32).
Labels must be integers (integral floats are rejected: they usually mean a mix-up of
arrays).
"""
import numpy as np
import jax.numpy as jnp

_MAX_LISTED = 5


def _float_dtype(dtype):
  """The float dtype computations use for inputs of ``dtype`` (float64 only if x64 is on)."""
  if np.issubdtype(dtype, np.floating) and np.dtype(dtype).itemsize >= 4:
    return jnp.asarray(np.zeros((), dtype)).dtype  # float64 -> float32 unless x64 enabled
  return jnp.dtype(jnp.float32)


def features(x, name: str = "x", dim=None, allow_memmap: bool = False):
  """Checks a (N, D) feature array; returns it as a numpy array of a float dtype.

  Raises:
    TypeError: non-numeric dtype.
    ValueError: wrong ndim, empty, dimension mismatch, NaN or inf entries (with the count
      of bad rows and the first indices).
  """
  if allow_memmap and isinstance(x, np.memmap):
    arr = x
  else:
    arr = np.asarray(x)
  if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
    raise TypeError(f"{name} must be a numeric array, got dtype {arr.dtype}.")
  if arr.ndim != 2:
    raise ValueError(f"{name} must be 2-D (num_points, num_features), got shape {arr.shape}.")
  if arr.shape[0] == 0 or arr.shape[1] == 0:
    raise ValueError(f"{name} is empty (shape {arr.shape}).")
  if dim is not None and arr.shape[1] != dim:
    raise ValueError(f"{name} has {arr.shape[1]} features but the detector was fitted on "
                     f"{dim}; features from a different extractor or layer?")
  dtype = _float_dtype(arr.dtype)
  if not isinstance(arr, np.memmap):
    arr = arr.astype(dtype, copy=False)
    _check_finite(arr, name)
  return arr


def _check_finite(arr, name):
  if np.issubdtype(arr.dtype, np.floating):
    bad_rows = ~np.all(np.isfinite(arr), axis=1)
    if bad_rows.any():
      idx = np.flatnonzero(bad_rows)
      raise ValueError(f"{name} has {idx.size} row(s) with NaN or inf values (first rows: "
                       f"{idx[:_MAX_LISTED].tolist()}).")


def check_finite_chunk(arr, name, offset):
  """Finite check for one chunk of a memory-mapped array (row indices are global)."""
  try:
    _check_finite(np.asarray(arr), name)
  except ValueError as err:
    raise ValueError(f"{err} [chunk starting at row {offset}]") from None


def labels(y, num_points: int, num_classes=None, name: str = "y"):
  """Checks integer labels; returns (labels int32 numpy array, num_classes).

  Raises:
    TypeError: labels that are not integers.
    ValueError: wrong shape, labels outside 0..K-1, classes with no points, K < 2.
  """
  arr = np.asarray(y)
  if arr.ndim != 1 or arr.shape[0] != num_points:
    raise ValueError(f"{name} must have shape ({num_points},) to match the features, got "
                     f"{arr.shape}.")
  if not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
    raise TypeError(f"{name} must hold integer class labels, got dtype {arr.dtype}.")
  if arr.min() < 0:
    raise ValueError(f"{name} has negative labels (min {arr.min()}); labels must be "
                     "0..K-1.")
  if num_classes is None:
    num_classes = int(arr.max()) + 1
  num_classes = int(num_classes)
  if arr.max() >= num_classes:
    raise ValueError(f"{name} has labels up to {arr.max()} but num_classes={num_classes}; "
                     f"labels must lie in 0..{num_classes - 1}.")
  if num_classes < 2:
    raise ValueError(f"OOD detection needs at least 2 classes, got {num_classes}.")
  counts = np.bincount(arr, minlength=num_classes)
  empty = np.flatnonzero(counts == 0)
  if empty.size:
    raise ValueError(f"{empty.size} class(es) have no training points (first: "
                     f"{empty[:_MAX_LISTED].tolist()}); drop them or relabel 0..K-1.")
  return arr.astype(np.int32), num_classes


def positive(value, name):
  if not np.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a positive finite number, got {value}.")
  return value


def positive_or_none(value, name):
  if value is not None:
    positive(float(value), name)
  return value


def em_options(tol, max_iter):
  positive(float(tol), "tol")
  if int(max_iter) != max_iter or max_iter < 1:
    raise ValueError(f"max_iter must be a positive integer, got {max_iter}.")
