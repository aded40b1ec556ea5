"""jax's persistent compilation cache, on by default in a per-user directory.

A fit compiles its EM loop, the scorer compiles once per chunk shape: seconds that a
user who fits once pays in every new process. jax can keep compiled programs on disk
(``jax_compilation_cache_dir``); ``import dpmm_jax`` turns that on, so the second process
that fits or scores the same shapes loads them instead of compiling. Nothing is changed
when

* the user has configured a cache directory already (``JAX_COMPILATION_CACHE_DIR`` or
  ``jax.config.update("jax_compilation_cache_dir", ...)`` before ``import dpmm_jax``);
* ``DPMM_JAX_COMPILATION_CACHE=0`` (or ``off``/``false``/``no``) is set; or
* the directory cannot be created or written.

The directory is ``$DPMM_JAX_COMPILATION_CACHE`` when that names a path, else
``$XDG_CACHE_HOME/dpmm_jax/jax_cache/<host>`` (``~/.cache/dpmm_jax/jax_cache/<host>``),
where ``<host>`` names this machine's CPU (architecture and a hash of its model and
feature flags, ``host_key()``). A CPU program is machine code for the CPU that compiled
it, and jax's cache key does not include the CPU: a home directory shared by machines of
different CPUs would otherwise hand one machine's programs to another (XLA warns "This
could lead to execution errors such as SIGILL"). While a public-API call runs
(``store_every_program()``), every program it compiles is stored: left out, a fit's
dozen small programs (statistics, checks, preprocessing) cost a second process 0.5-0.7 s
of its first fit (benchmarks/RESULTS.md, session 18). Programs compiled outside those
calls (your own, or the functional layer's called directly) are stored when they compile
in at least ``MIN_COMPILE_SECS`` (jax's default is 1 s, which would leave out most
scorers), so that a session's many tiny eager operations do not fill the directory.
``disable()`` switches the cache off before the first compilation; delete the directory
to clear it (jax does not bound its size).

jaxlib logs a C++ warning ("Assume version compatibility. PjRt-IFRT does not track XLA
executable versions.") each time it loads a program from the cache, and on some CPUs
(AMD Zen 4 with jaxlib 0.9) two errors per program ("Loading XLA:CPU AOT result. Target
machine feature +prefer-no-gather is not supported on the host machine"): the compiler
records tuning features that the loader's host detection does not list, on the very
machine that compiled the program. ``quiet_cache_loads()`` raises jaxlib's C++ log
threshold to FATAL while a public-API call runs (and restores it after), but only when
this module enabled the cache and the C++ threshold is jax's default (``TF_CPP_MIN_LOG_LEVEL``
unset or 1, ``jax_logging_level`` unset): a user's own setting is respected, and C++
warnings outside the library's calls are untouched.
"""
import contextlib
import hashlib
import os
import platform
import threading
from typing import Optional

import jax

try:
  from jax._src.lib import utils as _jaxlib_utils  # absl_set_min_log_level
except ImportError:  # pragma: no cover - a jaxlib without the setter: nothing is silenced
  _jaxlib_utils = None
try:  # the storing threshold as a thread-local context (``store_every_program``)
  from jax._src.config import persistent_cache_min_compile_time_secs as _min_compile_secs
except ImportError:  # pragma: no cover - a jax without it: MIN_COMPILE_SECS throughout
  _min_compile_secs = None

ENV_VAR = "DPMM_JAX_COMPILATION_CACHE"
MIN_COMPILE_SECS = 0.2
_OFF = ("0", "off", "false", "no")
_enabled_dir = [None]
# jaxlib's C++ log thresholds: FATAL, and WARNING, the default that ``import jax`` sets
# (TF_CPP_MIN_LOG_LEVEL=1 unless the user set it).
_ABSL_FATAL, _ABSL_WARNING = 3, 1
_quiet_lock = threading.Lock()
_quiet_depth = [0]


def host_key() -> str:
  """``<architecture>-<12 hex digits>``: a hash of the CPU's model names and feature
  flags (``/proc/cpuinfo``; ``platform.processor()`` where that is missing)."""
  arch = platform.machine() or "unknown"
  try:
    with open("/proc/cpuinfo") as f:
      lines = sorted({line.strip() for line in f
                      if line.startswith(("model name", "flags", "Features", "CPU part",
                                          "CPU implementer", "cpu model"))})
  except OSError:
    lines = [platform.processor()]
  digest = hashlib.sha256("\n".join([arch] + lines).encode()).hexdigest()[:12]
  return f"{arch}-{digest}"


def default_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "dpmm_jax", "jax_cache", host_key())


def enable_default() -> Optional[str]:
  """Points jax's persistent cache at the per-user directory unless the user configured
  one or opted out. Returns the directory it set (None if it changed nothing)."""
  setting = os.environ.get(ENV_VAR, "").strip()
  if setting.lower() in _OFF:
    return None
  if jax.config.jax_compilation_cache_dir:
    return None                                  # the user's own cache wins
  path = setting if setting and setting.lower() not in ("1", "on", "true", "yes") else (
      default_dir())
  try:
    os.makedirs(path, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
      return None
  except OSError:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  if jax.config.jax_persistent_cache_min_compile_time_secs > MIN_COMPILE_SECS:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
  _enabled_dir[0] = path
  return path


def enabled_dir() -> Optional[str]:
  """The directory ``import dpmm_jax`` enabled, if it is still jax's setting."""
  if _enabled_dir[0] and jax.config.jax_compilation_cache_dir == _enabled_dir[0]:
    return _enabled_dir[0]
  return None


def disable() -> None:
  """Turns off the cache that ``import dpmm_jax`` enabled (a cache directory the user
  configured is left alone). Call it before the first compilation: jax reads the
  setting once per process."""
  if enabled_dir():
    jax.config.update("jax_compilation_cache_dir", None)
  _enabled_dir[0] = None


@contextlib.contextmanager
def store_every_program():
  """Stores every program compiled while it is open, however quickly it compiled, in the
  cache this module enabled (thread-local; nothing changes when the user configured the
  cache or opted out)."""
  if _enabled_dir[0] is None or not callable(_min_compile_secs):
    yield
    return
  with _min_compile_secs(0.0):
    yield


def _may_silence() -> bool:
  return (_jaxlib_utils is not None
          and hasattr(_jaxlib_utils, "absl_set_min_log_level")
          and enabled_dir() is not None
          and os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1").strip() == "1"
          and jax.config.jax_logging_level in (None, "NOTSET"))


@contextlib.contextmanager
def quiet_cache_loads():
  """Hides jaxlib's per-load cache warning for the duration (re-entrant; see the module
  docstring for when it does nothing)."""
  if not _may_silence():
    yield
    return
  with _quiet_lock:
    if _quiet_depth[0] == 0:
      _jaxlib_utils.absl_set_min_log_level(_ABSL_FATAL)
    _quiet_depth[0] += 1
  try:
    yield
  finally:
    with _quiet_lock:
      _quiet_depth[0] -= 1
      if _quiet_depth[0] == 0:
        _jaxlib_utils.absl_set_min_log_level(_ABSL_WARNING)


enable_default()
