"""Float64 references for the accuracy checks (own pytest process; x64 on at import):
independent numpy oracles for the MDS, RMDS and independent-RMDS scores, and the coupled
model's class and prior predictive against a 20,001-node quadrature.
"""
import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

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


# ------------------------------------------------------------ coupled model's tails
from dpmm_jax import stats as stats_lib  # noqa: E402
from dpmm_jax.models import coupled  # noqa: E402
from tests import coupled_reference  # noqa: E402

REF_NODES = coupled_reference.REF_NODES
_np_log_predictive = coupled_reference.log_predictive


_params = jax.jit(coupled.params_from_hyper)
_log_predictive = jax.jit(coupled.log_predictive)


def _coupled_problem(dim, alpha0, df0=8.0, kappa0=0.5, n=50, seed=0):
  """Two classes (scales 0.6 and 1.4 of the prior variances) and the fitted Params."""
  rng = np.random.default_rng(seed + dim)
  var0 = np.exp(rng.normal(size=dim) * 0.3)
  scales = np.array([0.6, 1.4])
  x = np.concatenate([np.sqrt(scales[c] * var0) * rng.normal(size=(n, dim)) + 2.0 * c
                      for c in range(2)])
  y = np.repeat(np.arange(2), n).astype(np.int32)
  hyper = coupled.Hyper(jnp.zeros(dim), jnp.asarray(var0), jnp.full(dim, df0),
                        jnp.full(dim, kappa0), jnp.asarray(alpha0, jnp.float64))
  st = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), 2, full=False)
  # Points 1x, 3x, 5x and 10x the spread of class 0 from its mean.
  spread = np.sqrt(scales[0] * var0)
  xt = x[:n].mean(0) + (np.array([1.0, 3.0, 5.0, 10.0])[:, None] * spread
                        * rng.normal(size=(4, dim)) / np.sqrt(1.0))
  return x[:n], xt, var0, _params(hyper, st)


@pytest.mark.parametrize("dim", [256])
def test_coupled_class_predictive_in_the_tails_matches_a_20001_node_reference(dim):
  """Points 1x, 3x, 5x and 10x the within-class spread from a class: the coupled model's
  log p(x | D_k) (and the prior predictive) is within 1e-3 nats of a 20,001-node
  quadrature. (Before: the grid over u ignored x and was 86 nats too low for D = 256.)"""
  df0, kappa0, alpha0 = 8.0, 0.5, 6.0
  x0, xt, var0, params = _coupled_problem(dim, alpha0, df0, kappa0)
  class_lp, prior_lp = map(np.asarray, _log_predictive(params, jnp.asarray(xt)))
  ref = _np_log_predictive(x0, xt, np.zeros(dim), var0, df0, kappa0, alpha0)
  np.testing.assert_allclose(class_lp[:, 0], ref, rtol=0, atol=1e-3)
  ref_prior = _np_log_predictive(x0[:0], xt, np.zeros(dim), var0, df0, kappa0, alpha0)
  np.testing.assert_allclose(prior_lp, ref_prior, rtol=0, atol=1e-3)


@pytest.mark.parametrize("alpha0", [1e3, 1e5])
def test_coupled_prior_predictive_at_large_alpha0_matches_a_20001_node_reference(alpha0):
  """The prior predictive p(x) = int p(gamma) p(x | gamma) at alpha0 = 1e3 and 1e5 (D =
  256), points in and far out: within 1e-3 nats of the 20,001-node reference. (Before:
  the prior grid's right edge, 4 prior widths, cut the tilted mass at alpha0 = 1e5.)"""
  dim, df0, kappa0 = 256, 8.0, 0.5
  x0, xt, var0, params = _coupled_problem(dim, alpha0, df0, kappa0)
  _, prior_lp = _log_predictive(params, jnp.asarray(xt))
  ref = _np_log_predictive(x0[:0], xt, np.zeros(dim), var0, df0, kappa0, alpha0)
  np.testing.assert_allclose(np.asarray(prior_lp), ref, rtol=0, atol=1e-3)


def test_coupled_prior_density_is_infinite_exactly_where_its_integral_diverges():
  """At the prior mean the integrand over u = log gamma grows like exp(s u) as u -> -inf
  with s = alpha0 + sum_{d off the mean} nu0_d / 2 - #{d on the mean} / 2: p(x) is +inf
  where s <= 0 (was NaN), and finite, equal to the 20,001-node reference, just past the
  boundary. D = 256, alpha0 = 6, nu0 = 8: s = 6 + 4 m - (256 - m) / 2 for m coordinates
  off the mean, so m <= 27 diverges and m = 28 (s = 4) does not."""
  dim, alpha0, df0, kappa0 = 256, 6.0, 8.0, 0.5
  x0, _, var0, params = _coupled_problem(dim, alpha0, df0, kappa0)
  loc = np.asarray(params.hyper.loc)
  rng = np.random.default_rng(5)
  offs = (0, 1, 27, 28, 40)
  rows = []
  for m in offs:
    row = loc.copy()
    row[:m] += np.sqrt(var0[:m]) * rng.choice([-1.0, 1.0], m) * rng.uniform(0.5, 2.0, m)
    rows.append(row)
  xt = np.stack(rows)
  infinite = np.asarray(coupled.prior_density_is_infinite(params, jnp.asarray(xt)))
  slope = np.array([alpha0 + m * df0 / 2 - (dim - m) / 2 for m in offs])
  np.testing.assert_array_equal(infinite, slope <= 0)
  assert infinite[:3].all() and not infinite[3:].any()     # both sides of the boundary
  for predictive in (_log_predictive, coupled.log_predictive_exact):
    class_lp, prior_lp = map(np.asarray, predictive(params, jnp.asarray(xt)))
    assert np.all(np.isfinite(class_lp))
    assert np.all(prior_lp[infinite] == np.inf), prior_lp
  # (log_predictive_exact's fixed prior grid is no reference there: the per-point path is.)
  _, prior_lp = map(np.asarray, _log_predictive(params, jnp.asarray(xt[3:])))
  ref = _np_log_predictive(x0[:0], xt[3:], loc, var0, df0, kappa0, alpha0)
  np.testing.assert_allclose(prior_lp, ref, rtol=0, atol=1e-3)


def _tilted_case(dim=256, n=200, alpha0=6.0, spread=5.0):
  """Class TailTerms of a fitted class, and w of a point ``spread`` x its spread away."""
  x0, _, var0, params = _coupled_problem(dim, alpha0, n=n)
  rng = np.random.default_rng(3)
  xt = x0.mean(0) + spread * np.sqrt(0.6 * var0) * rng.normal(size=dim)
  t = jax.tree_util.tree_map(lambda a: a[0], params.class_tail)
  w = (jnp.asarray(xt) - t.loc) ** 2 * t.inv_scale
  return t, w


def test_tilted_integrand_third_and_fourth_derivatives_match_autodiff():
  """The hand-derived Phi_3, Phi_4 of the per-point integrand equal jax.grad of Phi''."""
  t, w = _tilted_case(dim=16, n=5)
  hess = lambda u: coupled._tilted_log_integrand(u, t, w, t.half_df1)[2]
  for u in (-1.5, -0.2, 0.0, 0.4, 2.0):
    f3, f4 = coupled._tilted_third_fourth(jnp.asarray(u), t, w, t.half_df1)
    np.testing.assert_allclose(f3, jax.grad(hess)(u), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(f4, jax.grad(jax.grad(hess))(u), rtol=1e-9, atol=1e-9)


def test_a_class_whose_mode_lies_beyond_the_search_bound_is_scored_per_point_and_right():
  """A class 1e-10 as wide as the prior scale: the posterior mode of u = log gamma_k lies
  near -46, beyond the mode search's bound (-U_BOUND = -30), so the class grid is centred
  at the wrong place. Every point must then take the per-point path, whose searches (the
  point's integral and the class normaliser's) go on from the bound: log p(x | D_k) within
  1e-3 nats of a 20,001-node reference on u in [-60, 15]. (A normaliser centred at the
  bound without a search gave NaN here.)"""
  dim, df0, kappa0, alpha0, n = 8, 8.0, 0.5, 6.0, 50
  rng = np.random.default_rng(11)
  var0 = np.ones(dim)
  x0 = 1e-10 * rng.normal(size=(n, dim))
  hyper = coupled.Hyper(jnp.zeros(dim), jnp.asarray(var0), jnp.full(dim, df0),
                        jnp.full(dim, kappa0), jnp.asarray(alpha0, jnp.float64))
  st = stats_lib.from_labels(jnp.asarray(x0), jnp.zeros(n, jnp.int32), 1, full=False)
  mode, _, _ = coupled.posterior_mode(hyper, st)
  assert float(mode[0]) == -coupled.U_BOUND                  # the case under test
  params = _params(hyper, st)
  xt = x0.mean(0) + 1e-10 * np.array([0.5, 1.0, 3.0, 10.0])[:, None] * rng.normal(size=(4, dim))
  assert np.all(np.asarray(coupled._tilt_needs_point_grid(jnp.asarray(xt), params.class_tail)))
  class_lp, _ = _log_predictive(params, jnp.asarray(xt))
  ref = _np_log_predictive(x0, xt, np.zeros(dim), var0, df0, kappa0, alpha0, u_range=(-60.0, 15.0))
  np.testing.assert_allclose(np.asarray(class_lp)[:, 0], ref, rtol=0, atol=1e-3)


@pytest.mark.parametrize("df0,alpha0", [(0.001, 0.03), (0.01, 0.1), (0.1, 0.3)])
def test_wide_posteriors_of_u_are_integrated_right_on_the_per_point_path(df0, alpha0):
  """Small nu0 and alpha0 (EM takes them to their floors when one class is far wider than
  the rest) make the posterior of u = log gamma_k wide: Laplace sd 1.2-5.4 here, exp(a t)
  on the left (a = alpha0 + D nu0 / 2) and doubly exponential on the right. On the old
  window [t - 8 sd - 12 sd^2, t + 8 sd] the per-point path's 24 nodes were 0.008-0.26
  nats off (the normaliser's 96 up to 0.014). The window now stops where Phi is linear
  on the left (the sum continued past it exactly) and where it has fallen 40 nats on the
  right: the per-point path (``_tail_block``) within 1e-3 nats of a 20,001-node reference
  on u in [-700, 40], for points near and far. ``log_predictive`` scores such a class
  (Laplace sd above 1) by that path for every point: its 13-node class grid was off by
  6.7e-4 to 8.4e-3 nats here."""
  dim, n, kappa0 = 8, 20, 0.5
  rng = np.random.default_rng(5)
  x0 = rng.normal(size=(n, dim))
  hyper = coupled.Hyper(jnp.zeros(dim), jnp.ones(dim), jnp.full(dim, df0), jnp.full(dim, kappa0),
                        jnp.asarray(alpha0, jnp.float64))
  st = stats_lib.from_labels(jnp.asarray(x0), jnp.zeros(n, jnp.int32), 1, full=False)
  _, width, _ = coupled.posterior_mode(hyper, st)
  assert float(width[0]) > 1.0                                # the case under test
  params = _params(hyper, st)
  xt = x0.mean(0) + np.array([0.0, 0.3, 1.0, 3.0, 10.0])[:, None] * rng.normal(size=(5, dim))
  per_point = jax.jit(coupled._tail_block, static_argnums=2)(
      jnp.asarray(xt), params.class_tail, coupled.QuadratureOptions().tail_nodes)
  ref = _np_log_predictive(x0, xt, np.zeros(dim), np.ones(dim), df0, kappa0, alpha0,
                           u_range=(-700.0, 40.0))
  np.testing.assert_allclose(np.asarray(per_point)[:, 0], ref, rtol=0, atol=1e-3)
  class_lp, _ = _log_predictive(params, jnp.asarray(xt))
  np.testing.assert_allclose(np.asarray(class_lp)[:, 0], ref, rtol=0, atol=1e-3)
  # The differentiable scorer's gradient there is finite (the closed-form tail once gave
  # NaN through expm1's overflow) and matches central differences. The cut window's ends
  # are held fixed, so the match is to the quadrature's error, ~1e-5 of the gradient.
  for x in xt[2:4]:
    g = np.asarray(_class_lp_grad(params, jnp.asarray(x)))
    h = 1e-5
    fd = [float(_class_lp_at(params, jnp.asarray(x + h * e))
                - _class_lp_at(params, jnp.asarray(x - h * e))) / (2 * h) for e in np.eye(dim)]
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, fd, rtol=0, atol=1e-4 * np.abs(g).max())


def _first_class_lp(params, x):
  """log p(x | D_1) of one point (D,) by the differentiable scorer."""
  return coupled.log_predictive(params, x[None], differentiable=True)[0][0, 0]


_class_lp_at = jax.jit(_first_class_lp)
_class_lp_grad = jax.jit(jax.grad(_first_class_lp, argnums=1))


@pytest.mark.parametrize("dim,n,alpha0,spread", [(256, 200, 6.0, 5.0), (768, 50, 6.0, 3.0),
                                                 (64, 3, 6.0, 10.0), (2, 2, 0.5, 1.0)])
def test_corrected_laplace_branch_matches_the_grid(dim, n, alpha0, spread):
  """Where the per-point integral's second-order correction is below _LAPLACE_TOL the
  corrected Laplace approximation stands in for the grid: equal to ~1e-6 nats. With two
  points in D = 2 and a loose prior (alpha0 = 1/2) the integrand is far from Gaussian,
  Laplace alone is off by ~6e-4 nats, and the grid is kept."""
  t, w = _tilted_case(dim, n, alpha0, spread=spread)
  grid, _ = coupled._laplace_log_integral(t, w, t.half_df1, 24)
  fast, _ = coupled._laplace_log_integral(t, w, t.half_df1, 24, laplace_tol=1e-3)
  np.testing.assert_allclose(fast, grid, rtol=0, atol=1e-5)
  laplace_only, _ = coupled._laplace_log_integral(t, w, t.half_df1, 24, laplace_tol=np.inf)
  if dim == 2:    # the branch switch matters here: Laplace alone is off
    assert abs(float(laplace_only - grid)) > 1e-4
