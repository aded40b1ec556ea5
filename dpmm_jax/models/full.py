"""Hierarchical Gaussian DPMM with full covariances and an NIW prior (paper, app. 13).

Empirical Bayes sets mu0 = global mean and Sigma0 = pooled within-class covariance; EM
learns kappa0 (closed form) and nu0 (generalized Newton in nu0 - D - 1).
"""
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.scipy.linalg import cho_solve, eigh_tridiagonal, solve_triangular

from dpmm_jax import blocks
from dpmm_jax import compiler
from dpmm_jax import linalg
from dpmm_jax import precision
from dpmm_jax import special
from dpmm_jax import validation as checks
from dpmm_jax import em
from dpmm_jax import newton
from dpmm_jax import stats as stats_lib
from dpmm_jax import student_t
from dpmm_jax.conjugate import niw
from dpmm_jax.models import diag

# Cap used when moving kappa0 towards infinity (class means no more spread than noise).
KAPPA_CAP = diag.KAPPA_CAP


class Hyper(NamedTuple):
  """loc (D,) mu0; mean_cov (D, D) Sigma0 = E[Sigma_k]; df () nu0 > D + 1;
  mean_concentration () kappa0."""
  loc: jax.Array
  mean_cov: jax.Array
  df: jax.Array
  mean_concentration: jax.Array


class Params(NamedTuple):
  """Fitted model: hyper; class predictive (K-batched niw.Predictive); prior predictive;
  log_counts (K,)."""
  hyper: Hyper
  class_pred: niw.Predictive
  prior_pred: niw.Predictive
  log_counts: jax.Array


# Params fields with a leading class axis (``em.run_jitted_fit`` cuts them to K).
CLASS_FIELDS = ("class_pred", "log_counts")


def init_hyper(stats: stats_lib.SufficientStats, df=None, mean_concentration=None) -> Hyper:
  """The paper's initialisation: nu0 ~ mean N_k (kept above D + 1), kappa0 small."""
  dim = stats.dim
  dtype = stats.mean.dtype
  if df is None:
    df = jnp.maximum(stats_lib.mean_class_count(stats), dim + 2.0)
  if mean_concentration is None:
    mean_concentration = 1e-3
  return Hyper(stats_lib.global_mean(stats), stats_lib.pooled_covariance(stats),
               jnp.asarray(df, dtype), jnp.asarray(mean_concentration, dtype))


def _prior(hyper: Hyper) -> niw.NIW:
  return niw.prior(hyper.loc, hyper.mean_cov, hyper.df, hyper.mean_concentration)


def _posterior(hyper: Hyper, stats):
  return niw.posterior(_prior(hyper), stats.count, stats.mean, stats.scatter)


# Elements of one class block's (kb, D, D) temporaries in the E-step / predictive pass.
_EM_BLOCK_BUDGET = blocks.DEFAULT_BUDGET


def _em_block_size(num_classes: int, dim: int) -> int:
  return blocks.class_block_size(1, num_classes, dim * dim, _EM_BLOCK_BUDGET)


def _class_terms(hyper: Hyper, stats):
  """Per-class E-step terms (maha (K,), df statistic t (K,), log marginal (K,)),
  computed one block of classes at a time (one block's (kb, D, D) temporaries)."""
  dim = stats.dim
  prior = _prior(hyper)

  def block(per_class):
    count, mean, scatter = per_class
    post = niw.posterior(prior, count, mean, scatter)
    chol = jnp.linalg.cholesky(post.scale)
    d = post.loc - hyper.loc
    maha = dim / post.mean_concentration + post.df * jnp.sum(
        d * cho_solve((chol, True), d[..., None])[..., 0], -1)
    stat = niw.df_statistic(post, hyper.mean_cov)
    lml = niw.log_marginal_likelihood(prior, post, count)
    return maha, stat, lml

  return blocks.map_blocks(block, (stats.count, stats.mean, stats.scatter),
                           _em_block_size(stats.num_classes, dim))


def _m_step(hyper: Hyper, count, maha, stat, dim, df_cap, newton_tol, newton_max_iter):
  """kappa0 in closed form and nu0 by Newton from the (K,) E-step terms (empty classes,
  count 0, left out)."""
  maha, stat = (stats_lib.nonempty_terms(count, a) for a in (maha, stat))
  num_classes = stats_lib.num_nonempty(count)
  kappa0 = num_classes * dim / jnp.sum(maha)                        # paper 13.2 (with D)
  derivs = functools.partial(niw.df_derivatives, stat_sum=jnp.sum(stat),
                             num_classes=num_classes, dim=dim)
  df, info = newton.maximize(derivs, hyper.df, offset=dim + 1.0, upper=df_cap,
                             tol=newton_tol, max_iter=newton_max_iter)
  return hyper._replace(df=df, mean_concentration=kappa0), info


def em_step(hyper: Hyper, stats, *, df_cap=1e6, newton_tol=1e-6, newton_max_iter=100):
  """One EM iteration: E-step over classes, closed-form kappa0, Newton for nu0.

  The E-step runs over blocks of classes (``blocks.map_blocks``), so its memory is one
  block's (kb, D, D) temporaries on top of the statistics. ``fit`` uses the equivalent
  spectral iteration (``spectral_summary``), whose iterations cost O(K D).
  """
  maha, stat, _ = _class_terms(hyper, stats)
  return _m_step(hyper, stats.count, maha, stat, stats.dim, df_cap, newton_tol,
                 newton_max_iter)


@compiler.jit
def log_marginal_likelihood(hyper: Hyper, stats):
  """log p(X | y, hyper) summed over classes (paper 13.4)."""
  return jnp.sum(stats_lib.nonempty_terms(stats.count, _class_terms(hyper, stats)[2]))


# ------------------------------------------------------------- spectral EM iteration
class SpectralSummary(NamedTuple):
  """What EM needs from the statistics, reduced once so that iterations cost O(K D).

  During EM only nu0 and kappa0 change; mu0 and Sigma0 = L0 L0^T stay fixed. In the
  whitened coordinates of Sigma0 the posterior scale of class k is

      B_k = L0^-1 Psi'_k L0^-T = c I + T_k + s_k e_k e_k^T,
      c = nu0 - D - 1,  T_k = L0^-1 S_k L0^-T,  e_k = L0^-1 (xbar_k - mu0),
      s_k = kappa0 N_k / (kappa0 + N_k),

  so every E-step quantity is a function of the eigenvalues lambda_k of T_k and of the
  scalar functions g_k(c) = e_k^T (c I + T_k)^-1 e_k and h_k(c) = e_k^T (c I + T_k)^-2 e_k
  (Sherman-Morrison for the rank-one term). g and h come from a tridiagonal form of T_k
  in which e_k is the first basis vector: g_k(c) = |e_k|^2 [(c I + H_k)^-1]_11, a
  continued fraction evaluated in O(D).

  Attributes:
    count: (K,) N_k.
    eigenvalues: (K, D) eigenvalues of T_k (clipped at 0).
    diagonal: (K, D) diagonal of the tridiagonal H_k.
    off_diagonal: (K, D - 1) its sub-diagonal.
    mean_sq: (K,) |e_k|^2.
  """
  count: jax.Array
  eigenvalues: jax.Array
  diagonal: jax.Array
  off_diagonal: jax.Array
  mean_sq: jax.Array


# From this dimension on, eigenvalues come from the tridiagonal form (bisection, cheap to
# run, ~3 s to compile) instead of a second dense LAPACK reduction (cheap to compile).
_TRIDIAGONAL_EIGVALS_MIN_DIM = 256


@precision.float32_matmuls
def spectral_summary(stats, loc, mean_cov) -> SpectralSummary:
  """Reduces full statistics for the EM iterations (one O(K D^3) pass, in class blocks).

  Args:
    stats: full SufficientStats.
    loc: (D,) mu0; mean_cov: (D, D) Sigma0.
  Returns:
    SpectralSummary.
  """
  dim = stats.dim
  white = solve_triangular(jnp.linalg.cholesky(mean_cov), jnp.eye(dim, dtype=mean_cov.dtype),
                           lower=True)                             # L0^-1

  def block(per_class):
    mean, scatter = per_class
    t = jnp.einsum("ij,kjl,ml->kim", white, scatter, white)        # (kb, D, D)
    t = 0.5 * (t + jnp.swapaxes(t, -1, -2))
    e = (mean - loc) @ white.T                                       # (kb, D)
    norm = jnp.sqrt(jnp.sum(e * e, -1))
    # Householder reflection R with R e = -sign(e_1) |e| e_1; R T R keeps the spectrum.
    sign = jnp.where(e[:, 0] >= 0, 1.0, -1.0)
    v = e.at[:, 0].add(sign * norm)
    vv = jnp.sum(v * v, -1)
    u = v * jnp.where(vv > 0, jnp.sqrt(2.0 / jnp.where(vv > 0, vv, 1.0)), 0.0)[:, None]
    tu = jnp.einsum("kij,kj->ki", t, u)
    utu = jnp.sum(u * tu, -1)
    w = tu - 0.5 * utu[:, None] * u
    t = t - u[:, :, None] * w[:, None, :] - w[:, :, None] * u[:, None, :]
    # Tridiagonal form whose reflectors leave e_1 fixed (LAPACK sytrd, lower).
    _, diagonal, off_diagonal, _ = jax.lax.linalg.tridiagonal(t, lower=True)
    if dim >= _TRIDIAGONAL_EIGVALS_MIN_DIM:   # O(D^2) bisection on the tridiagonal
      eig = jax.vmap(lambda d_, e_: eigh_tridiagonal(d_, e_, eigvals_only=True))(
          diagonal, off_diagonal)
    else:                                     # LAPACK: slower to run, faster to compile
      eig = jnp.linalg.eigvalsh(t)
    return jnp.maximum(eig, 0.0), diagonal, off_diagonal, norm * norm

  eig, diagonal, off_diagonal, mean_sq = blocks.map_blocks(
      block, (stats.mean, stats.scatter), _em_block_size(stats.num_classes, dim))
  return SpectralSummary(stats.count, eig, diagonal, off_diagonal, mean_sq)


def _resolvent_first(c, summary: SpectralSummary):
  """(g, h) = (e^T (cI + T)^-1 e, e^T (cI + T)^-2 e) per class, by the continued fraction
  t_D = c + a_D, t_i = c + a_i - b_i^2 / t_{i+1} (the pivots of cI + H from the bottom,
  all positive since cI + H is positive definite); g = |e|^2 / t_1 and h = -dg/dc."""
  a = jnp.moveaxis(summary.diagonal, -1, 0)                        # (D, K)
  b2 = jnp.moveaxis(summary.off_diagonal, -1, 0) ** 2              # (D - 1, K)
  t_last = c + a[-1]

  def step(carry, inputs):
    t, dt = carry
    a_i, b2_i = inputs
    new_t = c + a_i - b2_i / t
    new_dt = 1.0 + b2_i * dt / (t * t)
    return (new_t, new_dt), None

  (t1, dt1), _ = jax.lax.scan(step, (t_last, jnp.ones_like(t_last)), (a[:-1], b2),
                              reverse=True)
  return summary.mean_sq / t1, summary.mean_sq * dt1 / (t1 * t1)


def _spectral_terms(hyper: Hyper, summary: SpectralSummary, dim: int):
  """Per-class (maha, df statistic t, log|Psi'| - log|Psi0|, N log|Psi'| - N log|Sigma0|)."""
  n, lam = summary.count, summary.eigenvalues
  c = hyper.df - dim - 1.0
  kappa = hyper.mean_concentration + n
  nu = hyper.df + n
  s = hyper.mean_concentration * n / kappa
  g, h = _resolvent_first(c, summary)
  rank_one = jnp.log1p(s * g)
  maha = dim / kappa + nu * (n / kappa) ** 2 * g / (1.0 + s * g)
  # log|B'| - tr B' + D with B' = nu' Sigma0 Psi'^-1, per eigenvalue (cancellation-free):
  rho = (n[:, None] + dim + 1.0 - lam) / (c + lam)                 # nu'/(c + lam) - 1
  eig_part = jnp.sum(jnp.log1p(rho) - rho, -1)
  i = jnp.arange(dim, dtype=nu.dtype)
  z = 0.5 * (nu[..., None] - i)
  digamma_gap = jnp.sum(special.log_minus_digamma(z) - jnp.log1p(-i / nu[..., None]), -1)
  stat = eig_part - rank_one + nu * s * h / (1.0 + s * g) - digamma_gap
  log_det_ratio = jnp.sum(jnp.log1p(lam / c), -1) + rank_one       # log|Psi'| - log|Psi0|
  log_det_white = jnp.sum(jnp.log(c + lam), -1) + rank_one         # log|Psi'| - log|Sigma0|
  return maha, stat, log_det_ratio, log_det_white


def _spectral_log_marginal(hyper: Hyper, summary: SpectralSummary, dim: int,
                           log_det_mean_cov):
  """(K,) log p(X_k | hyper) = log Z' - log Z0 - N D/2 log(2 pi), with the nu log|Psi|
  terms grouped as nu0 (log|Psi'| - log|Psi0|) + N log|Psi'| (no large cancellation)."""
  n = summary.count
  _, _, log_det_ratio, _ = _spectral_terms(hyper, summary, dim)
  kappa0, nu0 = hyper.mean_concentration, hyper.df
  c = nu0 - dim - 1.0
  lam = summary.eigenvalues
  # log Gamma_D(nu'/2) - log Gamma_D(nu0/2) + N D/2 log 2 - N/2 log|Psi'| with the large
  # parts paired so that nothing cancels at nu0 ~ 1e6 (the tied limit): with
  # z_i = (nu0 + 1 - i)/2, lgamma(z_i + N/2) - lgamma(z_i) = excess_i + N/2 log z_i, and
  # N/2 [log(2 z_i) - log(c + lam_i)] = N/2 log1p((D + 2 - i - lam_i) / (c + lam_i)).
  i = jnp.arange(1, dim + 1, dtype=lam.dtype)
  z = 0.5 * (nu0 + 1.0 - i)
  excess = jnp.sum(special.log_gamma_ratio_excess(z, 0.5 * n[:, None]), -1)
  paired = jnp.sum(jnp.log1p((dim + 2.0 - i - lam) / (c + lam)), -1)
  g, _ = _resolvent_first(c, summary)
  rank_one = jnp.log1p(kappa0 * n / (kappa0 + n) * g)              # log(1 + s_k g_k(c))
  return (-0.5 * dim * jnp.log1p(n / kappa0) + excess
          + 0.5 * n * (paired - rank_one - log_det_mean_cov)
          - 0.5 * nu0 * log_det_ratio - 0.5 * n * dim * special.LOG_2PI)


def extrapolation_bounds(dim: int, df_cap=1e6):
  """{field: (lower, upper)} of the concentrations SQUAREM extrapolates (``em.run``)."""
  return {"df": (dim + 1.0, dim + 1.0 + df_cap), "mean_concentration": (0.0, KAPPA_CAP)}


def spectral_em_functions(mean_cov, dim: int, df_cap=1e6):
  """(step, lml) of the spectral EM iteration for ``em.run`` on a SpectralSummary reduced
  with Sigma0 = ``mean_cov``: step(hyper, summary) -> (hyper, NewtonInfo) and
  lml(hyper, summary) -> (K,) log marginal likelihood terms (0 for an empty class)."""
  log_det_mean_cov = linalg.chol_log_det(jnp.linalg.cholesky(mean_cov))

  def step(hyper, summary):
    maha, stat, _, _ = _spectral_terms(hyper, summary, dim)
    return _m_step(hyper, summary.count, maha, stat, dim, df_cap, 1e-6, 100)

  def lml(hyper, summary):
    return stats_lib.nonempty_terms(
        summary.count, _spectral_log_marginal(hyper, summary, dim, log_det_mean_cov))

  return step, lml


def fit_hyper(stats, *, df=None, mean_concentration=None, tol=1e-6, max_iter=100,
              df_cap=1e6, accelerate=True, trace_length=None):
  """Runs EM from the paper's initialisation; returns (Hyper, EMInfo).

  The statistics are reduced once by ``spectral_summary`` (O(K D^3), in class blocks);
  each EM iteration then costs O(K D) and gives the same iterates as ``em_step``.
  ``accelerate`` (default True; may be traced) turns on SQUAREM in ``em.run``.
  """
  init = init_hyper(stats, df, mean_concentration)
  dim = stats.dim
  summary = spectral_summary(stats, init.loc, init.mean_cov)
  step, lml = spectral_em_functions(init.mean_cov, dim, df_cap)
  # Boundary proposal for em.run, the diagonal model's with nu0's cap shifted by D + 1:
  # nu0 (kappa0) moves onto D + 1 + df_cap (KAPPA_CAP) when the slope there is positive.
  caps = diag.boundary_caps(dim + 1.0 + df_cap, KAPPA_CAP)
  return em.run(step, lml, init, summary, tol=tol, max_iter=max_iter, caps=caps,
                extrapolate=extrapolation_bounds(dim, df_cap), accelerate=accelerate,
                trace_length=trace_length)


@compiler.jit
def params_from_hyper(hyper: Hyper, stats) -> Params:
  """Predictive Student-t of every class (computed one class block at a time)."""
  prior = _prior(hyper)

  def block(per_class):
    count, mean, scatter = per_class
    return niw.predictive(niw.posterior(prior, count, mean, scatter))

  class_pred = blocks.map_blocks(block, (stats.count, stats.mean, stats.scatter),
                                 _em_block_size(stats.num_classes, stats.dim))
  return Params(hyper, class_pred, niw.predictive(prior), jnp.log(stats.count))


_fit = em.jit_fit(fit_hyper, params_from_hyper)


def check_fit_arguments(stats, tol, max_iter, df, mean_concentration,
                        model: str = "full-covariance"):
  """Host-side checks of the NIW models' fit arguments (``full`` and ``lowrank``)."""
  if stats.scatter is None:
    raise ValueError(f"The {model} model needs full statistics (full=True).")
  checks.em_options(tol, max_iter)
  if df is not None and not float(df) > stats.dim + 1:
    raise ValueError(f"Initial df (nu0) must exceed D + 1 = {stats.dim + 1} for the NIW "
                     f"prior with E[Sigma] = Sigma0; got {df}.")
  checks.positive_or_none(mean_concentration, "mean_concentration")


def fit(stats, *, df=None, mean_concentration=None, tol=1e-6, max_iter=100, df_cap=1e6,
        accelerate=True):
  """Fits hyperparameters by EM and precomputes the predictives: (Params, EMInfo).

  ``accelerate``: SQUAREM-accelerated EM (default) or plain EM (False); same compiled fit,
  which also serves every max_iter up to 127 (``em.trace_length``).

  Raises:
    ValueError: missing full statistics, or an initial df <= D + 1 (the NIW prior with
      E[Sigma] = Sigma0 needs nu0 > D + 1).
  """
  check_fit_arguments(stats, tol, max_iter, df, mean_concentration)
  return em.run_jitted_fit(_fit, stats, df=df, mean_concentration=mean_concentration,
                           tol=tol, max_iter=max_iter, df_cap=df_cap, accelerate=accelerate,
                           class_fields=CLASS_FIELDS)


# ---------------------------------------------------------------------------- scoring
class InverseFactors(NamedTuple):
  """Inverses of the predictive scales' Cholesky factors (lower-triangular), for
  ``log_predictive(..., inverse=)``: class_inv (K, D, D); prior_inv (D, D)."""
  class_inv: jax.Array
  prior_inv: jax.Array


def inverse_factors(params: Params) -> InverseFactors:
  """The factors ``log_predictive`` inverts on every call, inverted once.

  Scoring many chunks of points with them saves an inversion of every class's factor per
  chunk: about D / (1.9 M) of an M-row chunk's multiply-adds, but less of its time (at
  K = 120, D = 768, M = 2048: 1.57-1.58 -> 1.36-1.39 s per chunk, against 0.41 s for the inversion
  alone; benchmarks/RESULTS.md, session 20). They take as much memory as the factors; the
  inversion runs in blocks of classes.
  """
  num_classes, dim = params.class_pred.loc.shape
  size = blocks.class_block_size(dim, num_classes, dim)
  return InverseFactors(
      blocks.map_blocks(linalg.triangular_inverse, params.class_pred.chol_scale, size),
      linalg.triangular_inverse(params.prior_pred.chol_scale))


def _mvt_block(x, pred: niw.Predictive, inv=None):
  """(M, kb) multivariate-t log densities for a block of classes (matrix products).

  ``x`` and ``pred.loc`` are centred on a common reference by the caller, so the
  subtraction of the two products loses nothing to a large common offset. ``inv``: the
  inverted factors (kb, D, D), or None to invert ``pred.chol_scale`` here.
  """
  dim = x.shape[-1]
  inv = linalg.triangular_inverse(pred.chol_scale) if inv is None else inv
  maha = linalg.triangular_mahalanobis_sq(x, pred.loc, inv)
  return student_t.mvt_log_density_from_mahalanobis(
      maha, pred.df[:, None], pred.log_normalizer[:, None], dim).T


def scoring_flops(num_points: int, num_classes: int, dim: int) -> float:
  """Multiply-add flops (2 per MAC) ``log_predictive`` runs in matrix products: the
  triangular inverses and the blocked triangular products (prior included)."""
  rows = sum((hi - lo) * hi for lo, hi in linalg.triangle_row_blocks(dim))
  per_class = 2.0 * num_points * rows + 2.0 * dim ** 3 / 3.0
  return per_class * (num_classes + 1)


@compiler.jit
def log_predictive(params: Params, x, inverse: Optional[InverseFactors] = None):
  """(class (M, K) log p(x | D_k), prior (M,) log p(x)).

  Per block of classes the Cholesky factors are inverted (``linalg.triangular_inverse``;
  or taken from ``inverse``, see ``inverse_factors``) and the Mahalanobis distances run
  as (M, D) x (D, D) products that skip the zero blocks of the triangle; temporaries are
  (kb, M, D) with kb set by ``blocks.class_block_size``.
  """
  num_classes, dim = params.class_pred.loc.shape
  ref = params.hyper.loc
  xc, m = linalg.pad_aliased_rows(x - ref)       # row counts like 2048 run slower
  centred = params.class_pred._replace(loc=params.class_pred.loc - ref)
  size = blocks.class_block_size(x.shape[0], num_classes, dim)
  class_inv = None if inverse is None else inverse.class_inv
  class_lp = blocks.map_class_blocks(lambda block: _mvt_block(xc, *block),
                                     (centred, class_inv), size)
  prior = params.prior_pred._replace(loc=params.prior_pred.loc - ref)
  prior_inv = None if inverse is None else inverse.prior_inv[None]
  prior_lp = _mvt_block(xc, jax.tree_util.tree_map(lambda a: a[None], prior), prior_inv)[:, 0]
  return class_lp[:m], prior_lp[:m]
