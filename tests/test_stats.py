"""Sufficient statistics (dpmm_jax.stats) against float64 numpy references.

Float32 tolerances: every statistic is a sum of N terms; a float32 sum of N values of
magnitude m carries an error of about sqrt(N) * eps * m (eps = 1.2e-7), so for the
N <= 1,000 point, unit-scale data below, relative errors of ~1e-5 are the expected
round-off and 1e-4 leaves a margin of ~10 while still catching any algebra slip (a
missing term is O(1) relative).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmm_jax import stats as stats_lib

K, D = 4, 3
# One compilation per input shape (eager from_labels would dispatch op by op).
_from_labels = jax.jit(stats_lib.from_labels,
                       static_argnames=("num_classes", "full", "block_size"))


def _data(seed=0, n=300, num_classes=K, dim=D, offset=2.0):
  rng = np.random.default_rng(seed)
  y = rng.integers(0, num_classes, n).astype(np.int32)
  mix = rng.normal(size=(dim, dim))
  x = rng.normal(size=(n, dim)) @ mix + 3.0 * rng.normal(size=(num_classes, dim))[y] + offset
  return x.astype(np.float32), y


def _numpy_stats(x, y, num_classes):
  """float64 reference: counts, means, centred scatter, squared deviations, pooled."""
  x = np.asarray(x, np.float64)
  dim = x.shape[1]
  count = np.zeros(num_classes)
  mean = np.zeros((num_classes, dim))
  scatter = np.zeros((num_classes, dim, dim))
  for k in range(num_classes):
    xk = x[y == k]
    count[k] = len(xk)
    if len(xk):
      mean[k] = xk.mean(0)
      c = xk - mean[k]
      scatter[k] = c.T @ c
  sq_dev = np.einsum("kdd->kd", scatter)
  return count, mean, scatter, sq_dev, scatter.sum(0)


def _assert_stats_close(got, count, mean, scatter, sq_dev, pooled, rtol=1e-4):
  scale_x = np.max(np.abs(mean)) + 1.0
  np.testing.assert_array_equal(np.asarray(got.count), count)
  np.testing.assert_allclose(got.mean, mean, rtol=rtol, atol=rtol * scale_x)
  scale_s = np.max(np.abs(pooled))
  if scatter is not None:
    np.testing.assert_allclose(got.scatter, scatter, rtol=rtol, atol=rtol * scale_s)
  np.testing.assert_allclose(got.sq_dev, sq_dev, rtol=rtol, atol=rtol * scale_s)
  np.testing.assert_allclose(got.pooled_scatter, pooled, rtol=rtol, atol=rtol * scale_s)


def _assert_same_stats(a, b, rtol=1e-4):
  _assert_stats_close(a, np.asarray(b.count), np.asarray(b.mean, np.float64),
                      None if b.scatter is None else np.asarray(b.scatter, np.float64),
                      np.asarray(b.sq_dev, np.float64),
                      np.asarray(b.pooled_scatter, np.float64), rtol)


@pytest.mark.parametrize("full", [True, False])
def test_from_labels_matches_numpy(full):
  x, y = _data(n=257)  # 257 is not a multiple of the 128-row outer-product block
  got = _from_labels(x, y, K, full=full)
  count, mean, scatter, sq_dev, pooled = _numpy_stats(x, y, K)
  _assert_stats_close(got, count, mean, scatter if full else None, sq_dev, pooled)
  assert (got.scatter is None) == (not full)
  assert got.num_classes == K and got.dim == D


def test_from_labels_ignores_out_of_range_labels_and_empty_classes():
  x, y = _data(n=100)
  y = np.where(y == 2, 7, y).astype(np.int32)    # class 2 empty, label 7 out of range
  y[:5] = -1                                      # padding label
  got = _from_labels(x, y, K)
  count, mean, scatter, sq_dev, pooled = _numpy_stats(x, y, K)
  assert count[2] == 0
  _assert_stats_close(got, count, mean, scatter, sq_dev, pooled)
  np.testing.assert_array_equal(np.asarray(got.mean[2]), 0.0)


def test_from_labels_jitted_equals_eager():
  x, y = _data(n=64)
  _assert_same_stats(_from_labels(x, y, num_classes=K), stats_lib.from_labels(x, y, K),
                     rtol=1e-6)


def test_merge_equals_stats_of_concatenation():
  x, y = _data(seed=1, n=400)
  # Split unevenly; class 3 lives only in the second part, class 0 only in the first.
  first = np.arange(400) < 150
  first = np.where(y == 3, False, first)
  first = np.where(y == 0, True, first)
  a = _from_labels(x[first], y[first], K)
  b = _from_labels(x[~first], y[~first], K)
  assert float(a.count[3]) == 0 and float(b.count[0]) == 0
  merged = stats_lib.merge(a, b)
  _assert_stats_close(merged, *_numpy_stats(x, y, K))


def test_merge_is_associative_and_commutative():
  x, y = _data(seed=2, n=450)
  parts = [_from_labels(x[s], y[s], K)
           for s in (slice(0, 100), slice(100, 170), slice(170, 450))]
  left = stats_lib.merge(stats_lib.merge(parts[0], parts[1]), parts[2])
  right = stats_lib.merge(parts[0], stats_lib.merge(parts[1], parts[2]))
  swapped = stats_lib.merge(parts[2], stats_lib.merge(parts[1], parts[0]))
  _assert_same_stats(left, right)
  _assert_same_stats(left, swapped)
  _assert_stats_close(left, *_numpy_stats(x, y, K))


def test_merge_without_full_scatter_keeps_none():
  x, y = _data(n=60)
  a = _from_labels(x[:30], y[:30], K, full=False)
  b = _from_labels(x[30:], y[30:], K, full=False)
  assert stats_lib.merge(a, b).scatter is None


def test_statistics_without_the_pooled_scatter():
  """pooled=False skips only the (D, D) pooled scatter: the rest is what a pass with it
  computes, its diagonal is the classes' summed sq_dev, and merge keeps it absent."""
  x, y = _data(seed=5, n=700)
  chunks = [(x[:300], y[:300]), (x[300:], y[300:])]
  with_pooled = stats_lib.from_chunks(chunks, K, full=False, chunk_size=128)
  without = stats_lib.from_chunks(chunks, K, full=False, chunk_size=128, pooled=False)
  assert without.pooled_scatter is None and without.scatter is None
  for field in ("count", "mean", "sq_dev"):
    np.testing.assert_array_equal(getattr(without, field), getattr(with_pooled, field))
  count, mean, _, sq_dev, pooled = _numpy_stats(x, y, K)
  np.testing.assert_allclose(np.asarray(without.sq_dev).sum(0), np.diag(pooled), rtol=1e-5)
  assert stats_lib.merge(without, with_pooled).pooled_scatter is None
  assert stats_lib.finalize(without).pooled_scatter is None
  with pytest.raises(ValueError, match="pooled=False needs full=False"):
    stats_lib.from_chunks(chunks, K, full=True, pooled=False)
  # What needs the pooled scatter says so, eagerly and under jit, instead of a TypeError.
  for fn in (stats_lib.pooled_covariance, stats_lib.total_covariance,
             jax.jit(stats_lib.total_covariance)):
    with pytest.raises(ValueError, match="without it \\(pooled=False\\)"):
      fn(without)
  np.testing.assert_allclose(stats_lib.pooled_covariance(with_pooled),
                             pooled / len(y), rtol=1e-5, atol=1e-6)


def test_row_blocks_of_the_pooled_scatter_and_of_the_transform(monkeypatch):
  """The diagonal-only pass sums the pooled scatter over blocks of rows, the last one
  overlapping the one before it (masked), and ``preprocess.apply`` maps blocks of rows:
  with blocks of 8 rows over a 37-row chunk (padding rows included) both equal the
  float64 reference."""
  from dpmm_jax import blocks
  from dpmm_jax import preprocess
  rows = jnp.arange(10.0)
  assert float(blocks.sum_row_blocks(lambda r, keep: jnp.sum(jnp.where(keep, r, 0.0)),
                                     rows, 4)) == 45.0
  x, y = _data(seed=6, n=37)
  y = y.copy()
  y[-3:] = -1                                   # padding rows: not counted
  monkeypatch.setattr(stats_lib, "_POOLED_ROW_BLOCK", 8)
  update = jax.jit(lambda s, a, b: stats_lib._update(s, a, b, 128))   # traced with the patch
  got = update(stats_lib.empty(K, D, full=False), jnp.asarray(x), jnp.asarray(y))
  count, mean, _, sq_dev, pooled = _numpy_stats(x[:-3], y[:-3], K)
  _assert_stats_close(got, count, mean, None, sq_dev, pooled)
  monkeypatch.setattr(preprocess, "_APPLY_ROW_BLOCK", 8)
  transform = preprocess.Transform(jnp.asarray(x[0]), jnp.asarray(
      np.random.default_rng(7).normal(size=(D, D - 1)), jnp.float32))
  z = jax.jit(lambda t, a: preprocess.apply.__wrapped__(t, a))(transform, jnp.asarray(x))
  want = (x.astype(np.float64) - x[0]) @ np.asarray(transform.projection, np.float64)
  np.testing.assert_allclose(z, want, rtol=1e-5, atol=1e-4 * np.max(np.abs(want)))


@pytest.mark.parametrize("num_keys,n", [(5, 300), (1001, 4096), (70_000, 65_536)])
def test_stable_key_order_equals_a_stable_argsort(num_keys, n):
  """The packed one-operand sort (key * n + row fits in uint32) and, at 70,000 keys x
  65,536 rows where it would overflow, the argsort it falls back to: both give numpy's
  stable order, ties in row order (keys drawn from a few values, so most are tied)."""
  rng = np.random.default_rng(num_keys)
  key = rng.choice(np.array([0, 1, num_keys // 2, num_keys - 1]), n).astype(np.int32)
  got = jax.jit(stats_lib.stable_key_order, static_argnums=1)(jnp.asarray(key), num_keys)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.argsort(key, kind="stable"))


@pytest.mark.parametrize("full", [True, False])
def test_from_arrays_on_memmap_equals_in_memory(tmp_path, full):
  n = 1003
  x, y = _data(seed=3, n=n, offset=50.0)
  xm = np.memmap(tmp_path / "x.f32", dtype=np.float32, mode="w+", shape=x.shape)
  xm[:] = x
  xm.flush()
  ym = np.memmap(tmp_path / "y.i32", dtype=np.int32, mode="w+", shape=y.shape)
  ym[:] = y
  ym.flush()
  xr = np.memmap(tmp_path / "x.f32", dtype=np.float32, mode="r", shape=x.shape)
  yr = np.memmap(tmp_path / "y.i32", dtype=np.int32, mode="r", shape=y.shape)
  chunked = stats_lib.from_arrays(xr, yr, K, full=full, chunk_size=128)  # 1003 = 7*128+107
  _assert_same_stats(chunked, _from_labels(x, y, K, full=full))
  count, mean, scatter, sq_dev, pooled = _numpy_stats(x, y, K)
  _assert_stats_close(chunked, count, mean, scatter if full else None, sq_dev, pooled)


def test_from_chunks_with_uneven_chunks_and_rechunking():
  x, y = _data(seed=4, n=500)
  bounds = [0, 37, 250, 251, 500]
  chunks = [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
  got = stats_lib.from_chunks(chunks, K, chunk_size=64)
  _assert_stats_close(got, *_numpy_stats(x, y, K))


@pytest.mark.parametrize("full", [True, False])
def test_from_chunks_of_one_chunk_runs_one_program(full):
  """A single chunk (every problem of up to chunk_size rows) is summarised by the fused
  ``from_labels`` program, not by the streaming zeros / update / symmetrisation, with
  the same statistics as the stream over several chunks (and as numpy)."""
  x, y = _data(seed=11, n=211)
  streaming = stats_lib._update_jit._cache_size()
  one = stats_lib.from_chunks([(x, y)], K, full=full, chunk_size=256)
  assert stats_lib._update_jit._cache_size() == streaming
  several = stats_lib.from_chunks([(x[:100], y[:100]), (x[100:], y[100:])], K, full=full,
                                  chunk_size=128)
  count, mean, scatter, sq_dev, pooled = _numpy_stats(x, y, K)
  _assert_stats_close(one, count, mean, scatter if full else None, sq_dev, pooled)
  assert (one.scatter is None) == (not full)
  for field in ("count", "mean", "sq_dev", "scatter", "pooled_scatter"):
    a, b = getattr(one, field), getattr(several, field)
    assert (a is None) == (b is None), field
    if a is not None:
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=field)


def test_from_chunks_skips_the_finite_check_only_when_told():
  x, y = _data(seed=8, n=40)
  x = x.copy()
  x[7, 1] = np.nan
  for chunk in (x, jnp.asarray(x)):                 # on the host and on the device
    with pytest.raises(ValueError, match=r"1 row\(s\) with NaN or inf values"):
      stats_lib.from_chunks([(chunk, y)], K, full=False)
    unchecked = stats_lib.from_chunks([(chunk, y)], K, full=False, finite_checked=True)
    assert not np.all(np.isfinite(np.asarray(unchecked.mean)))


def test_from_chunks_rejects_empty_input():
  with pytest.raises(ValueError, match="no data"):
    stats_lib.from_chunks(iter([]), K)


def _offset_data(offset, n=10_000, seed=0):
  rng = np.random.default_rng(seed)
  y = rng.integers(0, 2, n).astype(np.int32)
  x = rng.normal(size=(n, 2)) * np.array([1.0, 0.5]) @ np.array([[1.0, 0.6], [0.0, 1.0]])
  return (x + offset).astype(np.float32), y


@pytest.mark.parametrize("offset", [1e3, 1e4])
def test_centred_float32_stats_survive_a_large_offset(offset):
  """10,000 2-D points offset by 1e3..1e4: the centred two-pass statistics keep the
  per-class scatter accurate in float32; the raw-moment formula
  sum x x^T - N xbar xbar^T loses it (shown below, so the test has teeth)."""
  x, y = _offset_data(offset)
  got = _from_labels(jnp.asarray(x), jnp.asarray(y), 2)
  assert got.scatter.dtype == jnp.float32
  _, _, scatter, _, _ = _numpy_stats(x, y, 2)
  raw_errors = []
  for k in range(2):
    ref = np.linalg.eigvalsh(scatter[k])
    eig = np.linalg.eigvalsh(np.asarray(got.scatter[k], np.float64))
    assert eig[0] > 0
    # The reference uses the same float32-rounded inputs, so only the arithmetic
    # differs. The centred scatter's error is second order in the float32 error delta of
    # the class mean (a float32 sum of 5,000 values ~offset: delta ~1e-2 at offset 1e4),
    # N_k delta^2 ~ 0.5 on eigenvalues ~900: measured 1e-5 (offset 1e3) and 6e-4 (1e4)
    # relative. The raw formula is off by 10-200x the eigenvalues at 1e4.
    np.testing.assert_allclose(eig, ref, rtol=2e-3)
    xk = jnp.asarray(x[y == k])
    raw = xk.T @ xk - xk.shape[0] * jnp.outer(xk.mean(0), xk.mean(0))
    raw_eig = np.linalg.eigvalsh(np.asarray(raw, np.float64))
    raw_errors.append(np.max(np.abs(raw_eig - ref) / ref[-1]))
  # The raw formula is off by more than 1% of the largest eigenvalue (often it is not
  # even positive semi-definite), i.e. > 5x the tolerance the centred stats meet.
  assert max(raw_errors) > 1e-2, raw_errors


def test_derived_covariances_match_numpy():
  x, y = _data(seed=5, n=600, offset=10.0)
  st = _from_labels(x, y, K)
  x64 = x.astype(np.float64)
  n = len(x64)
  count, mean, scatter, sq_dev, pooled = _numpy_stats(x, y, K)
  np.testing.assert_allclose(float(stats_lib.total_count(st)), n)
  np.testing.assert_allclose(stats_lib.global_mean(st), x64.mean(0), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(stats_lib.total_covariance(st), np.cov(x64.T, bias=True),
                             rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(stats_lib.pooled_covariance(st), pooled / n, rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(stats_lib.pooled_variance(st), np.diag(pooled) / n,
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(stats_lib.class_covariances(st),
                             scatter / count[:, None, None], rtol=1e-4, atol=1e-5)
  # The law of total covariance links the two (a check independent of numpy.cov).
  between = ((mean - x64.mean(0)).T * count) @ (mean - x64.mean(0)) / n
  np.testing.assert_allclose(stats_lib.total_covariance(st), pooled / n + between,
                             rtol=1e-4, atol=1e-4)


def test_class_covariances_needs_full_stats():
  x, y = _data(n=50)
  with pytest.raises(ValueError, match="full"):
    stats_lib.class_covariances(stats_lib.from_labels(x, y, K, full=False))
