r"""Location-dependent Dirichlet process (LDDP) mixtures of Gaussians, mean-field CAVI.

Sun, Paisley & Liu, "Location Dependent Dirichlet Processes" (the paper's displayed
equations were lost; the model below is reconstructed from its prose, see the notes at
the end of this docstring).

Model (finite gamma-process approximation of the DP with K components; n = 1..N points
x_n (D,) observed at locations l_n (P,)):
  z_k ~ Gamma(alpha0 / K, 1),      f_k ~ GP(0, k),    k(l, l') = s_f^2 exp(-|l - l'|^2 / s_l^2)
  mu_k ~ N(mu0, R0^-1),  R_k ~ W(W0, nu0)                        (``conjugate.normal_wishart``)
  P(c_n = k | z, f) = z_k e^{f_k(l_n)} / sum_j z_j e^{f_j(l_n)},   x_n ~ N(mu_{c_n}, R_{c_n}^-1).
With f = 0 this is a finite Bayesian GMM whose weights z / sum z are Dirichlet(alpha0 / K).

Variational family: q(c_n) = Cat(phi_n), q(z_k) = Gamma(a_k, b_k) (shape-rate),
q(mu_k) q(R_k) independent Normal x Wishart, and a point estimate (delta q) of f_k.
The intractable E[-log sum_j z_j e^{f_jn}] is bounded with an auxiliary xi_n > 0 (first
order Taylor bound of the convex -log):  -log s >= -log xi - s / xi + 1, tight at
xi_n = sum_j E[z_j] e^{f_jn}.  The evidence lower bound is then

  L = sum_nk phi_nk (E log N(x_n | mu_k, R_k^-1) + E log z_k + f_kn - log phi_nk)
      + sum_n (1 - log xi_n - sum_j E[z_j] e^{f_jn} / xi_n)
      - sum_k KL(q(z_k) || Gamma(alpha0/K, 1)) - sum_k KL(q(mu_k, R_k) || p(mu, R))
      - 1/2 sum_k f_k^T K^-1 f_k                      (+ an f-independent constant),

and each block update below maximises it in its block:
  phi_nk  propto exp(E log N(x_n | theta_k) + psi(a_k) - log b_k + f_kn)
  a_k = alpha0/K + sum_n phi_nk,   b_k = 1 + sum_n e^{f_kn} / xi_n
  q(mu_k), q(R_k) from the phi-weighted statistics (``normal_wishart.posterior``)
  xi_n = sum_j E[z_j] e^{f_jn}
  f_k <- f_k + rho [K (phi_.k - E[z_k] e^{f_k} / xi) - f_k]   (gradient phi_.k - E[z_k]
        e^{f_k}/xi - K^-1 f_k preconditioned by K), with a backtracking rho (see below).

Nystrom. With M inducing locations l* (an even grid), K ~ K_{n*} K_eps^-1 K_{*n},
K_eps = K(l*, l*) + jitter I. This is the covariance of f = K_{n*} K_eps^-1 g with
g ~ N(0, K_eps) the field at the inducing points, so f is parameterised by the weights
u = K_eps^-1 g (M, K): f = K_{n*} u and the prior term is -1/2 u^T K_eps u. The paper's
preconditioned step in f, with K replaced by its Nystrom form, is then exactly
  u <- u + rho (K_eps^-1 K_{*n} r - u),   r = phi_.k - E[z_k] e^{f_k} / xi,
a step along the gradient in u (K_{*n} r - K_eps u) preconditioned by K_eps^-1. Only
(M, N) and (M, M) matrices are stored; the N x N kernel is never formed. With all N
locations as inducing points (and jitter -> 0) it is the exact model.

Monotone f-step. The f-block of L with xi at its optimum is
  L_f(u) = sum_k phi_.k . f_k - sum_n log sum_j E[z_j] e^{f_jn} - 1/2 sum_k u_k^T K_eps u_k,
concave in u. A fixed step rho is not guaranteed to increase it (the paper's full step
rho = 1 sets f = K r, which overflows on an image: rows of K sum to ~N pi s_l^2). Each
sweep therefore backtracks: rho starts at min(max_step, 2 rho_previous) and is halved
until the Armijo condition L_f(rho) >= L_f(0) + 1e-4 rho slope holds (slope = d^T K_eps d
> 0 away from a stationary point), at most 40 times; if none holds the step is not taken.
Since f is linear in u, each trial costs O(N K) (no new kernel products). With xi
re-set to its optimum after every block, every block update is an argmax (phi, q(z),
q(mu), q(R), xi) or an improvement (f) of the same bound, so L never decreases.

Reconstruction notes (the paper's equations are missing; choices made here):
  * Kernel: k = s_f^2 exp(-|l - l'|^2 / s_l^2) (no factor 2; the prose says only "the
    common Gaussian kernel"). With s_l = 0.1 this equals the 2 s^2 convention with
    s = 0.1 / sqrt(2). Locations are used as given: pass them scaled to [0, 1] for the
    paper's s_l = 0.1 (``experiments/lddp.py`` does).
  * Clusters: independent mu ~ N(mu0, R0^-1), R ~ W(W0, nu0) and factorised q(mu) q(R),
    as the paper states ("q(theta_i) = q(mu_i) q(R_i)"); not the conjugate NIW coupling.
  * Settings from the paper: alpha0 = 1, mu0 = empirical mean, R0 = inverse empirical
    covariance (plus a 1e-6 relative ridge so constant channels do not make it singular),
    nu0 = D, W0 = R0 / D (so E[R_k] = R0), f = 0 and a = b = 1 at the start, q(theta) = the
    prior except that the means of q(mu) come from k-means on x.
  * The paper's delta q(f) has no entropy; the GP normaliser -1/2 log|2 pi K| is a
    constant and is left out of the reported bound.
"""
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy import special as jsp
from jax.scipy.linalg import cho_solve

from dpmm_jax import entry_points
from dpmm_jax import precision
from dpmm_jax import stats
from dpmm_jax import validation
from dpmm_jax.conjugate import gamma
from dpmm_jax.conjugate import normal_wishart

_ARMIJO = 1e-4
_MAX_HALVINGS = 40


# ----------------------------------------------------------------------- kernel, Nystrom
@precision.float32_matmuls
def rbf_kernel(a, b, amplitude=1.0, length_scale=0.1):
  """(A, B) k(a_i, b_j) = amplitude^2 exp(-|a_i - b_j|^2 / length_scale^2).

  Args:
    a: (A, P) locations; b: (B, P) locations.
    amplitude: s_f; length_scale: s_l (see the module notes on the factor of 2).
  """
  a = jnp.asarray(a)
  b = jnp.asarray(b, a.dtype)
  sq = (jnp.sum(a * a, -1)[:, None] - 2.0 * a @ b.T + jnp.sum(b * b, -1)[None, :])
  sq = jnp.maximum(sq, 0.0)
  return jnp.square(amplitude) * jnp.exp(-sq / jnp.square(length_scale))


class Nystrom(NamedTuple):
  """Nystrom factors of the GP kernel at N locations with M inducing locations.

  inducing: (M, P) l*; cross: (M, N) K_{*n}; chol: (M, M) lower Cholesky factor of
  K_eps = K(l*, l*) + jitter I; amplitude, length_scale, jitter: () kernel settings.
  """
  inducing: jax.Array
  cross: jax.Array
  chol: jax.Array
  amplitude: jax.Array
  length_scale: jax.Array
  jitter: jax.Array


def default_jitter(dtype, amplitude=1.0) -> float:
  """Diagonal jitter for K(l*, l*): 1e-4 s_f^2 in float32, 1e-8 s_f^2 in float64."""
  rel = 1e-8 if jnp.dtype(dtype) == jnp.float64 else 1e-4
  return rel * float(amplitude) ** 2


def nystrom(locations, inducing, amplitude=1.0, length_scale=0.1, jitter=None) -> Nystrom:
  """Precomputes K_{*n} (M, N) and chol(K(l*, l*) + jitter I) (M, M)."""
  locations = jnp.asarray(locations)
  inducing = jnp.asarray(inducing, locations.dtype)
  if jitter is None:
    jitter = default_jitter(locations.dtype, amplitude)
  dtype = locations.dtype
  amplitude = jnp.asarray(amplitude, dtype)
  length_scale = jnp.asarray(length_scale, dtype)
  jitter = jnp.asarray(jitter, dtype)
  gram = rbf_kernel(inducing, inducing, amplitude, length_scale)
  gram = gram + jitter * jnp.eye(gram.shape[0], dtype=dtype)
  cross = rbf_kernel(inducing, locations, amplitude, length_scale)
  return Nystrom(inducing, cross, jnp.linalg.cholesky(gram), amplitude, length_scale, jitter)


@precision.float32_matmuls
def kernel_matvec(nys: Nystrom, v):
  """(N, K) Nystrom kernel product K_{n*} (K_eps^-1 (K_{*n} v)); never forms N x N.

  Args:
    nys: Nystrom factors.
    v: (N, K) (or (N,)) vectors.
  """
  return nys.cross.T @ cho_solve((nys.chol, True), nys.cross @ v)


@precision.float32_matmuls
def field_at(nys: Nystrom, weights, locations=None):
  """f = K(l, l*) u: (N, K) at the training locations, or (M', K) at new ``locations``."""
  if locations is None:
    return nys.cross.T @ weights
  cross = rbf_kernel(locations, nys.inducing, nys.amplitude, nys.length_scale)
  return cross @ weights


def grid_inducing(locations, num_per_dim: int):
  """(num_per_dim^P, P) evenly spaced grid over the bounding box of ``locations`` (N, P)."""
  locations = np.asarray(locations)
  lo, hi = locations.min(0), locations.max(0)
  axes = [np.linspace(lo[p], hi[p], num_per_dim) for p in range(locations.shape[1])]
  mesh = np.meshgrid(*axes, indexing="ij")
  return np.stack([m.reshape(-1) for m in mesh], -1).astype(locations.dtype)


def default_num_per_dim(num_points: int, loc_dim: int, fraction: float = 0.05) -> int:
  """Grid points per dimension so the grid holds about ``fraction`` of N (the paper's 5 %)."""
  return max(2, int(round((fraction * num_points) ** (1.0 / loc_dim))))


# ----------------------------------------------------------------------------- k-means
@precision.float32_matmuls
@functools.partial(jax.jit, static_argnames=("num_clusters", "num_iters"))
def kmeans(x, num_clusters: int, key, num_iters: int = 20):
  """(K, D) k-means centres: k-means++ seeding then ``num_iters`` Lloyd iterations.

  Empty clusters keep their previous centre. Used to initialise the means of q(mu).
  """
  x = jnp.asarray(x)
  n = x.shape[0]
  keys = jax.random.split(key, num_clusters)
  first = jax.random.randint(keys[0], (), 0, n)
  centres = jnp.zeros((num_clusters, x.shape[1]), x.dtype).at[0].set(x[first])
  d2 = jnp.sum(jnp.square(x - x[first]), -1)

  def seed(i, carry):
    centres, d2 = carry
    total = jnp.sum(d2)
    p = jnp.where(total > 0, d2 / jnp.where(total > 0, total, 1.0), 1.0 / n)
    idx = jax.random.choice(keys[i], n, p=p)
    c = x[idx]
    return centres.at[i].set(c), jnp.minimum(d2, jnp.sum(jnp.square(x - c), -1))

  centres, _ = jax.lax.fori_loop(1, num_clusters, seed, (centres, d2))

  def lloyd(_, centres):
    dist = (jnp.sum(x * x, -1)[:, None] - 2.0 * x @ centres.T
            + jnp.sum(centres * centres, -1)[None, :])
    onehot = jax.nn.one_hot(jnp.argmin(dist, -1), num_clusters, dtype=x.dtype)
    count = jnp.sum(onehot, 0)
    sums = onehot.T @ x
    return jnp.where(count[:, None] > 0, sums / jnp.maximum(count, 1.0)[:, None], centres)

  return jax.lax.fori_loop(0, num_iters, lloyd, centres)


# ------------------------------------------------------------------------ model pieces
class Prior(NamedTuple):
  """concentration: () alpha0; clusters: unbatched NormalWishart prior of (mu_k, R_k)."""
  concentration: jax.Array
  clusters: normal_wishart.NormalWishart


class State(NamedTuple):
  """Variational parameters (K = number of components, M = inducing points).

  responsibilities: (N, K) phi; gamma_shape, gamma_rate: (K,) a, b of q(z);
  clusters: NormalWishart factors with leading axis K; field_weights: (M, K) u;
  field: (N, K) f = K_{n*} u; log_xi: (N,) log of the auxiliary xi;
  step_size: () the last f-step rho (the next sweep starts from twice it).
  """
  responsibilities: jax.Array
  gamma_shape: jax.Array
  gamma_rate: jax.Array
  clusters: normal_wishart.NormalWishart
  field_weights: jax.Array
  field: jax.Array
  log_xi: jax.Array
  step_size: jax.Array


@precision.float32_matmuls
def default_prior(x, concentration=1.0) -> Prior:
  """The paper's empirical prior: mu0 = mean(x), R0 = cov(x)^-1, nu0 = D, E[R] = R0.

  A ridge of 1e-6 times the average variance keeps R0 finite for constant channels.
  """
  x = jnp.asarray(x)
  dim = x.shape[1]
  mu0 = jnp.mean(x, 0)
  xc = x - mu0
  cov = xc.T @ xc / x.shape[0]
  cov = cov + 1e-6 * jnp.trace(cov) / dim * jnp.eye(dim, dtype=x.dtype)
  eye = jnp.eye(dim, dtype=x.dtype)
  r0 = cho_solve((jnp.linalg.cholesky(cov), True), eye)
  r0 = 0.5 * (r0 + r0.T)
  df = jnp.asarray(dim, x.dtype)
  clusters = normal_wishart.NormalWishart(mu0, r0, df, df * cov)   # Psi0 = W0^-1 = D cov
  return Prior(jnp.asarray(concentration, x.dtype), clusters)


def expected_log_weights(state: State):
  """(K,) E[log z_k] = psi(a_k) - log b_k."""
  return gamma.expected_log(state.gamma_shape, state.gamma_rate)


def optimal_log_xi(state: State):
  """(N,) log xi_n at its optimum, log sum_j E[z_j] e^{f_jn} (log-sum-exp, no overflow)."""
  log_mean_z = jnp.log(gamma.mean(state.gamma_shape, state.gamma_rate))
  return jax.nn.logsumexp(log_mean_z + state.field, axis=-1)


def update_xi(state: State) -> State:
  return state._replace(log_xi=optimal_log_xi(state))


def _log_resp_unnormalised(x, state: State):
  return (normal_wishart.expected_log_likelihood(state.clusters, x)
          + expected_log_weights(state) + state.field)


def update_responsibilities(x, state: State) -> State:
  """phi_nk propto exp(E log N(x_n | theta_k) + psi(a_k) - log b_k + f_kn)."""
  return state._replace(
      responsibilities=jax.nn.softmax(_log_resp_unnormalised(x, state), axis=-1))


def update_clusters(x, state: State, prior: Prior) -> State:
  """q(mu_k) then q(R_k) from the phi-weighted centred statistics."""
  s = stats.from_responsibilities(x, state.responsibilities, full=True)
  clusters = normal_wishart.posterior(prior.clusters, state.clusters, s.count, s.mean,
                                      s.scatter)
  return state._replace(clusters=clusters)


def update_weights(state: State, prior: Prior) -> State:
  """a_k = alpha0/K + sum_n phi_nk,  b_k = 1 + sum_n e^{f_kn} / xi_n (xi as in the state)."""
  k = state.gamma_shape.shape[0]
  shape = prior.concentration / k + jnp.sum(state.responsibilities, 0)
  rate = 1.0 + jnp.sum(jnp.exp(state.field - state.log_xi[:, None]), 0)
  return state._replace(gamma_shape=shape, gamma_rate=rate)


class FieldStep(NamedTuple):
  """Diagnostics of one f-step: direction slope (>= 0), accepted rho, gain in L."""
  slope: jax.Array
  step_size: jax.Array
  gain: jax.Array


@precision.float32_matmuls
def field_gradient(state: State, nys: Nystrom):
  """(M, K) gradient of the bound in u with xi at its optimum: K_{*n} r - K_eps u."""
  log_mean_z = jnp.log(gamma.mean(state.gamma_shape, state.gamma_rate))
  logits = log_mean_z + state.field
  p = jax.nn.softmax(logits, axis=-1)                    # E[z_k] e^{f_kn} / xi_n
  r = state.responsibilities - p
  gram_u = nys.chol @ (nys.chol.T @ state.field_weights)   # K_eps u
  return nys.cross @ r - gram_u


@precision.float32_matmuls
def update_field(state: State, nys: Nystrom, max_step=1.0):
  """Preconditioned gradient step on u with a backtracking rho (module notes).

  Returns:
    (state with new field_weights, field and step_size, FieldStep). xi is not updated
    here; call ``update_xi`` after it.
  """
  u, f, phi = state.field_weights, state.field, state.responsibilities
  log_mean_z = jnp.log(gamma.mean(state.gamma_shape, state.gamma_rate))
  logits = log_mean_z + f
  log_p = jax.nn.log_softmax(logits, axis=-1)
  kr = nys.cross @ (phi - jnp.exp(log_p))                   # K_{*n} r       (M, K)
  gram_u = nys.chol @ (nys.chol.T @ u)                       # K_eps u
  grad = kr - gram_u                                         # = K_eps d
  d = cho_solve((nys.chol, True), kr) - u                    # direction      (M, K)
  df = nys.cross.T @ d                                       # K_{n*} d       (N, K)
  slope = jnp.sum(d * grad)                                  # d^T K_eps d
  lin = jnp.sum(phi * df) - jnp.sum(u * grad)                # phi.df - u^T K_eps d

  def gain(rho):
    lse = jax.nn.logsumexp(log_p + rho * df, axis=-1)        # log xi(rho) - log xi(0)
    g = rho * lin - jnp.sum(lse) - 0.5 * rho * rho * slope
    return jnp.where(jnp.isfinite(g), g, -jnp.inf)

  def failed(rho):
    return gain(rho) < _ARMIJO * rho * slope

  rho0 = jnp.minimum(jnp.asarray(max_step, f.dtype), 2.0 * state.step_size)

  def cond(carry):
    rho, i = carry
    return (i < _MAX_HALVINGS) & failed(rho)

  rho, _ = jax.lax.while_loop(cond, lambda c: (0.5 * c[0], c[1] + 1),
                              (rho0, jnp.array(0, jnp.int32)))
  ok = (slope > 0) & ~failed(rho)
  taken = jnp.where(ok, rho, 0.0)
  new = state._replace(field_weights=u + taken * d, field=f + taken * df,
                       step_size=jnp.where(slope > 0, rho, state.step_size))
  return new, FieldStep(slope, taken, jnp.where(ok, gain(rho), 0.0))


def sweep(x, state: State, prior: Prior, nys: Nystrom, update_field_: bool = True,
          max_step=1.0) -> State:
  """One CAVI sweep: q(theta), q(z), xi, f (monotone step), xi, phi.

  Args:
    x: (N, D) observations.
    state: current variational parameters (with phi and xi already consistent).
    prior: Prior.
    nys: Nystrom factors at the N locations.
    update_field_: False keeps f fixed (f = 0 gives the finite Bayesian GMM).
    max_step: largest f step rho tried.
  """
  state = update_clusters(x, state, prior)
  state = update_weights(state, prior)
  state = update_xi(state)
  if update_field_:
    state, _ = update_field(state, nys, max_step)
    state = update_xi(state)
  return update_responsibilities(x, state)


@precision.float32_matmuls
def bound(x, state: State, prior: Prior, nys: Nystrom):
  """The evidence lower bound L (module docstring) at ``state``, xi taken from the state.

  Args:
    x: (N, D); state: State; prior: Prior; nys: Nystrom (only chol is used).
  Returns:
    () scalar.
  """
  phi = state.responsibilities
  k = phi.shape[1]
  e_loglik = normal_wishart.expected_log_likelihood(state.clusters, x)
  term_c = jnp.sum(phi * (e_loglik + expected_log_weights(state) + state.field)
                   - jsp.xlogy(phi, phi))
  log_mean_z = jnp.log(gamma.mean(state.gamma_shape, state.gamma_rate))
  ratio = jnp.sum(jnp.exp(log_mean_z + state.field - state.log_xi[:, None]), -1)
  term_xi = jnp.sum(1.0 - state.log_xi - ratio)
  shape0 = prior.concentration / k
  term_z = -jnp.sum(gamma.kl_divergence(state.gamma_shape, state.gamma_rate, shape0, 1.0))
  term_theta = -jnp.sum(normal_wishart.kl_divergence(state.clusters, prior.clusters))
  ku = nys.chol.T @ state.field_weights
  term_f = -0.5 * jnp.sum(ku * ku)                           # -1/2 u^T K_eps u
  return term_c + term_xi + term_z + term_theta + term_f


def init_state(x, prior: Prior, nys: Nystrom, init_means) -> State:
  """The paper's start: f = 0, a = b = 1, q(theta) = prior with k-means means; then xi
  and phi at their optima."""
  k = init_means.shape[0]
  dtype = x.dtype
  clusters = normal_wishart.broadcast(prior.clusters, k)._replace(
      loc=jnp.asarray(init_means, dtype))
  m = nys.chol.shape[0]
  state = State(responsibilities=jnp.full((x.shape[0], k), 1.0 / k, dtype),
                gamma_shape=jnp.ones((k,), dtype), gamma_rate=jnp.ones((k,), dtype),
                clusters=clusters, field_weights=jnp.zeros((m, k), dtype),
                field=jnp.zeros((x.shape[0], k), dtype),
                log_xi=jnp.zeros((x.shape[0],), dtype), step_size=jnp.asarray(0.5, dtype))
  return update_responsibilities(x, update_xi(state))


# ----------------------------------------------------------------------------- fitting
class Result(NamedTuple):
  """Output of ``fit``.

  assignments: (N,) int32 argmax_k phi_nk; responsibilities: (N, K) phi;
  bound_trace: (max_iter + 1,) L after 0, 1, ... sweeps (NaN after the last one run);
  num_iters: () sweeps run; converged: () relative change of L fell below tol;
  state: final State; prior: Prior; nystrom: Nystrom (for ``predict``).
  """
  assignments: jax.Array
  responsibilities: jax.Array
  bound_trace: jax.Array
  num_iters: jax.Array
  converged: jax.Array
  state: State
  prior: Prior
  nystrom: Nystrom


def run(x, state: State, prior: Prior, nys: Nystrom, tol, max_iter: int,
        update_field_: bool = True, max_step=1.0):
  """Sweeps in a ``lax.while_loop`` until |L_t - L_{t-1}| <= tol |L_{t-1}| or max_iter.

  Returns:
    (state, bound_trace (max_iter + 1,), num_iters, converged).
  """
  b0 = bound(x, state, prior, nys)
  trace = jnp.full((max_iter + 1,), jnp.nan, b0.dtype).at[0].set(b0)

  def cond(c):
    return (c[3] < max_iter) & ~c[4]

  def body(c):
    state, prev, trace, it, _ = c
    state = sweep(x, state, prior, nys, update_field_, max_step)
    new = bound(x, state, prior, nys)
    conv = jnp.abs(new - prev) <= tol * jnp.abs(prev)
    return state, new, trace.at[it + 1].set(new), it + 1, conv

  state, _, trace, it, conv = jax.lax.while_loop(
      cond, body, (state, b0, trace, jnp.array(0, jnp.int32), jnp.array(False)))
  return state, trace, it, conv


def _fit_impl(x, locations, inducing, key, init_means, concentration, amplitude,
              length_scale, jitter, tol, max_step, *, num_clusters, max_iter,
              update_field_, kmeans_iters, has_init_means):
  nys = nystrom(locations, inducing, amplitude, length_scale, jitter)
  prior = default_prior(x, concentration)
  if not has_init_means:
    init_means = kmeans(x, num_clusters, key, kmeans_iters)
  state = init_state(x, prior, nys, init_means)
  state, trace, it, conv = run(x, state, prior, nys, tol, max_iter, update_field_, max_step)
  assignments = jnp.argmax(state.responsibilities, -1).astype(jnp.int32)
  return Result(assignments, state.responsibilities, trace, it, conv, state, prior, nys)


_fit_jit = jax.jit(_fit_impl, static_argnames=("num_clusters", "max_iter", "update_field_",
                                               "kmeans_iters", "has_init_means"))


def _locations(locations, num_points, name="locations"):
  loc = validation.features(locations, name)
  if num_points is not None and loc.shape[0] != num_points:
    raise ValueError(f"{name} must have one row per point of x ({num_points}), got "
                     f"shape {loc.shape}.")
  return loc


def _prepare(x, locations, num_clusters, key, inducing=None, num_inducing_per_dim=None,
             concentration=1.0, amplitude=1.0, length_scale=0.1, jitter=None, tol=1e-5,
             max_iter=500, max_step=1.0, update_field=True, init_means=None,
             kmeans_iters=20):
  """Validates ``fit``'s inputs; returns (dynamic args, static options) of ``_fit_jit``."""
  x = validation.features(x, "x")
  loc = _locations(locations, x.shape[0])
  num_clusters = validation.positive_int(num_clusters, "num_clusters")
  validation.em_options(tol, max_iter)
  for value, name in ((concentration, "concentration"), (amplitude, "amplitude"),
                      (length_scale, "length_scale"), (max_step, "max_step")):
    validation.positive(value, name)
  if jitter is not None:
    validation.positive(jitter, "jitter")
  validation.positive_int(kmeans_iters, "kmeans_iters")
  if inducing is None:
    per_dim = (default_num_per_dim(x.shape[0], loc.shape[1]) if num_inducing_per_dim is None
               else validation.positive_int(num_inducing_per_dim, "num_inducing_per_dim"))
    inducing = grid_inducing(loc, per_dim)
  else:
    inducing = validation.features(inducing, "inducing")
    if inducing.shape[1] != loc.shape[1]:
      raise ValueError(f"inducing has {inducing.shape[1]} location dimensions but "
                       f"locations has {loc.shape[1]}.")
  if float(np.sum(np.var(np.asarray(x, np.float64), axis=0))) <= 0.0:
    raise ValueError("x is constant (zero variance in every feature): nothing to cluster "
                     "and no empirical prior covariance.")
  if init_means is not None:
    init_means = validation.features(init_means, "init_means", dim=x.shape[1])
    if init_means.shape[0] != num_clusters:
      raise ValueError(f"init_means must have shape ({num_clusters}, {x.shape[1]}), got "
                       f"{init_means.shape}.")
  validation.prng_key(key)
  dtype = jnp.asarray(x).dtype
  has_init = init_means is not None
  if not has_init:
    init_means = np.zeros((num_clusters, x.shape[1]), dtype)
  if jitter is None:
    jitter = default_jitter(dtype, amplitude)
  cast = lambda v: jnp.asarray(v, dtype)
  args = (cast(x), cast(loc), cast(inducing), key, cast(init_means), cast(concentration),
          cast(amplitude), cast(length_scale), cast(jitter), cast(tol), cast(max_step))
  static = dict(num_clusters=num_clusters, max_iter=int(max_iter),
                update_field_=bool(update_field), kmeans_iters=int(kmeans_iters),
                has_init_means=has_init)
  return args, static


@entry_points.public_call
def fit(x, locations, num_clusters: int, *, key, inducing=None, num_inducing_per_dim=None,
        concentration=1.0, amplitude=1.0, length_scale=0.1, jitter=None, tol=1e-5,
        max_iter: int = 500, max_step=1.0, update_field: bool = True, init_means=None,
        kmeans_iters: int = 20) -> Result:
  """Fits an LDDP mixture of Gaussians by CAVI (one call).

  Args:
    x: (N, D) observations (e.g. pixel colours).
    locations: (N, P) their locations (e.g. pixel coordinates scaled to [0, 1]).
    num_clusters: K, the truncation of the gamma process (e.g. 5 or 100).
    key: jax PRNG key (k-means initialisation).
    inducing: (M, P) Nystrom inducing locations; default an even grid over the bounding
      box of ``locations`` with ``num_inducing_per_dim`` points per dimension (default:
      about 5 % of N in all). Pass ``locations`` itself for the exact kernel.
    concentration: alpha0.
    amplitude, length_scale: s_f, s_l of the RBF kernel.
    jitter: added to the diagonal of K(l*, l*) (default 1e-4 s_f^2 in float32, 1e-8 s_f^2
      in float64).
    tol: relative change of the bound that stops the sweeps; max_iter: cap on sweeps.
    max_step: largest f step rho tried (1 = the paper's full preconditioned step).
    update_field: False keeps f = 0 (a finite Bayesian GMM with Gamma-normalised weights).
    init_means: (K, D) initial means of q(mu) instead of k-means.
    kmeans_iters: Lloyd iterations of the k-means initialisation.
  Returns:
    Result (assignments, responsibilities, bound_trace, num_iters, converged, ...).
  Raises:
    TypeError / ValueError: bad inputs, named.
  """
  args, static = _prepare(x, locations, num_clusters, key, inducing, num_inducing_per_dim,
                          concentration, amplitude, length_scale, jitter, tol, max_iter,
                          max_step, update_field, init_means, kmeans_iters)
  return _fit_jit(*args, **static)


@entry_points.public_call
def compile_fit(x, locations, num_clusters: int, *, key, **options):
  """Ahead-of-time compiled ``fit``: returns a callable of no arguments giving the Result.

  Same arguments as ``fit``; separates compilation from run time (for timing).
  """
  args, static = _prepare(x, locations, num_clusters, key, **options)
  compiled = _fit_jit.lower(*args, **static).compile()
  return lambda: compiled(*args)


# ------------------------------------------------------------------- prediction, usage
@entry_points.public_call
def predict(result: Result, x, locations):
  """(M, K) q(c = k | x, l) for new pairs: softmax(E log N(x | theta_k) + E log z_k + f_k(l)).

  f_k(l) = K(l, l*) u_k, the field's Nystrom / GP mean at the new locations.
  """
  dim = result.state.clusters.loc.shape[-1]
  x = validation.features(x, "x", dim=dim)
  loc = _locations(locations, x.shape[0])
  if loc.shape[1] != result.nystrom.inducing.shape[1]:
    raise ValueError(f"locations has {loc.shape[1]} dimensions, the fitted model "
                     f"{result.nystrom.inducing.shape[1]}.")
  return _predict_jit(result.state, result.nystrom, jnp.asarray(x), jnp.asarray(loc))


@jax.jit
def _predict_jit(state, nys, x, loc):
  field = field_at(nys, state.field_weights, loc.astype(nys.inducing.dtype))
  logits = (normal_wishart.expected_log_likelihood(state.clusters, x.astype(field.dtype))
            + expected_log_weights(state) + field)
  return jax.nn.softmax(logits, axis=-1)


def cluster_usage(result: Result, soft: bool = False):
  """(K,) number of points per component: hard (argmax) counts, or sum_n phi_nk."""
  if soft:
    return jnp.sum(result.responsibilities, 0)
  k = result.responsibilities.shape[1]
  return jnp.bincount(result.assignments, length=k)
