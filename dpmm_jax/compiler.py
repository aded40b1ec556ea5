"""``jit``: the library's ``jax.jit``, which compiles small CPU problems faster.

On small problems (a fit at K = 100, D = 64; the test suite's toy data) a user waits for
compilation, not for the run. XLA:CPU emits fused kernels with its MLIR "fusion emitters"
by default; its older emitters (``xla_cpu_use_fusion_emitters=False``) compile the same
programs about a third faster. They also run some kernels slower: the full-model fit
1.19-1.29x at K = 200, D = 256, the coupled scorer 1.06-1.97x, co-BPM's chain
0.99-1.53x in this machine's runs (benchmarks/RESULTS.md, sessions 16 and 25). So
``jit`` compiles a call with ``CPU_COMPILER_OPTIONS`` only when

* its array arguments hold at most ``SMALL_PROBLEM_ELEMENTS`` elements together (where
  compilation dominates; larger calls compile with XLA's defaults and run at full speed);
* no ``xla_defaults()`` block is open in this thread (a caller that knows its call runs
  long, e.g. ``score`` on the coupled model over more than ``SMALL_PROBLEM_ELEMENTS``
  point x class x dimension triples, compiles with the defaults);
* the backend is CPU and the installed jaxlib knows the options (probed once per
  process with a one-line program: an unknown option would fail every compilation);
* the call compiles a program of its own: at the top level or under ``jax.vmap`` alone.
  jax rejects ``compiler_options`` on a jit staged into another program (inside
  ``jax.jit``, ``grad``, ``scan``, ``checkpoint``); there the plain ``jax.jit`` of the
  same function is called and the enclosing program is compiled as its owner chose;
* ``DPMM_JAX_COMPILER_OPTIONS`` is not ``0`` (``off``/``false``/``no``; read at each call).

Programs whose run time is long even on small inputs (co-BPM's chain, the MSP head's
training, the MCMC and VB fits of ``gmm``, ``lddp``, ``discovery``) use plain ``jax.jit``.
Only the library's own programs are affected (no process-wide ``XLA_FLAGS``); a user's
``XLA_FLAGS`` still apply to them. Results agree with the default compilation to float32
round-off (``tests/test_compiler.py``).
"""
import contextlib
import functools
import os
import threading
from typing import Any, Callable, Dict, Optional

import jax

ENV_VAR = "DPMM_JAX_COMPILER_OPTIONS"
CPU_COMPILER_OPTIONS: Dict[str, Any] = {"xla_cpu_use_fusion_emitters": False}
# 2^22 elements (16 MB in float32): the full model's statistics at K = 200, D = 128 hold
# 3.3 M (run 0.95-1.14x of the defaults'), at K = 200, D = 256 (1.19-1.29x slower run) 13.3 M.
SMALL_PROBLEM_ELEMENTS = 1 << 22
_OFF = ("0", "off", "false", "no")
_supported = [None]   # whether this jaxlib accepts the options (probed once)
_lock = threading.Lock()
_xla_defaults = threading.local()


def _compiler_options_probe(v):
  return v + 1


def _probe() -> bool:
  """Whether this jaxlib accepts ``CPU_COMPILER_OPTIONS`` (one tiny compilation)."""
  try:
    jax.jit(_compiler_options_probe, compiler_options=CPU_COMPILER_OPTIONS).lower(
        jax.ShapeDtypeStruct((), "float32")).compile()
    return True
  except Exception:  # pylint: disable=broad-except  # e.g. "No such compile option"
    return False


def options() -> Optional[Dict[str, Any]]:
  """The options a small top-level call compiles with in this process now, or None."""
  if os.environ.get(ENV_VAR, "").strip().lower() in _OFF:
    return None
  if jax.default_backend() != "cpu":
    return None
  if _supported[0] is None:
    with _lock:
      if _supported[0] is None:
        _supported[0] = _probe()
  return CPU_COMPILER_OPTIONS if _supported[0] else None


@contextlib.contextmanager
def xla_defaults():
  """Calls made inside (in this thread) compile with XLA's defaults."""
  previous = getattr(_xla_defaults, "on", False)
  _xla_defaults.on = True
  try:
    yield
  finally:
    _xla_defaults.on = previous


def _compiled_on_its_own() -> bool:
  """Whether a jit called now compiles as a program of its own: at the top level or
  under vmaps only (whose batched jit still compiles on its own). False when unsure."""
  try:
    ctx = jax.core.trace_ctx
    if ctx.is_top_level():
      return True
    trace = ctx.trace
    while type(trace).__name__ == "BatchTrace":
      trace = trace.parent_trace
    return type(trace).__name__ == "EvalTrace"
  except AttributeError:  # pragma: no cover - a jax whose trace context differs
    return False


def is_traced(*trees) -> bool:
  """Whether any leaf of ``trees`` is a jax tracer: the call runs inside ``jit``,
  ``vmap``, ``grad``, ..., where values (and host-side shortcuts) are unavailable."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(trees))


def is_small(args) -> bool:
  """Whether the array leaves of ``args`` (any pytree) hold at most
  ``SMALL_PROBLEM_ELEMENTS`` elements together."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(args):
    total += getattr(leaf, "size", 1)
    if total > SMALL_PROBLEM_ELEMENTS:
      return False
  return True


def jit(fun: Optional[Callable] = None, **jit_kwargs):
  """``jax.jit(fun, **jit_kwargs)`` that compiles small top-level CPU calls with
  ``options()`` (module docstring).

  Usable as ``@jit``, ``@functools.partial(jit, static_argnames=...)`` or ``jit(f, ...)``.
  The result also has ``lower`` and ``trace`` (of the variant the call would use) and
  ``_cache_size`` (both variants together).
  """
  if fun is None:
    return functools.partial(jit, **jit_kwargs)
  plain = jax.jit(fun, **jit_kwargs)
  tuned = jax.jit(fun, compiler_options=CPU_COMPILER_OPTIONS, **jit_kwargs)

  def pick(args, kwargs):
    if (not getattr(_xla_defaults, "on", False) and _compiled_on_its_own()
        and is_small((args, kwargs)) and options() is not None):
      return tuned
    return plain

  @functools.wraps(fun)
  def call(*args, **kwargs):
    return pick(args, kwargs)(*args, **kwargs)

  call.lower = lambda *a, **k: pick(a, k).lower(*a, **k)
  call.trace = lambda *a, **k: pick(a, k).trace(*a, **k)
  call.eval_shape = plain.eval_shape
  call._cache_size = lambda: plain._cache_size() + tuned._cache_size()  # pylint: disable=protected-access
  call.clear_cache = lambda: (plain.clear_cache(), tuned.clear_cache())
  call._plain, call._tuned = plain, tuned  # pylint: disable=protected-access
  return call
