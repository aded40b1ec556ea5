"""dpmm_jax.functional: the scorer of a fitted Detector under jit, vmap and grad."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmm_jax
from dpmm_jax import functional

# One model per scoring path: Mahalanobis (max over classes), linear head (softmax),
# multivariate Student-t (Cholesky solves), and the coupled model's quadrature mixture.
# tied/diag/mds/indep_rmds share those code paths.
MODELS = ("rmds", "temp_msp", "full", "coupled")


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  k, d, n = 3, 4, 30
  means = rng.normal(0, 3, (k, d))
  scales = rng.uniform(0.5, 2.0, (k, d))
  y = np.repeat(np.arange(k), n)
  x = (means[y] + scales[y] * rng.normal(size=(k * n, d))).astype(np.float32)
  x_test = (means[rng.integers(0, k, 16)] + rng.normal(size=(16, d))).astype(np.float32)
  return x, y, x_test


@pytest.fixture(scope="module")
def detectors(data):
  x, y, _ = data
  return {m: dpmm_jax.fit_detector(x, y, m) for m in MODELS}


score_jit = jax.jit(functional.score)
evaluate_vmap = jax.jit(jax.vmap(functional.evaluate, in_axes=(None, 0)))
grad_jit = jax.jit(jax.grad(functional.score, argnums=1))


@pytest.mark.parametrize("model", MODELS)
def test_jit_vmap_grad(model, data, detectors):
  det, x_test = detectors[model], data[2]
  expected = np.asarray(dpmm_jax.score(det, x_test))
  expected_cs = np.asarray(dpmm_jax.class_scores(det, x_test))
  # jit, batched; the detector is a pytree argument (no retrace per detector value).
  got = np.asarray(score_jit(det, x_test))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=float(1e-4 * np.abs(expected).max()))
  # vmap over single points: (D,) -> (K,), ().
  cs, s = evaluate_vmap(det, x_test)
  assert cs.shape == expected_cs.shape and s.shape == expected.shape
  np.testing.assert_allclose(np.asarray(s), expected, rtol=1e-5,
                             atol=float(1e-4 * np.abs(expected).max()))
  np.testing.assert_allclose(np.asarray(cs), expected_cs, rtol=1e-5,
                             atol=float(1e-4 * np.abs(expected_cs).max()))
  # Gradient with respect to the input against central differences along random
  # directions (float32: step 1e-2 keeps rounding error ~1e-4 relative).
  rng = np.random.default_rng(1)
  for i in range(3):
    x0 = jnp.asarray(x_test[i])
    g = np.asarray(grad_jit(det, x0))
    assert g.shape == x0.shape and np.all(np.isfinite(g))
    v = rng.normal(size=x0.shape).astype(np.float32)
    v /= np.linalg.norm(v)
    h = 1e-2
    fd = (float(score_jit(det, x0 + h * v)) - float(score_jit(det, x0 - h * v))) / (2 * h)
    assert float(g @ v) == pytest.approx(fd, rel=3e-2, abs=float(3e-2 * np.linalg.norm(g) + 1e-4))


def test_outlier_probability_and_single_point(data, detectors):
  x_test = data[2]
  det = detectors["full"]
  p = jax.jit(functional.outlier_probability)(det, x_test, 2.0)
  np.testing.assert_allclose(np.asarray(p),
                             np.asarray(dpmm_jax.outlier_probability(det, x_test, 2.0)),
                             rtol=1e-5, atol=1e-6)
  assert functional.score(det, x_test[0]).shape == ()
  assert functional.class_scores(det, x_test[0]).shape == (3,)
  with pytest.raises(ValueError, match="DPMM model"):
    functional.outlier_probability(detectors["rmds"], x_test)
  # The convenience layer is not traceable (it validates on the host); this one is.
  with pytest.raises(TypeError):
    jax.jit(dpmm_jax.score)(det, x_test)


def test_coupled_far_points_score_as_in_the_api(data, detectors):
  """Points far from every class tilt the coupled model's posterior of gamma_k off its
  grid; the functional scorer takes the API's per-point path there too (with the fixed
  grids alone it was 158 nats off on these points), and its gradient matches
  central differences. Same detector and shapes as above: nothing new to compile."""
  det, x_test = detectors["coupled"], data[2]
  rng = np.random.default_rng(2)
  far = (x_test + 200.0 * rng.normal(size=x_test.shape)).astype(np.float32)
  expected = np.asarray(dpmm_jax.score(det, far))
  got = np.asarray(score_jit(det, far))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=float(1e-5 * np.abs(expected).max()))
  x0 = jnp.asarray(far[0])
  v = rng.normal(size=x0.shape).astype(np.float32)
  v /= np.linalg.norm(v)
  g = np.asarray(grad_jit(det, x0))
  # 200 spreads out the float32 score (~190) moves in rounding steps of ~5e-3, too coarse
  # for a two-point difference: the slope at 0 of a quadratic fitted to the score at 24
  # points (x_test's shape: already compiled) along v in [-4, 4] averages that out. (In
  # float64 the gradient equals central differences to 1e-8 here.)
  t = np.linspace(-4.0, 4.0, x_test.shape[0])
  along = np.asarray(score_jit(det, jnp.asarray(far[0][None] + t[:, None] * v[None])))
  slope = np.polyfit(t, along.astype(np.float64), 2)[1]
  assert float(g @ v) == pytest.approx(slope, rel=1e-2)
