"""Tests for dpmm_jax.quadrature and the coupled model's integral over gamma, float32.

The per-class integrand is log p(u) + log p(X_k | gamma = e^u) (``coupled.class_log_joint``),
integrated on ``coupled.class_grid`` (centred on the posterior mode, spaced by the Laplace
width). The reference is an independent float64 numpy implementation of the same
integrand, integrated by a 20001-point trapezoid over mode +- 80 Laplace widths (the
integrand is checked to have fallen by > 30 nats at both ends). The float64 pass, with the
1e-6 relative-error requirement, is in test_math_f64.py; here the float32 checks are
limited by the float32 round-off of the integrand (stated per check).
"""
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate
from scipy import optimize
from scipy import special as sps

from dpmm_jax import quadrature
from dpmm_jax import stats as stats_lib
from dpmm_jax.models import coupled

EPS32 = float(np.finfo(np.float32).eps)
LOG_2PI = np.log(2 * np.pi)


# -------------------------------------------------------- independent float64 reference
def make_class(rng, n, dim, gamma_shape, prior_df, dtype, mean_concentration=0.5,
               gamma_true=1.3):
  """One class of n points whose variances are drawn from the coupled model's prior."""
  var = rng.uniform(0.5, 2.0, size=dim)
  class_var = gamma_true * var * prior_df / rng.chisquare(prior_df, size=dim)
  x = rng.normal(size=(n, dim)) * np.sqrt(class_var) + rng.normal(size=dim)
  st = stats_lib.from_labels(jnp.asarray(x, dtype), jnp.zeros(n, jnp.int32), 1, full=False)
  hyper = coupled.Hyper(jnp.zeros(dim, dtype), jnp.asarray(var, dtype),
                        jnp.full(dim, prior_df, dtype), jnp.full(dim, mean_concentration, dtype),
                        jnp.asarray(gamma_shape, dtype))
  return hyper, st


def _nix_log_z(kappa, nu, nu_s2):
  return -0.5 * np.log(kappa) + sps.gammaln(nu / 2) - nu / 2 * np.log(nu_s2 / 2)


def ref_class_log_joint(hyper, st, u):
  """float64: log Gamma(e^u; a, a) e^u + sum_d log p(X_d | s0_d^2 = e^u var_d), class 0."""
  loc, var, nu0, k0, a = (np.asarray(v, np.float64) for v in hyper)
  n = float(st.count[0])
  mean = np.asarray(st.mean[0], np.float64)
  sq_dev = np.asarray(st.sq_dev[0], np.float64)
  u = np.asarray(u, np.float64)[..., None]
  prior_nu_s2 = nu0 * np.exp(u) * var
  kn = k0 + n
  post_nu_s2 = prior_nu_s2 + sq_dev + k0 * n / kn * (mean - loc) ** 2
  log_lik = np.sum(_nix_log_z(kn, nu0 + n, post_nu_s2) - _nix_log_z(k0, nu0, prior_nu_s2)
                   - n / 2 * LOG_2PI, -1)
  u = u[..., 0]
  return a * np.log(a) - sps.gammaln(a) + a * u - a * np.exp(u) + log_lik


def ref_integrand_magnitude(hyper, st, u):
  """Round-off scale of the integrand at u: the sum of |terms| once it is grouped so that
  nothing large cancels (what a float32 evaluation can reach). Per dimension
  log p(X_d | gamma) = -1/2 log1p(N/kappa0) + [lgamma(nu'/2) - lgamma(nu0/2) - N/2 log(nu0/2)]
  - nu'/2 log1p(R / (nu0 gamma s0^2)) - N/2 log(2 pi gamma s0^2), and log p(u) =
  [a log a - a - lgamma a] - a (e^u - 1 - u): all terms O(N) and O(a)."""
  loc, var, nu0, k0, a = (np.asarray(v, np.float64) for v in hyper)
  n = float(st.count[0])
  data = (np.asarray(st.sq_dev[0], np.float64) + k0 * n / (k0 + n)
          * (np.asarray(st.mean[0], np.float64) - loc) ** 2)
  prior_var = np.exp(u) * var
  excess = sps.gammaln((nu0 + n) / 2) - sps.gammaln(nu0 / 2) - n / 2 * np.log(nu0 / 2)
  terms = (0.5 * np.log1p(n / k0) + np.abs(excess)
           + (nu0 + n) / 2 * np.log1p(data / (nu0 * prior_var))
           + n / 2 * np.abs(np.log(2 * np.pi * prior_var)))
  prior = (abs(a * np.log(a) - a - sps.gammaln(a)) + a * (np.exp(u) - 1 - u) + a * abs(u))
  return np.sum(terms) + prior


def ref_mode_and_width(hyper, st):
  """float64 maximiser of the reference integrand and its Laplace width (by scipy)."""
  fn = lambda v: -ref_class_log_joint(hyper, st, np.array([v]))[0]
  res = optimize.minimize_scalar(fn, bounds=(-30.0, 30.0), method="bounded",
                                 options={"xatol": 1e-12})
  c, h = res.x, 1e-4
  curv = -(fn(c + h) - 2 * fn(c) + fn(c - h)) / h ** 2
  return c, 1.0 / np.sqrt(-curv)


def ref_log_integral(hyper, st, num=20001, half_width=80.0):
  """(log integral, nodes, log integrand) by a fine trapezoid around the mode, float64."""
  c, w = ref_mode_and_width(hyper, st)
  u = np.linspace(c - half_width * w, c + half_width * w, num)
  f = ref_class_log_joint(hyper, st, u)
  top = f.max()
  assert f[0] < top - 30 and f[-1] < top - 30  # the range holds all the mass
  return top + np.log(integrate.trapezoid(np.exp(f - top), u)), u, f


SMALL = dict(n=5, dim=2, gamma_shape=10.0, prior_df=8.0)
# N_k D = 3.2e5 observations and a near-tied prior: posterior sd of u ~ 2.5e-3.
NARROW = dict(n=5000, dim=64, gamma_shape=10.0, prior_df=1e6)


# ------------------------------------------------------------------------------- tests
def test_reference_integral_agrees_with_adaptive_quad():
  rng = np.random.default_rng(0)
  hyper, st = make_class(rng, dtype=jnp.float32, **SMALL)
  ref, u, _ = ref_log_integral(hyper, st)
  val, _ = integrate.quad(lambda v: np.exp(ref_class_log_joint(hyper, st, np.array([v]))[0]
                                           - ref), u[0], u[-1], epsabs=0, epsrel=1e-12,
                          limit=200)
  assert abs(np.log(val)) < 1e-10


def test_class_log_joint_matches_independent_reference():
  rng = np.random.default_rng(1)
  for cfg in (SMALL, NARROW):
    hyper, st = make_class(rng, dtype=jnp.float32, **cfg)
    u = np.linspace(-0.5, 0.5, 9)
    got = np.asarray(coupled.class_log_joint(hyper, st, jnp.asarray(u[None], jnp.float32)))
    ref = ref_class_log_joint(hyper, st, u.astype(np.float32).astype(np.float64))
    mag = np.array([ref_integrand_magnitude(hyper, st, v) for v in u])
    np.testing.assert_array_less(np.abs(got[0] - ref), 16 * EPS32 * mag)


def test_small_class_log_integral_matches_fine_reference():
  rng = np.random.default_rng(2)
  hyper, st = make_class(rng, dtype=jnp.float32, **SMALL)
  ref, _, _ = ref_log_integral(hyper, st)
  opts = coupled.QuadratureOptions()
  grid = coupled.class_grid(hyper, st, opts.em_nodes, opts.em_half_width)
  got = float(quadrature.log_integral(grid, coupled.class_log_joint(hyper, st, grid.nodes))[0])
  # float32 integrand error (16 eps x term magnitudes near the mode) + quadrature (~1e-7).
  mode, _ = ref_mode_and_width(hyper, st)
  tol = 16 * EPS32 * ref_integrand_magnitude(hyper, st, mode) + 1e-6
  assert abs(got - ref) < tol, (got, ref, tol)
  total = float(coupled.log_marginal_likelihood(hyper, st))
  assert abs(total - ref) < tol


@pytest.mark.parametrize("cfg", [SMALL, NARROW], ids=["small", "narrow"])
def test_posterior_mode_and_laplace_width_match_float64_reference(cfg):
  # The mode comes from a Newton iteration on the analytic derivative, whose float32
  # error is ~ eps * sum_d nu'_d / 2, i.e. a shift of eps * sum_d nu'_d/2 * sd^2 in u:
  # <= 1e-3 sd for both cases. The float64 reference maximises the integrand by scipy.
  rng = np.random.default_rng(3)
  hyper, st = make_class(rng, dtype=jnp.float32, **cfg)
  mode, scale, converged = coupled.posterior_mode(hyper, st)
  c, w = ref_mode_and_width(hyper, st)
  assert bool(converged)
  assert abs(float(mode[0]) - c) < 1e-2 * w, (float(mode[0]), c, w)
  np.testing.assert_allclose(float(scale[0]), w, rtol=1e-3)
  if cfg is NARROW:
    assert w < 5e-3  # really narrow: far below any fixed grid's spacing


def test_posterior_mode_settles_where_float32_round_off_makes_newton_bounce():
  """Ten points at scale 1e8 (an example of tests/test_properties.py) and the
  hyperparameters a coupled fit ended at: the float32 Newton iterates of class 2 bounce
  between two values 1.4e-6 apart (gradient round-off ~1e-5 on terms of size nu0), never
  meeting the 1e-6 tolerance, and the search reported no convergence (a fit warning).
  The search now also ends when each class's step is below the tolerance or a small one
  that reverses its last: converged, and every class's mode within 1e-3 Laplace widths
  of the float64 maximiser."""
  x = np.array([[3.8162364e+07, 2.9127309e+08], [1.4361208e+08, -3.6827792e+08],
                [1.0259888e+08, -3.4881117e+08], [9.2774160e+06, -4.0350288e+08],
                [4.0308436e+07, -3.4479318e+08], [1.0397756e+08, -4.1348726e+08],
                [1.7620723e+08, 1.1409018e+08], [2.7260016e+08, 1.1267124e+08],
                [4.2949363e+08, 2.1150213e+08], [-5.9178284e+07, -1.1676722e+07]],
               np.float32)
  y = np.array([0, 1, 1, 1, 1, 1, 2, 2, 2, 2], np.int32)
  st = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), 3, full=False)
  hyper = coupled.init_hyper(st)._replace(
      df=jnp.array([250.20341, 332.70364], jnp.float32),
      mean_concentration=jnp.array([10.932162, 0.02206829], jnp.float32),
      gamma_shape=jnp.asarray(2.318183422088623, jnp.float32))
  mode, width, converged = coupled.posterior_mode(hyper, st)
  assert bool(converged)
  for k in range(3):
    one = st._replace(count=st.count[k:k + 1], mean=st.mean[k:k + 1],
                      sq_dev=st.sq_dev[k:k + 1])
    c, w = ref_mode_and_width(hyper, one)
    assert abs(float(mode[k]) - c) < 1e-3 * w, (k, float(mode[k]), c, w)
    np.testing.assert_allclose(float(width[k]), w, rtol=1e-3)


def test_small_class_mode_has_zero_finite_difference_slope():
  rng = np.random.default_rng(4)
  hyper, st = make_class(rng, dtype=jnp.float32, **SMALL)
  mode, scale, _ = coupled.posterior_mode(hyper, st)
  h = 0.05 * float(scale[0])
  u = jnp.asarray([[float(mode[0]) - h, float(mode[0]), float(mode[0]) + h]], jnp.float32)
  f = np.asarray(coupled.class_log_joint(hyper, st, u)[0], np.float64)
  slope = (f[2] - f[0]) / (2 * h)
  curv = (f[2] - 2 * f[1] + f[0]) / h ** 2
  # Round-off of the float32 integrand, eps * magnitude, limits the slope to ~ that / h;
  # a displacement |slope / curv| of the mode below 1e-3 sd is what we require.
  noise = 4 * EPS32 * ref_integrand_magnitude(hyper, st, float(mode[0])) / h
  assert abs(slope) < max(noise, 1e-3 / float(scale[0])), (slope, noise)
  # Curvature: round-off 4 eps |f| / h^2 relative to 1/sd^2 is ~3e-3, truncation
  # O((h/sd)^2) ~ 3e-3; 5% is ten times that.
  np.testing.assert_allclose(-1.0 / curv, float(scale[0]) ** 2, rtol=0.05)


def test_narrow_class_in_float32_integral_and_posterior_mean_of_u():
  # N_k D = 3.2e5: the integrand is ~5e5 nats, so float32 can only resolve it to
  # ~eps * 5e5 ~ 0.06 nats per node. That bounds (i) the log integral's error by a few
  # ulps of the integrand's term magnitudes, and (ii) the error of E[u] under the node
  # weights: perturbing log-weights by delta_p moves E[u] by Cov(u, delta) <= sd max|delta|.
  # (An integrand formed as a difference of log normalisers has ~1 nat of noise per node
  # and fails both: E[u] was off by up to 1.4 sd.)
  rng = np.random.default_rng(5)
  hyper, st = make_class(rng, dtype=jnp.float32, **NARROW)
  ref, u_ref, f_ref = ref_log_integral(hyper, st)
  p = np.exp(f_ref - f_ref.max())
  mean_ref = np.sum(p * u_ref) / np.sum(p)
  sd_ref = np.sqrt(np.sum(p * (u_ref - mean_ref) ** 2) / np.sum(p))
  opts = coupled.QuadratureOptions()
  grid = coupled.class_grid(hyper, st, opts.em_nodes, opts.em_half_width)
  log_joint = coupled.class_log_joint(hyper, st, grid.nodes)
  mag = ref_integrand_magnitude(hyper, st, mean_ref)
  got = float(quadrature.log_integral(grid, log_joint)[0])
  assert abs(got - ref) < 16 * EPS32 * mag, (got, ref, 16 * EPS32 * mag)
  log_w = quadrature.normalized_log_weights(grid, log_joint)
  mean = float(jnp.sum(jnp.exp(log_w[0]) * grid.nodes[0]))
  assert abs(mean - mean_ref) < 2 * (2 * EPS32 * mag) * sd_ref, (mean, mean_ref, sd_ref)


# ------------------------------------------------------------------------- prior grid
@pytest.mark.parametrize("shape", [0.5, 1.0, 10.0, 1000.0])
def test_prior_grid_weights_reproduce_gamma_moments(shape):
  a = jnp.float32(shape)
  grid = quadrature.gamma_prior_grid(a, coupled.QuadratureOptions().prior_nodes)
  log_density = quadrature.log_gamma_density_of_log(grid.nodes, a)
  w = jnp.exp(quadrature.normalized_log_weights(grid, log_density))
  num = grid.nodes.shape[-1]
  # Round-off of a float32 P-term weighted sum: random walk, 4 sigma: 4 sqrt(P) eps.
  tol = 4 * np.sqrt(num) * EPS32
  assert abs(float(jnp.sum(w * jnp.exp(grid.nodes))) - 1.0) < tol          # E[gamma] = 1
  e_log = float(jnp.sum(w * grid.nodes))
  assert abs(e_log - (sps.digamma(shape) - np.log(shape))) < tol * (1 + np.abs(grid.nodes).max())
  # The density itself integrates to one (its normaliser a log a - a - lgamma(a) is
  # O(log a), evaluated without the cancellation of its O(a log a) parts).
  norm = float(quadrature.log_integral(grid, log_density))
  assert abs(norm) < tol + 16 * EPS32 * (1 + abs(np.log(shape)))


def test_log_integral_of_a_gaussian_on_a_centred_grid():
  # Trapezoid on an analytic, rapidly decaying integrand: exact to round-off at 1 sd
  # spacing (error ~ 2 exp(-2 pi^2) ~ 5e-9), for any centre and width.
  mode = jnp.asarray([0.3, -20.0], jnp.float32)
  scale = jnp.asarray([1e-3, 4.0], jnp.float32)
  grid = quadrature.centred_grid(mode, scale, 25, 12.0)
  z = (grid.nodes - mode[:, None]) / scale[:, None]
  log_f = -0.5 * z ** 2 - jnp.log(scale)[:, None] - 0.5 * LOG_2PI + 7.0
  np.testing.assert_allclose(quadrature.log_integral(grid, log_f), 7.0, rtol=0,
                             atol=64 * EPS32 * 7.0)
