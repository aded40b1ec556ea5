"""LRVB covariances of novelty discovery (dpmm_jax.discovery_lrvb) vs a Gibbs sampler.

The design note's test C: p = 2, two known classes (200 training points each), priors
rho_j = (xbar_j, lambda = 50, nu = 53, 50 S_j), one novelty component (T = 1) with
rho_0 = NIW(0, 0.1, 4, 3 I), alpha = (1, 1, 1), gamma = 1; test batch 100 + 100 known
and 100 novel points from N((2, 2), I). With T = 1 VBrand is a finite mixture with
component-specific NIW priors, so ``gmm.gibbs`` with a K-batched prior samples its exact
posterior.
"""
import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dpmm_jax import discovery, discovery_lrvb, gmm, mcmc  # noqa: E402
from dpmm_jax.conjugate import niw  # noqa: E402


def _problem(seed):
  rng = np.random.default_rng(seed)
  centres = np.array([[0.0, 0.0], [6.0, 0.0]])
  train = [rng.normal(size=(200, 2)) + c for c in centres]
  locs = np.stack([t.mean(0) for t in train])
  covs = np.stack([np.cov(t.T) for t in train])
  known = niw.NIW(jnp.asarray(locs), jnp.full(2, 50.0), jnp.full(2, 53.0),
                  jnp.asarray(50.0 * covs))
  novel = niw.NIW(jnp.zeros((1, 2)), jnp.full(1, 0.1), jnp.full(1, 4.0),
                  3.0 * jnp.eye(2)[None])
  comps = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), known, novel)
  priors = discovery.Priors(jnp.ones(3), jnp.asarray(1.0), comps)
  y = np.concatenate([rng.normal(size=(100, 2)) + centres[0],
                      rng.normal(size=(100, 2)) + centres[1],
                      rng.normal(size=(100, 2)) + np.array([2.0, 2.0])])
  labels = np.repeat(np.arange(3), 100)
  return jnp.asarray(y), labels, priors


def _fit(y, labels, priors):
  params0 = discovery.m_step(jax.nn.one_hot(labels, 3, dtype=y.dtype), y, priors)
  params, info = discovery.fit(params0, y, priors, tol=1e-13, max_iter=2000)
  assert bool(info.converged)
  return params


def test_lrvb_equals_the_finite_mixture_lrvb_when_t_is_one():
  """With T = 1 the VBrand ELBO is the finite GMM's with per-component priors: the two
  LRVB computations (different code, different ELBO implementations) agree. Both use
  the same chart, so they agree at any point; no polishing (saves two compilations)."""
  y, labels, priors = _problem(0)
  params = _fit(y, labels, priors)
  res = discovery_lrvb.posterior_covariance(params, y, priors, polish=0)
  order = jnp.array([1, 2, 0])                     # gmm order: known classes, then novel
  state = gmm.State(params.concentration[order], params.components)
  g = gmm.lrvb_covariance(state, gmm.Prior(priors.alpha[order], priors.components), y,
                          polish=0)
  np.testing.assert_allclose(res.block("novelty_weight")[0, 0], g.block("weights")[2, 2],
                             rtol=1e-6)
  np.testing.assert_allclose(res.block("means"), g.block("means"), rtol=1e-6, atol=1e-12)


def test_novelty_weight_lrvb_within_10_percent_of_gibbs_mean_field_not():
  y, labels, priors = _problem(0)
  params = _fit(y, labels, priors)
  res = discovery_lrvb.posterior_covariance(params, y, priors, polish=3)
  assert float(res.info.grad_norm) < 1e-6
  order = jnp.array([1, 2, 0])
  prior = gmm.Prior(priors.alpha[order], priors.components)
  init = gmm.State(res.params.concentration[order], res.params.components)
  samples = gmm.gibbs(jax.random.PRNGKey(0), prior, y, init, num_samples=2500,
                      num_chains=4, burn_in=500)
  pi0 = np.asarray(samples.weights[..., 2])[..., None]
  ess = mcmc.effective_sample_size(pi0)[0]
  assert ess >= 1000, ess
  sd_g = pi0.std()
  mean_vb = float(params.concentration[0] / jnp.sum(params.concentration))
  assert abs(pi0.mean() - mean_vb) <= 0.25 * sd_g
  lr = float(res.sd("novelty_weight")[0])
  mf = float(res.sd("novelty_weight", mean_field=True)[0])
  assert 0.88 <= lr / sd_g <= 1.10, (lr, sd_g)
  assert mf / sd_g <= 0.85, (mf, sd_g)
  # Known-class means (class A) too.
  mu_a = np.asarray(samples.means[..., 0, :]).reshape(-1, 2)
  lr_mu = np.asarray(res.sd("means"))[:2]
  assert np.all(np.abs(lr_mu / mu_a.std(0) - 1) <= 0.12), lr_mu / mu_a.std(0)


def test_diag_components_are_rejected():
  from dpmm_jax.conjugate import nix
  comps = nix.NIX(jnp.zeros((2, 2)), jnp.ones((2, 2)), jnp.full((2, 2), 4.0),
                  jnp.ones((2, 2)))
  params = discovery.Params(jnp.ones(2), jnp.ones((0,)), jnp.ones((0,)), comps)
  with pytest.raises(ValueError, match="NIW"):
    discovery_lrvb.to_chart(params)
