#!/usr/bin/env bash
# The whole test suite: the float32 pass, then the float64 pass in its own process
# (x64 is switched on at import in tests/*_f64.py and never toggled inside a test),
# then tests that need several fake CPU devices (tests/*_multidevice.py), if any.
set -euo pipefail
cd "$(dirname "$0")/.."
# One pytest worker per core: at least 2, at most 4, and at most one per 5 GB of memory
# (a worker holds up to ~3.5 GB at peak).
cores="$(nproc 2>/dev/null || echo 2)"
mem_gb="$(awk '/^MemTotal:/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 10)"
auto=$(( cores < 4 ? cores : 4 ))
auto=$(( auto < mem_gb / 5 ? auto : mem_gb / 5 ))
auto=$(( auto < 2 ? 2 : auto ))
workers="${PYTEST_WORKERS:-$auto}"
# One compilation cache for this run's pytest processes (see tests/conftest.py).
if [ -z "${DPMM_JAX_TEST_CACHE:-}" ]; then
  DPMM_JAX_TEST_CACHE="$(mktemp -d)"
  trap 'rm -rf "$DPMM_JAX_TEST_CACHE"' EXIT
fi
export DPMM_JAX_TEST_CACHE
# Notebook kernels and experiment binaries that tests start use it too (not the user's
# per-user cache in ~/.cache/dpmm_jax, which the suite leaves untouched).
export DPMM_JAX_COMPILATION_CACHE="$DPMM_JAX_TEST_CACHE"
python -m pytest tests --ignore-glob='*_f64.py' --ignore-glob='*_multidevice.py' -q -n "$workers" --dist worksteal --durations=15 "$@"
shopt -s nullglob
f64=(tests/*_f64.py)
if [ ${#f64[@]} -gt 0 ]; then
  python -m pytest "${f64[@]}" -q -n "$workers" --dist worksteal --durations=15 "$@"
fi
multi=(tests/*_multidevice.py)
if [ ${#multi[@]} -gt 0 ]; then
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest "${multi[@]}" -q --durations=15 "$@"
fi
