"""Input checks at the public boundary: clear errors instead of silent NaNs.

Every public entry point converts its inputs here and raises ``TypeError`` (wrong kind of
input) or ``ValueError`` (wrong shape or value) with a message that names the argument,
the problem and, for bad rows, how many there are and the first few indices.

What is accepted (see ``docs/failure_modes.md``):

* features: a 2-D array (N, D), N >= 1, D >= 1, of any real numeric dtype. float32 and
  float64 are used as they are (float64 only when ``jax_enable_x64`` is on, float32
  otherwise); float16, bfloat16, integers and bools are converted to float32 (integers
  above 2**24 lose precision there). Complex, string and object arrays are rejected.
  Every entry must be finite, also after the conversion (float64 values beyond the
  float32 range are reported as such).
* labels: a 1-D integer array (N,) with values in 0..K-1; bools and floats are rejected,
  even integral floats (they usually mean an array mix-up).
"""
import numbers
import operator

import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import compiler

_MAX_LISTED = 5


def _listed(indices) -> str:
  indices = np.asarray(indices).tolist()
  more = ", ..." if len(indices) > _MAX_LISTED else ""
  return f"[{', '.join(str(i) for i in indices[:_MAX_LISTED])}{more}]"


def _float_dtype(dtype):
  """The float dtype computations use for inputs of ``dtype`` (float64 only if x64 is on)."""
  if np.issubdtype(dtype, np.floating) and np.dtype(dtype).itemsize >= 4:
    return jnp.asarray(np.zeros((), dtype)).dtype  # float64 -> float32 unless x64 enabled
  return jnp.dtype(jnp.float32)


def _is_real_numeric(dtype) -> bool:
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return True
  if np.issubdtype(dtype, np.complexfloating):
    return False
  if np.issubdtype(dtype, np.number):
    return True
  return dtype.name == "bfloat16"  # ml_dtypes' bfloat16 is not a numpy "number"


def features(x, name: str = "x", dim=None, allow_memmap: bool = False,
             allow_empty: bool = False, dim_source: str = "the detector was fitted on",
             convert: bool = True):
  """Checks a (N, D) feature array; returns it as a numpy array of a float dtype.

  Args:
    x: array-like (N, D).
    name: argument name used in messages.
    dim: required number of features (e.g. the detector's input dimension).
    allow_memmap: keep an ``np.memmap`` as it is (the caller checks each chunk with
      ``check_finite_chunk`` while reading it).
    allow_empty: accept N = 0 (scoring an empty batch).
    dim_source: where ``dim`` comes from, for the mismatch message.
    convert: check finiteness and cast to the compute float dtype; with False only the
      kind, shape and dimension are checked and the array is returned as it is.
  Returns:
    numpy array (or the memmap) with a float dtype.
  Raises:
    TypeError: non-numeric or complex dtype.
    ValueError: wrong ndim, empty, dimension mismatch, NaN or inf entries (with the count
      of bad rows and the first indices), values beyond the float32 range.
  """
  if allow_memmap and isinstance(x, np.memmap):
    arr = x
  else:
    try:
      arr = np.asarray(x)
    except (TypeError, ValueError) as err:
      raise TypeError(f"{name} must be a numeric array; could not convert a "
                      f"{type(x).__name__}: {err}") from None
  if not _is_real_numeric(arr.dtype):
    raise TypeError(f"{name} must be a real numeric array (float, int or bool), got dtype "
                    f"{arr.dtype}.")
  if arr.ndim != 2:
    hint = ""
    if arr.ndim == 1:
      hint = (" For a single feature use x.reshape(-1, 1); for a single point use "
              "x.reshape(1, -1).")
    raise ValueError(f"{name} must be 2-D (num_points, num_features), got shape "
                     f"{arr.shape}.{hint}")
  if arr.shape[1] == 0 or (arr.shape[0] == 0 and not allow_empty):
    raise ValueError(f"{name} is empty (shape {arr.shape}).")
  if dim is not None and arr.shape[1] != dim:
    raise ValueError(f"{name} has {arr.shape[1]} features but {dim_source} {dim}; "
                     "features from a different extractor or layer?")
  dtype = _float_dtype(arr.dtype)
  if convert and not isinstance(arr, np.memmap):
    _check_finite(arr, name)
    arr = _convert(arr, dtype, name)
  return arr


def _check_finite(arr, name, offset: int = 0):
  if np.issubdtype(arr.dtype, np.inexact) or arr.dtype.name == "bfloat16":
    bad_rows = ~np.all(np.isfinite(arr), axis=1)
    if bad_rows.any():
      idx = np.flatnonzero(bad_rows) + offset
      raise ValueError(f"{name} has {idx.size} row(s) with NaN or inf values (first rows: "
                       f"{_listed(idx)}).")


def _convert(arr, dtype, name, offset: int = 0):
  """Casts to the compute dtype; a finite float64 value beyond float32's range is an
  error rather than an inf."""
  if arr.dtype == dtype:
    return arr
  with np.errstate(over="ignore", invalid="ignore"):
    out = arr.astype(dtype)
  if np.issubdtype(arr.dtype, np.floating) and np.dtype(dtype).itemsize < arr.dtype.itemsize:
    bad_rows = ~np.all(np.isfinite(out), axis=1)
    if bad_rows.any():
      idx = np.flatnonzero(bad_rows) + offset
      raise ValueError(
          f"{name} has {idx.size} row(s) with values beyond the {np.dtype(dtype).name} range "
          f"(first rows: {_listed(idx)}; largest |value| {np.max(np.abs(arr)):.3g}); "
          "rescale the features or enable jax_enable_x64.")
  return out


def check_finite_rows(arr, name: str, chunk_rows: int = 65536) -> None:
  """Scans a (N, D) array (or memmap) in chunks; raises ValueError with the total count
  of rows holding NaN or inf and the first of them."""
  if not (np.issubdtype(arr.dtype, np.inexact) or arr.dtype.name == "bfloat16"):
    return
  bad = []
  for start in range(0, arr.shape[0], chunk_rows):
    chunk = np.asarray(arr[start:start + chunk_rows])
    bad.append(np.flatnonzero(~np.all(np.isfinite(chunk), axis=1)) + start)
  bad = np.concatenate(bad) if bad else np.zeros(0, np.int64)
  if bad.size:
    raise ValueError(f"{name} has {bad.size} row(s) with NaN or inf values out of "
                     f"{arr.shape[0]} (first rows: {_listed(bad)}).")


def check_finite_chunk(arr, name, offset, check: bool = True):
  """Finite check for one chunk of a memory-mapped array (row indices are global), and
  its cast to the compute dtype. ``check=False``: the cast alone (rows already checked)."""
  arr = np.asarray(arr)
  if check:
    _check_finite(arr, name, offset)
  return _convert(arr, _float_dtype(arr.dtype), name, offset)


def check_num_classes(value, name: str = "num_classes"):
  """A positive Python int (bools and non-integral values are rejected)."""
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an integer, got {value!r}.")
  value = operator.index(value)
  if value < 1:
    raise ValueError(f"{name} must be >= 1, got {value}.")
  return value


def label_array(y, num_points: int, name: str = "y") -> np.ndarray:
  """Checks a (N,) array of non-negative integer labels (no class-count checks).

  Raises:
    TypeError: labels that are not integers (bool and float labels included).
    ValueError: wrong shape, empty, negative labels.
  """
  arr = np.asarray(y)
  if arr.ndim != 1 or arr.shape[0] != num_points:
    raise ValueError(f"{name} must have shape ({num_points},) to match the features, got "
                     f"{arr.shape}.")
  if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"{name} must hold integer class labels, got dtype {arr.dtype}; map "
                    "class names (or float labels) to integers 0..K-1.")
  if arr.size == 0:
    raise ValueError(f"{name} is empty.")
  negative = np.flatnonzero(arr < 0)
  if negative.size:
    raise ValueError(f"{name} has {negative.size} negative label(s) (first at rows "
                     f"{_listed(negative)}); labels must be 0..K-1.")
  return arr


def labels(y, num_points: int, num_classes=None, name: str = "y"):
  """Checks integer labels; returns (labels int32 numpy array, num_classes).

  Raises:
    TypeError: labels that are not integers (bool and float labels included).
    ValueError: wrong shape, labels outside 0..K-1, classes with no points, K < 2.
  """
  num_classes = check_num_classes(num_classes)
  arr = label_array(y, num_points, name)
  if num_classes is None:
    num_classes = int(arr.max()) + 1
  too_big = np.flatnonzero(arr >= num_classes)
  if too_big.size:
    raise ValueError(f"{name} has {too_big.size} label(s) >= num_classes={num_classes} "
                     f"(first at rows {_listed(too_big)}, largest {arr.max()}); labels must "
                     f"lie in 0..{num_classes - 1}.")
  if num_classes < 2:
    raise ValueError(
        f"OOD detection needs at least 2 classes, got {num_classes}: the models learn "
        "their priors from the variation between classes (and a softmax over one class "
        "is constant).")
  counts = np.bincount(arr, minlength=num_classes)
  empty = np.flatnonzero(counts == 0)
  if empty.size:
    raise ValueError(f"{empty.size} class(es) have no training points (first: "
                     f"{_listed(empty)}); drop them or relabel 0..K-1.")
  return arr.astype(np.int32), num_classes


def _number(value, name, what: str, allowed) -> None:
  """Raises unless ``value`` is a finite number with ``allowed(value)``."""
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a {what} finite number, got {value!r}.") from None
  if not np.isfinite(number) or not allowed(number):
    raise ValueError(f"{name} must be a {what} finite number, got {value}.")


def _integer(value, name, what: str, smallest: int) -> int:
  """Raises unless ``value`` is an integer (not a bool) >= ``smallest``."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be a {what} integer, got {value!r}.")
  if value < smallest:
    raise ValueError(f"{name} must be a {what} integer, got {value}.")
  return int(value)


def positive(value, name):
  _number(value, name, "positive", lambda v: v > 0)
  return value


def non_negative(value, name):
  _number(value, name, "non-negative", lambda v: v >= 0)
  return value


def positive_or_none(value, name):
  if value is not None:
    positive(value, name)
  return value


def positive_int(value, name):
  return _integer(value, name, "positive", 1)


def non_negative_int(value, name):
  return _integer(value, name, "non-negative", 0)


def prng_key(key, name: str = "key"):
  """``key`` if it is one jax PRNG key: a typed key (``jax.random.key``, shape ()) or a
  raw one (``jax.random.PRNGKey``, uint32 of shape (2,)); else a TypeError that says how
  to make one (an int seed is not accepted: jax keys are explicit)."""
  dtype = getattr(key, "dtype", None)
  shape = getattr(key, "shape", None)
  typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
  if isinstance(key, (jax.Array, np.ndarray)) and (
      (typed and shape == ()) or (not typed and dtype == np.uint32 and shape == (2,))):
    return key
  got = (f"an array of shape {shape} and dtype {dtype}" if shape is not None
         else f"{type(key).__name__} {key!r}")
  raise TypeError(f"{name} must be one jax PRNG key, e.g. jax.random.key(0) or "
                  f"jax.random.PRNGKey(0); got {got}.")


def em_options(tol, max_iter):
  positive(tol, "tol")
  if isinstance(max_iter, (bool, np.bool_)) or not isinstance(max_iter, numbers.Integral):
    raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}.")
  if max_iter < 1:
    raise ValueError(f"max_iter must be a positive integer, got {max_iter}.")


# ---------------------------------------------------------------- statistics functions
def stats_chunk(x, y, num_classes: int, offset: int = 0, dim=None, name: str = "x",
                finite_checked: bool = False):
  """Checks one (x, y) chunk given to the chunked statistics functions.

  Args:
    x: (n, D) features (numpy or a jax array, which stays on its device); y: (n,) integer
      labels in 0..K-1.
    num_classes: K.
    offset: index of the chunk's first row in the whole data set (for messages).
    dim: D of the previous chunks (None for the first).
    finite_checked: the caller has checked that the features are finite: skip that
      check (for a jax array it waits for the chunk to be computed).
  Returns:
    (x with a float dtype, y as an int32 numpy array).
  """
  on_device = isinstance(x, jax.Array)
  if not on_device:
    x = np.asarray(x)
  if not _is_real_numeric(x.dtype):
    raise TypeError(f"{name} must be a real numeric array, got dtype {x.dtype}.")
  if x.ndim != 2:
    raise ValueError(f"{name} chunks must be 2-D (num_points, num_features), got shape "
                     f"{x.shape} [chunk starting at row {offset}].")
  if dim is not None and x.shape[1] != dim:
    raise ValueError(f"{name} chunk starting at row {offset} has {x.shape[1]} features, "
                     f"the previous chunks {dim}.")
  if x.shape[1] == 0:
    raise ValueError(f"{name} has no features (shape {x.shape}).")
  y = np.asarray(y)
  if y.ndim != 1 or y.shape[0] != x.shape[0]:
    raise ValueError(f"labels must have shape ({x.shape[0]},) to match the features, got "
                     f"{y.shape} [chunk starting at row {offset}].")
  if y.dtype == np.bool_ or not np.issubdtype(y.dtype, np.integer):
    raise TypeError(f"labels must be integers, got dtype {y.dtype}.")
  bad = np.flatnonzero((y < 0) | (y >= num_classes))
  if bad.size:
    raise ValueError(f"{bad.size} label(s) outside 0..{num_classes - 1} (first at rows "
                     f"{_listed(bad + offset)}).")
  if on_device:
    if (not finite_checked and jnp.issubdtype(x.dtype, jnp.inexact)
        and not bool(_all_finite(x))):
      _check_finite(np.asarray(x), name, offset)
    return x.astype(_float_dtype(x.dtype)), y.astype(np.int32)
  if not finite_checked:
    _check_finite(x, name, offset)
  return _convert(x, _float_dtype(x.dtype), name, offset), y.astype(np.int32)


@compiler.jit
def _all_finite(x):
  """() whether every entry of x is finite: one compiled program per shape (eagerly,
  isfinite and all would compile one each)."""
  return jnp.all(jnp.isfinite(x))


def finite_stats(stats, what: str = "training features"):
  """Raises if accumulated statistics over- or underflowed (features far too large)."""
  for field in ("count", "mean", "sq_dev", "scatter", "pooled_scatter"):
    value = getattr(stats, field)
    if value is not None and not bool(np.all(np.isfinite(np.asarray(value)))):
      raise ValueError(
          f"The statistics of the {what} overflowed ({field} is not finite): squared "
          f"feature values exceed the {np.asarray(value).dtype} range. Rescale the features "
          "(or enable jax_enable_x64).")
