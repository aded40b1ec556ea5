"""Linear response variational Bayes (LRVB): corrected covariances for mean-field fits.

Mean-field variational Bayes (MFVB) gets posterior means right and covariances wrong:
``q`` factorises, so ``Cov_q`` is block diagonal and usually too small. LRVB (Giordano,
Broderick and Jordan; ``../shared/papers/004``) corrects it from the fitted solution
alone. With ``m`` the mean parameters of the converged ``q``, ``V = Cov_q`` (block
diagonal) and ``H = d^2 E_q[log p] / dm dm^T``, the corrected covariance is (Eq. 10)

    Sigma_LR = (I - V H)^-1 V,

and for a nuisance block ``z`` with ``V_az = 0`` the covariance of the globals ``a`` is
the Schur complement (Eq. 11)

    Sigma_a = (I - V_a H_aa - V_a H_az (I - V_z H_zz)^-1 V_z H_za)^-1 V_a.

Both are the inverse negative Hessian of the ELBO in the mean parameters. The Hessian
of the ELBO in *any* smooth unconstrained chart ``eta`` of the variational parameters
gives the same answer at a stationary point (chain rule: the first-derivative term
vanishes there), and maximising the nuisance block out first (profiling) reproduces the
Schur complement exactly. So the generic recipe implemented by ``covariance`` is

    Sigma_g = G (-d^2 L / d eta d eta^T)^-1 G^T,    G = d E_q[g] / d eta,

for any smooth functional ``g`` of the parameters (its LRVB covariance; the delta rule
``grad g^T Sigma grad f`` for functions of the mean parameters is the special case
``delta_covariance``). ``L`` is an objective written as a function of a parameter pytree
(usually the ELBO with the local assignments profiled out); JAX gives the Hessian densely
(``jax.hessian``) or as Hessian-vector products for conjugate gradients
(``jax.scipy.sparse.linalg.cg``) when the dense Hessian does not fit.

The formulas assume a stationary point: CAVI's stopping rule is a relative change of the
bound, not stationarity, so ``covariance`` can polish the solution with a few Newton steps
in the chart first (``polish``) and reports the gradient norm it was left with.
"""
import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jax.scipy.linalg import cho_factor, cho_solve

from dpmm_jax import compiler
from dpmm_jax import precision

METHODS = ("dense", "cg")


class LRVBInfo(NamedTuple):
  """Diagnostics of an LRVB covariance.

  objective: () the objective at the point used.
  grad_norm: () max |dL/d eta| there (should be ~0: LRVB assumes a stationary point).
  max_eigenvalue: () largest eigenvalue of d^2 L/d eta^2 (must be < 0; NaN for ``cg``,
    which never forms the Hessian).
  cg_residual: () largest relative residual |(-H) x - G^T| / |G^T| of the solves (0 for
    ``dense``).
  dim: number of free parameters (the size of the Hessian).
  """
  objective: jax.Array
  grad_norm: jax.Array
  max_eigenvalue: jax.Array
  cg_residual: jax.Array
  dim: int

  @property
  def ok(self) -> bool:
    """The Hessian is negative definite (dense path) and the CG solves converged."""
    eig = float(self.max_eigenvalue)
    return bool((eig < 0 or eig != eig) and float(self.cg_residual) < 1e-3)


def _check_callable(value, name):
  if not callable(value):
    raise TypeError(f"{name} must be a callable, got {type(value).__name__}.")


def _flat_objective(objective, params, args):
  flat, unravel = ravel_pytree(params)
  return (lambda v: objective(unravel(v), *args)), unravel, flat


def _check_args(args):
  if not isinstance(args, tuple):
    raise TypeError(f"args must be a tuple of extra objective arguments, got "
                    f"{type(args).__name__}.")
  return args


# A polish step that lowers the objective by at most this many eps times its magnitude
# (round-off) is taken when it shrinks the gradient (``newton_polish``).
POLISH_NOISE_ULPS = 8.0


def newton_polish(objective: Callable, params, num_steps: int = 3, *, args=()):
  """A few damped Newton steps towards a stationary point of ``objective`` (maximised).

  Each step solves ``(-H) d = grad`` (dense Hessian; ``H`` must be negative definite
  near a maximum) and halves the step up to 10 times until the objective does not
  decrease (a step that never stops decreasing it is not taken). Next to the maximum the
  gain of a step (about ``grad' (-H)^-1 grad / 2``) falls below the objective's round-off,
  so a step that leaves the objective lower by no more than ``POLISH_NOISE_ULPS`` eps
  times its magnitude also counts when it shrinks the gradient: the gradient, not the
  rounded objective, then tells the better point (a float64 objective of -1.8e4 whose
  Newton step cut the gradient norm from 1.5e-6 to 1.4e-11 came out 1.4e-11, 4 ulps,
  lower). Use it on a CAVI
  solution before ``covariance``: CAVI stops on a relative change of its bound, which is
  not stationarity. Runs as one compiled loop, cached per (objective, shapes): pass data
  through ``args`` rather than a fresh closure to reuse the compilation.

  Args:
    objective: (params, *args) -> scalar to maximise.
    params: starting point (a pytree of arrays).
    num_steps: Newton steps.
    args: extra arguments of the objective (a tuple of pytrees).
  Returns:
    the polished params (same structure).
  """
  _check_callable(objective, "objective")
  return _newton(objective, params, _check_args(args), num_steps=int(num_steps))


@functools.partial(compiler.jit, static_argnames=("objective", "num_steps"))
def _newton(objective, params, args, num_steps):
  f, unravel, x = _flat_objective(objective, params, args)
  value_and_grad = jax.value_and_grad(f)

  def step(_, carry):
    x, value, grad = carry
    h = jax.hessian(f)(x)
    d = cho_solve(cho_factor(-0.5 * (h + h.T), lower=True), grad)
    d = jnp.where(jnp.all(jnp.isfinite(d)), d, 0.0)

    def halve(c):
      scale, _, _, _, it = c
      trial = x + 0.5 * scale * d
      return (0.5 * scale,) + value_and_grad(trial) + (trial, it + 1)

    floor = POLISH_NOISE_ULPS * jnp.finfo(x.dtype).eps * jnp.abs(value)

    def better(new_value, new_grad):
      level = (new_value >= value) | (
          (new_value >= value - floor) & (jnp.linalg.norm(new_grad) < jnp.linalg.norm(grad)))
      return jnp.isfinite(new_value) & level

    def worse(c):
      _, new_value, new_grad, _, it = c
      return ~better(new_value, new_grad) & (it < 10)

    # The loop's first pass evaluates the full step x + d (scale 2 halved: 0.5 * 2 * d
    # is d exactly), so the program holds one copy of value_and_grad in the loop and
    # one for the start, not a third for the full step.
    start = (jnp.full((), 2.0, x.dtype), jnp.full((), -jnp.inf, value.dtype),
             jnp.zeros_like(grad), x, jnp.array(-1, jnp.int32))
    _, new_value, new_grad, new_x, _ = jax.lax.while_loop(worse, halve, start)
    accept = better(new_value, new_grad)
    return (jnp.where(accept, new_x, x), jnp.where(accept, new_value, value),
            jnp.where(accept, new_grad, grad))

  value, grad = value_and_grad(x)
  return unravel(jax.lax.fori_loop(0, num_steps, step, (x, value, grad))[0])


def _hvp(f, x):
  grad = jax.grad(f)
  return lambda v: jax.jvp(grad, (x,), (v,))[1]


def _jacobian(functional, unravel, x, args):
  if functional is None:
    return jnp.eye(x.shape[0], dtype=x.dtype)
  g = lambda v: ravel_pytree(functional(unravel(v), *args))[0]
  return jax.jacfwd(g)(x)                                   # (G, n)


@functools.partial(compiler.jit, static_argnames=("objective", "functional"))
@precision.float32_matmuls
def _dense_core(objective, functional, params, args):
  f, unravel, x = _flat_objective(objective, params, args)
  value, grad = jax.value_and_grad(f)(x)
  h = jax.hessian(f)(x)
  h = 0.5 * (h + h.T)
  jac = _jacobian(functional, unravel, x, args)
  max_eig = jnp.max(jnp.linalg.eigvalsh(h))
  sol = cho_solve(cho_factor(-h, lower=True), jac.T)       # (n, G)
  return value, grad, max_eig, jac @ sol


@functools.partial(compiler.jit, static_argnames=("objective", "functional", "max_iter"))
@precision.float32_matmuls
def _cg_core(objective, functional, params, args, tol, max_iter):
  f, unravel, x = _flat_objective(objective, params, args)
  value, grad = jax.value_and_grad(f)(x)
  jac = _jacobian(functional, unravel, x, args)
  hvp = _hvp(f, x)
  neg = lambda v: -hvp(v)
  max_iter = x.shape[0] if max_iter is None else max_iter
  solve = lambda b: jax.scipy.sparse.linalg.cg(neg, b, tol=tol, maxiter=max_iter)[0]
  sol = jax.vmap(solve)(jac).T                               # (n, G)
  res = jax.vmap(neg, in_axes=1, out_axes=1)(sol) - jac.T
  norms = jnp.maximum(jnp.linalg.norm(jac, axis=1), jnp.finfo(x.dtype).tiny)
  return value, grad, jnp.max(jnp.linalg.norm(res, axis=0) / norms), jac @ sol


def covariance(objective: Callable, params, functional: Optional[Callable] = None, *,
               args=(), method: str = "dense", polish: int = 0, cg_tol: float = 1e-8,
               cg_max_iter: Optional[int] = None):
  """LRVB covariance ``G (-H)^-1 G^T`` of a functional at a stationary point.

  Args:
    objective: (params, *args) -> scalar, the (profiled) ELBO as a function of the
      variational parameters in an unconstrained chart (any smooth bijective chart gives
      the same answer at a stationary point).
    params: the fitted parameters (pytree of arrays) in that chart.
    functional: (params, *args) -> array (or pytree) of posterior expectations
      ``E_q[g]`` whose covariance is wanted (flattened in ``ravel_pytree`` order);
      default: the flattened parameters themselves (then the result is ``(-H)^-1``).
    args: extra arguments (data, prior) of objective and functional. The computation
      is compiled once per (objective, functional, shapes); module-level functions with
      the data in ``args`` reuse it across data sets, fresh closures recompile.
    method: "dense" (``jax.hessian``, a Cholesky solve; checks negative definiteness)
      or "cg" (conjugate gradients on Hessian-vector products, one solve per functional
      component; never forms the Hessian).
    polish: Newton steps (``newton_polish``, dense) before the covariance.
    cg_tol: relative tolerance of the CG solves.
    cg_max_iter: CG iteration cap (default: the number of parameters).
  Returns:
    (cov (G, G), LRVBInfo), G = number of functional components.
  Raises:
    TypeError: objective or functional not callable, args not a tuple.
    ValueError: unknown method; dense Hessian not negative definite (not a maximum).
  """
  _check_callable(objective, "objective")
  if functional is not None:
    _check_callable(functional, "functional")
  args = _check_args(args)
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  if polish:
    params = newton_polish(objective, params, polish, args=args)
  dim = int(ravel_pytree(params)[0].shape[0])
  if method == "dense":
    value, grad, max_eig, cov = _dense_core(objective, functional, params, args)
    if not bool(max_eig < 0):
      raise ValueError(
          f"The Hessian of the objective is not negative definite (largest eigenvalue "
          f"{float(max_eig):.3g}): the parameters are not at a maximum (run the fit to "
          "convergence, or use polish=) or the chart has redundant coordinates.")
    residual = jnp.zeros((), cov.dtype)
  else:
    value, grad, residual, cov = _cg_core(
        objective, functional, params, args, cg_tol,
        None if cg_max_iter is None else int(cg_max_iter))
    max_eig = jnp.array(jnp.nan, cov.dtype)
  cov = 0.5 * (cov + cov.T)
  return cov, LRVBInfo(value, jnp.max(jnp.abs(grad)), max_eig, residual, dim)


def polished_covariance(objective: Callable, params, functional: Optional[Callable] = None,
                        *, args=(), method: str = "dense", polish: int = 0):
  """``covariance`` after ``polish`` Newton steps, also returning the polished params.

  The same as ``covariance(..., polish=polish)`` but the caller gets the point the
  covariance was taken at (to report the polished fit alongside it).

  Args:
    objective, params, functional, args, method: as in ``covariance``.
    polish: ``newton_polish`` steps before the covariance (0: none).
  Returns:
    (cov (G, G), LRVBInfo, polished params (same structure as ``params``)).
  """
  if polish:
    params = newton_polish(objective, params, polish, args=args)
  cov, info = covariance(objective, params, functional, args=args, method=method)
  return cov, info, params


@precision.float32_matmuls
def linear_response(var, hess):
  """Eq. 10 in mean parameters: ``(I - V H)^-1 V``.

  Args:
    var: (n, n) mean-field covariance V (block diagonal over the factors).
    hess: (n, n) Hessian H of E_q[log p] in the mean parameters.
  Returns:
    (n, n) LRVB covariance.
  """
  var, hess = jnp.asarray(var), jnp.asarray(hess)
  n = var.shape[0]
  cov = jnp.linalg.solve(jnp.eye(n, dtype=var.dtype) - var @ hess, var)
  return 0.5 * (cov + cov.T)


@precision.float32_matmuls
def schur_covariance(var_a, var_z, hess_aa, hess_az, hess_zz):
  """Eq. 11: LRVB covariance of the globals ``a`` with the nuisance block ``z`` eliminated.

  ``(I - V_a H_aa - V_a H_az (I - V_z H_zz)^-1 V_z H_za)^-1 V_a``, which equals the
  ``a`` block of ``linear_response`` on the joint (V, H) when ``V_az = 0``.

  Args:
    var_a: (na, na); var_z: (nz, nz) mean-field covariances.
    hess_aa: (na, na); hess_az: (na, nz); hess_zz: (nz, nz) blocks of H.
  Returns:
    (na, na) covariance of the globals.
  """
  na, nz = var_a.shape[0], var_z.shape[0]
  eye_a = jnp.eye(na, dtype=var_a.dtype)
  eye_z = jnp.eye(nz, dtype=var_z.dtype)
  inner = jnp.linalg.solve(eye_z - var_z @ hess_zz, var_z @ hess_az.T)   # (nz, na)
  m = eye_a - var_a @ hess_aa - var_a @ hess_az @ inner
  cov = jnp.linalg.solve(m, var_a)
  return 0.5 * (cov + cov.T)


@precision.float32_matmuls
def delta_covariance(cov, jac_f, jac_g=None):
  """Delta rule ``J_f Sigma J_g^T`` for smooth functions f, g of the parameters.

  Args:
    cov: (n, n) covariance of the parameters (e.g. from ``covariance``).
    jac_f: (F, n) Jacobian of f at the estimate; jac_g: (G, n) (default jac_f).
  Returns:
    (F, G) covariance of (f, g).
  """
  jac_g = jac_f if jac_g is None else jac_g
  return jac_f @ cov @ jac_g.T


def standard_deviations(cov):
  """sqrt of the diagonal of a covariance (NaN-free for tiny negative round-off)."""
  return jnp.sqrt(jnp.maximum(jnp.diagonal(cov), 0.0))
