"""VBrand novelty discovery (dpmm_jax.discovery), float64: exact oracles and bounds.

- one-hot oracle: with one-hot phi and the M-step of that phi, the ELBO equals
  log p(Y, xi) from conjugate marginal likelihoods (catches any wrong ELBO term);
- enumeration: on a tiny problem the final ELBO is below log p(Y) = logsumexp over all
  labelings, and CAVI started at the MAP labeling ends above max_xi log p(Y, xi);
- CAVI never decreases the ELBO (several problems, both variants), and every block
  update is the argmax of the ELBO in its block (perturbations lower it);
- reductions to the detector: on an empty batch predict_proba is the detector's label
  posterior (known classes + new-class event); with growing training counts the known-
  class responsibilities of a test point approach the supervised label posterior.
"""
import itertools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dpmm_jax  # noqa: E402
from dpmm_jax import discovery  # noqa: E402
from dpmm_jax import scores  # noqa: E402
from dpmm_jax.conjugate import dirichlet, niw, nix  # noqa: E402
from dpmm_jax.models import diag as diag_model  # noqa: E402
from dpmm_jax.models import full as full_model  # noqa: E402


# Jitted once per shape (the problems below share shapes), instead of op-by-op dispatch.
_m_step = jax.jit(discovery.m_step)
_elbo = jax.jit(discovery.elbo)
_elbo_at = jax.jit(discovery.elbo_at)
_responsibilities = jax.jit(discovery.responsibilities)
_init = jax.jit(discovery.init_params)
_fit = jax.jit(discovery.fit, static_argnames="max_iter")


def _random_priors(rng, num_known, t, dim, full):
  """Known-class priors at random locations, a broad novelty base measure."""
  if full:
    a = rng.normal(size=(num_known, dim, dim))
    known = niw.NIW(jnp.asarray(rng.normal(scale=3.0, size=(num_known, dim))),
                    jnp.asarray(rng.uniform(1.0, 20.0, num_known)),
                    jnp.asarray(dim + 2.0 + rng.uniform(0.0, 20.0, num_known)),
                    jnp.asarray(a @ np.swapaxes(a, 1, 2) + 3.0 * np.eye(dim)))
    base = niw.NIW(jnp.zeros((dim,)), jnp.asarray(0.1), jnp.asarray(dim + 2.0),
                   jnp.asarray(4.0 * np.eye(dim)))
  else:
    known = nix.NIX(jnp.asarray(rng.normal(scale=3.0, size=(num_known, dim))),
                    jnp.asarray(rng.uniform(1.0, 20.0, (num_known, dim))),
                    jnp.asarray(3.0 + rng.uniform(0.0, 20.0, (num_known, dim))),
                    jnp.asarray(rng.uniform(0.5, 2.0, (num_known, dim))))
    base = nix.NIX(jnp.zeros((dim,)), jnp.full((dim,), 0.1), jnp.full((dim,), 3.0),
                   jnp.full((dim,), 2.0))
  base_t = jax.tree_util.tree_map(lambda v: jnp.broadcast_to(v, (t,) + v.shape), base)
  comps = jax.tree_util.tree_map(lambda u, v: jnp.concatenate([u, v]), known, base_t)
  alpha = jnp.asarray(rng.uniform(0.5, 5.0, num_known + 1))
  return discovery.Priors(alpha, jnp.asarray(rng.uniform(0.5, 5.0)), comps)


def _problem(seed, full, num_known=3, t=4, dim=2, m=60):
  rng = np.random.default_rng(seed)
  priors = _random_priors(rng, num_known, t, dim, full)
  centres = np.concatenate([np.asarray(priors.components.loc[:num_known]),
                            rng.normal(scale=6.0, size=(2, dim))])
  z = rng.integers(0, len(centres), m)
  y = jnp.asarray(centres[z] + rng.normal(size=(m, dim)))
  return priors, y


def _log_joint(priors, y, z):
  """log p(Y, xi = z) from conjugate marginal likelihoods and Dirichlet/Beta ratios."""
  num_known = priors.alpha.shape[0] - 1
  num_comp = priors.components.loc.shape[0]
  resp = jax.nn.one_hot(z, num_comp, dtype=y.dtype)
  post = _m_step(resp, y, priors).components
  count = jnp.sum(resp, 0)
  if isinstance(priors.components, niw.NIW):
    lml = jnp.sum(niw.log_marginal_likelihood(priors.components, post, count))
  else:
    lml = jnp.sum(nix.log_marginal_likelihood(priors.components, post, count))
  novel = count[num_known:]
  n = jnp.concatenate([jnp.sum(novel)[None], count[:num_known]])
  log_dir = dirichlet.log_normalizer(priors.alpha + n) - dirichlet.log_normalizer(priors.alpha)
  tail = jnp.cumsum(novel[::-1])[::-1][1:]
  one = jnp.ones_like(tail)
  log_sticks = jnp.sum(
      dirichlet.log_normalizer(jnp.stack([1.0 + novel[:-1], priors.gamma + tail], -1))
      - dirichlet.log_normalizer(jnp.stack([one, priors.gamma * one], -1)))
  return lml + log_dir + log_sticks


@pytest.mark.parametrize("full", [True, False])
def test_one_hot_elbo_is_log_joint(full):
  priors, y = _problem(0, full)
  rng = np.random.default_rng(1)
  num_comp = priors.components.loc.shape[0]
  for z in (rng.integers(0, num_comp, y.shape[0]),
            np.concatenate([np.zeros(20, int), np.full(20, 3), np.full(20, 5)])):
    z = jnp.asarray(z)
    resp = jax.nn.one_hot(z, num_comp, dtype=y.dtype)
    params = _m_step(resp, y, priors)
    got = float(_elbo_at(params, y, priors, resp))
    want = float(_log_joint(priors, y, z))
    assert abs(got - want) <= 1e-10 * max(1.0, abs(want)), (got, want)


@pytest.mark.parametrize("full", [True, False])
def test_profiled_elbo_equals_elbo_at_optimal_responsibilities(full):
  priors, y = _problem(2, full)
  params = _init(jax.random.PRNGKey(0), y, priors)
  resp = _responsibilities(params, y)
  got, want = _elbo(params, y, priors), _elbo_at(params, y, priors, resp)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  # any other phi gives a smaller bound
  other = jax.nn.softmax(jnp.log(resp) + 0.3 * jax.random.normal(jax.random.PRNGKey(1),
                                                                  resp.shape), -1)
  assert float(_elbo_at(params, y, priors, other)) < float(want)


@pytest.mark.parametrize("full", [True, False])
def test_elbo_below_evidence_by_enumeration(full):
  rng = np.random.default_rng(3)
  priors = _random_priors(rng, 2, 3, 2, full)
  y = jnp.asarray(np.concatenate([rng.normal(np.asarray(priors.components.loc[0]), 1.0, (3, 2)),
                                  rng.normal(5.0, 1.0, (3, 2))]))
  num_comp = 5
  labelings = jnp.asarray(list(itertools.product(range(num_comp), repeat=y.shape[0])))
  log_joint = jax.jit(jax.vmap(lambda z: _log_joint(priors, y, z)))(labelings)
  log_evidence = float(jax.nn.logsumexp(log_joint))
  params0 = _init(jax.random.PRNGKey(0), y, priors)
  params, info = _fit(params0, y, priors, tol=1e-13, max_iter=200)
  final = float(_elbo(params, y, priors))
  assert final <= log_evidence
  # from the MAP labeling, CAVI ends at or above the best single labeling
  best = labelings[int(jnp.argmax(log_joint))]
  start = _m_step(jax.nn.one_hot(best, num_comp, dtype=y.dtype), y, priors)
  params, _ = _fit(start, y, priors, tol=1e-13, max_iter=200)
  final_map = float(_elbo(params, y, priors))
  assert final_map >= float(jnp.max(log_joint)) - 1e-9
  assert final_map <= log_evidence


@pytest.mark.parametrize("full", [True, False])
def test_cavi_never_decreases_elbo(full):
  for seed in range(3):
    priors, y = _problem(10 + seed, full)
    for restart in range(3):
      key = jax.random.PRNGKey(restart)
      resp = jax.random.dirichlet(key, jnp.ones(priors.components.loc.shape[0]), (y.shape[0],))
      params0 = _m_step(resp, y, priors)
      _, info = _fit(params0, y, priors, tol=1e-14, max_iter=80)
      trace = np.asarray(info.elbo_trace[:int(info.num_iters) + 1])
      assert trace.size > 5 and np.all(np.isfinite(trace))
      assert np.all(np.diff(trace) >= -1e-9 * np.abs(trace[1:])), np.diff(trace).min()


def _perturb(params, key, eps, block):
  keys = jax.random.split(key, 4)
  noise = lambda k, a: eps * jax.random.normal(k, jnp.shape(a), jnp.asarray(a).dtype)
  if block == "concentration":
    return params._replace(concentration=params.concentration
                           * jnp.exp(noise(keys[0], params.concentration)))
  if block == "sticks":
    return params._replace(stick_a=params.stick_a * jnp.exp(noise(keys[0], params.stick_a)),
                           stick_b=params.stick_b * jnp.exp(noise(keys[1], params.stick_b)))
  c = params.components
  if isinstance(c, niw.NIW):
    a = noise(keys[3], c.scale)
    scale = c.scale + 0.5 * (a + jnp.swapaxes(a, -1, -2)) * jnp.abs(c.scale).max()
    new = niw.NIW(c.loc + noise(keys[0], c.loc), c.mean_concentration
                  * jnp.exp(noise(keys[1], c.mean_concentration)),
                  c.df + noise(keys[2], c.df), scale)
  else:
    new = nix.NIX(c.loc + noise(keys[0], c.loc),
                  c.mean_concentration * jnp.exp(noise(keys[1], c.loc)),
                  c.df * jnp.exp(noise(keys[2], c.loc)),
                  c.scale_sq * jnp.exp(noise(keys[3], c.loc)))
  return params._replace(components=new)


@pytest.mark.parametrize("full", [True, False])
def test_each_block_update_maximises_its_block(full):
  priors, y = _problem(20, full)
  num_comp = priors.components.loc.shape[0]
  resp = jax.random.dirichlet(jax.random.PRNGKey(5), jnp.ones(num_comp), (y.shape[0],))
  params = _m_step(resp, y, priors)      # argmax over all globals given resp
  best = float(_elbo_at(params, y, priors, resp))
  for block in ("concentration", "sticks", "components"):
    for i in range(4):
      other = _perturb(params, jax.random.PRNGKey(i), 1e-3, block)
      assert float(_elbo_at(other, y, priors, resp)) < best, block
  # the E-step: softmax(r) is the argmax over phi given the globals
  opt = _responsibilities(params, y)
  best_phi = float(_elbo_at(params, y, priors, opt))
  for i in range(4):
    other = jax.nn.softmax(jnp.log(opt) + 1e-2 * jax.random.normal(jax.random.PRNGKey(i),
                                                                   opt.shape), -1)
    assert float(_elbo_at(params, y, priors, other)) < best_phi


def test_unused_novel_component_stays_at_prior():
  priors, y = _problem(30, True)
  num_comp = priors.components.loc.shape[0]
  z = jnp.asarray(np.arange(y.shape[0]) % 4)       # last components get no points
  params = _m_step(jax.nn.one_hot(z, num_comp, dtype=y.dtype), y, priors)
  for leaf, prior_leaf in zip(params.components, priors.components):
    np.testing.assert_allclose(leaf[4:], prior_leaf[4:], rtol=1e-14, atol=1e-14)
  np.testing.assert_allclose(params.stick_a[-2:], 1.0)
  np.testing.assert_allclose(params.stick_b[-1], priors.gamma)


def _three_class_data(rng, n_per_class, dim=2):
  means = np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]])[:, :dim]
  covs = [np.eye(dim), np.array([[1.0, 0.5], [0.5, 1.0]]), np.diag([0.5, 1.5])]
  x = np.concatenate([rng.multivariate_normal(m, c, n_per_class) for m, c in zip(means, covs)])
  return x, np.repeat(np.arange(3), n_per_class)


@pytest.mark.parametrize("model", ["full", "diag"])
def test_empty_batch_predict_proba_is_detector_label_posterior(model):
  rng = np.random.default_rng(40)
  x, y = _three_class_data(rng, 60)
  det = dpmm_jax.fit_detector(x, y, model=model)
  alpha = 2.0
  res = dpmm_jax.discover(det, np.zeros((0, 2)), 5, alpha=alpha)
  assert res.assignments.shape == (0,) and res.responsibilities.shape == (0, 8)
  x_new = rng.normal(scale=4.0, size=(25, 2))
  prob = np.asarray(discovery.predict_proba(res, x_new))
  z = det.transform and dpmm_jax.preprocess.apply(det.transform, jnp.asarray(x_new))
  module = full_model if model == "full" else diag_model
  class_lp, prior_lp = module.log_predictive(det.params, z)
  want = np.asarray(scores.label_probabilities(det.params.log_counts, class_lp, prior_lp, alpha))
  np.testing.assert_allclose(prob[:, :3], want[:, :3], atol=1e-12)
  np.testing.assert_allclose(prob[:, 3:].sum(1), want[:, 3], atol=1e-12)


def test_known_class_responsibilities_approach_supervised_posterior():
  """M = 1: phi_{1:J} / sum phi_{1:J} -> softmax_j(log N_j + log St_j(y)) as N_j grows
  (the novelty responsibility does not reduce: a single point cannot open a cluster)."""
  rng = np.random.default_rng(50)
  points = rng.normal(scale=2.0, size=(6, 2)) + np.array([2.0, 2.0])
  errors = []
  for n in (300, 3000, 30000):
    x, y = _three_class_data(rng, n)
    det = dpmm_jax.fit_detector(x, y, model="full", preprocess=False, chunk_size=1024)
    worst = 0.0
    for point in points:
      res = dpmm_jax.discover(det, point[None], 2, num_restarts=1, tol=1e-12)
      known = np.asarray(res.responsibilities[0, :3])
      class_lp, _ = full_model.log_predictive(det.params, jnp.asarray(point[None]))
      want = np.asarray(jax.nn.softmax(det.params.log_counts + class_lp[0]))
      worst = max(worst, np.max(np.abs(known / known.sum() - want)))
    errors.append(worst)
  assert errors[0] > errors[1] > errors[2]
  assert errors[2] <= 2e-3, errors
