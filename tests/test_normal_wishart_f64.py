"""Wishart (precision form) and independent Normal x Wishart mean-field pieces (float64).

Densities and entropies against scipy, expectations and KL divergences against Monte
Carlo, and the coordinate updates as exact maximisers of the bound (zero gradient,
perturbations lower it).
"""
import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats as sps  # noqa: E402

from dpmm_jax import stats  # noqa: E402
from dpmm_jax.conjugate import normal_wishart as nw  # noqa: E402
from dpmm_jax.conjugate import wishart  # noqa: E402


def _spd(rng, d, k=None):
  shape = (d, d) if k is None else (k, d, d)
  a = rng.normal(size=shape)
  return a @ np.swapaxes(a, -1, -2) + d * np.eye(d)


def _random_nw(rng, k, d):
  return nw.NormalWishart(jnp.asarray(rng.normal(size=(k, d))), jnp.asarray(_spd(rng, d, k)),
                          jnp.asarray(d + 1.0 + rng.uniform(0, 5, k)),
                          jnp.asarray(_spd(rng, d, k)))


def test_wishart_log_density_and_entropy_match_scipy():
  rng = np.random.default_rng(0)
  d = 3
  w = wishart.Wishart(jnp.asarray([3.0, 6.5]), jnp.asarray(_spd(rng, d, 2)))
  r = _spd(rng, d)
  for k in range(2):
    ref = sps.wishart(df=float(w.df[k]), scale=np.linalg.inv(np.asarray(w.inv_scale[k])))
    np.testing.assert_allclose(wishart.log_density(w, jnp.asarray(r))[k], ref.logpdf(r),
                               rtol=1e-12)
    np.testing.assert_allclose(wishart.entropy(w)[k], ref.entropy(), rtol=1e-12)


def test_wishart_expectations_match_monte_carlo():
  rng = np.random.default_rng(1)
  d = 3
  w = wishart.Wishart(jnp.asarray(4.5), jnp.asarray(_spd(rng, d)))
  draws = sps.wishart(df=4.5, scale=np.linalg.inv(np.asarray(w.inv_scale))).rvs(
      40000, random_state=rng)
  mean, se = draws.mean(0), draws.std(0) / np.sqrt(len(draws))
  np.testing.assert_array_less(np.abs(np.asarray(wishart.mean(w)) - mean), 5 * se)
  logdet = np.linalg.slogdet(draws)[1]
  assert abs(float(wishart.expected_log_det(w)) - logdet.mean()) < 5 * logdet.std() / 200
  m = wishart.from_mean(jnp.asarray(_spd(rng, d)), 7.0)
  np.testing.assert_allclose(wishart.mean(m), wishart.mean(m), rtol=0)
  target = _spd(np.random.default_rng(5), d)
  np.testing.assert_allclose(wishart.mean(wishart.from_mean(jnp.asarray(target), 7.0)),
                             target, rtol=1e-12)


def test_wishart_kl_matches_monte_carlo_and_vanishes_at_equality():
  rng = np.random.default_rng(2)
  d = 3
  q = wishart.Wishart(jnp.asarray(6.0), jnp.asarray(_spd(rng, d)))
  p = wishart.Wishart(jnp.asarray(4.0), jnp.asarray(_spd(rng, d)))
  draws = sps.wishart(df=6.0, scale=np.linalg.inv(np.asarray(q.inv_scale))).rvs(
      20000, random_state=rng)
  vals = (np.asarray(wishart.log_density(q, jnp.asarray(draws)))
          - np.asarray(wishart.log_density(p, jnp.asarray(draws))))
  got = float(wishart.kl_divergence(q, p))
  assert got > 0 and abs(got - vals.mean()) < 5 * vals.std() / np.sqrt(len(vals))
  np.testing.assert_allclose(wishart.kl_divergence(q, q), 0.0, atol=1e-12)


def test_normal_wishart_expected_log_likelihood_matches_monte_carlo():
  rng = np.random.default_rng(3)
  k, d = 2, 3
  q = _random_nw(rng, k, d)
  x = rng.normal(size=(4, d))
  got = np.asarray(nw.expected_log_likelihood(q, jnp.asarray(x)))
  assert got.shape == (4, k)
  n = 20000
  for j in range(k):
    mus = rng.multivariate_normal(np.asarray(q.loc[j]), np.linalg.inv(q.loc_precision[j]), n)
    rs = sps.wishart(df=float(q.df[j]), scale=np.linalg.inv(q.inv_scale[j])).rvs(
        n, random_state=rng)
    diff = x[None] - mus[:, None]                                   # (n, 4, d)
    vals = (-0.5 * d * np.log(2 * np.pi) + 0.5 * np.linalg.slogdet(rs)[1][:, None]
            - 0.5 * np.einsum("smi,sij,smj->sm", diff, rs, diff))
    mc, se = vals.mean(0), vals.std(0) / np.sqrt(n)
    np.testing.assert_array_less(np.abs(got[:, j] - mc), 5 * se)


def test_normal_wishart_kl_matches_monte_carlo():
  rng = np.random.default_rng(4)
  d = 2
  q, p = _random_nw(rng, 1, d), _random_nw(rng, 1, d)
  p = jax.tree_util.tree_map(lambda a: a[0], p)
  n = 8000
  mus = rng.multivariate_normal(np.asarray(q.loc[0]), np.linalg.inv(q.loc_precision[0]), n)
  rs = sps.wishart(df=float(q.df[0]), scale=np.linalg.inv(q.inv_scale[0])).rvs(
      n, random_state=rng)

  def log_dens(f, mu, r):
    return (sps.multivariate_normal(np.asarray(f.loc).reshape(-1),
                                    np.linalg.inv(np.asarray(f.loc_precision).reshape(d, d))
                                    ).logpdf(mu)
            + sps.wishart(df=float(np.asarray(f.df).reshape(())),
                          scale=np.linalg.inv(np.asarray(f.inv_scale).reshape(d, d))
                          ).logpdf(np.moveaxis(r, 0, -1)))

  q0 = jax.tree_util.tree_map(lambda a: a[0], q)
  vals = log_dens(q0, mus, rs) - log_dens(p, mus, rs)
  got = float(nw.kl_divergence(q, p)[0])
  assert abs(got - vals.mean()) < 5 * vals.std() / np.sqrt(n)
  np.testing.assert_allclose(nw.kl_divergence(q, q), 0.0, atol=1e-12)


# ------------------------------------------- coordinate updates are exact block maximisers
def _objective(q, prior, x, w):
  """sum_n w_n E log N(x_n | mu, R^-1) - KL(q || prior) for one class (K = 1)."""
  return (jnp.sum(w[:, None] * nw.expected_log_likelihood(q, x))
          - jnp.sum(nw.kl_divergence(q, prior)))


def _problem(seed=6, n=30, d=3):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, d)) * 2.0 + 1.0)
  w = jnp.asarray(rng.uniform(0, 1, n))
  prior = nw.prior(jnp.zeros(d), jnp.asarray(0.3 * np.eye(d)), float(d),
                   jnp.asarray(0.5 * np.eye(d)))
  s = stats.from_responsibilities(x, w[:, None])
  q = nw.broadcast(prior, 1)._replace(loc=jnp.asarray(rng.normal(size=(1, d))))
  return x, w, prior, s, q


def _chol_params(q):
  return (q.loc, jnp.linalg.cholesky(q.loc_precision), q.df, jnp.linalg.cholesky(q.inv_scale))


def _from_chol(params):
  loc, l1, df, l2 = params
  return nw.NormalWishart(loc, l1 @ jnp.swapaxes(l1, -1, -2), df, l2 @ jnp.swapaxes(l2, -1, -2))


def _assert_block_maximum(obj, params, rng, dense, dense_scale, tril):
  """obj(params) beats 5 random perturbations of the block (params[dense], params[tril]):
  normal noise times dense_scale on the first, lower-triangular noise times 0.05 on the
  second (a Cholesky factor)."""
  base = float(obj(params))
  for _ in range(5):
    pert = list(params)
    pert[dense] = pert[dense] + dense_scale * rng.normal(size=pert[dense].shape)
    pert[tril] = pert[tril] + 0.05 * jnp.tril(rng.normal(size=pert[tril].shape))
    assert float(obj(tuple(pert))) < base


def test_updates_are_exact_block_maximisers():
  x, w, prior, s, q = _problem()
  obj = jax.jit(lambda params: _objective(_from_chol(params), prior, x, w))
  grad = jax.jit(jax.grad(obj))
  rng = np.random.default_rng(7)
  for _ in range(2):                                   # two coordinate-ascent passes
    q = nw.update_loc(prior, q, s.count, s.mean)
    g = grad(_chol_params(q))
    # Mean block: gradient in (loc, chol(Lambda)) vanishes.
    assert float(jnp.max(jnp.abs(g[0]))) < 1e-9 and float(jnp.max(jnp.abs(jnp.tril(g[1])))) < 1e-9
    _assert_block_maximum(obj, _chol_params(q), rng, dense=0, dense_scale=0.05, tril=1)
    q = nw.update_precision(prior, q, s.count, s.mean, s.scatter)
    g = grad(_chol_params(q))
    assert abs(float(g[2][0])) < 1e-9 and float(jnp.max(jnp.abs(jnp.tril(g[3])))) < 1e-9
    _assert_block_maximum(obj, _chol_params(q), rng, dense=2, dense_scale=0.2, tril=3)


def test_updates_from_zero_weight_return_the_prior():
  x, _, prior, _, q = _problem()
  s = stats.from_responsibilities(x, jnp.zeros((x.shape[0], 1)))
  out = nw.posterior(prior, q, s.count, s.mean, s.scatter)
  for a, b in zip(out, nw.broadcast(prior, 1)):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
