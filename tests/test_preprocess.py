"""The paper's section-8 preprocessing (dpmm_jax.preprocess)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import dpmm_jax
from dpmm_jax import preprocess
from dpmm_jax import stats as stats_lib

K, D = 6, 5


def _data(seed=0, n=600, dim=D, num_classes=K):
  """Correlated, offset, anisotropic classes with differing covariances."""
  rng = np.random.default_rng(seed)
  y = np.repeat(np.arange(num_classes), n // num_classes).astype(np.int32)
  mix = rng.normal(size=(num_classes, dim, dim)) * 0.3 + np.eye(dim)
  z = rng.normal(size=(len(y), dim)) * np.linspace(0.3, 3.0, dim)
  x = np.einsum("nd,nde->ne", z, mix[y]) + 4.0 * rng.normal(size=(num_classes, dim))[y]
  return (x @ rng.normal(size=(dim, dim)) + 20.0).astype(np.float32), y


def _fit_apply(x, y, num_classes=K, **kwargs):
  st = stats_lib.from_labels(x, y, num_classes, full=False)
  t = preprocess.fit(st, **kwargs)
  return t, np.asarray(preprocess.apply(t, x), np.float64)


def _pooled(z, y):
  means = np.stack([z[y == k].mean(0) for k in np.unique(y)])
  c = z - means[y]
  return c.T @ c / len(z)


def test_transformed_training_data_is_white_with_diagonal_within_covariance():
  x, y = _data()
  t, z = _fit_apply(x, y)
  assert t.projection.shape == (D, D)
  # float32 data of scale ~20: the whitened moments carry ~1e-5 relative round-off.
  np.testing.assert_allclose(z.mean(0), 0.0, atol=1e-4)
  np.testing.assert_allclose(np.cov(z.T, bias=True), np.eye(D), atol=1e-4)
  within = _pooled(z, y)
  off_diag = within - np.diag(np.diag(within))
  np.testing.assert_allclose(off_diag, 0.0, atol=1e-4)
  diag = np.diag(within)
  assert np.all(np.diff(diag) > 0), diag          # ascending
  assert np.all((diag > 0) & (diag < 1)), diag    # within < total in every direction


def test_apply_is_jittable_and_matches_affine_map():
  x, y = _data(seed=1)
  t, z = _fit_apply(x, y)
  zj = jax.jit(preprocess.apply)(t, x[:7])
  np.testing.assert_allclose(zj, z[:7], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      zj, (x[:7].astype(np.float64) - np.asarray(t.loc)) @ np.asarray(t.projection),
      rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_components", [1, 3])
def test_num_components_keeps_the_top_principal_components(num_components):
  x, y = _data(seed=2)
  t, z = _fit_apply(x, y, num_components=num_components)
  assert t.projection.shape == (D, num_components)
  np.testing.assert_allclose(np.cov(z.T, bias=True).reshape(num_components, -1),
                             np.eye(num_components), atol=1e-4)
  # The projection's columns span the top principal subspace of the total covariance:
  # projecting them onto that subspace leaves them unchanged, and the data's variance
  # captured equals the sum of the top eigenvalues.
  cov = np.cov(x.astype(np.float64).T, bias=True)
  values, vectors = np.linalg.eigh(cov)
  top = vectors[:, ::-1][:, :num_components]
  proj = np.asarray(t.projection, np.float64)
  np.testing.assert_allclose(top @ (top.T @ proj), proj, atol=1e-4 * np.abs(proj).max())
  xc = x.astype(np.float64) - x.mean(0)
  captured = np.sum((xc @ top) ** 2) / len(x)
  np.testing.assert_allclose(captured, values[::-1][:num_components].sum(), rtol=1e-6)
  # Keeping more components than exist is harmless.
  t_all, _ = _fit_apply(x, y, num_components=D + 3)
  assert t_all.projection.shape == (D, D)


@pytest.mark.parametrize("kind", ["duplicate", "constant", "both"])
def test_near_zero_variance_directions_are_dropped(kind):
  x, y = _data(seed=3, dim=4)
  cols = [x]
  if kind in ("duplicate", "both"):
    cols.append(x[:, 1:2])                                   # exact copy of a feature
  if kind in ("constant", "both"):
    cols.append(np.full((len(x), 1), 7.5, np.float32))       # constant feature
  xd = np.concatenate(cols, axis=1)
  t, z = _fit_apply(xd, y)
  assert t.projection.shape == (xd.shape[1], 4)
  assert np.all(np.isfinite(z))
  np.testing.assert_allclose(np.cov(z.T, bias=True), np.eye(4), atol=1e-3)
  # The kept directions carry the same information as the original 4 features: the
  # transformed within-class spectrum equals that of the non-degenerate data.
  _, z_ref = _fit_apply(x, y)
  np.testing.assert_allclose(np.diag(_pooled(z, y)), np.diag(_pooled(z_ref, y)),
                             rtol=1e-3, atol=1e-4)


def test_all_constant_features_raise():
  x = np.ones((20, 3), np.float32)
  y = np.repeat(np.arange(2), 10).astype(np.int32)
  with pytest.raises(ValueError, match="non-zero variance"):
    preprocess.fit(stats_lib.from_labels(x, y, 2, full=False))


def test_rmds_scores_are_invariant_to_the_transform():
  x, y = _data(seed=4)
  rng = np.random.default_rng(5)
  x_test = np.concatenate([x[::7] + rng.normal(size=x[::7].shape).astype(np.float32),
                           (x.mean(0) + 5.0 * rng.normal(size=(80, D))).astype(np.float32)])
  s_pre = np.asarray(dpmm_jax.score(dpmm_jax.fit_detector(x, y, "rmds", preprocess=True),
                                    x_test), np.float64)
  s_raw = np.asarray(dpmm_jax.score(dpmm_jax.fit_detector(x, y, "rmds", preprocess=False),
                                    x_test), np.float64)
  assert scipy.stats.spearmanr(s_pre, s_raw)[0] > 0.9999
  # RMDS is exactly invariant to invertible affine maps, so the values agree too, up to
  # float32 round-off of squared distances of size ~|s| (relative 1e-4).
  np.testing.assert_allclose(s_pre, s_raw, rtol=1e-3, atol=1e-3 * np.abs(s_raw).max())


def _orthogonal(rng, m):
  q, r = np.linalg.qr(rng.normal(size=(m, m)))
  return q * np.sign(np.diag(r))


def test_canonical_basis_does_not_depend_on_the_basis_an_eigensolver_returned():
  rng = np.random.default_rng(3)
  dim = 9
  vectors = rng.normal(size=(dim, dim))
  values = np.array([0.1, 0.3, 0.5, 0.5, 0.5, 0.5, 0.8, 1.0, 1.0])   # two repeated ones
  turned = vectors.copy()
  turned[:, 2:6] = vectors[:, 2:6] @ _orthogonal(rng, 4)            # another basis of each
  turned[:, 7:9] = vectors[:, 7:9] @ _orthogonal(rng, 2)
  turned[:, 0] *= -1.0                                               # and another sign
  got, want = (preprocess.canonical_basis(values, v) for v in (turned, vectors))
  np.testing.assert_allclose(got, want, atol=1e-12)
  # Columns of a simple eigenvalue keep their direction (only the sign is fixed) and
  # every eigenspace keeps its span.
  np.testing.assert_allclose(np.abs(want[:, [0, 1, 6]]), np.abs(vectors[:, [0, 1, 6]]))
  for lo, hi in ((2, 6), (7, 9)):
    coef = np.linalg.lstsq(vectors[:, lo:hi], want[:, lo:hi], rcond=None)[0]
    np.testing.assert_allclose(vectors[:, lo:hi] @ coef, want[:, lo:hi], atol=1e-12)
  largest = want[np.argmax(np.abs(want), axis=0), np.arange(dim)]
  assert np.all(largest > 0)


def _fewer_classes_than_dimensions(seed=0, num_classes=12, dim=40, per_class=40):
  """K - 1 < D: the within-class covariance has D - K + 1 equal eigenvalues after the
  total whitening, so the eigensolver's basis of that eigenspace is arbitrary."""
  rng = np.random.default_rng(seed)
  y = np.repeat(np.arange(num_classes), per_class).astype(np.int32)
  scale = rng.gamma(5.0, 0.2, size=(num_classes, dim))
  x = rng.normal(size=(num_classes, dim))[y] * 2.0 + scale[y] * rng.standard_normal(
      (len(y), dim))
  return x.astype(np.float32), y, rng.normal(size=(300, dim)).astype(np.float32) * 1.5


@pytest.mark.parametrize("model", ["diag", "coupled"])
def test_axis_aligned_fits_do_not_depend_on_the_order_of_the_training_rows(model):
  # Permuting the rows changes the statistics' round-off only. Without a canonical basis
  # of the repeated eigenvalue the rotation differed completely between the two fits
  # and so did the diag/coupled detectors (K = 100, D = 128: 4.5 % / 1 % of the score
  # scale); a CPU and a GPU fit differed the same way.
  x, y, test = _fewer_classes_than_dimensions()
  perm = np.random.default_rng(1).permutation(len(y))
  a = dpmm_jax.fit_detector(x, y, model)
  b = dpmm_jax.fit_detector(x[perm], y[perm], model)
  np.testing.assert_allclose(np.asarray(a.transform.projection),
                             np.asarray(b.transform.projection), atol=1e-4)
  sa, sb = np.asarray(dpmm_jax.score(a, test)), np.asarray(dpmm_jax.score(b, test))
  assert np.max(np.abs(sa - sb)) <= 1e-4 * np.max(np.abs(sa))
  np.testing.assert_array_equal(np.asarray(dpmm_jax.predict(a, test)),
                                np.asarray(dpmm_jax.predict(b, test)))
