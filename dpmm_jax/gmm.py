"""Finite Bayesian Gaussian mixture: CAVI, LRVB covariances and a Gibbs sampler.

Model (K components, D features; the conjugate version of the model in the experiments
of ``../shared/papers/004``)::

    pi ~ Dirichlet(alpha),   (mu_k, Sigma_k) ~ NIW(m0, kappa0, nu0, Psi0),
    z_n ~ Categorical(pi),   x_n | z_n = k ~ N(mu_k, Sigma_k).

Mean-field family q(pi) q(mu, Sigma) q(z) = Dir(alpha') prod_k NIW_k prod_n Cat(phi_n),
fitted by coordinate ascent (CAVI) with the library's conjugate pieces: soft statistics
(``stats.from_responsibilities``) feed ``niw.posterior``; ``niw.expected_log_likelihood``
gives the responsibilities; ``niw.kl_divergence`` and ``dirichlet.kl_divergence`` the
bound. The bound is written with the assignments profiled out,

    L(g) = sum_n logsumexp_k [E log pi_k + E log N(x_n | mu_k, Sigma_k)] - KL(q(pi)||p(pi))
           - sum_k KL(q(mu_k, Sigma_k) || p),

which is the ELBO at phi = phi*(g) and never decreases under CAVI. Its Hessian in an
unconstrained chart of the globals (``Chart``) is the LRVB Schur complement (Eq. 11 of
the paper) with the assignments as the nuisance block, so ``lrvb_covariance`` is
``lrvb.covariance`` on ``L`` (see ``dpmm_jax.lrvb``).

``gibbs`` samples the exact posterior of the same model (blocked, conjugate draws;
chains ``vmap``-ed, iterations in ``lax.scan``) as the reference for the covariances.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy import special as jsp
from jax.scipy.linalg import cho_solve, solve_triangular

from dpmm_jax import entry_points
from dpmm_jax import linalg
from dpmm_jax import lrvb
from dpmm_jax import precision
from dpmm_jax import special
from dpmm_jax import stats as stats_lib
from dpmm_jax import validation
from dpmm_jax.conjugate import dirichlet, niw

FUNCTIONALS = ("means", "precisions", "weights", "log_weights")


class Prior(NamedTuple):
  """concentration (K,) Dirichlet alpha; components: one NIW (loc (D,), scalars, (D, D))."""
  concentration: jax.Array
  components: niw.NIW


class State(NamedTuple):
  """Global variational factors: concentration (K,) of q(pi); components: NIW, axis K."""
  concentration: jax.Array
  components: niw.NIW


class CAVIInfo(NamedTuple):
  """elbo_trace (max_iter + 1,) profiled ELBO after 0, 1, ... sweeps (NaN after the last);
  num_iters; converged (relative change <= tol)."""
  elbo_trace: jax.Array
  num_iters: jax.Array
  converged: jax.Array


class Chart(NamedTuple):
  """Unconstrained coordinates of a State (what LRVB differentiates).

  log_concentration (K,); loc (K, D); log_mean_concentration (K,);
  log_df_excess (K,) = log(df - D + 1); prec_chol (K, D(D+1)/2) lower-triangular entries
  (``jnp.tril_indices`` order, diagonal as logs) of U with Psi^-1 = U U^T. Working with
  the Cholesky factor of the inverse scale makes every ELBO term solve-free (products
  and log-diagonals only), so its Hessian compiles and runs fast.
  """
  log_concentration: jax.Array
  loc: jax.Array
  log_mean_concentration: jax.Array
  log_df_excess: jax.Array
  prec_chol: jax.Array


def make_prior(num_components: int, dim: int, *, concentration=5.0, loc=None,
               mean_concentration=0.01, df=None, scale=None, dtype=jnp.float32) -> Prior:
  """A weak conjugate prior (defaults: Dir(5, ..., 5), m0 = 0, kappa0 = 0.01,
  nu0 = D + 2, Psi0 = I, so E[Sigma_k] = I).

  Raises:
    ValueError: non-positive sizes or concentrations, df <= D - 1, bad shapes.
  """
  num_components = validation.positive_int(num_components, "num_components")
  dim = validation.positive_int(dim, "dim")
  validation.positive(concentration, "concentration")
  validation.positive(mean_concentration, "mean_concentration")
  df = dim + 2.0 if df is None else float(df)
  if not df > dim - 1:
    raise ValueError(f"df must exceed D - 1 = {dim - 1}, got {df}.")
  loc = jnp.zeros((dim,), dtype) if loc is None else jnp.asarray(loc, dtype)
  scale = jnp.eye(dim, dtype=dtype) if scale is None else jnp.asarray(scale, dtype)
  if loc.shape != (dim,):
    raise ValueError(f"loc must have shape ({dim},), got {loc.shape}.")
  if scale.shape != (dim, dim):
    raise ValueError(f"scale must have shape ({dim}, {dim}), got {scale.shape}.")
  return Prior(jnp.full((num_components,), concentration, dtype),
               niw.NIW(loc, jnp.asarray(mean_concentration, dtype), jnp.asarray(df, dtype),
                       scale))


# ------------------------------------------------------------------------------ CAVI
def log_weights(state: State, x):
  """(N, K) r_nk = E log pi_k + E log N(x_n | mu_k, Sigma_k)."""
  return (dirichlet.expected_log(state.concentration)[None]
          + niw.expected_log_likelihood(state.components, x))


def responsibilities(state: State, x):
  """(N, K) phi*_nk = softmax_k r_nk (the optimal q(z_n) given the globals)."""
  return jax.nn.softmax(log_weights(state, x), axis=-1)


def elbo(state: State, prior: Prior, x):
  """Profiled ELBO L(g) = sum_n logsumexp_k r_nk - KL(Dir) - sum_k KL(NIW_k)."""
  data = jnp.sum(jax.nn.logsumexp(log_weights(state, x), axis=-1))
  kl = (dirichlet.kl_divergence(state.concentration, prior.concentration)
        + jnp.sum(niw.kl_divergence(state.components, prior.components)))
  return data - kl


def m_step(prior: Prior, x, resp) -> State:
  """Conjugate updates of the globals from soft statistics (exact in float32)."""
  st = stats_lib.from_responsibilities(x, resp, full=True)
  return State(prior.concentration + st.count,
               niw.posterior(prior.components, st.count, st.mean, st.scatter))


@precision.float32_matmuls
def _kmeans_labels(x, key, num_components, num_iters):
  n = x.shape[0]
  centres = x[jax.random.choice(key, n, (num_components,), replace=False)]

  def step(_, c):
    d = jnp.sum((x[:, None, :] - c[None]) ** 2, -1)
    resp = jax.nn.one_hot(jnp.argmin(d, -1), num_components, dtype=x.dtype)
    count = jnp.sum(resp, 0)
    new = (resp.T @ x) / jnp.maximum(count, 1.0)[:, None]
    return jnp.where(count[:, None] > 0, new, c)

  c = jax.lax.fori_loop(0, num_iters, step, centres)
  return jnp.argmin(jnp.sum((x[:, None, :] - c[None]) ** 2, -1), -1)


@functools.partial(jax.jit, static_argnames=("num_kmeans_iters",))
def init_state(prior: Prior, x, key, num_kmeans_iters: int = 20) -> State:
  """M-step from hard k-means labels (random distinct points as starting centres)."""
  num_components = prior.concentration.shape[0]
  labels = _kmeans_labels(x, key, num_components, num_kmeans_iters)
  return m_step(prior, x, jax.nn.one_hot(labels, num_components, dtype=x.dtype))


@functools.partial(jax.jit, static_argnames=("max_iter",))
def fit(prior: Prior, x, state: State, tol=1e-7, max_iter: int = 500):
  """CAVI from ``state`` until the relative change of the profiled ELBO is <= tol.

  One sweep: phi = responsibilities(state) then the conjugate M-step; the profiled ELBO
  of every iterate is recorded (it never decreases).

  Args:
    prior: Prior; x: (N, D) data; state: initial State (e.g. ``init_state``).
    tol: relative tolerance; max_iter: sweep cap (static).
  Returns:
    (State, CAVIInfo).
  """
  dtype = jax.eval_shape(elbo, state, prior, x).dtype
  trace = jnp.full((max_iter + 1,), jnp.nan, dtype)

  def cond(c):
    return ((c[3] < max_iter) | c[5]) & ~c[4]

  def body(c):
    # The first pass keeps the initial state (one sweep computed and dropped) and records
    # its bound: the compiled loop holds the only copy of the bound's code.
    s, value, tr, it, _, first = c
    swept = m_step(prior, x, responsibilities(s, x))
    new = jax.tree_util.tree_map(lambda a, b: jnp.where(first, a, b), s, swept)
    new_value = elbo(new, prior, x)
    done = ~first & (jnp.abs(new_value - value)
                     <= tol * jnp.maximum(1.0, jnp.abs(new_value)))
    it = jnp.where(first, it, it + 1)
    return new, new_value, tr.at[it].set(new_value), it, done, jnp.array(False)

  s, _, tr, it, done, _ = jax.lax.while_loop(
      cond, body, (state, jnp.array(jnp.nan, dtype), trace, jnp.array(0, jnp.int32),
                   jnp.array(False), jnp.array(True)))
  return s, CAVIInfo(tr, it, done)


@entry_points.public_call
def fit_gmm(x, num_components: int, *, key=None, prior: Prior = None, tol=1e-7,
            max_iter: int = 500, num_restarts: int = 1):
  """Validated one-call CAVI fit: k-means start(s), CAVI, best bound kept.

  Args:
    x: (N, D) finite data.
    num_components: K.
    key: PRNG key for the k-means starts (default PRNGKey(0)).
    prior: Prior (default ``make_prior(K, D)``).
    tol, max_iter: CAVI stopping rule.
    num_restarts: k-means starts; the fit with the highest final bound is returned.
  Returns:
    (State, CAVIInfo).
  Raises:
    TypeError, ValueError: bad data (shape, non-finite, fewer points than components).
  """
  x = jnp.asarray(validation.features(x, "x"))
  num_components = validation.positive_int(num_components, "num_components")
  num_restarts = validation.positive_int(num_restarts, "num_restarts")
  validation.em_options(tol, max_iter)
  if x.shape[0] < num_components:
    raise ValueError(f"x has {x.shape[0]} rows, fewer than num_components={num_components}.")
  prior = make_prior(num_components, x.shape[1], dtype=x.dtype) if prior is None else prior
  if prior.concentration.shape != (num_components,) or prior.components.loc.shape != (
      x.shape[1],):
    raise ValueError("prior does not match num_components and the dimension of x.")
  key = jax.random.PRNGKey(0) if key is None else validation.prng_key(key)
  best = None
  for k in jax.random.split(key, num_restarts):
    state, info = fit(prior, x, init_state(prior, x, k), tol, max_iter)
    value = float(info.elbo_trace[int(info.num_iters)])
    if best is None or value > best[0]:
      best = (value, state, info)
  return best[1], best[2]


# ------------------------------------------------------------------------------ LRVB
def _tril(dim):
  return jnp.tril_indices(dim)


def to_chart(state: State) -> Chart:
  comps = state.components
  dim = comps.loc.shape[-1]
  rows, cols = _tril(dim)
  chol = jnp.linalg.cholesky(comps.scale)
  eye = jnp.broadcast_to(jnp.eye(dim, dtype=chol.dtype), chol.shape)
  u = jnp.linalg.cholesky(cho_solve((chol, True), eye))
  entries = u[:, rows, cols]
  entries = jnp.where(rows == cols, jnp.log(jnp.where(rows == cols, entries, 1.0)), entries)
  return Chart(jnp.log(state.concentration), comps.loc, jnp.log(comps.mean_concentration),
               jnp.log(comps.df - dim + 1.0), entries)


def _tril_basis(dim, dtype):
  """(D(D+1)/2, D, D) basis matrices E_j with ones at the j-th tril position, so that a
  lower-triangular matrix is a contraction of its entries (no scatter to differentiate)."""
  rows, cols = _tril(dim)
  n = rows.shape[0]
  return jnp.zeros((n, dim, dim), dtype).at[jnp.arange(n), rows, cols].set(1.0)


@precision.float32_matmuls
def _unpack(chart: Chart):
  """(U (K, D, D) lower with Psi^-1 = U U^T, log|Psi^-1| (K,), df (K,), kappa (K,))."""
  dim = chart.loc.shape[-1]
  rows, cols = _tril(dim)
  on_diag = rows == cols
  entries = jnp.where(on_diag, jnp.exp(chart.prec_chol), chart.prec_chol)
  u = jnp.einsum("kj,jde->kde", entries, _tril_basis(dim, chart.loc.dtype))
  log_det = 2.0 * jnp.sum(jnp.where(on_diag, chart.prec_chol, 0.0), -1)
  return u, log_det, jnp.exp(chart.log_df_excess) + dim - 1.0, jnp.exp(
      chart.log_mean_concentration)


@precision.float32_matmuls
def from_chart(chart: Chart) -> State:
  u, _, df, kappa = _unpack(chart)
  dim = chart.loc.shape[-1]
  eye = jnp.broadcast_to(jnp.eye(dim, dtype=u.dtype), u.shape)
  u_inv = solve_triangular(u, eye, lower=True)
  scale = jnp.swapaxes(u_inv, -1, -2) @ u_inv                       # (U U^T)^-1
  return State(jnp.exp(chart.log_concentration), niw.NIW(chart.loc, kappa, df, scale))


@precision.float32_matmuls
def chart_elbo(chart: Chart, prior: Prior, x):
  """The profiled ELBO (``elbo``) evaluated from a Chart without solves or Choleskys.

  With W = Psi^-1 = U U^T: E log|Lambda| = psi_D(nu/2) + D log 2 + log|W|,
  E log N(x | mu, Sigma) = -D/2 log 2 pi + E log|Lambda|/2 - [D/kappa + nu |U^T (x - m)|^2]/2,
  and KL(NIW_q || NIW_p) as in ``niw.kl_divergence`` with Psi_q^-1 = W (tested equal to
  ``elbo`` at every state).
  """
  u, log_det_w, df, kappa = _unpack(chart)
  dim = chart.loc.shape[-1]
  p = prior.components
  e_log_det = special.multidigamma(0.5 * df, dim) + dim * jnp.log(2.0) + log_det_w
  z = jnp.einsum("nd,kde->nke", x, u) - jnp.einsum("kd,kde->ke", chart.loc, u)[None]
  ell = -0.5 * (dim * special.LOG_2PI - e_log_det[None] + dim / kappa[None]
                + df[None] * jnp.sum(z * z, -1))
  alpha = jnp.exp(chart.log_concentration)
  data = jnp.sum(jax.nn.logsumexp(dirichlet.expected_log(alpha)[None] + ell, -1))
  # KL(NIW_q || NIW_p) with Psi_q^-1 = W = U U^T.
  ratio = p.mean_concentration / kappa
  zd = jnp.einsum("kd,kde->ke", chart.loc - p.loc, u)
  mean_part = 0.5 * (dim * (ratio - 1.0 - jnp.log(ratio))
                     + p.mean_concentration * df * jnp.sum(zd * zd, -1))
  trace = jnp.sum((p.scale @ u) * u, axis=(-2, -1))                  # tr(Psi_p W)
  log_det_p = linalg.chol_log_det(jnp.linalg.cholesky(p.scale))      # constant
  wishart_part = (0.5 * (df - p.df) * special.multidigamma(0.5 * df, dim)
                  + jsp.multigammaln(0.5 * p.df, dim)
                  - jsp.multigammaln(0.5 * df, dim)
                  + 0.5 * p.df * (-log_det_w - log_det_p) + 0.5 * df * (trace - dim))
  kl = (dirichlet.kl_divergence(alpha, prior.concentration)
        + jnp.sum(mean_part + wishart_part))
  return data - kl


@precision.float32_matmuls
def chart_functionals(chart: Chart, prior: Prior = None, x=None):
  """All named functionals (``FUNCTIONALS`` order) from a Chart, solve-free."""
  del prior, x
  u, _, df, _ = _unpack(chart)
  rows, cols = _tril(chart.loc.shape[-1])
  prec = df[:, None, None] * (u @ jnp.swapaxes(u, -1, -2))
  alpha = jnp.exp(chart.log_concentration)
  return (chart.loc.reshape(-1), prec[:, rows, cols].reshape(-1), dirichlet.mean(alpha),
          dirichlet.expected_log(alpha))


def expected_precisions(state: State):
  """(K, D, D) E[Sigma_k^-1] = nu_k Psi_k^-1."""
  comps = state.components
  dim = comps.loc.shape[-1]
  chol = jnp.linalg.cholesky(comps.scale)
  eye = jnp.broadcast_to(jnp.eye(dim, dtype=comps.scale.dtype), comps.scale.shape)
  return comps.df[:, None, None] * cho_solve((chol, True), eye)


def functional(state: State, name: str):
  """E_q of a named functional, flattened component-major.

  means: (K D,) E mu_k; precisions: (K D(D+1)/2,) lower-triangle entries of E Sigma_k^-1;
  weights: (K,) E pi_k; log_weights: (K,) E log pi_k.
  """
  if name == "means":
    return state.components.loc.reshape(-1)
  if name == "precisions":
    rows, cols = _tril(state.components.loc.shape[-1])
    return expected_precisions(state)[:, rows, cols].reshape(-1)
  if name == "weights":
    return dirichlet.mean(state.concentration)
  if name == "log_weights":
    return dirichlet.expected_log(state.concentration)
  raise ValueError(f"functional must be one of {FUNCTIONALS}, got {name!r}.")


class Covariances(NamedTuple):
  """LRVB result: cov (G, G) joint covariance of all ``FUNCTIONALS`` (in that order,
  each flattened as in ``functional``); info (lrvb.LRVBInfo); state (the polished
  State the covariance was taken at)."""
  cov: jax.Array
  info: lrvb.LRVBInfo
  state: State

  def block(self, name: str, other: str = None):
    """The (name, other) block of ``cov`` (other defaults to name)."""
    sizes = _functional_sizes(self.state)
    start = {}
    offset = 0
    for n in FUNCTIONALS:
      start[n] = offset
      offset += sizes[n]
    other = name if other is None else other
    for n in (name, other):
      if n not in FUNCTIONALS:
        raise ValueError(f"name must be one of {FUNCTIONALS}, got {n!r}.")
    return self.cov[start[name]:start[name] + sizes[name],
                    start[other]:start[other] + sizes[other]]


def _functional_sizes(state: State):
  num, dim = state.components.loc.shape
  return {"means": num * dim, "precisions": num * dim * (dim + 1) // 2, "weights": num,
          "log_weights": num}


def lrvb_covariance(state: State, prior: Prior, x, *, method: str = "dense",
                    polish: int = 3) -> Covariances:
  """LRVB covariances of means, precisions, weights and log weights at a CAVI solution.

  ``lrvb.covariance`` on the profiled ELBO in the ``Chart`` (the assignments are the
  nuisance block, eliminated exactly by profiling: the Schur complement of Eq. 11),
  after ``polish`` Newton steps. The Hessian has K (D + 3 + D(D+1)/2) rows; use
  method="cg" when that is too large to form. Compiled once per shape.

  Returns:
    Covariances (``.block("means")`` etc.).
  """
  x = jnp.asarray(x)
  cov, info, chart = lrvb.polished_covariance(chart_elbo, to_chart(state),
                                              chart_functionals, args=(prior, x),
                                              method=method, polish=polish)
  return Covariances(cov, info, from_chart(chart))


@precision.float32_matmuls
def mean_field_covariance(state: State, name: str = "means"):
  """Cov_q of the same functional under the mean-field q (block diagonal over k).

  means: Cov(mu_k) = Psi_k / (kappa_k (nu_k - D - 1)); precisions: Wishart
  Cov(L_ij, L_kl) = nu (W_ik W_jl + W_il W_jk) with W = Psi^-1; weights: Dirichlet
  covariance; log_weights: trigamma(a_k) delta_kl - trigamma(sum a).
  """
  comps = state.components
  num, dim = comps.loc.shape
  if name == "means":
    blocks = comps.scale / (comps.mean_concentration * (comps.df - dim - 1.0))[:, None, None]
    return jax.scipy.linalg.block_diag(*blocks)
  if name == "precisions":
    w = expected_precisions(state) / comps.df[:, None, None]
    rows, cols = _tril(dim)
    wik = w[:, rows][:, :, rows]            # W_{i k}
    wjl = w[:, cols][:, :, cols]            # W_{j l}
    wil = w[:, rows][:, :, cols]            # W_{i l}
    wjk = w[:, cols][:, :, rows]            # W_{j k}
    blocks = comps.df[:, None, None] * (wik * wjl + wil * wjk)
    return jax.scipy.linalg.block_diag(*blocks)
  a = state.concentration
  total = jnp.sum(a)
  if name == "weights":
    p = a / total
    return (jnp.diag(p) - jnp.outer(p, p)) / (total + 1.0)
  if name == "log_weights":
    return jnp.diag(jsp.polygamma(1, a)) - jsp.polygamma(1, total)
  raise ValueError(f"name must be one of {FUNCTIONALS}, got {name!r}.")


# ----------------------------------------------------------------------------- Gibbs
class GibbsSamples(NamedTuple):
  """Posterior draws, (C chains, S draws, ...): weights (C, S, K); means (C, S, K, D);
  precisions (C, S, K, D, D) Sigma_k^-1."""
  weights: jax.Array
  means: jax.Array
  precisions: jax.Array


@precision.float32_matmuls
def _sample_components(key, post: niw.NIW):
  """(mu (K, D), Lambda (K, D, D)) with Lambda ~ Wishart(nu, Psi^-1), mu ~ N(m, (kappa
  Lambda)^-1): Bartlett A (A_ii^2 ~ chi^2(nu - i), A_ij ~ N(0, 1) below), Psi = C C^T,
  Lambda = (C^-T A)(C^-T A)^T and mu = m + C A^-T eps / sqrt(kappa)."""
  num, dim = post.loc.shape
  k_chi, k_norm, k_mu = jax.random.split(key, 3)
  i = jnp.arange(dim, dtype=post.df.dtype)
  chi2 = 2.0 * jax.random.gamma(k_chi, 0.5 * (post.df[:, None] - i), dtype=post.df.dtype)
  normals = jax.random.normal(k_norm, (num, dim, dim), post.df.dtype)
  a = jnp.tril(normals, -1) + jnp.sqrt(chi2)[:, :, None] * jnp.eye(dim, dtype=chi2.dtype)
  c = jnp.linalg.cholesky(post.scale)
  b = solve_triangular(jnp.swapaxes(c, -1, -2), a, lower=False)   # C^-T A
  prec = b @ jnp.swapaxes(b, -1, -2)
  eps = jax.random.normal(k_mu, (num, dim, 1), post.df.dtype)
  v = solve_triangular(a, eps, lower=True, trans="T")               # A^-T eps
  mu = post.loc + (c @ v)[..., 0] / jnp.sqrt(post.mean_concentration)[:, None]
  return mu, 0.5 * (prec + jnp.swapaxes(prec, -1, -2))


@precision.float32_matmuls
def _gibbs_step(prior: Prior, x, carry, key):
  weights, means, prec = carry
  num, dim = means.shape
  k_z, k_c, k_pi = jax.random.split(key, 3)
  chol = jnp.linalg.cholesky(prec)                                  # Lambda = L L^T
  z = jnp.einsum("nd,kde->nke", x, chol) - jnp.einsum("kd,kde->ke", means, chol)[None]
  logp = (jnp.log(weights)[None] + jnp.sum(jnp.log(jnp.diagonal(chol, 0, -2, -1)), -1)[None]
          - 0.5 * jnp.sum(z * z, -1))
  labels = jax.random.categorical(k_z, logp, axis=-1)
  st = stats_lib.from_responsibilities(x, jax.nn.one_hot(labels, num, dtype=x.dtype))
  post = niw.posterior(prior.components, st.count, st.mean, st.scatter)
  means, prec = _sample_components(k_c, post)
  weights = jax.random.dirichlet(k_pi, prior.concentration + st.count, dtype=x.dtype)
  weights = jnp.maximum(weights, jnp.finfo(x.dtype).tiny)
  return (weights, means, prec), (weights, means, prec)


@functools.partial(jax.jit, static_argnames=("num_samples", "num_chains", "burn_in"))
def gibbs(key, prior: Prior, x, init: State, num_samples: int = 1000, num_chains: int = 4,
          burn_in: int = 200) -> GibbsSamples:
  """Blocked Gibbs sampler of the exact posterior (z | globals, then pi and (mu, Sigma)).

  Every chain starts at the mean-field posterior means of ``init`` (E pi, E mu,
  E Sigma^-1), which places it in the mode the CAVI fit found; label switching between
  well-separated components is then not seen in practice (check the effective sample
  sizes, ``mcmc.effective_sample_size``).

  Args:
    key: PRNG key; prior: Prior; x: (N, D); init: State.
    num_samples: draws kept per chain; num_chains: chains (vmapped); burn_in: draws
      discarded per chain (all static).
  Returns:
    GibbsSamples with leading axes (num_chains, num_samples).
  """
  start = (dirichlet.mean(init.concentration), init.components.loc,
           expected_precisions(init))

  def chain(k):
    keys = jax.random.split(k, burn_in + num_samples)
    step = functools.partial(_gibbs_step, prior, x)
    carry, _ = jax.lax.scan(lambda c, kk: (step(c, kk)[0], None), start, keys[:burn_in])
    _, draws = jax.lax.scan(step, carry, keys[burn_in:])
    return draws

  w, mu, prec = jax.vmap(chain)(jax.random.split(key, num_chains))
  return GibbsSamples(w, mu, prec)


def sample_functional(samples: GibbsSamples, name: str):
  """(C, S, G) draws of the functional ``name`` in the order of ``functional``."""
  c, s, num, dim = samples.means.shape
  if name == "means":
    return samples.means.reshape(c, s, num * dim)
  if name == "precisions":
    rows, cols = _tril(dim)
    return samples.precisions[..., rows, cols].reshape(c, s, -1)
  if name == "weights":
    return samples.weights
  if name == "log_weights":
    return jnp.log(samples.weights)
  raise ValueError(f"name must be one of {FUNCTIONALS}, got {name!r}.")
