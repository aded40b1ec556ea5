"""The BLAS/LAPACK thread pools behind the library's CPU kernels.

On CPU, XLA runs matrix products on its own thread pool, but jaxlib's LAPACK kernels
(Cholesky, eigh, triangular solves: the full and tied fits and the spectral reduction)
call the OpenBLAS bundled with scipy (``scipy.linalg.cython_lapack``), and the
host-side checks (``numpy.linalg``) call numpy's OpenBLAS. The scorers call no LAPACK
kernel (the full model's inverse factors are matrix products,
``linalg.triangular_inverse``), so they run at the same speed with or without a limit.
By default OpenBLAS starts one busy-waiting thread per core. Inside an XLA program those
threads compete with XLA's pool, and with any other process. On a 2-core machine with
one other CPU-bound job, ``fit_detector`` of the full model (K = 50, D = 384) took
52-108 s with the pools unmanaged against 3.7-4.4 s limited (BUILD.md, "Threads"); a
user's own ``jax.jit(models.full.fit)`` (K = 200, D = 768), which the library does not
manage, took 14.4-16.7 s with nothing set against 11.1-11.7 s with
``OPENBLAS_NUM_THREADS=1`` (benchmarks/RESULTS.md, session 21).

So the library's one-call entry points (``fit_detector``, ``score``, ``class_scores``,
``predict``, ``outlier_probability``, ``divergence.estimate``, ``discovery.discover``,
``lddp.fit``, ``gmm.fit_gmm``, ...: ``entry_points.public_call``) run with those pools
limited to ONE thread (via ``threadpoolctl``) and restore the caller's setting when they
return; the parallelism comes from XLA's pool. The limit is left alone (nothing is changed) when

* the user has set ``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``GOTO_NUM_THREADS``,
  ``MKL_NUM_THREADS`` or ``BLIS_NUM_THREADS`` (their choice is respected);
* ``DPMM_JAX_BLAS_THREADS`` is set: a positive integer is the limit used instead of 1,
  ``keep`` (or ``0``) turns the control off;
* ``set_blas_threads(None)`` was called (``set_blas_threads(n)`` sets the limit; it
  overrides the environment variables).

Functions below the public API (``models.full.fit`` etc.) do not change thread pools;
wrap them in ``with dpmm_jax.threads.limited():`` to get the same behaviour.
"""
import contextlib
import functools
import os
import threading
from typing import Optional

ENV_VAR = "DPMM_JAX_BLAS_THREADS"
USER_ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "GOTO_NUM_THREADS",
                 "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
DEFAULT_THREADS = 1
_UNSET = object()
_override = [_UNSET]
_lock = threading.Lock()
_state = {"depth": 0, "context": None}
_controller = [None]


def set_blas_threads(num_threads: Optional[int]) -> None:
  """Sets the BLAS/LAPACK thread limit used inside the public API (None: leave the
  pools alone). Overrides the environment variables."""
  if num_threads is not None:
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
      raise ValueError(f"num_threads must be a positive integer or None, got {num_threads!r}.")
  _override[0] = num_threads


def blas_threads() -> Optional[int]:
  """The limit the public API applies now (None: it leaves the thread pools alone)."""
  if _override[0] is not _UNSET:
    return _override[0]
  value = os.environ.get(ENV_VAR, "").strip().lower()
  if value:
    if value in ("keep", "0", "none"):
      return None
    try:
      n = int(value)
    except ValueError:
      raise ValueError(f"{ENV_VAR} must be a positive integer or 'keep', got "
                       f"{os.environ[ENV_VAR]!r}.") from None
    if n < 1:
      raise ValueError(f"{ENV_VAR} must be a positive integer or 'keep', got {n}.")
    return n
  if any(os.environ.get(v) for v in USER_ENV_VARS):
    return None
  return DEFAULT_THREADS


def _get_controller():
  """threadpoolctl's controller over numpy's and scipy's BLAS (None without
  threadpoolctl). scipy.linalg is imported first so that the OpenBLAS jaxlib's LAPACK
  kernels use is loaded and seen."""
  if _controller[0] is None:
    try:
      import scipy.linalg  # pylint: disable=g-import-not-at-top,unused-import
      import threadpoolctl  # pylint: disable=g-import-not-at-top
    except ImportError:
      _controller[0] = False
    else:
      _controller[0] = threadpoolctl.ThreadpoolController()
  return _controller[0] or None


@contextlib.contextmanager
def limited(num_threads=_UNSET):
  """Limits the BLAS/LAPACK pools for the duration (re-entrant; the outermost entry sets
  the limit and restores the previous one on exit). Results must be computed (not just
  dispatched) before the block ends: the public API converts them to numpy inside."""
  n = blas_threads() if num_threads is _UNSET else num_threads
  controller = _get_controller() if n is not None else None
  if controller is None:
    yield
    return
  with _lock:
    if _state["depth"] == 0:
      _state["context"] = controller.limit(limits=n, user_api="blas")
    _state["depth"] += 1
  try:
    yield
  finally:
    with _lock:
      _state["depth"] -= 1
      if _state["depth"] == 0:
        _state["context"].restore_original_limits()
        _state["context"] = None
