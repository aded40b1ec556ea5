"""A built-in high-dimensional problem shaped like the paper's ImageNet analysis.

Used by ``dim_sweep`` and ``covariance_analysis`` when no feature file is given. The class
covariances differ the way sections 5 and 9 found for ImageNet embeddings:

* a shared average within-class covariance ``Sigma0 = U diag(lambda) U^T`` with a
  power-law spectrum (``lambda_i ~ i^-within_decay``, mean 1) in a random orientation, so
  PCA and the section-8 rotation have something to find;
* partial pooling: ``Sigma~_k ~ IW(nu, (nu - D - 1) Sigma0)`` with ``nu = D + 1 +
  pooling * D`` (larger ``pooling`` = covariances closer to ``Sigma0``);
* a per-class scale factor (Figure 2): ``Sigma_k = gamma_k Sigma~_k`` with
  ``gamma_k ~ Gamma(shape a, rate a)`` (mean 1), so all variances of a class are larger
  or smaller together;
* class means ``mu_k ~ N(0, B)`` with ``B = U diag(beta) U^T``, a faster-decaying
  spectrum ``beta_i ~ i^-between_decay`` scaled so that ``tr B = separation * tr Sigma0``:
  as in real embeddings the class means differ mostly along the top principal
  components, and the trailing components carry within-class variation (and the
  covariance differences) only.

Near-OOD points come from fresh classes drawn from the same prior (new classes that look
like the training classes). Far-OOD points come from fresh classes with covariances drawn
the same way but means ``~ N(0, far_spread^2 B + far_shift Sigma0)``: besides being more
spread out along the top components, they are displaced along the trailing components
where the training classes do not vary (a domain shift), so that far OOD gets easier as
more components are kept.

All draws use ``dpmm_jax.synthetic`` samplers and explicit ``jax.random`` keys.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import synthetic


class Problem(NamedTuple):
  """x_* (N, D) float arrays, y_* (N,) int32; ``scales`` (K,) the true gamma_k;
  ``covariances`` (K, D, D) the true class covariances."""
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  x_near: np.ndarray
  x_far: np.ndarray
  scales: np.ndarray
  covariances: np.ndarray


DEFAULTS = dict(num_classes=50, dim=256, num_train_per_class=100, num_test_per_class=20,
                num_ood_classes=50, within_decay=0.5, between_decay=1.5, separation=0.2,
                pooling=2.0, scale_shape=8.0, far_spread=1.5, far_shift=1.0)


def _classes(key, num, sigma0, nu, scale_shape, mean_factor, dtype):
  """num classes: means mean_factor @ z (z standard normal), covariances gamma * IW."""
  k_cov, k_scale, k_mean = jax.random.split(key, 3)
  dim = sigma0.shape[0]
  cov = synthetic.sample_inverse_wishart(k_cov, nu, (nu - dim - 1) * sigma0, num)
  scales = jax.random.gamma(k_scale, scale_shape, (num,), dtype) / scale_shape
  cov = cov * scales[:, None, None]
  means = jax.random.normal(k_mean, (num, dim), dtype) @ mean_factor.T
  return means, cov, scales


def _points(key, means, cov, n):
  chol = jnp.linalg.cholesky(cov)
  z = jax.random.normal(key, (means.shape[0], n, means.shape[1]), means.dtype)
  x = means[:, None, :] + jnp.einsum("kij,knj->kni", chol, z)
  return np.asarray(x.reshape(-1, means.shape[1]))


def make_problem(key, *, num_classes: int = 50, dim: int = 256,
                 num_train_per_class: int = 100, num_test_per_class: int = 20,
                 num_ood_classes: int = 50, within_decay: float = 0.5,
                 between_decay: float = 1.5, separation: float = 0.2, pooling: float = 2.0,
                 scale_shape: float = 8.0, far_spread: float = 1.5, far_shift: float = 1.0,
                 dtype=jnp.float32) -> Problem:
  """Samples the problem (see the module docstring for the generative process).

  Args:
    key: a ``jax.random`` key.
    num_classes, dim: K and D.
    num_train_per_class, num_test_per_class: points per ID class.
    num_ood_classes: fresh classes in each of the near and far OOD sets (each
      contributes ``num_test_per_class`` points).
    within_decay: power-law exponent of the spectrum of ``Sigma0``.
    between_decay: power-law exponent of the spectrum of the class-mean covariance.
    separation: ``tr B / tr Sigma0`` (between- over within-class variance).
    pooling: ``nu = D + 1 + pooling * D`` for the inverse-Wishart around ``Sigma0``.
    scale_shape: shape (= rate) ``a`` of the per-class scale factors.
    far_spread: far-OOD means are this many times more spread out along ``B``.
    far_shift: extra far-OOD mean covariance, in units of ``Sigma0``.
    dtype: float dtype.

  Returns:
    Problem.
  """
  if min(pooling, scale_shape, separation, far_spread) <= 0 or far_shift < 0:
    raise ValueError("pooling, scale_shape, separation and far_spread must be > 0 and "
                     "far_shift >= 0.")
  keys = jax.random.split(key, 8)
  index = jnp.arange(1, dim + 1, dtype=dtype)
  lam = index ** (-within_decay)
  lam = lam / jnp.mean(lam)
  beta = index ** (-between_decay)
  beta = beta * separation * jnp.sum(lam) / jnp.sum(beta)
  q, _ = jnp.linalg.qr(jax.random.normal(keys[0], (dim, dim), dtype))
  sigma0 = (q * lam) @ q.T
  sigma0 = 0.5 * (sigma0 + sigma0.T)
  mean_factor = q * jnp.sqrt(beta)
  nu = dim + 1.0 + pooling * dim
  means, cov, scales = _classes(keys[1], num_classes, sigma0, nu, scale_shape, mean_factor,
                                dtype)
  near_m, near_c, _ = _classes(keys[2], num_ood_classes, sigma0, nu, scale_shape,
                               mean_factor, dtype)
  far_factor = q * jnp.sqrt(far_spread ** 2 * beta + far_shift * lam)
  far_m, far_c, _ = _classes(keys[3], num_ood_classes, sigma0, nu, scale_shape, far_factor,
                             dtype)
  labels = lambda n: np.repeat(np.arange(num_classes, dtype=np.int32), n)  # pylint: disable=g-long-lambda
  return Problem(
      x_train=_points(keys[4], means, cov, num_train_per_class),
      y_train=labels(num_train_per_class),
      x_test=_points(keys[5], means, cov, num_test_per_class),
      y_test=labels(num_test_per_class),
      x_near=_points(keys[6], near_m, near_c, num_test_per_class),
      x_far=_points(keys[7], far_m, far_c, num_test_per_class),
      scales=np.asarray(scales), covariances=np.asarray(cov))
