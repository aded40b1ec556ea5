"""Coupled-diagonal hierarchical DPMM (paper, section 5.3 and app. 15).

A per-class scale gamma_k ~ Gamma(alpha0, rate alpha0) multiplies the prior variances of
every dimension: sigma^2_{k,d} ~ scaled-inv-chi^2(nu0_d, gamma_k s0_d^2). Given gamma_k
the model is the diagonal model, so everything reuses ``nix`` and the diagonal model's
M-step; gamma_k is integrated out by quadrature in u = log gamma on a grid centred on
each class's posterior mode (``quadrature``).

The log posterior of u is concave, with (A_d = nu0_d s0_d^2, R_kd the data part of
nu' s'^2, q = A e^u / (A e^u + R)):
  l'(u)  = alpha0 (1 - e^u) + sum_d (nu0_d - nu'_kd q_kd) / 2,
  l''(u) = -alpha0 e^u - sum_d nu'_kd q_kd (1 - q_kd) / 2 < 0,
so a damped Newton iteration finds the mode and l'' gives the Laplace width.
"""
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from dpmm_jax import blocks
from dpmm_jax import compiler
from dpmm_jax import precision
from dpmm_jax import validation as checks
from dpmm_jax import em
from dpmm_jax import newton
from dpmm_jax import quadrature
from dpmm_jax import special
from dpmm_jax import stats as stats_lib
from dpmm_jax import student_t
from dpmm_jax.conjugate import nix
from dpmm_jax.models import diag

# Mode search in u = log gamma: bounds, step clip, tolerance and cap.
U_BOUND = 30.0
_U_BOUND = U_BOUND
_MAX_U_STEP = 2.0
_MODE_TOL = 1e-6
_MODE_MAX_ITER = 100
# The search also ends when every class's step is below _MODE_TOL or is below this
# while reversing its previous step: in float32 the gradient's terms (of size nu0 and
# N_k) carry round-off that can move the Newton step by more than _MODE_TOL, and the
# iterates then bounce between neighbours (1.4e-6 apart at nu0 ~ 300, N_k = 5:
# tests/test_quadrature.py).
_MODE_BOUNCE = 1e-4


class Hyper(NamedTuple):
  """Diagonal hyperparameters (D,) plus gamma_shape () alpha0."""
  loc: jax.Array
  var: jax.Array
  df: jax.Array
  mean_concentration: jax.Array
  gamma_shape: jax.Array


class QuadratureOptions(NamedTuple):
  """Nodes and half-widths (in Laplace standard deviations) of the grids.

  ``tail_nodes``: per-point grid of a test point that tilts the posterior of gamma_k off
  the class grid (``TailTerms``); ``norm_nodes``: grid of that path's class normaliser."""
  em_nodes: int = 25
  em_half_width: float = 12.0
  score_nodes: int = 13
  score_half_width: float = 6.0
  prior_nodes: int = 129
  tail_nodes: int = 24
  norm_nodes: int = 96


class Params(NamedTuple):
  """hyper; class_df, class_loc (K, D); class_scale_sq (K, P, D) predictive squared
  scales per node; class_log_weights (K, P); prior_log_weights (P0,) and prior_gamma
  (P0,) of the prior grid; log_counts (K,); class_tail (K, ...) and prior_tail (1, ...)
  ``TailTerms`` of the per-point path."""
  hyper: Hyper
  class_df: jax.Array
  class_loc: jax.Array
  class_scale_sq: jax.Array
  class_log_weights: jax.Array
  prior_log_weights: jax.Array
  prior_gamma: jax.Array
  log_counts: jax.Array
  class_tail: "TailTerms"
  prior_tail: "TailTerms"


# Params fields with a leading class axis (``em.run_jitted_fit`` cuts them to K).
CLASS_FIELDS = ("class_df", "class_loc", "class_scale_sq", "class_log_weights", "log_counts",
                "class_tail")


def init_hyper(stats, df=None, mean_concentration=None, gamma_shape=None) -> Hyper:
  base = diag.init_hyper(stats, df, mean_concentration)
  gamma_shape = 10.0 if gamma_shape is None else gamma_shape
  return Hyper(*base, jnp.asarray(gamma_shape, stats.mean.dtype))


def _as_diag(hyper: Hyper) -> diag.Hyper:
  return diag.Hyper(hyper.loc, hyper.var, hyper.df, hyper.mean_concentration)


def _data_part(hyper: Hyper, stats):
  """(R (K, D), nu' (K, D)): nu' s'^2 = nu0 gamma s0^2 + R."""
  base = nix.posterior(nix.prior(hyper.loc, jnp.zeros_like(hyper.var), hyper.df,
                                 hyper.mean_concentration),
                       stats.count, stats.mean, stats.sq_dev)
  return base.df * base.scale_sq, base.df


@compiler.jit
def posterior_mode(hyper: Hyper, stats):
  """(mode (K,), laplace_scale (K,), converged ()) of the log posterior of u = log gamma_k."""
  data, nu_post = _data_part(hyper, stats)
  log_a = jnp.log(hyper.df * hyper.var)
  log_r = jnp.log(data)  # -inf where a class has no spread: then q = 1
  alpha = hyper.gamma_shape

  count = stats.count[:, None]

  def derivatives(u):
    logit = u[:, None] + log_a - log_r
    q, p = jax.nn.sigmoid(logit), jax.nn.sigmoid(-logit)           # p = 1 - q, no cancellation
    # nu0 - nu' q = nu0 p - N q: formed directly it cancels terms of size nu0, which in
    # float32 is gradient noise of ~0.05 once nu0 reaches its cap (1e6) and keeps the
    # search from converging.
    grad = -alpha * jnp.expm1(u) + 0.5 * jnp.sum(hyper.df * p - count * q, -1)
    hess = -alpha * jnp.exp(u) - 0.5 * jnp.sum(nu_post * q * p, -1)
    return grad, hess

  def body(carry):
    u, last_move, _, it = carry
    grad, hess = derivatives(u)
    step = jnp.clip(-grad / hess, -_MAX_U_STEP, _MAX_U_STEP)
    new_u = jnp.clip(u + step, -_U_BOUND, _U_BOUND)
    move = new_u - u
    # Every class moves until, in one iteration, each step is below the tolerance or
    # is a small one that reverses the last (round-off; see _MODE_BOUNCE).
    settled = jnp.all((jnp.abs(move) <= _MODE_TOL)
                      | ((move * last_move < 0) & (jnp.abs(move) <= _MODE_BOUNCE)))
    return new_u, move, settled, it + 1

  def cond(carry):
    _, _, settled, it = carry
    return ~settled & (it < _MODE_MAX_ITER)

  u0 = jnp.zeros(stats.count.shape, stats.mean.dtype)
  u, _, settled, _ = jax.lax.while_loop(cond, body, (u0, jnp.zeros_like(u0), jnp.array(False),
                                                     jnp.array(0, jnp.int32)))
  _, hess = derivatives(u)
  return u, 1.0 / jnp.sqrt(-hess), settled


def _node_posteriors(hyper: Hyper, stats, gamma):
  """NIX prior and posterior for every class and node: fields (K, P, D)."""
  prior = nix.prior(hyper.loc, gamma[..., None] * hyper.var, hyper.df,
                    hyper.mean_concentration)
  post = nix.posterior(prior, stats.count[:, None], stats.mean[:, None, :],
                       stats.sq_dev[:, None, :])
  return prior, post


def class_log_joint(hyper: Hyper, stats, u):
  """(K, P) log p(u_kp) + log p(X_k | gamma = e^u_kp), the integrand over u."""
  prior = nix.prior(hyper.loc, jnp.exp(u)[..., None] * hyper.var, hyper.df,
                    hyper.mean_concentration)
  log_lik = jnp.sum(nix.log_evidence(prior, stats.count[:, None], stats.mean[:, None, :],
                                     stats.sq_dev[:, None, :]), -1)
  return quadrature.log_gamma_density_of_log(u, hyper.gamma_shape) + log_lik


def class_grid(hyper: Hyper, stats, num_nodes: int, half_width: float):
  mode, scale, _ = posterior_mode(hyper, stats)
  return quadrature.centred_grid(mode, scale, num_nodes, half_width)


class EStep(NamedTuple):
  """The E-step's class grids (K, P) over u = log gamma_k and the log joint on them."""
  grid: quadrature.Grid
  log_joint: jax.Array


def e_step(hyper: Hyper, stats, options=QuadratureOptions()) -> EStep:
  grid = class_grid(hyper, stats, options.em_nodes, options.em_half_width)
  return EStep(grid, class_log_joint(hyper, stats, grid.nodes))


def _log_marginal_terms_from(hyper: Hyper, stats, e: EStep):
  return stats_lib.nonempty_terms(stats.count, quadrature.log_integral(e.grid, e.log_joint))


@functools.partial(compiler.jit, static_argnames=("options",))
def log_marginal_terms(hyper: Hyper, stats, options=QuadratureOptions()):
  """(K,) log p(X_k | hyper), integrated over log gamma_k on the class grid."""
  return _log_marginal_terms_from(hyper, stats, e_step(hyper, stats, options))


@functools.partial(compiler.jit, static_argnames=("options",))
def log_marginal_likelihood(hyper: Hyper, stats, options=QuadratureOptions()):
  return jnp.sum(log_marginal_terms(hyper, stats, options))


def gamma_shape_derivatives(shape, stat_sum, num_classes):
  """L(a) = K [a log a - lgamma a] + a sum_k (E log g_k - E g_k) (paper 15.5):
  L' = K g(a) + sum_k E[log g - g + 1], L'' = K h(a) (g = log - digamma, h = 1/a - trigamma)."""
  return (num_classes * special.log_minus_digamma(shape) + stat_sum,
          num_classes * special.inv_minus_trigamma(shape))


def em_step(hyper: Hyper, stats, *, df_cap=1e6, shape_cap=1e6,
            options=QuadratureOptions()):
  return m_step(hyper, stats, e_step(hyper, stats, options), df_cap=df_cap,
                shape_cap=shape_cap)


def m_step(hyper: Hyper, stats, e: EStep, *, df_cap=1e6, shape_cap=1e6):
  """(new Hyper, NewtonInfo): the M-step given the E-step ``e`` at ``hyper``."""
  grid = e.grid
  weights = jnp.exp(quadrature.normalized_log_weights(grid, e.log_joint))   # (K, P)
  gamma = jnp.exp(grid.nodes)
  _, post = _node_posteriors(hyper, stats, gamma)
  kappa0, df, df_info = diag.update_concentrations(
      hyper, weights, post, gamma[..., None] * hyper.var, stats.count, df_cap=df_cap)
  # E[log g - g + 1] = E[u - expm1(u)], cancellation-free near gamma = 1.
  shape_stat = jnp.sum(stats_lib.nonempty_terms(
      stats.count, weights * (grid.nodes - jnp.expm1(grid.nodes))))
  shape, shape_info = newton.maximize(
      functools.partial(gamma_shape_derivatives, stat_sum=shape_stat,
                        num_classes=stats_lib.num_nonempty(stats.count)),
      hyper.gamma_shape, upper=shape_cap)
  new = Hyper(hyper.loc, hyper.var, df, kappa0, shape)
  return new, em.merge_newton_info(df_info, shape_info)


def boundary_caps(df_cap=1e6, shape_cap=1e6, kappa_cap=diag.KAPPA_CAP):
  """Boundary proposal for ``em.run`` (``caps``; see ``diag.boundary_caps``): nu0_d,
  kappa0_d and alpha0 (all gamma_k = 1) move onto their caps where the slope there is
  positive."""
  return dict(diag.boundary_caps(df_cap, kappa_cap), gamma_shape=(shape_cap, False))


def extrapolation_bounds(df_cap=1e6, shape_cap=1e6):
  """{field: (lower, upper)} of the concentrations SQUAREM extrapolates (``em.run``)."""
  return dict(diag.extrapolation_bounds(df_cap), gamma_shape=(0.0, shape_cap))


def fit_hyper(stats, *, df=None, mean_concentration=None, gamma_shape=None, tol=1e-6,
              max_iter=100, df_cap=1e6, options=QuadratureOptions(), accelerate=True,
              trace_length=None):
  # The M-step and L share the E-step: one copy of it in the compiled loop.
  step = em.SharedEStep(functools.partial(e_step, options=options),
                        functools.partial(m_step, df_cap=df_cap), _log_marginal_terms_from)
  return em.run(step, None, init_hyper(stats, df, mean_concentration, gamma_shape), stats,
                tol=tol, max_iter=max_iter,
                caps=boundary_caps(df_cap),
                extrapolate=extrapolation_bounds(df_cap), accelerate=accelerate,
                trace_length=trace_length)


@functools.partial(compiler.jit, static_argnames=("options",))
def params_from_hyper(hyper: Hyper, stats, options=QuadratureOptions()) -> Params:
  # One mode search serves the class grid and the per-point path's constants.
  mode, width, _ = posterior_mode(hyper, stats)
  grid = quadrature.centred_grid(mode, width, options.score_nodes, options.score_half_width)
  log_w = quadrature.normalized_log_weights(grid, class_log_joint(hyper, stats, grid.nodes))
  _, post = _node_posteriors(hyper, stats, jnp.exp(grid.nodes))
  df, loc, scale_sq = nix.predictive(post)                          # (K, P, D)
  prior_grid = quadrature.gamma_prior_grid(hyper.gamma_shape, options.prior_nodes)
  prior_log_w = quadrature.normalized_log_weights(
      prior_grid, quadrature.log_gamma_density_of_log(prior_grid.nodes, hyper.gamma_shape))
  class_tail, prior_tail = tail_terms(hyper, stats, mode, width, options)
  return Params(hyper, df[:, 0], loc[:, 0], scale_sq, log_w, prior_log_w,
                jnp.exp(prior_grid.nodes), jnp.log(stats.count), class_tail, prior_tail)


# ------------------------------------------------------------- per-point (tail) path
class TailTerms(NamedTuple):
  """Per-class constants of the integral over u = log gamma_k *given the test point x*.

  The class grid is centred on the posterior of u given D_k. A test point x tilts it by
  p(x | gamma, D_k): far from the class (3x the spread in D = 256) the tilted mass lies
  many grid widths to the right and the fixed grid misses tens to hundreds of nats. The
  exact predictive is

      p(x | D_k) = int p(u | D_k) p(x | u, D_k) du,

  and with t = u - m_k (m_k the class mode), B_d(u) = A_d e^u + R_d (so that
  nu'_d s'^2_d = B_d: A = nu0 s0^2, R the data part), q_d = A_d e^m / B_d(m),
  T_d = nu'_d sigma^2_d(m) (predictive scale at the mode) and w_d = (x_d - mu'_d)^2 / T_d,
  the log integrand is, with nothing large cancelling,

      Phi(t) = const_k + alpha0 t - alpha_em expm1(t)
               + sum_d [nu0_d/2 t - c_d log1p(q_d expm1(t) + w_d)],

  c = (nu' + 1)/2, alpha_em = alpha0 e^m, const_k = sum_d log St_d(mu'_d | m) - log Z_k,
  where Z_k = int exp(L(u) - L(m)) du is the same integral with c -> nu'/2 and w = 0
  (the class posterior's normaliser). Phi is concave (Phi'' < 0 term by term), so a
  damped Newton iteration finds its mode and a grid of ``tail_nodes`` points around it
  (Laplace width sigma; window [-(8 sigma + 12 sigma^2), 8 sigma], which covers the
  exp(a t) left and doubly exponential right tails; ``_window`` cuts it short for a wide
  posterior) integrates it. The prior predictive is
  the same integral with N = 0 (R = 0, q = 1, m = 0).

  Attributes (leading axis K, or 1 for the prior):
    loc, inv_scale (1/T), half_df1 (c), q, p (1 - q), half_df0 (nu0/2): (K, D).
    count1 (N_k + 1 for the class path, N_k for its normaliser: nu' or nu' + 1 less
    nu0), alpha0, alpha_em, const, width (Laplace sd of u given D_k): (K,).
  """
  loc: jax.Array
  inv_scale: jax.Array
  half_df1: jax.Array
  q: jax.Array
  p: jax.Array
  half_df0: jax.Array
  count1: jax.Array
  alpha0: jax.Array
  alpha_em: jax.Array
  const: jax.Array
  width: jax.Array


_TAIL_HALF_WIDTH = 8.0      # right half-width of the per-point window (Laplace sds)
_TAIL_LEFT_EXTRA = 12.0     # extra left width, times sigma^2 (heavy exp(a t) left tail)
# Where a wide posterior of u cuts the per-point window short (``_window``):
_TAIL_BOUND = 80.0          # |t| at most this: e^80 = 5.5e34 is finite in float32
_LINEAR_TAIL_TOL = 1e-6     # left: Phi's slope within this of its limit past the end
_TAIL_DROP = 40.0           # right: Phi this far below its mode past the end
_TAIL_TOL = 1e-3            # Newton stops when a step is below this many Laplace sds
_TAIL_MAX_ITER = 60
# A point is scored on the class grid when its tilt moves the posterior of u by at most
# _TILT_SHIFT Laplace widths and narrows it to no less than 1/sqrt(_TILT_NARROW) of one
# (the fixed grids' error then stays below 1e-5 nats); else by the per-point grid.
_TILT_SHIFT = 1.0
_TILT_NARROW = 1.8
# A class whose posterior of u has a Laplace sd above this is scored by the per-point
# path for every point: in D = 8 the class grid was off by 6.7e-4 nats at sd 1.2 and by
# 8.4e-3 at sd 2.7, the per-point path by 1e-4 (at sd 0.8 the grid's 1.6e-4 beats its
# 4.2e-4; benchmarks/RESULTS.md, session 19).
_WIDE_POSTERIOR = 1.0
# A block of (point, class) pairs on the per-point path uses the corrected Laplace
# approximation when every pair's second-order correction is below this (nats); its error
# is then ~1e-6 (``_laplace_log_integral``).
_LAPLACE_TOL = 1e-3


def _tilted_log_integrand(t, terms: TailTerms, w, half_df):
  """(Phi(t), Phi'(t), Phi''(t)) less const, for t (...), w (..., D) broadcastable.

  half_df is c = nu0/2 + count1/2. Each dimension's term nu0/2 t - c log1p(q expm1(t) + w)
  is formed in whichever of two equal forms has no large cancelling parts:

    q < 1/2:  nu0/2 t - c log1p(q expm1(t) + w)                  (parts ~ nu0 |t|),
    q >= 1/2: -count1/2 t - c log1p(p expm1(-t) + w e^-t)        (parts ~ N |t|),

  (q ~ nu0 / (nu0 + N)). With EM's nu0 at its cap (1e6) the first form cancels parts of
  size 1e6 |t| and in float32 lost 0.4 nats over D = 64 (prior predictive) before.
  The gradient's nu0/2 - c q e^t / den is formed as (nu0 (p + w) - count1 q e^t) / (2 den),
  which does not cancel terms of size nu0 either.
  """
  e = jnp.exp(t)
  em1 = jnp.expm1(t)
  q = terms.q
  count1 = terms.count1[..., None]
  use_neg = q >= 0.5
  arg = jnp.where(use_neg, terms.p * jnp.expm1(-t)[..., None] + w * jnp.exp(-t)[..., None],
                  q * em1[..., None] + w)
  slope = jnp.where(use_neg, -0.5 * count1, terms.half_df0)
  f = (terms.alpha0 * t - terms.alpha_em * em1
       + jnp.sum(slope * t[..., None] - half_df * jnp.log1p(arg), -1))
  den = 1.0 + q * em1[..., None] + w
  qe = q * e[..., None]
  grad = (terms.alpha0 - terms.alpha_em * e
          + jnp.sum((terms.half_df0 * (terms.p + w) - 0.5 * count1 * qe) / den, -1))
  hess = -terms.alpha_em * e - jnp.sum(half_df * qe * (terms.p + w) / (den * den), -1)
  return f, grad, hess


def _tilted_third_fourth(t, terms: TailTerms, w, half_df):
  """(Phi_3(t), Phi_4(t)), the third and fourth t-derivatives of Phi, for t (...), w (..., D).

  Each dimension's -c log(a + q e^t) (a = p + w) has t-derivatives -c r^(j - 1), with
  r = q e^t / (a + q e^t) a logistic function of t: r_1 = r (1 - r), r_2 = r_1 (1 - 2 r),
  r_3 = r_1 (1 - 6 r (1 - r)); the alpha term adds -alpha_em e^t to each.
  """
  e = jnp.exp(t)
  a = terms.p + w
  b = terms.q * e[..., None]
  r = b / (a + b)
  v = r * (1.0 - r)
  f3 = -terms.alpha_em * e - jnp.sum(half_df * v * (1.0 - 2.0 * r), -1)
  f4 = -terms.alpha_em * e - jnp.sum(half_df * v * (1.0 - 6.0 * v), -1)
  return f3, f4


def _left_slope(terms: TailTerms, w):
  """(...) the limit of Phi'(t) as t -> -inf: a = alpha0 + sum_d nu0_d / 2."""
  return terms.alpha0 + jnp.sum(jnp.broadcast_to(terms.half_df0, w.shape), -1)


def _window(t, sigma, f_mode, terms: TailTerms, w, half_df):
  """(lo, hi, lo cut, hi cut): the per-point grid's ends (...), and whether each was
  pulled in from the default window [t - 8 sigma - 12 sigma^2, t + 8 sigma] (t the mode,
  sigma the Laplace sd; ``_geometric_tail`` then continues the sum past it). ``terms``,
  ``w`` and ``half_df`` are constants here (the caller's ``stop_gradient``ed copies).

  The default suits a posterior of u close to Gaussian. A wide one (sigma of 1 or more,
  e.g. EM's nu0 and alpha0 near 0) is exp(a t) on the left and falls doubly
  exponentially on the right, and on that window 24 nodes were 0.26 nats off at
  sigma = 5.4 (benchmarks/RESULTS.md, session 19). So:
  - left: no further than where Phi is linear to a relative slope error of
    _LINEAR_TAIL_TOL. |Phi''(t)| <= e^t B with B = alpha_em + sum_d c_d q_d / (p_d + w_d)
    (each term of Phi'' is c q e^t (p + w) / den^2, den >= p + w) and Phi' tends to
    a = alpha0 + sum nu0/2, so Phi' is within tol a of a left of log(tol a / B);
  - right: where concavity keeps Phi _TAIL_DROP below its mode, given its fall over the
    first two sds (the Gaussian's 8 sigma when it falls no faster);
  - both within |t| <= _TAIL_BOUND, where e^t and e^-t are finite: the integrand
    multiplies them by p and w, which may be 0, and 0 * inf is NaN.
  """
  # The default ends move with sigma under differentiation, so the gradient is that of
  # the value returned; the cut ends are computed from constants, so that a NaN in the
  # derivative of a cut not taken cannot reach the gradient.
  fixed_sigma, f_mode = jax.lax.stop_gradient((sigma, f_mode))
  wanted_lo = t - (_TAIL_HALF_WIDTH * sigma + _TAIL_LEFT_EXTRA * sigma * sigma)
  wanted_hi = t + _TAIL_HALF_WIDTH * sigma
  curv = terms.alpha_em + jnp.sum(half_df * terms.q / (terms.p + w), -1)
  linear = jnp.log(_LINEAR_TAIL_TOL * _left_slope(terms, w)) - jnp.log(curv)
  lo_cut = jnp.maximum(jnp.minimum(linear, t - _TAIL_HALF_WIDTH * fixed_sigma), -_TAIL_BOUND)
  probe = t + 2.0 * fixed_sigma
  fall = jnp.maximum(f_mode - _tilted_log_integrand(probe, terms, w, half_df)[0], 1.0)
  past_probe = 2.0 * fixed_sigma * jnp.maximum(_TAIL_DROP / fall - 1.0, 0.0)
  hi_cut = jnp.minimum(probe + past_probe, _TAIL_BOUND)
  lo = jnp.maximum(wanted_lo, lo_cut)
  hi = jnp.minimum(wanted_hi, hi_cut)
  return lo, hi, lo > wanted_lo, hi < wanted_hi


def _geometric_tail(f_end, decay, cut):
  """(...) log of the grid's node sum continued past a cut end of the window with Phi
  linear beyond it, less log step: sum_{i >= 1} e^(Phi(end) - i decay) =
  e^Phi(end) / expm1(decay), decay = |Phi'| step > 0. -inf where the end was not cut.

  On the left Phi is linear past the end (its slope is alpha0 + sum nu0/2 to
  _LINEAR_TAIL_TOL; ``_window``), so the decay is that limit times the step. On the right
  it is the fall between the last two nodes: Phi is concave, so this bounds the tail
  (below e^-_TAIL_DROP of the peak) from above. Using the nodes' values adds no
  evaluation of the integrand to the per-point path.
  """
  use = cut & (decay > 0)
  decay = jnp.where(use, decay, 1.0)     # keeps NaN out of the unused branch's gradient
  # log expm1(s) as s + log(-expm1(-s)): no overflow, and a finite gradient, at large s.
  tail = f_end - decay - jnp.log(-jnp.expm1(-decay))
  return jnp.where(use, tail, -jnp.inf)


def _laplace_log_integral(terms: TailTerms, w, half_df, num_nodes: int,
                          laplace_tol: Optional[float] = None):
  """log int exp(Phi(t)) dt (less const) by Newton to the mode, then a Laplace grid.

  With ``laplace_tol``, when every integral's second-order Laplace correction
  ``Phi_4 / (8 H^2) + 5 Phi_3^2 / (24 H^3)`` (H = -Phi'' at the mode) is below it in size,
  the corrected Laplace approximation ``Phi + log sqrt(2 pi / H) + correction`` replaces
  the grid: its error is of the order of the next term, ~correction^2. That is the usual
  case far from a class with many points (the tilted posterior of u is then close to
  Gaussian), and it costs one pass over D instead of ``num_nodes``.

  Args:
    terms: TailTerms whose fields broadcast against w (..., D) / its leading axes (...).
    w: (..., D) scaled squared distances (zeros for the normaliser).
    half_df: (..., D) c or nu'/2.
    num_nodes: grid nodes.
    laplace_tol: None (always the grid) or the correction size below which the corrected
      Laplace approximation is used (decided for the whole array at once).
  Returns:
    ((...) log integral, (...) Newton converged).
  """

  # The mode only centres the grid (the integral does not depend on where): searching
  # it on constants keeps the Newton loop out of reverse-mode differentiation, so the
  # result differentiates through the grid or the Laplace terms at the mode.
  fixed_terms, fixed_w, fixed_half_df = jax.lax.stop_gradient((terms, w, half_df))

  def body(carry):
    t, _, it = carry
    _, grad, hess = _tilted_log_integrand(t, fixed_terms, fixed_w, fixed_half_df)
    step = jnp.clip(-grad / hess, -_MAX_U_STEP, _MAX_U_STEP)
    new_t = jnp.clip(t + step, -2.0 * _U_BOUND, 2.0 * _U_BOUND)
    size = jnp.abs(step) * jnp.sqrt(-hess)
    # A pair whose step is NaN (its integrand is not finite: the prior's at its own mean,
    # where the density is infinite and den^2 underflows) must not end the other pairs'
    # search, as NaN > tol would.
    return new_t, jnp.max(jnp.where(jnp.isnan(size), 0.0, size)), it + 1

  def cond(carry):
    _, change, it = carry
    return (change > _TAIL_TOL) & (it < _TAIL_MAX_ITER)

  t0 = jnp.zeros_like(w[..., 0])     # keeps w's sharding type in the loop carry
  change0 = jnp.max(t0) + jnp.inf    # ... and so does the step size (shard_map)
  t, change, _ = jax.lax.while_loop(cond, body, (t0, change0, jnp.array(0, jnp.int32)))
  converged = change <= _TAIL_TOL
  f_mode, _, hess = _tilted_log_integrand(t, terms, w, half_df)
  curv = -hess
  sigma = 1.0 / jnp.sqrt(curv)

  def grid():
    lo, hi, lo_cut, hi_cut = _window(t, sigma, f_mode, fixed_terms, fixed_w, fixed_half_df)
    step = (hi - lo) / (num_nodes - 1)

    def node(i, acc):
      f, _, _ = _tilted_log_integrand(lo + i * step, terms, w, half_df)
      return acc.at[..., i].set(f)

    vals = jax.lax.fori_loop(0, num_nodes, node,
                             jnp.zeros(t.shape + (num_nodes,), t.dtype) + t[..., None] * 0)
    on_grid = jax.nn.logsumexp(vals, -1) + jnp.log(step)
    beyond = jnp.logaddexp(_geometric_tail(vals[..., 0], _left_slope(terms, w) * step, lo_cut),
                           _geometric_tail(vals[..., -1], vals[..., -2] - vals[..., -1],
                                           hi_cut)) + jnp.log(step)
    return jnp.where(jnp.isfinite(beyond), jnp.logaddexp(on_grid, beyond), on_grid)

  if laplace_tol is None:
    return grid(), converged
  f3, f4 = _tilted_third_fourth(t, terms, w, half_df)
  correction = f4 / (8.0 * curv * curv) + 5.0 * f3 * f3 / (24.0 * curv * curv * curv)
  laplace = f_mode + 0.5 * (special.LOG_2PI - jnp.log(curv)) + correction
  use_laplace = jnp.all((jnp.abs(correction) <= laplace_tol) & converged)
  return jax.lax.cond(use_laplace, lambda: laplace, grid), converged


def tail_terms(hyper: Hyper, stats, mode, width, options=QuadratureOptions()):
  """(class TailTerms (K, ...), prior TailTerms (1, ...)); see ``TailTerms``.

  mode, width (K,): ``posterior_mode``'s mode and Laplace width of u = log gamma_k. The
  normaliser Z_k integrates the class posterior of u itself, whose mode is t = 0 unless
  the mode search clipped it at +-U_BOUND; its Newton search then goes on from there,
  as the per-point integrals' searches do, so the two stay consistent.
  """
  dtype = stats.mean.dtype
  data, nu_post = _data_part(hyper, stats)
  a = hyper.df * hyper.var
  gamma_m = jnp.exp(mode)
  q = jax.nn.sigmoid(mode[:, None] + jnp.log(a) - jnp.log(data))
  _, post = _node_posteriors(hyper, stats, gamma_m[:, None])
  df, loc, scale_sq = nix.predictive(post)                          # (K, 1, D)
  df, loc, scale_sq = df[:, 0], loc[:, 0], scale_sq[:, 0]
  shape = jnp.broadcast_to(hyper.gamma_shape, mode.shape).astype(dtype)
  half_df0 = jnp.broadcast_to(0.5 * hyper.df, loc.shape)
  peak = jnp.sum(student_t.t_log_normalizer(df, 1) - 0.5 * jnp.log(scale_sq), -1)
  p = jax.nn.sigmoid(-(mode[:, None] + jnp.log(a) - jnp.log(data)))
  base = TailTerms(loc, 1.0 / (df * scale_sq), 0.5 * (df + 1.0), q, p, half_df0,
                   stats.count + 1.0, shape, shape * gamma_m, jnp.zeros_like(mode), width)
  log_norm, _ = _laplace_log_integral(base._replace(count1=stats.count), jnp.zeros_like(loc),
                                      0.5 * nu_post, options.norm_nodes)
  classes = base._replace(const=peak - log_norm)
  # Prior: N = 0, so R = 0, q = 1, the mode of u is 0 and Z = exp(-excess(alpha0)).
  pdf, ploc, pscale = nix.predictive(nix.prior(hyper.loc, hyper.var, hyper.df,
                                               hyper.mean_concentration))
  pdf, ploc = jnp.broadcast_arrays(pdf, ploc)
  pscale = jnp.broadcast_to(pscale, ploc.shape)
  alpha = jnp.asarray(hyper.gamma_shape, dtype)
  ppeak = jnp.sum(student_t.t_log_normalizer(pdf, 1) - 0.5 * jnp.log(pscale), -1)
  prior = TailTerms(ploc[None], 1.0 / (pdf * pscale)[None], 0.5 * (pdf + 1.0)[None],
                    jnp.ones_like(ploc)[None], jnp.zeros_like(ploc)[None], (0.5 * pdf)[None],
                    jnp.ones((1,), dtype), alpha[None], alpha[None],
                    (ppeak + special.log_gamma_normalizer_excess(alpha))[None],
                    (1.0 / jnp.sqrt(alpha))[None])
  return classes, prior


def _tilt_needs_point_grid(x, t: TailTerms):
  """(M, kb) True where x tilts the posterior of u off the class grid (see _TILT_*)."""
  w = (x[:, None, :] - t.loc[None]) ** 2 * t.inv_scale[None]
  den = 1.0 + w
  c, q, p = t.half_df1[None], t.q[None], t.p[None]
  grad = ((t.alpha0 - t.alpha_em)[None]
          + jnp.sum((t.half_df0[None] * (p + w) - 0.5 * t.count1[None, :, None] * q) / den, -1))
  hess = -t.alpha_em[None] - jnp.sum(c * q * (p + w) / (den * den), -1)
  s = t.width[None]
  return (jnp.abs(grad) * s > _TILT_SHIFT) | (-hess * s * s > _TILT_NARROW)


def _tail_block(x, t: TailTerms, num_nodes: int):
  """(M, kb) log p(x | D_k) by the per-point grid (see TailTerms)."""
  w = (x[:, None, :] - t.loc[None]) ** 2 * t.inv_scale[None]       # (M, kb, D)
  per_pair = jax.tree_util.tree_map(lambda leaf: leaf[None], t)
  log_int, _ = _laplace_log_integral(per_pair, w, t.half_df1[None], num_nodes,
                                     laplace_tol=_LAPLACE_TOL)
  return log_int + t.const[None]


_fit = em.jit_fit(fit_hyper, params_from_hyper, static_argnames=("options",))


def fit(stats, *, df=None, mean_concentration=None, gamma_shape=None, tol=1e-6,
        max_iter=100, df_cap=1e6, options=QuadratureOptions(), accelerate=True):
  """Fits by EM: (Params, EMInfo). One compilation per shape (K padded with empty
  classes, ``em.padded_num_classes``) and options serves every max_iter up to 127
  (``em.trace_length``). ``accelerate``: SQUAREM-accelerated EM (default) or plain EM
  (False), from the same compiled fit."""
  checks.em_options(tol, max_iter)
  checks.positive_or_none(df, "df")
  checks.positive_or_none(mean_concentration, "mean_concentration")
  checks.positive_or_none(gamma_shape, "gamma_shape")
  # Only count, mean and sq_dev are used: one compiled fit serves statistics with and
  # without the (pooled) scatter.
  stats = stats._replace(scatter=None, pooled_scatter=None)
  return em.run_jitted_fit(_fit, stats, df=df, mean_concentration=mean_concentration,
                           gamma_shape=gamma_shape, tol=tol, max_iter=max_iter,
                           df_cap=df_cap, options=options, accelerate=accelerate,
                           class_fields=CLASS_FIELDS)


def scale_mixture_log_density(x, df, loc, scale_sq, log_weights):
  """log sum_p w_p prod_d St(x_d | df_d, loc_d, scale_sq_pd).

  Args:
    x: (M, D); df, loc: (..., D); scale_sq: (..., P, D); log_weights: (..., P).
  Returns:
    (M, ...) log densities.
  """
  xe = x.reshape(x.shape[:1] + (1,) * (loc.ndim - 1) + x.shape[1:])[..., None, :]
  lp = student_t.product_t_log_density(xe, df[..., None, :], loc[..., None, :], scale_sq)
  return jax.nn.logsumexp(lp + log_weights, axis=-1)


# --------------------------------------------------------------------------- scoring
# Expansion orders tried per class, cheapest first; a class that needs more is scored by
# the exact sum over its P nodes.
SERIES_ORDERS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
# Bound on the absolute error (nats) the expansion may add to a log density.
SERIES_TOL = 1e-4
# Temporaries per (point, class, dimension) of a series block (sets the class block size).
_SERIES_PAIR_ELEMENTS = 4


class MixtureTerms(NamedTuple):
  """Per-class constants for scoring sum_p w_p prod_d St(x_d | nu_d, mu_d, s_pd^2).

  With T_pd = nu_d s_pd^2, Tbar_d = nu_d sbar_d^2 (sbar^2 = sum_p w_p s_p^2, the scale at
  the posterior mean of gamma), zbar = (x - mu)^2 / Tbar, v = zbar / (1 + zbar),
  c = (nu + 1)/2 and delta_pd = T_pd / Tbar_d - 1,

      log St_pd(x_d) = G_pd - c_d log1p(zbar_d) + c_d F(v_d, delta_pd),
      F(v, a) = log1p(a) - log1p((1 - v) a) = sum_n (-1)^(n+1) a^n (1 - (1 - v)^n) / n,

  where G_pd = lgamma(c) - lgamma(nu/2) - log(pi T_pd)/2 (``student_t.t_log_normalizer``).
  The scale is linear in gamma, so delta_pd = e_p eta_d has rank one and

      sum_d c_d F(v_d, delta_pd) = sum_n (-1)^(n+1) e_p^n D_n / n,
      D_n = sum_d c_d eta_d^n (1 - (1 - v_d)^n),

  with 1 - (1 - v)^n formed by the positive recursion u_(n+1) = v + (1 - v) u_n (no
  cancellation; F is proportional to v, so an in-distribution point, v ~ 1/nu, is not
  hurt by round-off in the stored scales, just as in the exact sum). A class thus costs
  one log1p and about 3 J flops per (point, dimension) instead of P log1p's. Each class
  gets the smallest order J in SERIES_ORDERS whose remainder bound (independent of x:
  sum_d c_d rho^(J+1) / ((J+1)(1 - rho)) with rho = max |delta_pd|, plus the rank-one
  residual) is below SERIES_TOL; J = 0 keeps only the node constants. Classes whose
  posterior of gamma is wide (few points) get the exact P-node sum.

  Attributes:
    loc, inv_scale (1/Tbar), half_df1 (c), direction (eta): (K, D).
    node_shift: (K, P) e_p.
    node_inv_scale: (K, P, D) 1/T_pd (exact sum).
    node_const: (K, P) log w_p + sum_d G_pd.
    level: (K,) index into SERIES_ORDERS, or len(SERIES_ORDERS) for the exact sum.
  """
  loc: jax.Array
  inv_scale: jax.Array
  half_df1: jax.Array
  direction: jax.Array
  node_shift: jax.Array
  node_inv_scale: jax.Array
  node_const: jax.Array
  level: jax.Array


@precision.float32_matmuls
def mixture_terms(df, loc, scale_sq, log_weights, tol=SERIES_TOL) -> MixtureTerms:
  """MixtureTerms of (K, D) df, loc, (K, P, D) node scales and (K, P) log weights."""
  log_w = jax.nn.log_softmax(log_weights, -1)
  w = jnp.exp(log_w)
  df_p = df[..., None, :]
  node_t = df_p * scale_sq                                          # (K, P, D)
  half_df1 = 0.5 * (df + 1.0)
  g = student_t.t_log_normalizer(df, 1)[..., None, :] - 0.5 * jnp.log(scale_sq)
  node_const = log_w + jnp.sum(g, -1)
  mean_t = jnp.sum(w[..., None] * node_t, -2)                      # (K, D)
  delta = node_t / mean_t[..., None, :] - 1.0
  direction = jnp.sqrt(jnp.sum(w[..., None] * delta * delta, -2))
  norm = jnp.sum(direction * direction, -1, keepdims=True)
  shift = jnp.einsum("...pd,...d->...p", delta, direction) / jnp.where(norm > 0, norm, 1.0)
  # Remainder bound per order: |F(v, a) - F_J(v, a)| <= |a|^(J+1) / ((J+1)(1 - |a|)) and
  # |F(v, a) - F(v, b)| <= v |a - b| / (1 - rho)^2 (rank-one residual). The residual
  # beyond the float32 round-off of the stored scales is counted (that round-off moves
  # the exact sum by as much: it too enters multiplied by v).
  rank_one = shift[..., None] * direction[..., None, :]
  rho = jnp.maximum(jnp.abs(delta), jnp.abs(rank_one))
  ok = rho < 0.5
  safe = jnp.where(ok, rho, 0.0)
  c = half_df1[..., None, :]
  noise = 8.0 * jnp.finfo(delta.dtype).eps * (1.0 + jnp.abs(delta))
  residual = jnp.sum(c * jnp.maximum(jnp.abs(delta - rank_one) - noise, 0.0)
                     / (1.0 - safe) ** 2, -1)
  levels = []
  for order in SERIES_ORDERS:
    rem = jnp.sum(c * safe ** (order + 1) / ((order + 1) * (1.0 - safe)), -1)
    levels.append(jnp.max(rem + residual, -1) <= tol)
  fits = jnp.stack(levels, -1) & jnp.all(ok, (-2, -1))[..., None]  # (K, len)
  level = jnp.where(jnp.any(fits, -1), jnp.argmax(fits, -1), len(SERIES_ORDERS))
  return MixtureTerms(loc, 1.0 / mean_t, half_df1, direction, shift, 1.0 / node_t,
                      node_const, level.astype(jnp.int32))


@precision.float32_matmuls
def _series_block(order, x, t: MixtureTerms):
  """(M, kb) log densities by the order-``order`` expansion (see MixtureTerms).

  ``order`` may be traced (0 <= order <= SERIES_ORDERS[-1]): the terms are built in a loop
  with that trip count, so one compiled block serves every order.
  """
  max_order = SERIES_ORDERS[-1]
  z = (x[:, None, :] - t.loc[None]) ** 2 * t.inv_scale[None]       # (M, kb, D)
  base = jnp.sum(t.half_df1[None] * jnp.log1p(z), -1)               # (M, kb)
  w = 1.0 / (1.0 + z)
  v = z * w

  def term(n, carry):
    # weight = c eta^n and u = 1 - (1 - v)^n, by u_n = v + (1 - v) u_(n-1), u_0 = 0.
    weight, u, sums = carry
    weight = weight * t.direction
    u = v + w * u
    return weight, u, sums.at[..., n].set(jnp.sum(weight[None] * u, -1))

  # zeros_like keeps x's sharding type (varying over a shard_map axis) for the loop carry.
  sums = jnp.zeros_like(base)[..., None] + jnp.zeros((max_order,), x.dtype)   # (M, kb, J)
  _, _, sums = jax.lax.fori_loop(0, order, term, (t.half_df1, jnp.zeros_like(z), sums))
  n = jnp.arange(1, max_order + 1, dtype=x.dtype)
  coef = jnp.where(n <= order, jnp.where(n % 2 == 1, 1.0, -1.0) / n, 0.0)
  coef = coef * t.node_shift[..., None] ** n                        # (kb, P, J)
  series = jnp.einsum("mkj,kpj->mkp", sums, coef)
  return jax.nn.logsumexp(t.node_const[None] + series, -1) - base


def _exact_block(x, t: MixtureTerms):
  """(M, kb) log densities by the full sum over the P nodes, one class at a time
  ((M, P, D) temporaries)."""

  def one_class(tk):
    z = (x[:, None, :] - tk.loc[None, None]) ** 2 * tk.node_inv_scale[None]   # (M, P, D)
    lp = tk.node_const[None] - jnp.sum(tk.half_df1[None, None] * jnp.log1p(z), -1)
    return jax.nn.logsumexp(lp, -1)

  return jax.lax.map(one_class, t).T


def _adaptive_block(x, t: MixtureTerms):
  """(M, kb): the expansion of the order the block's most demanding class needs, or the
  exact node sum when one of them needs it (two compiled branches in all)."""
  level = jnp.max(t.level)
  orders = jnp.asarray(SERIES_ORDERS, jnp.int32)
  order = orders[jnp.minimum(level, len(SERIES_ORDERS) - 1)]
  return jax.lax.cond(level >= len(SERIES_ORDERS), _exact_block,
                      functools.partial(_series_block, order), x, t)


def _block_with_tails(x, terms, num_nodes: int, exact: bool = False):
  """(M, kb): ``_adaptive_block`` (``_exact_block`` if ``exact``) when no point tilts the
  block's classes off their grids and none of them is ``wide`` (kb,), else the per-point
  grid for the block (``TailTerms``)."""
  mixture, tail, wide = terms
  far = jnp.any(_tilt_needs_point_grid(x, tail)) | jnp.any(wide)
  on_grid = _exact_block if exact else _adaptive_block
  return jax.lax.cond(far, functools.partial(_tail_block, num_nodes=num_nodes),
                      lambda xx, tt: on_grid(xx, mixture), x, tail)


def scoring_orders(params: Params):
  """(K,) expansion order used to score each class; -1 where the exact P-node sum is used."""
  t = mixture_terms(params.class_df, params.class_loc, params.class_scale_sq,
                    params.class_log_weights)
  orders = jnp.asarray(SERIES_ORDERS + (-1,), jnp.int32)
  return orders[t.level]


def _no_mass(dtype):
  """A log weight of no mass that keeps sums and gradients finite (an all -inf logsumexp
  has a NaN gradient)."""
  return jnp.asarray(-0.25 * jnp.finfo(dtype).max, dtype)


def _prior_mixture(params: Params):
  """(df, loc (D,), scale_sq (P0, D), log_weights (P0,)): the prior predictive as a
  mixture over the prior grid's nodes.

  When alpha0 is small the grid reaches gamma far below the smallest normal float
  (u ~ -100 at alpha0 = 0.24), where a node's scales (and the inverse the scorers take)
  are not representable: gamma underflows to 0 and the node sum gives inf - inf. Such
  nodes get no mass and the scales of the last (largest) node. They hold a negligible
  share of the prior (e^-21 at alpha0 = 0.24 in float32), and their Student-t densities,
  at scales of order 1e-38, vanish except within that distance of the prior mean, where
  a point tilts the prior onto the per-point path (``TailTerms``) anyway.
  """
  h = params.hyper
  df, loc, scale_sq = nix.predictive(nix.prior(h.loc, h.var, h.df, h.mean_concentration))
  df, loc = jnp.broadcast_arrays(df, loc)
  node_scale = params.prior_gamma[:, None] * scale_sq                # (P0, D)
  tiny = jnp.finfo(node_scale.dtype).tiny
  usable = jnp.all((node_scale >= tiny) & (df * node_scale >= tiny), -1)
  # The last node (gamma >= 1) is kept: scales that underflow there are a problem of the
  # data's scale, better shown as non-finite than hidden as a prior of no mass.
  usable = usable.at[-1].set(True)
  node_scale = jnp.where(usable[:, None], node_scale, node_scale[-1])
  log_w = jnp.where(usable, params.prior_log_weights, _no_mass(node_scale.dtype))
  return df, loc, node_scale, log_w


def prior_density_is_infinite(params: Params, x):
  """(M,) True where the prior predictive density p(x) is infinite.

  p(x) = int Gamma(gamma; alpha0, alpha0) prod_d St(x_d | mu0_d, gamma s_d, nu0_d) dgamma.
  As u = log gamma -> -inf its log integrand grows like s u, with
  s = alpha0 + sum_{d: x_d != mu0_d} nu0_d / 2 - #{d: x_d = mu0_d} / 2 (a coordinate at
  the prior mean contributes gamma^(-1/2), any other one gamma^(nu0_d / 2)), so the
  integral diverges exactly when s <= 0: at the prior mean itself whenever
  alpha0 <= D / 2, and wherever enough coordinates coincide with it. The class
  predictives are always finite (their data bound gamma away from 0).
  """
  t = params.prior_tail
  slope = t.alpha0 + jnp.sum(jnp.where(x == t.loc, -0.5, t.half_df0), -1)
  return slope <= 0


def _prior_pseudo_classes(params: Params, num_nodes: int):
  """The prior's P0-node mixture as J = ceil(P0 / P) pseudo-classes of the classes' P nodes.

  Nodes are cut into J consecutive chunks (the last padded with copies of the last node,
  of no mass), each in the class layout, so that the compiled class block scores the
  prior too. On the grid path chunk j's density carries its share of the prior's mass
  (``share``, added to its node constants after ``mixture_terms`` has normalised each
  chunk), and log p(x) = logsumexp_j of the chunks' densities. All chunks share the
  prior's TailTerms, so they take the per-point path together; chunk 0 then gets the
  whole prior's integral and the others none, so only chunk 0 needs to run: it is placed
  last (``log_predictive`` starts its loop there).

  Returns:
    (df, loc (J, D), scale_sq (J, P, D), log_weights (J, P)) for ``mixture_terms``,
    share (J,) and TailTerms (J, ...).
  """
  df, loc, scale_sq, log_w = _prior_mixture(params)               # (D,), (D,), (P0, D), (P0,)
  none = _no_mass(loc.dtype)
  num_prior = log_w.shape[0]
  chunks = -(-num_prior // num_nodes)
  node = jnp.arange(chunks * num_nodes)
  idx = jnp.minimum(node, num_prior - 1)
  node_log_w = jnp.where(node < num_prior, log_w[idx], none).reshape(chunks, num_nodes)
  node_scale = scale_sq[idx].reshape(chunks, num_nodes, -1)
  share = jax.nn.logsumexp(node_log_w, -1) - jax.nn.logsumexp(log_w)
  tail = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (chunks,) + a.shape[1:]),
                                params.prior_tail)
  tail = tail._replace(const=jnp.where(jnp.arange(chunks) == 0, tail.const, none))
  inputs = (jnp.broadcast_to(df, (chunks,) + df.shape),
            jnp.broadcast_to(loc, (chunks,) + loc.shape), node_scale, node_log_w)
  chunk0_last = lambda a: jnp.roll(a, -1, axis=0)
  return jax.tree_util.tree_map(chunk0_last, (inputs, share, tail))


@functools.partial(compiler.jit, static_argnames=("differentiable",))
def log_predictive(params: Params, x, differentiable: bool = False):
  """(class (M, K) log p(x | D_k), prior (M,) log p(x)).

  Each class is scored by the cheapest branch valid for it (``_block_with_tails``): a
  class with a narrow posterior of gamma costs about one diagonal-model evaluation, not
  P of them. The prior is scored by the same compiled code, as pseudo-classes
  (``_prior_pseudo_classes``), so the scorer holds one copy of the branches. Classes go
  one at a time: each takes its own branch and expansion order (forced blocks of 2-30
  classes ran 2.6-4.6x slower at K = 30, D = 8). Together, the two changes made warm
  scoring 2.0-2.7x faster at K = 200, D = 256 (benchmarks/RESULTS.md, session 17). The
  prior's density is +inf where ``prior_density_is_infinite``.

  ``differentiable`` (static): points on the class grids are summed over all P nodes
  instead of by the series, whose loop has a value-dependent trip count that reverse-mode
  differentiation cannot go through (up to P times the work; the same densities up to
  the series' 1e-5 nats); points off them take the per-point path either way.
  """
  num_nodes = params.class_scale_sq.shape[1]
  prior_inputs, share, prior_tail = _prior_pseudo_classes(params, num_nodes)
  num_chunks = share.shape[0]
  class_inputs = (params.class_df, params.class_loc, params.class_scale_sq,
                  params.class_log_weights)
  terms = mixture_terms(*(jnp.concatenate(pair) for pair in zip(prior_inputs, class_inputs)))
  terms = terms._replace(node_const=terms.node_const.at[:num_chunks].add(share[:, None]))
  tails = jax.tree_util.tree_map(lambda p, c: jnp.concatenate([p, c]), prior_tail,
                                 params.class_tail)
  # A class whose posterior of u is wide is far from Gaussian, and its class grid (13
  # nodes) is then off by up to 1e-2 nats; it is scored by the per-point path instead.
  wide = jnp.concatenate([jnp.zeros(num_chunks, bool),
                          params.class_tail.width > _WIDE_POSTERIOR])
  # On the per-point path the prior needs only its last pseudo-class (chunk 0); the
  # others then add nothing. Reverse-mode differentiation needs a static loop start.
  prior_far = jnp.any(_tilt_needs_point_grid(x, params.prior_tail))
  first = 0 if differentiable else jnp.where(prior_far, num_chunks - 1, 0)
  lp = blocks.map_class_blocks(
      functools.partial(_block_with_tails, x, num_nodes=QuadratureOptions().tail_nodes,
                        exact=differentiable),
      (terms, tails, wide), 1, first)
  ran = jnp.arange(num_chunks) >= first
  prior_lp = jax.nn.logsumexp(jnp.where(ran, lp[:, :num_chunks], _no_mass(lp.dtype)), -1)
  return lp[:, num_chunks:], jnp.where(prior_density_is_infinite(params, x), jnp.inf, prior_lp)


@compiler.jit
def log_predictive_exact(params: Params, x):
  """Every class (and the prior) summed over all its fixed grid nodes, for every point:
  the reference of the series expansion for points on the grids. Not a reference for
  points that tilt a posterior of gamma off its grid (``TailTerms``): there it misses
  mass that ``log_predictive`` integrates per point."""
  num_classes, num_nodes, dim = params.class_scale_sq.shape
  terms = mixture_terms(params.class_df, params.class_loc, params.class_scale_sq,
                        params.class_log_weights)
  size = blocks.class_block_size(x.shape[0], num_classes, _SERIES_PAIR_ELEMENTS * dim)
  class_lp = blocks.map_class_blocks(functools.partial(_exact_block, x), terms, size)
  prior_terms = mixture_terms(*(a[None] for a in _prior_mixture(params)))
  prior_lp = _exact_block(x, prior_terms)[:, 0]
  return class_lp, jnp.where(prior_density_is_infinite(params, x), jnp.inf, prior_lp)
