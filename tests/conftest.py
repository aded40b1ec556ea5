"""Shared test configuration.

Float64 tests live in ``tests/*_f64.py`` and switch ``jax_enable_x64`` on when they are
imported, i.e. at collection time. A pytest session that collects one of them together
with float32 tests would silently run the float32 tests in float64 (their tolerances and
the "naive float32 formula fails" checks then mean nothing), even when ``-k`` later
deselects the f64 file. ``tests/run_all.sh`` runs the passes in separate processes; this
hook turns an accidental mixed session into a clear error instead of wrong results.
"""
import collections
import os

import jax
import pytest

# tests/run_all.sh points DPMM_JAX_TEST_CACHE at a fresh directory shared by the pytest
# worker processes of one run (and, through DPMM_JAX_COMPILATION_CACHE, by the notebook
# kernels and binaries the tests start), so a program that several of them need (the
# same EM fit or scorer at the same shapes) is compiled once. Every program is stored,
# however quickly it compiled: ``_release_compiled_programs`` below empties jax's
# in-memory caches after each module, so without the disk copy each small program (an
# eager ``jnp`` op, a validation step; 0.005-0.16 s each) compiles again in every module
# and every worker. Compiled programs are the same either way.
if os.environ.get("DPMM_JAX_TEST_CACHE"):
  jax.config.update("jax_compilation_cache_dir", os.environ["DPMM_JAX_TEST_CACHE"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _is_f64_file(path) -> bool:
  return os.path.basename(str(path)).endswith("_f64.py")


def pytest_collection_modifyitems(session, config, items):
  del session
  if not jax.config.jax_enable_x64:
    return
  float32_files = sorted({str(item.path) for item in items if not _is_f64_file(item.path)})
  if float32_files:
    raise pytest.UsageError(
        "jax_enable_x64 was switched on during collection (by a tests/*_f64.py module) but "
        f"float32 test files were collected in the same session: {float32_files[:3]}... "
        "Run the float64 files in their own process, e.g. "
        "`pytest tests --ignore-glob='*_f64.py'` and then `pytest tests/*_f64.py` "
        "(tests/run_all.sh does this).")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drops jax's in-memory compiled programs after each test module.

  Two of four full-suite runs of session 6 lost an xdist worker (segmentation fault, then abort)
  inside XLA's compilation of a coupled fit in test_properties.py, near the end of the
  float32 pass, when a worker holds every program compiled so far; the test never failed
  alone or in a fresh worker. Releasing the programs between modules keeps a worker's
  footprint that of one module; programs needed again load from the run's on-disk cache.
  (A precaution against the suspected cause, memory held by the worker; not proven.)
  """
  yield
  jax.clear_caches()


# --------------------------------------------------------------- compile-time report
# XLA compilation is most of the suite's time (2026-12-06, float32 pass: 961 s of its
# 1518 s of test time, tracing and lowering another 240 s). Each test report carries the
# seconds its phase spent compiling (or loading from the run's cache) as a
# ``user_property``, which pytest-xdist sends from the workers; the end of each pass prints
# the totals and the files that compile the most, next to ``--durations``.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compile_seconds = [0.0]


def _count_compile_time(event, duration, **kwargs):
  del kwargs
  if event == _COMPILE_EVENT:
    _compile_seconds[0] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile_time)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  del item, call
  outcome = yield
  report = outcome.get_result()
  report.user_properties.append(("jax_compile_s", _compile_seconds[0]))
  _compile_seconds[0] = 0.0


def pytest_terminal_summary(terminalreporter):
  by_file = collections.defaultdict(lambda: [0.0, 0.0])
  for reports in terminalreporter.stats.values():
    for report in reports:
      props = dict(getattr(report, "user_properties", ()) or ())
      if "jax_compile_s" not in props or not hasattr(report, "duration"):
        continue
      entry = by_file[report.nodeid.split("::")[0]]
      entry[0] += report.duration
      entry[1] += props["jax_compile_s"]
  if not by_file:
    return
  total = sum(v[0] for v in by_file.values())
  compiled = sum(v[1] for v in by_file.values())
  terminalreporter.write_sep(
      "=", "XLA compilation time (in-process, cache loads included; not notebooks or binaries)")
  terminalreporter.write_line(
      f"{compiled:.1f} s of {total:.1f} s test time ({100 * compiled / max(total, 1e-9):.0f}%)"
      " compiling; the files that compile the most:")
  for name, (seconds, comp) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:10]:
    terminalreporter.write_line(f"{comp:8.1f} s compile of {seconds:8.1f} s  {name}")
