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
``$XDG_CACHE_HOME/dpmm_jax/jax_cache`` (``~/.cache/dpmm_jax/jax_cache``). Programs that
compile in at least ``MIN_COMPILE_SECS`` are stored (jax's default is 1 s, which would
leave out most scorers). ``disable()`` switches it off before the first compilation;
delete the directory to clear it (jax does not bound its size).
"""
import os
from typing import Optional

import jax

ENV_VAR = "DPMM_JAX_COMPILATION_CACHE"
MIN_COMPILE_SECS = 0.2
_OFF = ("0", "off", "false", "no")
_enabled_dir = [None]


def default_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "dpmm_jax", "jax_cache")


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


enable_default()
