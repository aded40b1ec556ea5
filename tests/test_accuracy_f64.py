"""Float64 references for the accuracy checks (own pytest process; x64 on at import):
independent numpy oracles for the MDS, RMDS and independent-RMDS scores, and the coupled
model's class and prior predictive against a 20,001-node quadrature.
"""
import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scipy.special  # noqa: E402

import dpmm_jax  # noqa: E402


# ----------------------------------------------------------------- baseline oracles
def _baseline_problem(seed=0, num_classes=4, dim=5):
  rng = np.random.default_rng(seed)
  counts = np.array([3, 7, 12, 30])[:num_classes]        # N_k = 3 < D + 1: tau_k > 1
  y = np.repeat(np.arange(num_classes), counts).astype(np.int32)
  mix = np.eye(dim) + 0.4 * rng.normal(size=(num_classes, dim, dim))
  centres = 2.0 * rng.normal(size=(num_classes, dim)) + 5.0
  x = centres[y] + np.einsum("nd,nde->ne", rng.normal(size=(len(y), dim)), mix[y])
  xt = np.concatenate([centres[rng.integers(0, num_classes, 30)]
                       + rng.normal(size=(30, dim)), 6.0 * rng.normal(size=(10, dim))])
  return x, y, xt


def _md(diff, cov):
  """(M, K) diff^T cov^-1 diff for diff (M, K, D) and cov (D, D) or (K, D, D)."""
  if cov.ndim == 2:
    cov = np.broadcast_to(cov, (diff.shape[1],) + cov.shape)
  return np.stack([np.einsum("md,md->m", diff[:, k], np.linalg.solve(cov[k], diff[:, k].T).T)
                   for k in range(diff.shape[1])], 1)


def _oracle(x, y, xt, model):
  """Class scores straight from the papers' formulas (Lee et al. 2018; Ren et al. 2021;
  the independent variant with the pooled-covariance shrinkage documented in
  ``mahalanobis.regularised_class_covariances``)."""
  num_classes, dim = int(y.max()) + 1, x.shape[1]
  means = np.stack([x[y == k].mean(0) for k in range(num_classes)])
  r = x - means[y]
  pooled = r.T @ r / len(x)
  mu0 = x.mean(0)
  total = (x - mu0).T @ (x - mu0) / len(x)
  diff = xt[:, None, :] - means[None]
  if model == "mds":
    return -_md(diff, pooled)
  md0 = _md((xt - mu0)[:, None, :], total)
  if model == "rmds":
    return md0 - _md(diff, pooled)
  covs = []
  for k in range(num_classes):
    n = np.sum(y == k)
    rk = x[y == k] - means[k]
    tau = 1.0 + max(0.0, dim + 1.0 - n)
    covs.append((rk.T @ rk + tau * pooled) / (n + tau))
  return md0 - _md(diff, np.stack(covs))


@pytest.mark.parametrize("model", ["mds", "rmds", "indep_rmds"])
def test_mahalanobis_baselines_match_numpy_formulas(model):
  x, y, xt = _baseline_problem()
  det = dpmm_jax.fit_detector(x, y, model, preprocess=False)
  ref = _oracle(x, y, xt, model)
  np.testing.assert_allclose(np.asarray(dpmm_jax.class_scores(det, xt)), ref,
                             rtol=1e-9, atol=1e-9 * np.abs(ref).max())
  np.testing.assert_allclose(np.asarray(dpmm_jax.score(det, xt)), ref.max(-1),
                             rtol=1e-9, atol=1e-9 * np.abs(ref).max())
