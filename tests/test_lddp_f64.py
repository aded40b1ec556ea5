"""LDDP mixture (dpmm_jax.lddp) in float64: the bound never decreases, every block update
maximises the bound in its block, f = 0 reduces to a finite Bayesian GMM (checked against
an independent numpy implementation), and the Nystrom products against exact ones."""
import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy import special as ssp  # noqa: E402

from dpmm_jax import lddp  # noqa: E402
from dpmm_jax.conjugate import normal_wishart as nw  # noqa: E402

K = 3


def _scene(size=12, seed=0):
  """Three vertical bands with overlapping colour distributions."""
  rng = np.random.default_rng(seed)
  g = np.linspace(0.0, 1.0, size)
  yy, xx = np.meshgrid(g, g, indexing="ij")
  loc = np.stack([yy.ravel(), xx.ravel()], -1)
  labels = np.minimum((xx.ravel() + 0.15 * np.sin(6 * yy.ravel())) * 3, 2.999).astype(int)
  labels = np.clip(labels, 0, 2)
  means = np.array([[0.3, 0.5, 0.5], [0.5, 0.3, 0.5], [0.5, 0.5, 0.3]])
  x = means[labels] + 0.12 * rng.normal(size=(size * size, 3))
  return x, loc, labels


@pytest.fixture(scope="module")
def problem():
  x, loc, labels = _scene()
  inducing = lddp.grid_inducing(loc, 6)
  init_means = np.array([[0.3, 0.5, 0.5], [0.5, 0.3, 0.5], [0.5, 0.5, 0.3]]) + 0.02
  return dict(x=jnp.asarray(x), loc=jnp.asarray(loc), labels=labels, inducing=inducing,
              init_means=init_means)


@pytest.fixture(scope="module")
def long_fit(problem):
  return lddp.fit(problem["x"], problem["loc"], K, key=jax.random.key(0),
                  inducing=problem["inducing"], init_means=problem["init_means"],
                  tol=1e-13, max_iter=400)


def test_bound_never_decreases(long_fit):
  trace = np.asarray(long_fit.bound_trace)
  trace = trace[~np.isnan(trace)]
  assert trace.size == int(long_fit.num_iters) + 1 > 20
  steps = np.diff(trace)
  assert np.all(steps >= -1e-9 * np.abs(trace[1:])), steps.min()
  assert trace[-1] > trace[0] + 1.0
  # The field did move (the f-step is not a no-op).
  assert float(jnp.max(jnp.abs(long_fit.state.field))) > 0.3


def test_field_is_stationary_at_convergence(problem, long_fit):
  """f-block: the gradient of the bound in u (xi at its optimum) vanishes at the end."""
  nys = long_fit.nystrom
  start = lddp.init_state(problem["x"], long_fit.prior, nys, jnp.asarray(problem["init_means"]))
  g0 = float(jnp.max(jnp.abs(lddp.field_gradient(start, nys))))
  g = float(jnp.max(jnp.abs(lddp.field_gradient(long_fit.state, nys))))
  assert g0 > 0.1 and g < 1e-4 * g0, (g, g0)


_BLOCKS = dict(phi=(0,), z=(1, 2), xi=(3,), mu=(4, 5), r=(6, 7))


def _to_params(s):
  c = s.clusters
  return (jnp.log(s.responsibilities), jnp.log(s.gamma_shape), jnp.log(s.gamma_rate),
          s.log_xi, c.loc, jnp.linalg.cholesky(c.loc_precision), c.df,
          jnp.linalg.cholesky(c.inv_scale))


def _from_params(p, like):
  outer = lambda l: l @ jnp.swapaxes(l, -1, -2)
  clusters = nw.NormalWishart(p[4], outer(p[5]), p[6], outer(p[7]))
  return like._replace(responsibilities=jax.nn.softmax(p[0], -1), gamma_shape=jnp.exp(p[1]),
                       gamma_rate=jnp.exp(p[2]), log_xi=p[3], clusters=clusters)


def test_each_block_update_maximises_the_bound(problem, long_fit):
  """After each block update the bound's gradient in that block vanishes and random
  perturbations of the block lower the bound (phi by its logits, q(z) by (log a, log b),
  xi by log xi, q(mu) by (m, chol Lambda), q(R) by (nu, chol Psi))."""
  x, prior, nys = problem["x"], long_fit.prior, long_fit.nystrom
  rng = np.random.default_rng(0)
  # A state with a non-zero field, not at the optimum of any block.
  state = long_fit.state
  state = state._replace(field_weights=state.field_weights * 0.7, field=state.field * 0.7)
  value = jax.jit(lambda p, s: lddp.bound(x, _from_params(p, s), prior, nys))
  grad = jax.jit(jax.grad(lambda p, s: lddp.bound(x, _from_params(p, s), prior, nys)))
  from dpmm_jax import stats as stats_lib
  st = stats_lib.from_responsibilities(x, state.responsibilities)
  updates = dict(
      phi=lambda s: lddp.update_responsibilities(x, s),
      z=lambda s: lddp.update_weights(s, prior),
      xi=lddp.update_xi,
      mu=lambda s: s._replace(clusters=nw.update_loc(prior.clusters, s.clusters, st.count,
                                                     st.mean)),
      r=lambda s: s._replace(clusters=nw.update_precision(prior.clusters, s.clusters,
                                                          st.count, st.mean, st.scatter)))
  scales = dict(phi=0.1, z=0.05, xi=0.05, mu=0.01, r=0.01)
  for name, update in updates.items():
    new = update(state)
    params = _to_params(new)
    base = float(value(params, new))
    assert base >= float(value(_to_params(state), state)) - 1e-9, name
    g = grad(params, new)
    for i in _BLOCKS[name]:
      assert float(jnp.max(jnp.abs(g[i]))) < 1e-6, (name, i, g[i])
    for _ in range(6):
      pert = list(params)
      for i in _BLOCKS[name]:
        noise = rng.normal(size=np.shape(pert[i]))
        if np.ndim(pert[i]) == 3:
          noise = np.tril(noise)
        pert[i] = pert[i] + scales[name] * noise
      assert float(value(tuple(pert), new)) < base, name

  # f: the backtracking step raises the bound (xi re-set) by exactly its reported gain.
  s0 = lddp.update_xi(state)
  s1, info = lddp.update_field(s0, nys, max_step=1.0)
  s1 = lddp.update_xi(s1)
  assert float(info.slope) > 0 and float(info.step_size) > 0
  b0, b1 = float(value(_to_params(s0), s0)), float(value(_to_params(s1), s1))
  assert b1 > b0
  np.testing.assert_allclose(b1 - b0, float(info.gain), rtol=1e-8)


# ---------------------------------------------------------- f = 0: a finite Bayesian GMM
def _np_expected_loglik(x, m, lam, nu, psi):
  d = x.shape[1]
  out = np.zeros((x.shape[0], m.shape[0]))
  for k in range(m.shape[0]):
    e_r = nu[k] * np.linalg.inv(psi[k])
    e_logdet = (sum(ssp.digamma((nu[k] - i) / 2) for i in range(d)) + d * np.log(2)
                - np.linalg.slogdet(psi[k])[1])
    diff = x - m[k]
    maha = np.einsum("ni,ij,nj->n", diff, e_r, diff) + np.trace(e_r @ np.linalg.inv(lam[k]))
    out[:, k] = -0.5 * d * np.log(2 * np.pi) + 0.5 * e_logdet - 0.5 * maha
  return out


def _np_gmm(x, init_means, num_sweeps, alpha0=1.0):
  """Dirichlet(alpha0/K)-weighted GMM with independent Normal x Wishart clusters, CAVI
  (explicit inverses, loops; written from the textbook updates, not from dpmm_jax)."""
  n, d = x.shape
  k = init_means.shape[0]
  mu0 = x.mean(0)
  cov = np.cov(x.T, bias=True)
  cov = cov + 1e-6 * np.trace(cov) / d * np.eye(d)
  r0 = np.linalg.inv(cov)
  nu0, psi0 = float(d), d * cov
  m = init_means.copy()
  lam = np.stack([r0] * k)
  nu = np.full(k, nu0)
  psi = np.stack([psi0] * k)
  alpha = np.ones(k)                     # the LDDP starts from a = b = 1: equal weights

  def e_step():
    logits = _np_expected_loglik(x, m, lam, nu, psi) + ssp.digamma(alpha)
    return ssp.softmax(logits, axis=1)

  phi = e_step()
  history = [phi]
  for _ in range(num_sweeps):
    nk = phi.sum(0)
    xbar = (phi.T @ x) / nk[:, None]
    for j in range(k):
      e_r = nu[j] * np.linalg.inv(psi[j])
      lam[j] = r0 + nk[j] * e_r
      m[j] = np.linalg.solve(lam[j], r0 @ mu0 + nk[j] * e_r @ xbar[j])
      diff = x - m[j]
      psi[j] = (psi0 + (phi[:, j, None] * diff).T @ diff + nk[j] * np.linalg.inv(lam[j]))
      nu[j] = nu0 + nk[j]
    alpha = alpha0 / k + nk
    phi = e_step()
    history.append(phi)
  return history, dict(m=m, lam=lam, nu=nu, psi=psi, alpha=alpha)


def test_zero_field_is_a_finite_bayesian_gmm(problem):
  x = np.asarray(problem["x"])
  init = problem["init_means"] + np.array([[0.05, 0.0, 0.0], [0.0, -0.05, 0.0], [0.0, 0.0, 0.0]])
  res = lddp.fit(x, problem["loc"], K, key=jax.random.key(0), inducing=problem["inducing"],
                 init_means=init, update_field=False, tol=1e-300, max_iter=12)
  sweeps = int(res.num_iters)
  assert sweeps == 12
  history, ref = _np_gmm(x, init, sweeps)
  np.testing.assert_allclose(res.responsibilities, history[-1], rtol=1e-9, atol=1e-12)
  c = res.state.clusters
  np.testing.assert_allclose(c.loc, ref["m"], rtol=1e-9)
  np.testing.assert_allclose(c.loc_precision, ref["lam"], rtol=1e-9)
  np.testing.assert_allclose(c.df, ref["nu"], rtol=1e-12)
  np.testing.assert_allclose(c.inv_scale, ref["psi"], rtol=1e-9)
  # q(z) shapes are the Dirichlet concentrations; the rates are equal across k, so
  # E[log z_k] differ from the Dirichlet's E[log pi_k] by a k-independent constant.
  np.testing.assert_allclose(res.state.gamma_shape, ref["alpha"], rtol=1e-12)
  rate = np.asarray(res.state.gamma_rate)
  np.testing.assert_allclose(rate, rate[0], rtol=1e-12)
  assert float(jnp.max(jnp.abs(res.state.field))) == 0.0
  # And its bound is the Gamma-normalised GMM's bound with the xi auxiliary, in numpy.
  phi = history[-1]
  a, b = ref["alpha"], rate
  e_ll = _np_expected_loglik(x, ref["m"], ref["lam"], ref["nu"], ref["psi"])
  xi = np.sum(a / b) * np.ones(x.shape[0])
  e_logz = ssp.digamma(a) - np.log(b)
  term_c = np.sum(phi * (e_ll + e_logz - np.log(phi)))
  term_xi = np.sum(1 - np.log(xi) - np.sum(a / b) / xi)
  a0 = 1.0 / K
  kl_z = np.sum((a - a0) * ssp.digamma(a) - ssp.gammaln(a) + ssp.gammaln(a0)
                + a0 * np.log(b) + a * (1.0 - b) / b)
  kl_theta = float(jnp.sum(nw.kl_divergence(res.state.clusters, res.prior.clusters)))
  expected = term_c + term_xi - kl_z - kl_theta
  np.testing.assert_allclose(float(res.bound_trace[sweeps]), expected, rtol=1e-10)


# ------------------------------------------------------------------------------ Nystrom
def test_nystrom_products():
  rng = np.random.default_rng(1)
  size = 14
  g = np.linspace(0.0, 1.0, size)
  loc = np.stack([a.ravel() for a in np.meshgrid(g, g, indexing="ij")], -1)
  loc = loc + 0.01 * rng.normal(size=loc.shape)
  v = rng.normal(size=(loc.shape[0], 2))
  exact = np.asarray(lddp.rbf_kernel(loc, loc, 1.3, 0.25))
  # The kernel itself: k = s_f^2 exp(-|l - l'|^2 / s_l^2).
  d2 = ((loc[:, None] - loc[None]) ** 2).sum(-1)
  np.testing.assert_allclose(exact, 1.69 * np.exp(-d2 / 0.0625), rtol=1e-12, atol=1e-14)
  kv = exact @ v
  # All N locations inducing: exact up to the jitter (|K - K K_eps^-1 K| <= jitter).
  jitter = 1e-9
  nys = lddp.nystrom(loc, loc, 1.3, 0.25, jitter)
  err = np.linalg.norm(np.asarray(lddp.kernel_matvec(nys, jnp.asarray(v))) - kv, axis=0)
  assert np.all(err <= 50 * jitter * np.linalg.norm(v, axis=0)), err
  # Grids of M inducing points: the product equals K_{n*} K_eps^-1 K_{*n} v, and its
  # error against the exact product is within a small factor of the best rank-M error.
  eig = np.sort(np.linalg.eigvalsh(exact))[::-1]
  errors = []
  for per_dim in (4, 6, 9):
    nys = lddp.nystrom(loc, lddp.grid_inducing(loc, per_dim), 1.3, 0.25, jitter)
    c = np.asarray(nys.cross)
    gram = np.asarray(lddp.rbf_kernel(nys.inducing, nys.inducing, 1.3, 0.25)) + jitter * np.eye(
        c.shape[0])
    explicit = c.T @ np.linalg.solve(gram, c)
    got = np.asarray(lddp.kernel_matvec(nys, jnp.asarray(v)))
    np.testing.assert_allclose(got, explicit @ v, rtol=1e-6, atol=1e-8)
    spec = np.linalg.norm(exact - explicit, 2)
    m = per_dim ** 2
    assert eig[m] <= spec + 1e-9                     # Eckart-Young: no rank-M beats eig[M]
    assert spec <= 30 * eig[m] + 10 * jitter, (per_dim, spec, eig[m])
    errors.append(np.linalg.norm(got - kv) / np.linalg.norm(kv))
  assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-3, errors


def test_predict_at_training_points_equals_responsibilities(problem, long_fit):
  probs = lddp.predict(long_fit, problem["x"], problem["loc"])
  np.testing.assert_allclose(probs, long_fit.responsibilities, rtol=1e-8, atol=1e-12)
  usage = lddp.cluster_usage(long_fit)
  assert int(usage.sum()) == problem["x"].shape[0]
  np.testing.assert_allclose(lddp.cluster_usage(long_fit, soft=True).sum(),
                             problem["x"].shape[0], rtol=1e-12)
