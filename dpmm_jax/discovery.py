"""Novelty discovery: VBrand (variational Brand) on top of a fitted detector.

Where the detector says "this point is new", discovery clusters the test batch into the
J known classes and up to T *novel* classes, by coordinate-ascent variational inference
(CAVI) in the semiparametric model of Brand (paper 001, eqs. 1-5):

    y_m | xi_m = k ~ N(mu_k, Sigma_k),     p(xi_m = k) = pi~_k,
    pi~_j = pi_j (j <= J),   pi~_{J+l} = pi_0 omega_l,
    (pi_0, pi_1..pi_J) ~ Dir(alpha_0, alpha_1..alpha_J),
    omega ~ stick-breaking(gamma): v_l ~ Beta(1, gamma), truncated at T (v_T = 1),
    (mu_j, Sigma_j) ~ rho_j (known classes),  (mu_{J+l}, Sigma_{J+l}) ~ rho_0 (novel).

With ``class_weights="train"`` (alpha_j = N_j, the training counts), alpha_0 = gamma =
``alpha``, rho_j = the detector's class posteriors and rho_0 = its empirical-Bayes prior
H, this is the transductive posterior of the library's own DPMM (paper 000). For the
``full`` model every factor is Normal-inverse-Wishart (``conjugate.niw``); for the
``diag`` model it is Normal-inverse-chi-squared per dimension (``conjugate.nix``, cost
O(M (J+T) D) per sweep, for embeddings with hundreds of dimensions). Everything runs in
the detector's preprocessed space (``det.transform``).

Variational family (shapes: J known classes, T = ``max_new_classes``, K = J + T):
q(pi) = Dir(eta) with eta (J+1,) (index 0 = novelty mass), q(v_l) = Beta(a_l, b_l) for
l < T, q(mu_k, Sigma_k) = NIW / NIX, q(xi_m) = Cat(phi_m). ``Params`` holds the globals.

The ELBO, written in KL form with the assignments profiled out
--------------------------------------------------------------------
With r_mk = E log pi~_k + E log N(y_m | mu_k, Sigma_k) the optimal phi_m = softmax(r_m),
and at that phi

    ELBO(g) = sum_m logsumexp_k r_mk(g)
              - KL(Dir(eta) || Dir(alpha)) - sum_{l<T} KL(Beta(a_l, b_l) || Beta(1, gamma))
              - sum_k KL(q(mu_k, Sigma_k) || rho_k).

``elbo(params, y, priors)`` is this function: pure, jittable and differentiable in every
leaf of ``params`` (a pytree) and of ``y``, so the linear-response (LRVB) covariance of
the globals is ``jax.hessian`` of it in an unconstrained chart of ``params``.
``elbo_at(params, y, priors, responsibilities)`` is the un-profiled bound
sum phi (r - log phi) - KL (equal to ``elbo`` at phi = softmax(r)); for one-hot phi and
the M-step of that phi it equals log p(Y, xi) exactly (the tests check this).

CAVI (``fit``): E-step phi = softmax(r); M-step (eqs. 9-11) eta = alpha + counts,
a_l = 1 + N_{J+l}, b_l = gamma + sum_{l'>l} N_{J+l'}, q(mu_k, Sigma_k) = the conjugate
posterior of rho_k given the phi-weighted (centred) statistics. Each sweep evaluates the
ELBO of the current globals in the same pass as the E-step; a ``lax.while_loop`` runs to
a relative ELBO change below ``tol`` or ``max_iter`` sweeps, and records the trace. The
ELBO never decreases (each step is an exact coordinate maximisation).

Initialisation (``init_params``): hard labels from the label posterior of the priors
(argmax over log alpha_j + log St(y | rho_j) and log alpha_0 + log St(y | rho_0): the
detector's label posterior with its new-class event for the default priors), k-means++
(plus Lloyd iterations) with min(T, #flagged) centres on the points flagged novel, the
M-step first. Several restarts (different k-means++ seeds) run vmapped; the best final
ELBO is kept.

Corrections to the paper's printed equations (see the module README section / report):
the NIW scatter update uses the outer product (ybar - mu)(ybar - mu)^T; u_k = nu_k + N_k
(not nu_K); E log|Lambda| = psi_p(u/2) + p log 2 - log|S| with the variational (u, S);
the ELBO is derived in KL form (the printed f3 drops (nu - p - 1)/2 E log|Lambda|, f6
has a wrong digamma term, the global entropies are counted once, not M times, and h1's
-log sum phi is dropped); the novelty indicator is 1{k > J}; the sticks run l = 1..T-1.
"""
import functools
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import blocks
from dpmm_jax import entry_points
from dpmm_jax import linalg
from dpmm_jax import precision
from dpmm_jax import preprocess as preprocess_lib
from dpmm_jax import stats as stats_lib
from dpmm_jax import student_t
from dpmm_jax import validation
from dpmm_jax.conjugate import dirichlet, niw, nix
from dpmm_jax.models import diag as diag_model

Component = Union[niw.NIW, nix.NIX]


class Priors(NamedTuple):
  """Prior of the VBrand model (a pytree; J known classes, T novel components).

  Attributes:
    alpha: (J+1,) Dirichlet concentration, index 0 = novelty mass alpha_0, then alpha_j.
    gamma: () stick-breaking concentration of the novel classes.
    components: (J+T, ...) NIW (full) or NIX (diag, fields (J+T, D)) priors: rho_1..rho_J
      of the known classes, then T copies of the novelty base measure rho_0.
  """
  alpha: jax.Array
  gamma: jax.Array
  components: Any


class Params(NamedTuple):
  """Variational parameters of the globals (a pytree).

  Attributes:
    concentration: (J+1,) eta of q(pi) = Dir(eta), index 0 = novelty mass.
    stick_a, stick_b: (T-1,) q(v_l) = Beta(a_l, b_l), l < T (v_T = 1).
    components: (J+T, ...) NIW / NIX factors q(mu_k, Sigma_k).
  """
  concentration: jax.Array
  stick_a: jax.Array
  stick_b: jax.Array
  components: Any


class Info(NamedTuple):
  """CAVI diagnostics: elbo_trace (max_iter + 1,) ELBO of the globals after 0, 1, ...
  M-steps (NaN after the last); num_iters (); converged ()."""
  elbo_trace: jax.Array
  num_iters: jax.Array
  converged: jax.Array


class Discovery(NamedTuple):
  """Result of ``discover`` (a pytree).

  Attributes:
    assignments: (M,) argmax_k phi_mk: a known class j < J, or J + l for novel class l.
    responsibilities: (M, J+T) phi.
    novelty_probability: (M,) sum of the novel columns of phi.
    params: fitted ``Params`` (best restart).
    priors: the ``Priors`` used.
    elbo: () final ELBO of the best restart.
    elbo_trace: (max_iter + 1,) its ELBO trace (NaN-padded).
    iterations: () CAVI sweeps run by the best restart.
    converged: () whether it met ``tol``.
    restart_elbos: (R,) final ELBO of every restart.
    num_known: J (static).
    transform: the detector's preprocessing transform (or None), used by ``predict_proba``.
  """
  assignments: jax.Array
  responsibilities: jax.Array
  novelty_probability: jax.Array
  params: Params
  priors: Priors
  elbo: jax.Array
  elbo_trace: jax.Array
  iterations: jax.Array
  converged: jax.Array
  restart_elbos: jax.Array
  transform: Any

  @property
  def num_known(self) -> int:
    return int(self.priors.alpha.shape[0]) - 1

  @property
  def novel_counts(self) -> np.ndarray:
    """(T,) number of points assigned to each novel component."""
    j = self.num_known
    t = self.responsibilities.shape[1] - j
    a = np.asarray(self.assignments)
    return np.bincount(a[a >= j] - j, minlength=t)

  @property
  def num_novel_clusters(self) -> int:
    """Novel components with at least one assigned point."""
    return int(np.sum(self.novel_counts > 0))


def _is_full(components) -> bool:
  return isinstance(components, niw.NIW)


# --------------------------------------------------------------------- expectations
def expected_log_weights(params: Params):
  """(J+T,) E_q log pi~_k: psi(eta_j) - psi(sum eta) for known classes, and
  E log pi_0 + E log v_l + sum_{h<l} E log(1 - v_h) for novel class l (v_T = 1)."""
  e_log_pi = dirichlet.expected_log(params.concentration)
  e_log_omega = dirichlet.stick_breaking_expected_log_weights(params.stick_a, params.stick_b)
  return jnp.concatenate([e_log_pi[1:], e_log_pi[0] + e_log_omega])


def expected_weights(params: Params):
  """(J+T,) E_q pi~_k = E pi_j, and E pi_0 E v_l prod_{h<l} E(1 - v_h) (E v_T = 1); the
  factors are independent under q, so these are the exact expectations (they sum to 1)."""
  e_pi = dirichlet.mean(params.concentration)
  e_v = params.stick_a / (params.stick_a + params.stick_b)
  one = jnp.ones((1,), e_pi.dtype)
  e_v = jnp.concatenate([e_v, one])
  rest = jnp.concatenate([one, jnp.cumprod(1.0 - e_v[:-1])])
  return jnp.concatenate([e_pi[1:], e_pi[0] * e_v * rest])


def expected_log_likelihood(components, y):
  """(M, K) E_q log N(y_m | mu_k, Sigma_k) (NIW) or its per-dimension product (NIX).

  NIW: -1/2 [D log 2 pi + E log|Sigma_k| + D/kappa_k + nu_k (y - m_k)^T Psi_k^-1 (y - m_k)]
  (``niw.expected_log_likelihood``); NIX: ``nix.expected_log_likelihood``.
  """
  if _is_full(components):
    return niw.expected_log_likelihood(components, y)
  return nix.expected_log_likelihood(components, y)


def logits(params: Params, y):
  """(M, J+T) r_mk = E log pi~_k + E log N(y_m | Theta_k) (paper eqs. 12-13)."""
  return expected_log_weights(params)[None, :] + expected_log_likelihood(params.components, y)


def responsibilities(params: Params, y):
  """(M, J+T) phi = softmax(r) (the CAVI E-step)."""
  return jax.nn.softmax(logits(params, y), axis=-1)


def kl_globals(params: Params, priors: Priors):
  """KL(q(globals) || p(globals)): Dirichlet + sticks + every component factor."""
  kl = dirichlet.kl_divergence(params.concentration, priors.alpha)
  kl = kl + jnp.sum(dirichlet.beta_kl_divergence(
      params.stick_a, params.stick_b, jnp.ones_like(params.stick_a), priors.gamma))
  if _is_full(params.components):
    kl = kl + jnp.sum(niw.kl_divergence(params.components, priors.components))
  else:
    kl = kl + jnp.sum(nix.kl_divergence(params.components, priors.components))
  return kl


def elbo(params: Params, y, priors: Priors):
  """The profiled ELBO: sum_m logsumexp_k r_mk - KL(globals).

  Equals ``elbo_at(params, y, priors, responsibilities(params, y))``, the largest ELBO
  over phi for these globals. Pure and differentiable in ``params`` and ``y`` (the LRVB
  covariance is built from its Hessian).

  Args:
    params: ``Params``.
    y: (M, D) test points in the detector's preprocessed space.
    priors: ``Priors``.
  Returns:
    () ELBO.
  """
  return jnp.sum(jax.nn.logsumexp(logits(params, y), axis=-1)) - kl_globals(params, priors)


def elbo_at(params: Params, y, priors: Priors, resp):
  """The ELBO at arbitrary responsibilities: sum phi (r - log phi) - KL(globals).

  Args:
    params, y, priors: as in ``elbo``.
    resp: (M, J+T) phi, rows on the simplex (zeros allowed: 0 log 0 = 0).
  """
  r = logits(params, y)
  entropy_part = jnp.sum(jnp.where(resp > 0, resp * (r - jnp.log(jnp.where(resp > 0, resp, 1.0))),
                                   0.0))
  return entropy_part - kl_globals(params, priors)


# -------------------------------------------------------------------------- M-step
@precision.float32_matmuls
def _diag_stats(y, resp):
  """(count (K,), mean (K, D), centred squared deviations (K, D)), one class at a time."""
  count = jnp.sum(resp, 0)
  centre = jnp.mean(y, 0)
  yc = y - centre
  safe = jnp.where(count > 0, count, 1.0)
  mean = (resp.T @ yc) / safe[:, None]

  def one(args):
    r_k, m_k = args
    d = yc - m_k
    return r_k @ (d * d)

  sq_dev = jax.lax.map(one, (resp.T, mean))
  return count, mean + centre, sq_dev


def m_step(resp, y, priors: Priors) -> Params:
  """Closed-form CAVI updates of every global factor given phi (paper eqs. 9-11).

  eta_0 = alpha_0 + sum_l N_{J+l}; eta_j = alpha_j + N_j; a_l = 1 + N_{J+l};
  b_l = gamma + sum_{l'>l} N_{J+l'}; q(Theta_k) = conjugate posterior of rho_k given the
  phi-weighted centred statistics (``niw.posterior`` / ``nix.posterior``, which use the
  outer product kappa N/(kappa + N) (ybar - mu)(ybar - mu)^T).

  Args:
    resp: (M, J+T) responsibilities.
    y: (M, D) points.
    priors: ``Priors``.
  Returns:
    ``Params``.
  """
  num_known = priors.alpha.shape[0] - 1
  if _is_full(priors.components):
    st = stats_lib.from_responsibilities(y, resp, full=True)
    count = st.count
    comps = niw.posterior(priors.components, count, st.mean, st.scatter)
  else:
    count, mean, sq_dev = _diag_stats(y, resp)
    comps = nix.posterior(priors.components, count, mean, sq_dev)
  novel = count[num_known:]
  concentration = priors.alpha + jnp.concatenate([jnp.sum(novel)[None], count[:num_known]])
  tail = jnp.cumsum(novel[::-1])[::-1]                        # sum_{l' >= l} N_{J+l'}
  stick_a = 1.0 + novel[:-1]
  stick_b = priors.gamma + tail[1:]
  return Params(concentration, stick_a, stick_b, comps)


def prior_params(priors: Priors) -> Params:
  """q equal to the prior (the state of an empty batch)."""
  t = priors.components.loc.shape[0] - (priors.alpha.shape[0] - 1)
  dtype = priors.alpha.dtype
  return Params(priors.alpha, jnp.ones((t - 1,), dtype),
                jnp.full((t - 1,), priors.gamma, dtype), priors.components)


# ---------------------------------------------------------------------------- CAVI
@functools.partial(jax.jit, static_argnames=("max_iter",))
def fit(params0: Params, y, priors: Priors, *, tol=1e-6, max_iter: int = 500):
  """CAVI from ``params0`` until the relative ELBO change is below ``tol``.

  Each sweep is one pass over the data: r = logits(params), ELBO(params) =
  sum logsumexp r - KL (recorded), phi = softmax(r), params = m_step(phi). The loop stops
  when |L_t - L_{t-1}| <= tol max(1, |L_t|) or after ``max_iter`` M-steps; the ELBO of
  the returned (last M-step's) ``params`` ends the trace.

  Args:
    params0: initial ``Params``.
    y: (M, D) points (M >= 1).
    priors: ``Priors``.
    tol: relative tolerance.
    max_iter: cap on sweeps (static).
  Returns:
    (Params, Info): ``Info.elbo_trace[t]`` is the ELBO after t M-steps, t = 0..num_iters.
  """
  dtype = y.dtype
  trace = jnp.full((max_iter + 1,), jnp.nan, dtype)

  def cond(carry):
    _, _, _, it, converged = carry
    return jnp.logical_and(it < max_iter, jnp.logical_not(converged))

  def body(carry):
    params, last, trace_, it, _ = carry
    r = logits(params, y)
    value = jnp.sum(jax.nn.logsumexp(r, axis=-1)) - kl_globals(params, priors)
    converged = jnp.abs(value - last) <= tol * jnp.maximum(1.0, jnp.abs(value))
    new = m_step(jax.nn.softmax(r, axis=-1), y, priors)
    return new, value, trace_.at[it].set(value), it + 1, converged

  init = (params0, jnp.asarray(-jnp.inf, dtype), trace, jnp.array(0, jnp.int32),
          jnp.array(False))
  params, last, trace, it, converged = jax.lax.while_loop(cond, body, init)
  final = elbo(params, y, priors)
  converged = jnp.logical_or(converged, jnp.abs(final - last)
                             <= tol * jnp.maximum(1.0, jnp.abs(final)))
  return params, Info(trace.at[it].set(final), it, converged)


# ----------------------------------------------------------------- initialisation
def predictive_log_density(components, y):
  """(M, K) log Student-t predictive of every factor (NIW: multivariate; NIX: product)."""
  if _is_full(components):
    pred = niw.predictive(components)
    maha = linalg.class_mahalanobis_sq(y, pred.loc, pred.chol_scale)
    return student_t.mvt_log_density_from_mahalanobis(maha, pred.df, pred.log_normalizer,
                                                      y.shape[-1])
  df, loc, scale_sq = nix.predictive(components)
  terms = diag_model.t_terms(df, loc, scale_sq)
  size = blocks.class_block_size(y.shape[0], loc.shape[0], loc.shape[1])
  return blocks.map_class_blocks(functools.partial(diag_model.t_terms_block, y), terms, size)


@precision.float32_matmuls
def _kmeans_pp(key, y, mask, num_centres: int, num_lloyd: int = 25):
  """k-means++ seeding and Lloyd iterations on the rows where ``mask`` is True.

  Returns (M,) cluster index per row (meaningless where mask is False). If fewer rows
  than centres are flagged, some centres repeat and their clusters stay empty.
  """
  m = y.shape[0]
  w = mask.astype(y.dtype)
  key0, key = jax.random.split(key)
  logits0 = jnp.where(mask, 0.0, -jnp.inf)
  first = jax.random.categorical(key0, jnp.where(jnp.any(mask), logits0, 0.0))
  centres = jnp.zeros((num_centres, y.shape[1]), y.dtype).at[0].set(y[first])
  d2 = jnp.sum((y - y[first]) ** 2, -1)

  def seed(i, carry):
    centres_, d2_, key_ = carry
    key_, sub = jax.random.split(key_)
    p = d2_ * w
    logit = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
    logit = jnp.where(jnp.any(p > 0), logit, logits0)
    logit = jnp.where(jnp.any(jnp.isfinite(logit)), logit, 0.0)
    idx = jax.random.categorical(sub, logit)
    centres_ = centres_.at[i].set(y[idx])
    d2_ = jnp.minimum(d2_, jnp.sum((y - y[idx]) ** 2, -1))
    return centres_, d2_, key_

  centres, _, _ = jax.lax.fori_loop(1, num_centres, seed, (centres, d2, key))

  def assign(c):
    dist = (jnp.sum(y * y, -1)[:, None] - 2.0 * y @ c.T + jnp.sum(c * c, -1)[None, :])
    return jnp.argmin(dist, -1)

  def lloyd(_, c):
    z = assign(c)
    onehot = jax.nn.one_hot(z, num_centres, dtype=y.dtype) * w[:, None]
    n = jnp.sum(onehot, 0)
    new = (onehot.T @ y) / jnp.where(n > 0, n, 1.0)[:, None]
    return jnp.where((n > 0)[:, None], new, c)

  centres = jax.lax.fori_loop(0, num_lloyd, lloyd, centres)
  return assign(centres)


def initial_labels(key, y, priors: Priors):
  """(M,) hard labels: the priors' label posterior (known class or "new"), then k-means++
  on the rows flagged new (labels J + cluster)."""
  num_known = priors.alpha.shape[0] - 1
  t = priors.components.loc.shape[0] - num_known
  known = jax.tree_util.tree_map(lambda a: a[:num_known + 1], priors.components)
  lp = predictive_log_density(known, y)                              # (M, J+1)
  scores = jnp.concatenate([jnp.log(priors.alpha[1:]) + lp[:, :num_known],
                            jnp.log(priors.alpha[0]) + lp[:, num_known:]], axis=-1)
  z = jnp.argmax(scores, -1)
  novel = z == num_known
  clusters = _kmeans_pp(key, y, novel, t)
  return jnp.where(novel, num_known + clusters, z)


@jax.jit
def init_params(key, y, priors: Priors) -> Params:
  """Detector initialisation: ``initial_labels`` then the M-step of their one-hot phi."""
  z = initial_labels(key, y, priors)
  resp = jax.nn.one_hot(z, priors.components.loc.shape[0], dtype=y.dtype)
  return m_step(resp, y, priors)


@functools.partial(jax.jit, static_argnames=("max_iter",))
def fit_restarts(keys, y, priors: Priors, tol, max_iter: int):
  """Detector initialisation + CAVI for each key (vmapped); returns the best restart.

  Args:
    keys: (R, 2) PRNG keys (one k-means++ seed per restart).
    y: (M, D) points.
    priors: ``Priors``.
    tol, max_iter: as in ``fit``.
  Returns:
    (Params, Info, restart_elbos (R,)) of the restart with the largest final ELBO.
  """
  def one(key):
    params, info = fit(init_params(key, y, priors), y, priors, tol=tol, max_iter=max_iter)
    return params, info, info.elbo_trace[info.num_iters]

  params, info, finals = jax.vmap(one)(keys)
  best = jnp.argmax(jnp.where(jnp.isfinite(finals), finals, -jnp.inf))
  pick = lambda tree: jax.tree_util.tree_map(lambda a: a[best], tree)
  return pick(params), pick(info), finals


# ------------------------------------------------------------------ priors from a detector
def _paper_novelty_prior(dim: int, dtype, full: bool):
  """The paper's hand-set rho_0 = (mu0 = 0, nu0 = p + 2, lambda0 = 0.1, Psi0 = 10 I)
  (in the detector's space); the NIX analogue has nu0 s0^2 = 10 per dimension."""
  if full:
    return niw.NIW(jnp.zeros((dim,), dtype), jnp.asarray(0.1, dtype),
                   jnp.asarray(dim + 2.0, dtype), 10.0 * jnp.eye(dim, dtype=dtype))
  df = jnp.full((dim,), dim + 2.0, dtype)
  return nix.NIX(jnp.zeros((dim,), dtype), jnp.full((dim,), 0.1, dtype), df, 10.0 / df)


@precision.float32_matmuls
def _class_posteriors(det):
  """(known-class NIW/NIX posteriors (J, ...), EB prior H, training counts (J,)).

  The detector stores predictive Student-t parameters; the class posteriors are recovered
  exactly by inverting the predictive: NIW nu' = df + D - 1, kappa' = kappa0 + N_j,
  Psi' = kappa' (nu' - D + 1)/(kappa' + 1) L L^T; NIX s'^2 = scale_sq kappa'/(kappa' + 1).
  """
  p = det.params
  counts = jnp.exp(p.log_counts)
  if det.model == "full":
    hyper = p.hyper
    dim = hyper.loc.shape[-1]
    kappa = hyper.mean_concentration + counts
    df = p.class_pred.df + dim - 1.0
    chol = p.class_pred.chol_scale
    factor = kappa * (df - dim + 1.0) / (kappa + 1.0)
    scale = factor[:, None, None] * (chol @ jnp.swapaxes(chol, -1, -2))
    post = niw.NIW(p.class_pred.loc, kappa, df, 0.5 * (scale + jnp.swapaxes(scale, -1, -2)))
    base = niw.prior(hyper.loc, hyper.mean_cov, hyper.df, hyper.mean_concentration)
    return post, base, counts
  hyper = p.hyper
  kappa = hyper.mean_concentration[None, :] + counts[:, None]
  post = nix.NIX(p.class_loc, kappa, p.class_df, p.class_scale_sq * kappa / (kappa + 1.0))
  base = nix.prior(hyper.loc, hyper.var, hyper.df, hyper.mean_concentration)
  return post, base, counts


def _flattened(loc, cov, strength, full: bool):
  """The paper's informative prior from estimates (mu^, Sigma^) at strength c:
  NIW(mu^, lambda = c, nu = c + D + 1, Psi = c Sigma^) (so E[Sigma] = Sigma^); the NIX
  analogue has kappa = c, nu = c + 2, s^2 = c Sigma^_dd / (c + 2) (E[sigma^2] = Sigma^_dd)."""
  c = jnp.asarray(strength, loc.dtype)
  c = jnp.broadcast_to(c, loc.shape[:-1])
  if full:
    dim = loc.shape[-1]
    return niw.NIW(loc, c, c + dim + 1.0, c[:, None, None] * cov)
  cd = jnp.broadcast_to(c[:, None], loc.shape)
  return nix.NIX(loc, cd, cd + 2.0, cd * cov / (cd + 2.0))


def _robust_estimates(det, robust_data, full: bool, random_state):
  """Per-class MCD location/covariance (sklearn MinCovDet) in the detector's space, for
  classes with N_j > D; other classes return None (they keep the posterior estimates)."""
  try:
    from sklearn.covariance import MinCovDet   # lazily: scikit-learn is optional
  except ImportError as err:   # pragma: no cover
    raise ImportError("robust=True needs scikit-learn (sklearn.covariance.MinCovDet).") from err
  if not (isinstance(robust_data, (tuple, list)) and len(robust_data) == 2):
    raise TypeError("robust_data must be a pair (x_train, y_train) of the detector's "
                    "training data.")
  x, y = robust_data
  x = validation.features(x, "robust_data[0]", dim=det.input_dim)
  y, _ = validation.labels(y, x.shape[0], det.num_classes, name="robust_data[1]")
  z = np.asarray(_to_model_space(det, x), np.float64)
  out = []
  for j in range(det.num_classes):
    zj = z[y == j]
    if zj.shape[0] <= zj.shape[1]:
      out.append(None)
      continue
    mcd = MinCovDet(random_state=random_state).fit(zj)
    cov = mcd.covariance_ if full else np.diag(mcd.covariance_)
    out.append((mcd.location_, cov))
  return out


def priors_from_detector(det, max_new_classes: int = 20, *, alpha: float = 1.0,
                         gamma: Optional[float] = None, class_weights="train",
                         known_strength: Optional[float] = None, novelty_prior=None,
                         robust_data=None, random_state: int = 0) -> Priors:
  """Priors of the VBrand model from a fitted ``full`` or ``diag`` detector.

  Args:
    det: fitted ``Detector`` with model ``"full"`` (NIW factors) or ``"diag"`` (NIX).
    max_new_classes: truncation T of the novel classes.
    alpha: alpha_0, the prior mass of the novelty component (the DPMM concentration).
    gamma: stick-breaking concentration of the novel classes (default ``alpha``, which
      makes the prior over test partitions the DPMM's).
    class_weights: alpha_j of the known classes: ``"train"`` (the training counts N_j),
      a positive number (the same for every class; the paper uses 0.1), or a (J,) array.
    known_strength: None keeps the exact class posteriors rho_j = p(Theta_j | D_j);
      a number c flattens them as the paper does with its robust estimates:
      rho_j = NIW(mu^_j, lambda = c, nu = c + D + 1, Psi = c Sigma^_j), where (mu^_j,
      Sigma^_j) are the posterior means (or the MCD estimates with ``robust_data``).
    novelty_prior: rho_0: None = the detector's empirical-Bayes prior H; ``"paper"`` =
      the paper's hand-set (0, nu0 = D + 2, lambda0 = 0.1, Psi0 = 10 I); or an unbatched
      ``niw.NIW`` / ``nix.NIX`` in the detector's preprocessed space.
    robust_data: optional (x_train, y_train): per-class MCD estimates
      (``sklearn.covariance.MinCovDet``) replace (mu^_j, Sigma^_j) for classes with
      N_j > D (the paper's stage 1); the strength is ``known_strength`` or N_j.
    random_state: seed of the MCD.
  Returns:
    ``Priors``.
  Raises:
    TypeError, ValueError: wrong detector model or invalid options.
  """
  _check_discovery_detector(det)
  t = validation.positive_int(max_new_classes, "max_new_classes")
  validation.positive(alpha, "alpha")
  gamma = alpha if gamma is None else validation.positive(gamma, "gamma")
  validation.positive_or_none(known_strength, "known_strength")
  full = det.model == "full"
  post, base, counts = _class_posteriors(det)
  dtype = counts.dtype
  num_known = det.num_classes
  dim = post.loc.shape[-1]
  # known-class weights
  if isinstance(class_weights, str):
    if class_weights != "train":
      raise ValueError(f"class_weights must be 'train', a positive number or a (J,) array, "
                       f"got {class_weights!r}.")
    weights = counts
  else:
    w = np.asarray(class_weights, np.float64)
    if w.ndim == 0:
      w = np.full((num_known,), float(w))
    if w.shape != (num_known,) or not np.all(np.isfinite(w)) or np.any(w <= 0):
      raise ValueError(f"class_weights must be positive and finite with shape ({num_known},) "
                       f"or a scalar, got shape {w.shape}.")
    weights = jnp.asarray(w, dtype)
  # known-class priors
  if robust_data is not None or known_strength is not None:
    if full:
      est_loc = post.loc
      est_cov = post.scale / (post.df - dim - 1.0)[:, None, None]
    else:
      est_loc = post.loc
      est_cov = post.df * post.scale_sq / (post.df - 2.0)
    est_loc, est_cov = np.array(est_loc, np.float64), np.array(est_cov, np.float64)
    if robust_data is not None:
      for j, est in enumerate(_robust_estimates(det, robust_data, full, random_state)):
        if est is not None:
          est_loc[j], est_cov[j] = est
    strength = (np.full((num_known,), float(known_strength)) if known_strength is not None
                else np.asarray(counts, np.float64))
    known = _flattened(jnp.asarray(est_loc, dtype), jnp.asarray(est_cov, dtype),
                       jnp.asarray(strength, dtype), full)
  else:
    known = post
  # novelty base measure
  if novelty_prior is None:
    rho0 = base
  elif isinstance(novelty_prior, str):
    if novelty_prior != "paper":
      raise ValueError(f"novelty_prior must be None, 'paper' or an NIW/NIX, got "
                       f"{novelty_prior!r}.")
    rho0 = _paper_novelty_prior(dim, dtype, full)
  else:
    want = niw.NIW if full else nix.NIX
    if not isinstance(novelty_prior, want):
      raise TypeError(f"novelty_prior for the {det.model} model must be a {want.__name__}, "
                      f"got {type(novelty_prior).__name__}.")
    rho0 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), novelty_prior)
    if full:
      rho0 = niw.NIW(rho0.loc, rho0.mean_concentration, rho0.df, rho0.scale)
      if rho0.loc.shape != (dim,) or rho0.scale.shape != (dim, dim):
        raise ValueError(f"novelty_prior must have loc ({dim},) and scale ({dim}, {dim}).")
      if not float(rho0.df) > dim - 1 or not float(rho0.mean_concentration) > 0:
        raise ValueError("novelty_prior needs df > D - 1 and mean_concentration > 0.")
      if not np.all(np.linalg.eigvalsh(np.asarray(rho0.scale, np.float64)) > 0):
        raise ValueError("novelty_prior.scale must be positive definite.")
    else:
      rho0 = nix.NIX(*(jnp.broadcast_to(a, (dim,)) for a in rho0))
      if not all(bool(jnp.all(a > 0)) for a in rho0[1:]):
        raise ValueError("novelty_prior needs positive mean_concentration, df, scale_sq.")
  rho0_t = jax.tree_util.tree_map(
      lambda a: jnp.broadcast_to(jnp.asarray(a, dtype), (t,) + jnp.shape(a)), rho0)
  if not full:
    known = nix.NIX(*(jnp.broadcast_to(a, (num_known, dim)) for a in known))
  components = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), known, rho0_t)
  alpha_vec = jnp.concatenate([jnp.asarray([alpha], dtype), jnp.asarray(weights, dtype)])
  return Priors(alpha_vec, jnp.asarray(gamma, dtype), components)


# ------------------------------------------------------------------------- public API
_MODELS = ("full", "diag")


def _check_discovery_detector(det):
  from dpmm_jax import api   # local: api imports nothing from here
  if not isinstance(det, api.Detector):
    raise TypeError(f"Expected a dpmm_jax.Detector (from fit_detector or load), got "
                    f"{type(det).__name__}.")
  if det.model not in _MODELS:
    raise ValueError(f"Novelty discovery needs a detector of model 'full' (NIW) or 'diag' "
                     f"(NIX), got {det.model!r}; refit with model='full' or 'diag'.")


def _to_model_space(det, x):
  x = jnp.asarray(x)
  if det.transform is not None:
    x = preprocess_lib.apply(det.transform, x)
  return x


@entry_points.public_call
def discover(det, x_test, max_new_classes: int = 20, *, alpha: float = 1.0,
             gamma: Optional[float] = None, class_weights="train",
             known_strength: Optional[float] = None, novelty_prior=None,
             robust_data=None, num_restarts: int = 4, key=None, tol: float = 1e-6,
             max_iter: int = 500) -> Discovery:
  """Clusters a test batch into the detector's known classes and up to T novel classes.

  One call: priors from the detector (``priors_from_detector``), detector initialisation
  with ``num_restarts`` k-means++ seeds on the points flagged new, CAVI to a relative
  ELBO tolerance (vmapped over restarts), best ELBO kept.

  Args:
    det: fitted ``Detector`` of model ``"full"`` or ``"diag"``.
    x_test: (M, D) test features (raw, like the training features; M may be 0).
    max_new_classes: truncation T of the novel classes.
    alpha, gamma, class_weights, known_strength, novelty_prior, robust_data: see
      ``priors_from_detector``.
    num_restarts: R k-means++ initialisations run in parallel.
    key: PRNG key for the restarts (default PRNGKey(0)).
    tol: relative ELBO tolerance; max_iter: cap on CAVI sweeps.
  Returns:
    ``Discovery`` (assignments (M,), responsibilities (M, J+T), novelty_probability (M,),
    params, priors, elbo, elbo_trace, iterations, converged, restart_elbos, transform).
  Raises:
    TypeError, ValueError: invalid detector or inputs (NaN/inf rows, wrong dimension).
  """
  _check_discovery_detector(det)
  num_restarts = validation.positive_int(num_restarts, "num_restarts")
  validation.em_options(tol, max_iter)
  key = jax.random.PRNGKey(0) if key is None else validation.prng_key(key)
  x = validation.features(x_test, "x_test", dim=det.input_dim, allow_empty=True)
  priors = priors_from_detector(det, max_new_classes, alpha=alpha, gamma=gamma,
                                class_weights=class_weights, known_strength=known_strength,
                                novelty_prior=novelty_prior, robust_data=robust_data)
  dtype = priors.alpha.dtype
  num_components = priors.components.loc.shape[0]
  if x.shape[0] == 0:
    params = prior_params(priors)
    e = jnp.asarray(-kl_globals(params, priors), dtype)
    return Discovery(jnp.zeros((0,), jnp.int32), jnp.zeros((0, num_components), dtype),
                     jnp.zeros((0,), dtype), params, priors, e,
                     jnp.full((max_iter + 1,), jnp.nan, dtype).at[0].set(e),
                     jnp.asarray(0, jnp.int32), jnp.asarray(True),
                     jnp.full((num_restarts,), e), det.transform)
  y = _to_model_space(det, jnp.asarray(x, dtype))
  keys = jax.random.split(key, num_restarts)
  params, info, finals = fit_restarts(keys, y, priors, jnp.asarray(tol, dtype), max_iter)
  resp = responsibilities(params, y)
  final = info.elbo_trace[info.num_iters]
  if not bool(jnp.isfinite(final)) or not bool(jnp.all(jnp.isfinite(resp))):
    raise ValueError(
        "CAVI produced a non-finite ELBO or responsibilities; the test features are "
        "numerically degenerate for this detector (rescale them or enable jax_enable_x64).")
  num_known = priors.alpha.shape[0] - 1
  return Discovery(jnp.argmax(resp, -1).astype(jnp.int32), resp,
                   jnp.sum(resp[:, num_known:], -1), params, priors, final,
                   info.elbo_trace, info.num_iters, info.converged, finals, det.transform)


@entry_points.public_call
def predict_proba(result: Discovery, x_new):
  """(M', J+T) collapsed predictive p(xi_new = k | test batch) for new points.

  p(k | y) is proportional to E_q[pi~_k] St(y | q(Theta_k)): expected weights times the
  Student-t predictive of each fitted factor (unoccupied novel components keep q = rho_0
  and act as the "brand-new class"). On an empty batch this equals the detector's label
  posterior: its known columns directly and the sum of the T novel columns as the
  new-class event. The novelty probability of new points is the sum of the last T columns.

  Args:
    result: ``Discovery`` from ``discover``.
    x_new: (M', D) raw features (M' may be 0).
  Returns:
    (M', J+T) probabilities.
  """
  if not isinstance(result, Discovery):
    raise TypeError(f"Expected a Discovery (from dpmm_jax.discover), got "
                    f"{type(result).__name__}.")
  comps = result.params.components
  dim_in = (result.transform.loc.shape[0] if result.transform is not None
            else comps.loc.shape[-1])
  x = validation.features(x_new, "x_new", dim=dim_in, allow_empty=True)
  dtype = result.priors.alpha.dtype
  if x.shape[0] == 0:
    return jnp.zeros((0, comps.loc.shape[0]), dtype)
  y = jnp.asarray(x, dtype)
  if result.transform is not None:
    y = preprocess_lib.apply(result.transform, y)
  return _predict_proba(result.params, y)


@jax.jit
def _predict_proba(params: Params, y):
  logw = jnp.log(expected_weights(params))
  return jax.nn.softmax(logw[None, :] + predictive_log_density(params.components, y), -1)
