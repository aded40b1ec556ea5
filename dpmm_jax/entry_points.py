"""How the library's one-call entry points run.

``fit_detector``, ``fit_detectors``, ``score``, ``class_scores``, ``predict`` and
``outlier_probability`` (``api``), ``divergence.estimate``, ``discovery.discover`` and
``discovery.predict_proba``, ``lddp.fit``, ``lddp.compile_fit`` and ``lddp.predict``, and
``gmm.fit_gmm`` run inside ``public_call``, which

* limits the BLAS/LAPACK pools to one thread (``threads.limited``; the caller's own
  setting is respected and restored),
* hides jaxlib's log lines for each program loaded from the compilation cache
  (``compilation_cache.quiet_cache_loads``; a warning, and on some CPUs two spurious
  errors several kilobytes long, per program),
* stores every program the call compiles in that cache, however quickly it compiled
  (``compilation_cache.store_every_program``),

and waits for the call's arrays before returning, so that no kernel runs after the limit
is lifted. Called inside the user's own ``jit`` or ``vmap`` (the arrays are tracers),
nothing is waited for. The functional layer below them (``models.*``,
``divergence.run_chain``, ``discovery.fit``, ...) changes nothing around a call.
"""
import functools

import jax

from dpmm_jax import compilation_cache
from dpmm_jax import compiler
from dpmm_jax import threads


def _wait_for_arrays(out):
  if not compiler.is_traced(out):
    for leaf in jax.tree_util.tree_leaves(out):
      if isinstance(leaf, jax.Array):
        leaf.block_until_ready()
  return out


def public_call(fn):
  """Decorator: runs ``fn`` as a library entry point (see the module docstring).
  Warnings issued by ``fn`` with ``stacklevel=2`` name the wrapper's frame: count one
  more to reach the caller."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with threads.limited(), compilation_cache.quiet_cache_loads():
      with compilation_cache.store_every_program():
        return _wait_for_arrays(fn(*args, **kwargs))
  return wrapped
