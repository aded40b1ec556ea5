"""LRVB experiments (paper 004): corrected covariances of a Gaussian mixture vs Gibbs.

Filled in below: the paper's simulation, scikit-learn digits 0/1, run-time scaling.
"""
import jax
import jax.numpy as jnp

# The paper's data-generating process (rgiordan/MVNMixtureLRVB GenerateSampleParams with
# k=2, p=2, vars.scale=0.5, anisotropy=1): means (0,0) and (1,1),
# Sigma_k = sqrt(k) 0.25 diag(1, 1.5)^2 / 2.25, weights (3/7, 4/7).
PAPER_MEANS = ((0.0, 0.0), (1.0, 1.0))
PAPER_WEIGHTS = (3.0 / 7.0, 4.0 / 7.0)


def paper_covariances(dtype=None):
  base = 0.25 * jnp.diag(jnp.array([1.0, 1.5], dtype) ** 2) / 2.25
  return jnp.stack([jnp.sqrt(float(k + 1)) * base for k in range(2)])


def paper_data(key, num_points: int):
  """(N, 2) draws from the paper's two-component simulation."""
  k_z, k_e = jax.random.split(key)
  dtype = jnp.zeros(()).dtype
  covs = paper_covariances(dtype)
  means = jnp.asarray(PAPER_MEANS, dtype)
  z = jax.random.choice(k_z, 2, (num_points,), p=jnp.asarray(PAPER_WEIGHTS, dtype))
  e = jax.random.normal(k_e, (num_points, 2), dtype)
  return means[z] + jnp.einsum("nij,nj->ni", jnp.linalg.cholesky(covs)[z], e)
