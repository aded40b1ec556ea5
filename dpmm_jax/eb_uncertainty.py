"""Standard errors of the empirical-Bayes hyperparameters of the hierarchical models.

The hierarchical fits (``full``, ``diag``, ``coupled``) have no mean-field error to
correct (their class posteriors are exact conjugate updates, so LRVB = MFVB there). What
they do leave out is the uncertainty of the hyperparameters EM estimates. Their
observed information is the negative Hessian of the log marginal likelihood at the EM
optimum, taken by ``jax.hessian`` in an unconstrained chart:

  full:    t = (log(nu0 - D - 1), log kappa0)
  diag:    t = (log nu0_d, log kappa0_d), d = 1..D  (separable: a 2 x 2 block per d)
  coupled: t = (log nu0_d, log kappa0_d, log alpha0)

``Cov(t) ~ [-d^2 log p(X | t) / dt dt^T]^-1`` (the asymptotic analogue of LRVB: the
observed information that supplemented EM reports, Meng and Rubin 1991). A
concentration EM left on its cap (optimum at infinity: tied covariances, or class means
no more spread than their noise) gets an infinite standard error and is flagged; the
others are conditioned on it.

These intervals are conditional on the plug-in mu0 and Sigma0 (the paper's moment
estimates from the same data), and are too narrow when Sigma0 is uncertain (measured in
``docs/results/lrvb_hyper_coverage.md``). ``prior_moments=True`` corrects for that with a
two-step M-estimator sandwich over the classes, the independent units: the estimating
equations per class are the scores of its log marginal likelihood in t and the moment
equations of mu0 and Sigma0 (their sums over classes are zero at the estimates), so

  Cov(t, mu0, Sigma0) ~ A^-1 B A^-T,  A = d(sum_k psi_k)/d theta,  B = sum_k psi_k psi_k^T.
"""
import functools
from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import compiler
from dpmm_jax import precision
from dpmm_jax import quadrature
from dpmm_jax.conjugate import niw, nix
from dpmm_jax.models import coupled, diag, full

MODELS = ("full", "diag", "coupled")
# A hyperparameter within this relative distance of its cap counts as on it.
_CAP_RTOL = 1e-3


class HyperStandardErrors(NamedTuple):
  """Standard errors of the EB hyperparameters in their unconstrained chart.

  names: tuple of P parameter names (e.g. "log(nu0-D-1)", "log kappa0[3]").
  estimate: (P,) chart values t at the EM optimum.
  standard_error: (P,) sqrt of the diagonal of the covariance (inf on a cap, or where
    the information is not positive definite).
  covariance: (P, P) (rows/columns of capped parameters are inf on the diagonal, 0 off it).
  at_cap: (P,) bool, the parameter is on its cap (optimum at infinity).
  ok: the (uncapped) observed information is positive definite.
  prior_moments: whether mu0 and Sigma0's estimation uncertainty is included (sandwich).
  """
  names: Tuple[str, ...]
  estimate: np.ndarray
  standard_error: np.ndarray
  covariance: np.ndarray
  at_cap: np.ndarray
  ok: bool
  prior_moments: bool

  def interval(self, level: float = 0.95):
    """(lower, upper) Wald intervals in the chart (normal quantile)."""
    from scipy.stats import norm  # scipy is a dependency of the library's tests only
    z = float(norm.ppf(0.5 + 0.5 * level))
    return self.estimate - z * self.standard_error, self.estimate + z * self.standard_error


# ----------------------------------------------------------------- chart per model
def _full_chart(hyper: full.Hyper):
  dim = hyper.loc.shape[-1]
  return jnp.stack([jnp.log(hyper.df - dim - 1.0), jnp.log(hyper.mean_concentration)])


def _full_hyper(t, hyper: full.Hyper, loc=None, mean_cov=None):
  dim = hyper.loc.shape[-1]
  return hyper._replace(df=jnp.exp(t[0]) + dim + 1.0, mean_concentration=jnp.exp(t[1]),
                        loc=hyper.loc if loc is None else loc,
                        mean_cov=hyper.mean_cov if mean_cov is None else mean_cov)


def _full_class_lml(hyper: full.Hyper, stats):
  prior = niw.prior(hyper.loc, hyper.mean_cov, hyper.df, hyper.mean_concentration)
  post = niw.posterior(prior, stats.count, stats.mean, stats.scatter)
  return niw.log_marginal_likelihood(prior, post, stats.count)            # (K,)


def _diag_class_lml(hyper, stats):
  prior = nix.prior(hyper.loc, hyper.var, hyper.df, hyper.mean_concentration)
  return nix.log_evidence(prior, stats.count, stats.mean, stats.sq_dev)   # (K, D)


def _cap_flags(model, hyper, df_cap, kappa_cap, shape_cap):
  near = lambda value, cap: np.asarray(value) >= (1.0 - _CAP_RTOL) * cap
  if model == "full":
    dim = hyper.loc.shape[-1]
    return np.array([near(hyper.df - dim - 1.0, df_cap),
                     near(hyper.mean_concentration, kappa_cap)])
  flags = np.concatenate([near(hyper.df, df_cap), near(hyper.mean_concentration, kappa_cap)])
  if model == "coupled":
    flags = np.concatenate([flags, [near(hyper.gamma_shape, shape_cap)]])
  return flags


def _names(model, dim):
  if model == "full":
    return ("log(nu0-D-1)", "log kappa0")
  names = tuple(f"log nu0[{d}]" for d in range(dim)) + tuple(
      f"log kappa0[{d}]" for d in range(dim))
  return names + (("log alpha0",) if model == "coupled" else ())


def _invert(info, at_cap):
  """Covariance from an information matrix, capped parameters removed (inf SE)."""
  p = info.shape[0]
  free = np.flatnonzero(~at_cap)
  cov = np.zeros((p, p))
  ok = True
  if free.size:
    sub = info[np.ix_(free, free)]
    sub = 0.5 * (sub + sub.T)
    eig = np.linalg.eigvalsh(sub) if np.all(np.isfinite(sub)) else np.array([-1.0])
    if eig.min() > 0:
      cov[np.ix_(free, free)] = np.linalg.inv(sub)
    else:
      ok = False
      cov[np.ix_(free, free)] = np.nan
  cov[at_cap, at_cap] = np.inf
  return cov, ok


def _se(cov):
  d = np.diagonal(cov).copy()
  return np.where(np.isfinite(d) & (d >= 0), np.sqrt(np.where(d >= 0, d, 0.0)), np.inf)


# ------------------------------------------------------------ observed information
@compiler.jit
def _full_information(hyper: full.Hyper, stats):
  f = lambda t: jnp.sum(_full_class_lml(_full_hyper(t, hyper), stats))
  return -jax.hessian(f)(_full_chart(hyper))


@compiler.jit
def _diag_information(hyper: diag.Hyper, stats):
  """(D, 2, 2) per-dimension blocks: log p is a sum over d of functions of (t1_d, t2_d),
  so two Hessian-vector products with all-ones directions give every block."""
  t = jnp.stack([jnp.log(hyper.df), jnp.log(hyper.mean_concentration)])          # (2, D)
  f = lambda t_: jnp.sum(_diag_class_lml(hyper._replace(df=jnp.exp(t_[0]),
                                                        mean_concentration=jnp.exp(t_[1])),
                                         stats))
  grad = jax.grad(f)
  ones, zeros = jnp.ones_like(t[0]), jnp.zeros_like(t[0])
  col0 = jax.jvp(grad, (t,), (jnp.stack([ones, zeros]),))[1]                     # (2, D)
  col1 = jax.jvp(grad, (t,), (jnp.stack([zeros, ones]),))[1]
  return -jnp.stack([col0, col1], -1).transpose(1, 0, 2)                         # (D, 2, 2)


@functools.partial(compiler.jit, static_argnames=("options",))
def _coupled_information(hyper: coupled.Hyper, stats, options):
  grid = coupled.class_grid(hyper, stats, options.em_nodes, options.em_half_width)
  grid = jax.tree_util.tree_map(jax.lax.stop_gradient, grid)   # the integral, not the grid

  def f(t):
    dim = hyper.loc.shape[-1]
    h = hyper._replace(df=jnp.exp(t[:dim]), mean_concentration=jnp.exp(t[dim:2 * dim]),
                       gamma_shape=jnp.exp(t[-1]))
    return jnp.sum(quadrature.log_integral(grid, coupled.class_log_joint(h, stats,
                                                                         grid.nodes)))

  t0 = jnp.concatenate([jnp.log(hyper.df), jnp.log(hyper.mean_concentration),
                        jnp.log(hyper.gamma_shape)[None]])
  grad = jax.grad(f)
  hvp = lambda v: jax.jvp(grad, (t0,), (v,))[1]
  return -jax.lax.map(hvp, jnp.eye(t0.shape[0], dtype=t0.dtype)), t0   # column by column


# ------------------------------------------------------------- sandwich (mu0, Sigma0)
def _vech_basis(dim, dtype):
  rows, cols = np.tril_indices(dim)
  basis = np.zeros((rows.size, dim, dim))
  basis[np.arange(rows.size), rows, cols] = 1.0
  basis[np.arange(rows.size), cols, rows] = 1.0
  return jnp.asarray(basis, dtype), rows, cols


@compiler.jit
@precision.float32_matmuls
def _full_sandwich_pieces(hyper: full.Hyper, stats):
  """Per-class estimating functions psi_k (K, P) and A = d sum_k psi_k / d theta."""
  dim = hyper.loc.shape[-1]
  basis, rows, cols = _vech_basis(dim, hyper.loc.dtype)
  theta0 = jnp.concatenate([_full_chart(hyper), hyper.loc, hyper.mean_cov[rows, cols]])

  def psi(theta):
    t, loc, vech = theta[:2], theta[2:2 + dim], theta[2 + dim:]
    mean_cov = jnp.einsum("j,jde->de", vech, basis)
    scores = jax.jacfwd(lambda t_: _full_class_lml(_full_hyper(t_, hyper, loc, mean_cov),
                                                   stats))(t)               # (K, 2)
    m_loc = stats.count[:, None] * (stats.mean - loc)                       # (K, D)
    m_cov = (stats.scatter - stats.count[:, None, None] * mean_cov)[:, rows, cols]
    return jnp.concatenate([scores, m_loc, m_cov], -1)                      # (K, P)

  per_class = psi(theta0)
  a = jax.jacfwd(lambda th: jnp.sum(psi(th), 0))(theta0)
  return per_class, a


@compiler.jit
def _diag_sandwich_pieces(hyper: diag.Hyper, stats):
  """(K, D, 4) per-class, per-dimension psi and (D, 4, 4) A blocks (separable in d),
  theta_d = (log nu0_d, log kappa0_d, mu0_d, s0_d^2)."""
  theta0 = jnp.stack([jnp.log(hyper.df), jnp.log(hyper.mean_concentration), hyper.loc,
                      hyper.var], -1)                                        # (D, 4)

  def psi(theta):
    def lml(tt):
      h = hyper._replace(df=jnp.exp(tt[:, 0]), mean_concentration=jnp.exp(tt[:, 1]),
                         loc=theta[:, 2], var=theta[:, 3])
      return _diag_class_lml(h, stats)                                      # (K, D)
    # d lml_kd / d t_d: separable, so a jvp per chart coordinate gives the diagonal.
    e = lambda j: jnp.zeros_like(theta[:, :2]).at[:, j].set(1.0)
    s0 = jax.jvp(lml, (theta[:, :2],), (e(0),))[1]
    s1 = jax.jvp(lml, (theta[:, :2],), (e(1),))[1]
    m_loc = stats.count[:, None] * (stats.mean - theta[:, 2])
    m_var = stats.sq_dev - stats.count[:, None] * theta[:, 3]
    return jnp.stack([s0, s1, m_loc, m_var], -1)                             # (K, D, 4)

  per_class = psi(theta0)
  total = lambda th: jnp.sum(psi(th), 0)                                     # (D, 4)
  cols = [jax.jvp(total, (theta0,), (jnp.zeros_like(theta0).at[:, j].set(1.0),))[1]
          for j in range(4)]
  return per_class, jnp.stack(cols, -1)                                      # (D, 4, 4)


@precision.float32_matmuls
def _sandwich(per_class, a, keep):
  """A^-1 B A^-T restricted to the ``keep`` parameters (others: fixed moment rows)."""
  b = per_class.T @ per_class
  a_inv = np.linalg.inv(a)
  cov = a_inv @ b @ a_inv.T
  return cov[np.ix_(keep, keep)]


def _capped_sandwich(per_class, a, at_cap):
  """Sandwich covariance of the p = at_cap.size leading parameters, capped ones held fixed.

  per_class: (K, n) per-class estimating functions psi_k; a: (n, n) their Jacobian A, the
  first p coordinates the parameters and the rest fixed moment rows (mu0, Sigma0).
  Capped coordinates are dropped (their rows and columns) and get variance inf.
  Returns (cov (p, p), ok: all free entries finite).
  """
  p = at_cap.size
  free = np.flatnonzero(~at_cap)
  keep = np.concatenate([free, np.arange(p, a.shape[0])])
  sub = _sandwich(per_class[:, keep], a[np.ix_(keep, keep)], np.arange(free.size))
  cov = np.zeros((p, p))
  cov[np.ix_(free, free)] = sub
  cov[at_cap, at_cap] = np.inf
  return cov, bool(np.all(np.isfinite(sub)))


# ----------------------------------------------------------------------------- public
def hyperparameter_standard_errors(model: str, stats, hyper, *, prior_moments: bool = False,
                                   df_cap: float = 1e6, kappa_cap: float = full.KAPPA_CAP,
                                   shape_cap: float = 1e6,
                                   options: coupled.QuadratureOptions = coupled.QuadratureOptions()
                                   ) -> HyperStandardErrors:
  """Observed-information standard errors of the EM hyperparameters.

  Args:
    model: "full", "diag" or "coupled".
    stats: the SufficientStats the model was fitted on (full statistics for "full").
    hyper: the fitted ``Hyper`` (``Params.hyper``).
    prior_moments: also account for the estimation of mu0 and Sigma0 (sandwich over
      classes; "full" and "diag" only; "full" costs O((D^2/2)^2) memory).
    df_cap, kappa_cap, shape_cap: the caps EM used (a value on its cap gets SE inf).
    options: quadrature options of the coupled model.
  Returns:
    HyperStandardErrors.
  Raises:
    ValueError: unknown model, missing full statistics, prior_moments for "coupled".
  """
  if model not in MODELS:
    raise ValueError(f"model must be one of {MODELS}, got {model!r}.")
  if model == "full" and stats.scatter is None:
    raise ValueError("The full model's standard errors need full statistics (full=True).")
  if prior_moments and model == "coupled":
    raise ValueError("prior_moments=True is implemented for 'full' and 'diag' only.")
  dim = stats.dim
  at_cap = _cap_flags(model, hyper, df_cap, kappa_cap, shape_cap)
  names = _names(model, dim)
  if model == "full":
    estimate = np.asarray(_full_chart(hyper), np.float64)
    if prior_moments:
      per_class, a = (np.asarray(v, np.float64) for v in _full_sandwich_pieces(hyper, stats))
      cov, ok = _capped_sandwich(per_class, a, at_cap)
    else:
      cov, ok = _invert(np.asarray(_full_information(hyper, stats), np.float64), at_cap)
  elif model == "diag":
    estimate = np.concatenate([np.log(np.asarray(hyper.df, np.float64)),
                               np.log(np.asarray(hyper.mean_concentration, np.float64))])
    cov = np.zeros((2 * dim, 2 * dim))
    ok = True
    if prior_moments:
      per_class, a = (np.asarray(v, np.float64) for v in _diag_sandwich_pieces(hyper, stats))
    else:
      blocks = np.asarray(_diag_information(hyper, stats), np.float64)        # (D, 2, 2)
    for d in range(dim):
      idx = np.array([d, dim + d])
      caps = at_cap[idx]
      if prior_moments:
        block, ok_d = _capped_sandwich(per_class[:, d], a[d], caps)
      else:
        block, ok_d = _invert(blocks[d], caps)
      cov[np.ix_(idx, idx)] = block
      ok = ok and ok_d
  else:
    info, t0 = _coupled_information(hyper, stats, options)
    estimate = np.asarray(t0, np.float64)
    cov, ok = _invert(np.asarray(info, np.float64), at_cap)
  return HyperStandardErrors(names, estimate, _se(cov), cov, at_cap, ok, prior_moments)
