"""Reliability in float64 (issue 4): float32 and float64 fits of every model rank the
synthetic benchmark alike, float64 detectors save and load bit-identically, and the
cancellation-free likelihood forms equal the textbook ones.

x64 is switched on at import (tests/run_all.sh runs *_f64.py files in their own process).
"""
import functools
import warnings

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dpmm_jax  # noqa: E402
from dpmm_jax import metrics  # noqa: E402
from dpmm_jax import quadrature  # noqa: E402
from dpmm_jax import special  # noqa: E402
from dpmm_jax import synthetic  # noqa: E402
from dpmm_jax.conjugate import nix  # noqa: E402


def test_x64_is_on():
  assert jnp.zeros(()).dtype == jnp.float64


@functools.lru_cache(maxsize=None)
def _benchmark():
  """The paper's synthetic setting (section 6.1) at a small size: 10 classes in 8-D,
  heterogeneous covariances (nu0 = 12), 40 training points per class."""
  ds = synthetic.make_dataset(jax.random.PRNGKey(0), num_classes=10, dim=8, nu0=12.0,
                              kappa0=0.1, num_train_per_class=40, num_test_per_class=40,
                              dtype=jnp.float64)
  return tuple(np.asarray(a) for a in (ds.x_train, ds.y_train, ds.x_test, ds.x_ood))


def _auroc(det, x_test, x_ood):
  return metrics.auroc(np.asarray(dpmm_jax.score(det, x_test)),
                       np.asarray(dpmm_jax.score(det, x_ood)))


@pytest.mark.parametrize("model", dpmm_jax.MODELS)
def test_float32_and_float64_fits_rank_the_benchmark_alike(model):
  x, y, x_test, x_ood = _benchmark()
  aurocs = {}
  for dtype in (np.float32, np.float64):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", dpmm_jax.ConvergenceWarning)
      det = dpmm_jax.fit_detector(x.astype(dtype), y, model, key=jax.random.PRNGKey(0))
    # float32 inputs stay float32 end to end even with x64 on (no silent promotion).
    leaves = jax.tree_util.tree_leaves(det)
    assert {np.asarray(a).dtype for a in leaves
            if np.issubdtype(np.asarray(a).dtype, np.floating)} == {np.dtype(dtype)}
    aurocs[dtype] = _auroc(det, x_test.astype(dtype), x_ood.astype(dtype))
  if model not in ("msp", "temp_msp"):     # the MSP heads are weak OOD detectors here
    assert aurocs[np.float64] > 0.8, aurocs        # (the benchmark is not trivial noise)
  assert abs(aurocs[np.float32] - aurocs[np.float64]) < 1e-3, aurocs


@pytest.mark.parametrize("model", ["tied", "diag", "coupled", "full"])
def test_float64_detectors_round_trip_bit_identically(model, tmp_path):
  x, y, x_test, x_ood = _benchmark()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", dpmm_jax.ConvergenceWarning)
    det = dpmm_jax.fit_detector(x, y, model)
  dpmm_jax.save(det, tmp_path / "d.npz")
  assert dpmm_jax.serialization.read_metadata(tmp_path / "d.npz")["dtype"] == "float64"
  loaded = dpmm_jax.load(tmp_path / "d.npz")
  points = np.concatenate([x_test, x_ood])
  assert (np.asarray(dpmm_jax.score(det, points)).tobytes()
          == np.asarray(dpmm_jax.score(loaded, points)).tobytes())


@pytest.mark.parametrize("df", [0.7, 4.0, 55.0, 3e3, 2e5])
def test_nix_log_evidence_equals_the_difference_of_log_normalisers(df):
  rng = np.random.default_rng(3)
  count = jnp.asarray([1.0, 4.0, 120.0])
  mean = jnp.asarray(rng.normal(size=(3, 5)))
  sq_dev = jnp.asarray(rng.uniform(0.1, 2.0, size=(3, 5))) * count[:, None]
  prior = nix.prior(jnp.asarray(rng.normal(size=5)), jnp.asarray(rng.uniform(0.5, 2, 5)),
                    jnp.full(5, df), jnp.asarray(rng.uniform(0.01, 3.0, 5)))
  direct = nix.log_marginal_likelihood(prior, nix.posterior(prior, count, mean, sq_dev), count)
  np.testing.assert_allclose(np.asarray(nix.log_evidence(prior, count, mean, sq_dev)),
                             np.asarray(direct), rtol=1e-11, atol=1e-9)


@pytest.mark.parametrize("z", [0.4, 3.0, 10.0, 77.0, 4e4])
@pytest.mark.parametrize("h", [0.5, 2.5, 60.0])
def test_log_gamma_ratio_excess_to_float64_precision(z, h):
  from scipy.special import gammaln  # pylint: disable=import-outside-toplevel
  ref = gammaln(z + h) - gammaln(z) - h * np.log(z)
  np.testing.assert_allclose(float(special.log_gamma_ratio_excess(z, h)), ref,
                             rtol=1e-10, atol=1e-12 * abs(gammaln(z + h)))


@pytest.mark.parametrize("shape", [0.3, 5.0, 12.0, 900.0])
def test_log_gamma_density_of_log_to_float64_precision(shape):
  from scipy.special import gammaln  # pylint: disable=import-outside-toplevel
  u = np.linspace(-4.0, 1.5, 23) / np.sqrt(shape)
  ref = shape * np.log(shape) - gammaln(shape) + shape * u - shape * np.exp(u)
  np.testing.assert_allclose(np.asarray(quadrature.log_gamma_density_of_log(u, shape)), ref,
                             rtol=1e-10, atol=1e-10 * shape * np.log(shape))
