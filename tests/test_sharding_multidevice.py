"""Statistics and scores over a data mesh of 8 fake CPU devices equal one device's.

Run in its own process with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(tests/run_all.sh does). The statistics are sums regrouped across devices, so they agree
with the single-device computation up to float32 summation order: relative 1e-5 of the
data scale (a wrong combination, e.g. summing centred scatters without the Chan term or
dropping a device's rows, is off by O(1)).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmm_jax import api
from dpmm_jax import sharding
from dpmm_jax import stats as stats_lib
from dpmm_jax.models import coupled, diag, full, tied

NUM_DEVICES = 8

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < NUM_DEVICES,
    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/run_all.sh)")

K, D = 5, 6


def _data(seed=0, n=1003, offset=20.0):
  rng = np.random.default_rng(seed)
  y = rng.integers(0, K, n).astype(np.int32)
  scale = rng.uniform(0.5, 2.0, size=(K, 1, D))
  x = (rng.normal(size=(n, D)) * scale[y, 0] @ rng.normal(size=(D, D)) * 0.5
       + 3.0 * rng.normal(size=(K, D))[y] + offset)
  return x.astype(np.float32), y


def _assert_stats_equal(a, b, rtol=1e-5):
  np.testing.assert_array_equal(np.asarray(a.count), np.asarray(b.count))
  scale_m = float(np.max(np.abs(b.mean))) + 1.0
  np.testing.assert_allclose(a.mean, b.mean, rtol=rtol, atol=rtol * scale_m)
  scale_s = float(np.max(np.abs(b.pooled_scatter)))
  for name in ("sq_dev", "scatter", "pooled_scatter"):
    got, want = getattr(a, name), getattr(b, name)
    assert (got is None) == (want is None)
    if want is not None:
      np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale_s, err_msg=name)


def test_mesh_has_eight_devices():
  mesh = sharding.data_mesh()
  assert sharding.num_shards(mesh) == NUM_DEVICES


@pytest.mark.parametrize("full_stats", [True, False])
def test_sharded_from_labels_equals_one_device(full_stats):
  x, y = _data()                                     # 1003 rows: padded to 1008
  mesh = sharding.data_mesh()
  got = sharding.from_labels(x, y, K, mesh, full=full_stats, block_size=16)
  want = stats_lib.from_labels(x, y, K, full=full_stats)
  _assert_stats_equal(got, want)


def test_sharded_streaming_equals_one_device_and_compiles_once():
  x, y = _data(seed=1, n=2500)
  mesh = sharding.data_mesh()
  before = sharding._sharded_update._cache_size()
  got = sharding.from_arrays(x, y, K, mesh, chunk_size=300, block_size=16)   # 9 chunks
  assert sharding._sharded_update._cache_size() - before == 1
  want = stats_lib.from_labels(x, y, K)
  _assert_stats_equal(got, want)


def test_sharded_stats_keep_every_device_partial_until_the_end():
  # Rows of class 0 live on the first device only: a combination that ignored the other
  # devices' partials (or double counted the first) would change the scatter of class 0.
  x, y = _data(seed=2, n=800)
  order = np.argsort(y, kind="stable")
  x, y = x[order], y[order]
  mesh = sharding.data_mesh()
  got = sharding.from_labels(x, y, K, mesh)
  want = stats_lib.from_labels(x, y, K)
  _assert_stats_equal(got, want)


def _models(x, y):
  st = stats_lib.from_labels(x, y, K)
  return {"tied": (tied, tied.fit(st)), "full": (full, full.fit(st)[0]),
          "diag": (diag, diag.fit(st)[0]), "coupled": (coupled, coupled.fit(st)[0])}


@pytest.mark.parametrize("name", ["tied", "full", "diag", "coupled"])
def test_sharded_log_predictive_equals_one_device(name):
  x, y = _data(seed=3, n=600, offset=0.0)
  module, params = _models(x, y)[name]
  xt = np.concatenate([x[:45], 3.0 * x[45:50]])            # 50 rows: not a multiple of 8
  mesh = sharding.data_mesh()
  got_class, got_prior = sharding.log_predictive(module, params, xt, mesh)
  want_class, want_prior = jax.jit(module.log_predictive)(params, xt)
  assert got_class.shape == want_class.shape and got_prior.shape == want_prior.shape
  np.testing.assert_allclose(got_class, want_class, rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(got_prior, want_prior, rtol=1e-5, atol=1e-3)


def test_sharded_detector_score_equals_api_score():
  x, y = _data(seed=4, n=700, offset=0.0)
  det = api.fit_detector(x, y, model="diag")
  xt = np.concatenate([x[:60], x[60:75] * 2.0])
  mesh = sharding.data_mesh()
  got = sharding.score(det, xt, mesh, chunk_size=32)
  np.testing.assert_allclose(got, api.score(det, xt), rtol=1e-5, atol=1e-3)
