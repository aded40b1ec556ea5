"""LRVB (dpmm_jax.lrvb) in float64: exact oracles where mean-field is wrong.

A. A correlated Gaussian target under a factorised q: LRVB recovers the exact covariance
   to numerical precision (mean-field does not), in two charts and in mean parameters.
B. Schur complement (Eq. 11) == the full inverse (Eq. 10) restricted to the globals ==
   the Hessian of the objective with the nuisance block maximised out == exact.
C. Dense == conjugate gradients.
D. A mixture weight under heavy overlap vs exact quadrature of its posterior.
"""
import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.scipy import special as jsp  # noqa: E402

from dpmm_jax import lrvb  # noqa: E402
from dpmm_jax.conjugate import dirichlet  # noqa: E402


def _gaussian_elbo(mu, prec):
  """ELBO of a factorised Gaussian q(theta) = prod_j N(m_j, v_j) for target N(mu, prec^-1),
  in the chart (m, log v): -1/2 [(m - mu)^T P (m - mu) + sum_j P_jj v_j] + 1/2 sum log v."""
  def elbo(params):
    m, log_v = params["m"], params["log_v"]
    d = m - mu
    return (-0.5 * (d @ prec @ d + jnp.sum(jnp.diag(prec) * jnp.exp(log_v)))
            + 0.5 * jnp.sum(log_v))
  return elbo


MU = jnp.array([1.0, -2.0])
SIGMA = jnp.array([[1.0, 1.8], [1.8, 4.0]])


def test_exact_gaussian_lrvb_recovers_covariance_mean_field_does_not():
  prec = jnp.linalg.inv(SIGMA)
  params = {"m": MU, "log_v": -jnp.log(jnp.diag(prec))}          # the MFVB fixed point
  cov, info = lrvb.covariance(_gaussian_elbo(MU, prec), params, lambda p: p["m"])
  assert float(info.grad_norm) < 1e-12 and float(info.max_eigenvalue) < 0
  np.testing.assert_allclose(cov, SIGMA, atol=1e-10)
  mf_var = 1.0 / jnp.diag(prec)                                   # (0.19, 0.76)
  np.testing.assert_allclose(mf_var, [0.19, 0.76], atol=1e-12)
  assert np.all(np.asarray(mf_var) < 0.8 * np.diag(SIGMA))


def test_exact_gaussian_chart_invariance_and_polish():
  prec = jnp.linalg.inv(SIGMA)
  mu = MU
  # Natural chart (m, v) instead of (m, log v): same covariance at the fixed point.
  def elbo_v(params):
    d = params["m"] - mu
    return (-0.5 * (d @ prec @ d + jnp.sum(jnp.diag(prec) * params["v"]))
            + 0.5 * jnp.sum(jnp.log(params["v"])))
  fixed = {"m": mu, "v": 1.0 / jnp.diag(prec)}
  cov_v, _ = lrvb.covariance(elbo_v, fixed, lambda p: p["m"])
  np.testing.assert_allclose(cov_v, SIGMA, atol=1e-10)
  # Started away from the fixed point, Newton polishing restores the exact answer;
  # without it the answer is still right here (quadratic in m) but the gradient is not 0.
  off = {"m": mu + 0.3, "log_v": -jnp.log(jnp.diag(prec)) + 0.2}
  _, info_off = lrvb.covariance(_gaussian_elbo(mu, prec), off, lambda p: p["m"])
  assert float(info_off.grad_norm) > 1e-2
  cov_p, info_p = lrvb.covariance(_gaussian_elbo(mu, prec), off, lambda p: p["m"], polish=8)
  assert float(info_p.grad_norm) < 1e-10
  np.testing.assert_allclose(cov_p, SIGMA, atol=1e-10)


def test_polish_takes_a_step_whose_gain_is_below_the_objectives_round_off():
  """Next to the maximum a Newton step gains less than the objective's round-off. Here a
  constant 1e4 plus a stop-gradient "round-off" term makes every moved point look 1e-12
  lower (8 eps |1e4| = 1.8e-11 is the floor): the step that removes a 1.7e-7 gradient is
  still taken. A point lower by more than the floor is not, whatever its gradient."""
  start = jnp.full(3, 1.0 + 1e-7)

  def objective(x, penalty):
    moved = jax.lax.stop_gradient(jnp.any(x != start)).astype(x.dtype)
    return 1e4 - 0.5 * jnp.sum((x - 1.0) ** 2) - penalty * moved

  grad0 = jnp.linalg.norm(jax.grad(objective)(start, 1e-12))
  assert 1e-7 < float(grad0) < 1e-6
  polished = lrvb.newton_polish(objective, start, 1, args=(1e-12,))
  np.testing.assert_allclose(polished, 1.0, rtol=0, atol=1e-12)
  assert float(objective(polished, 1e-12)) < float(objective(start, 1e-12))
  # 1e-9 is above the floor: a real loss, the step (and all its halvings) is refused.
  stuck = lrvb.newton_polish(objective, start, 1, args=(1e-9,))
  np.testing.assert_array_equal(stuck, start)


def _mean_parameter_blocks(mu, prec, m):
  """V and H of a factorised Gaussian in the mean parameters (E theta_j, E theta_j^2),
  ordered (theta_1, theta_1^2, theta_2, theta_2^2, ...), at means m, variances 1/P_jj."""
  n = mu.shape[0]
  v = 1.0 / jnp.diag(prec)
  var = jnp.zeros((2 * n, 2 * n))
  hess = jnp.zeros((2 * n, 2 * n))
  for j in range(n):
    block = jnp.array([[v[j], 2 * m[j] * v[j]],
                       [2 * m[j] * v[j], 4 * m[j] ** 2 * v[j] + 2 * v[j] ** 2]])
    var = var.at[2 * j:2 * j + 2, 2 * j:2 * j + 2].set(block)
    for i in range(n):
      if i != j:   # E_q log p = -1/2 sum_{i != j} P_ij m_i m_j + (terms linear per factor)
        hess = hess.at[2 * i, 2 * j].set(-prec[i, j])
  return var, hess


def test_mean_parameter_formula_matches_exact_gaussian():
  prec = jnp.linalg.inv(SIGMA)
  var, hess = _mean_parameter_blocks(MU, prec, MU)
  cov = lrvb.linear_response(var, hess)
  np.testing.assert_allclose(cov[::2, ::2], SIGMA, atol=1e-10)


def _random_gaussian(n, seed):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(n, n))
  sigma = a @ a.T / n + 0.3 * np.eye(n)
  return jnp.asarray(rng.normal(size=n)), jnp.asarray(sigma)


def test_schur_equals_full_inverse_restricted_and_profiled_hessian():
  n, na = 6, 2
  mu, sigma = _random_gaussian(n, 0)
  prec = jnp.linalg.inv(sigma)
  var, hess = _mean_parameter_blocks(mu, prec, mu)
  full = lrvb.linear_response(var, hess)
  a = slice(0, 2 * na)
  z = slice(2 * na, 2 * n)
  schur = lrvb.schur_covariance(var[a, a], var[z, z], hess[a, a], hess[a, z], hess[z, z])
  np.testing.assert_allclose(schur, full[a, a], atol=1e-10)
  np.testing.assert_allclose(schur[::2, ::2], sigma[:na, :na], atol=1e-10)
  # Profiling: maximise the z factors out inside the objective (their optimal means
  # solve P_zz (m_z - mu_z) = -P_za (m_a - mu_a)); the Hessian of the profiled objective
  # in the globals' chart gives the same covariance.
  elbo = _gaussian_elbo(mu, prec)
  log_vz = -jnp.log(jnp.diag(prec)[na:])

  def profiled(params):
    da = params["m"] - mu[:na]
    mz = mu[na:] - jnp.linalg.solve(prec[na:, na:], prec[na:, :na] @ da)
    return elbo({"m": jnp.concatenate([params["m"], mz]),
                 "log_v": jnp.concatenate([params["log_v"], log_vz])})

  glob = {"m": mu[:na], "log_v": -jnp.log(jnp.diag(prec)[:na])}
  cov, info = lrvb.covariance(profiled, glob, lambda p: p["m"])
  assert float(info.grad_norm) < 1e-12
  np.testing.assert_allclose(cov, sigma[:na, :na], atol=1e-10)
  # Mean-field is wrong here (so the test can fail on a dropped coupling).
  assert np.max(np.abs(1.0 / np.diag(prec)[:na] - np.diag(sigma)[:na])) > 0.05


def test_dense_equals_cg():
  n = 6
  mu, sigma = _random_gaussian(n, 1)
  prec = jnp.linalg.inv(sigma)
  params = {"m": mu, "log_v": -jnp.log(jnp.diag(prec))}
  functional = lambda p: jnp.concatenate([p["m"], jnp.exp(p["log_v"][:2])])
  dense, _ = lrvb.covariance(_gaussian_elbo(mu, prec), params, functional)
  cg, info = lrvb.covariance(_gaussian_elbo(mu, prec), params, functional, method="cg",
                             cg_tol=1e-12)
  assert float(info.cg_residual) < 1e-8
  np.testing.assert_allclose(cg, dense, atol=1e-9)
  np.testing.assert_allclose(dense[:n, :n], sigma, atol=1e-10)


def test_delta_rule_matches_covariance_of_functional():
  prec = jnp.linalg.inv(SIGMA)
  params = {"m": MU, "log_v": -jnp.log(jnp.diag(prec))}
  w = jnp.array([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]])
  cov_lin, _ = lrvb.covariance(_gaussian_elbo(MU, prec), params, lambda p: w @ p["m"])
  np.testing.assert_allclose(cov_lin, lrvb.delta_covariance(SIGMA, w), atol=1e-10)
  np.testing.assert_allclose(lrvb.delta_covariance(SIGMA, w[:1], w[1:]),
                             cov_lin[:1, 1:], atol=1e-10)


def test_bad_inputs():
  prec = jnp.linalg.inv(SIGMA)
  params = {"m": MU, "log_v": -jnp.log(jnp.diag(prec))}
  with pytest.raises(ValueError, match="method"):
    lrvb.covariance(_gaussian_elbo(MU, prec), params, method="lu")
  with pytest.raises(TypeError, match="objective"):
    lrvb.covariance(3.0, params)
  with pytest.raises(TypeError, match="functional"):
    lrvb.covariance(_gaussian_elbo(MU, prec), params, functional="means")
  with pytest.raises(ValueError, match="negative definite"):
    lrvb.covariance(lambda p: -_gaussian_elbo(MU, prec)(p), params)


# ------------------------------------------------ D. mixture weight vs exact quadrature
def _mixture_data(n, delta, seed, weight=0.3):
  rng = np.random.default_rng(seed)
  z = rng.random(n) < weight
  x = np.where(z, rng.normal(delta, 1.0, n), rng.normal(-delta, 1.0, n))
  log_f1 = -0.5 * (x - delta) ** 2
  log_f2 = -0.5 * (x + delta) ** 2
  return jnp.asarray(log_f1), jnp.asarray(log_f2)


def _weight_objective(log_f1, log_f2):
  """Profiled ELBO of q(pi) = Beta(a, b), q(z_n) Bernoulli, in (log a, log b)."""
  def objective(params):
    ab = jnp.exp(jnp.stack([params["log_a"], params["log_b"]]))
    elog = dirichlet.expected_log(ab)
    data = jnp.sum(jnp.logaddexp(elog[0] + log_f1, elog[1] + log_f2))
    return data - dirichlet.kl_divergence(ab, jnp.ones(2))
  return objective


def _exact_sd(log_f1, log_f2):
  t = jnp.linspace(-8.0, 8.0, 16_001)   # logit spacing 1e-3 (posterior sd >~ 0.05)
  pi = jax.nn.sigmoid(t)
  loglik = jax.vmap(lambda p: jnp.sum(jnp.logaddexp(jnp.log(p) + log_f1,
                                                    jnp.log1p(-p) + log_f2)))(pi)
  logw = loglik + jnp.log(pi) + jnp.log1p(-pi)       # flat prior, Jacobian of the logit
  w = jnp.exp(logw - jnp.max(logw))
  w = w / jnp.sum(w)
  mean = jnp.sum(w * pi)
  return float(jnp.sqrt(jnp.sum(w * (pi - mean) ** 2)))


@pytest.mark.parametrize("n,delta,seed,tol,mf_max", [(200, 0.5, 0, 0.02, 0.5),
                                                     (200, 0.5, 1, 0.02, 0.5),
                                                     (2000, 1.0, 0, 0.005, 0.8)])
def test_mixture_weight_vs_quadrature(n, delta, seed, tol, mf_max):
  log_f1, log_f2 = _mixture_data(n, delta, seed)
  # CAVI for (a, b), then Newton polish inside covariance().
  def sweep(_, ab):
    elog = dirichlet.expected_log(ab)
    phi = jax.nn.sigmoid(elog[0] + log_f1 - elog[1] - log_f2)
    return jnp.stack([1.0 + jnp.sum(phi), 1.0 + jnp.sum(1.0 - phi)])
  a, b = jax.jit(lambda ab: jax.lax.fori_loop(0, 200, sweep, ab))(jnp.full(2, 1.0 + n / 2))
  params = {"log_a": jnp.log(a), "log_b": jnp.log(b)}
  mean_pi = lambda p: jnp.exp(p["log_a"]) / (jnp.exp(p["log_a"]) + jnp.exp(p["log_b"]))
  cov, info = lrvb.covariance(_weight_objective(log_f1, log_f2), params, mean_pi, polish=3)
  assert float(info.grad_norm) < 1e-8
  exact = _exact_sd(log_f1, log_f2)
  lr = float(jnp.sqrt(cov[0, 0]))
  a, b = float(a), float(b)
  mf = np.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))
  assert abs(lr / exact - 1.0) <= tol, (lr, exact)
  assert mf / exact <= mf_max, (mf, exact)
