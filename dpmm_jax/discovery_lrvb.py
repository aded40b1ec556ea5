"""LRVB covariances of novelty discovery's global parameters (``dpmm_jax.discovery``).

VBrand's mean-field q(pi) q(v) prod_k q(mu_k, Sigma_k) prod_m q(xi_m) underestimates
the posterior spread of its globals: the assignments couple the novelty weight pi_0,
the sticks and every component. ``discovery.elbo`` is the ELBO with the assignments
profiled out, so its Hessian in an unconstrained chart of the globals is LRVB's Schur
complement (Eq. 11 of ``../shared/papers/004``) and ``lrvb.covariance`` gives the
corrected covariances of any smooth functional, e.g. "the novel classes hold
12 % +- 2 % of the batch".

Chart: the Dirichlet and NIW factors as in ``gmm.Chart`` (log concentration, locations,
log kappa, log(nu - D + 1), Cholesky of Psi^-1 with a log diagonal) plus the logs of the
stick Beta parameters. Full-covariance (NIW) discoveries only.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from dpmm_jax import discovery
from dpmm_jax import gmm
from dpmm_jax import lrvb
from dpmm_jax import precision
from dpmm_jax.conjugate import dirichlet, niw

FUNCTIONALS = ("novelty_weight", "class_weights", "means")


class Chart(NamedTuple):
  """Unconstrained coordinates of ``discovery.Params``: ``globals_`` a ``gmm.Chart`` of
  (concentration, components); log_stick_a, log_stick_b (T-1,)."""
  globals_: gmm.Chart
  log_stick_a: jax.Array
  log_stick_b: jax.Array


def to_chart(params: discovery.Params) -> Chart:
  if not isinstance(params.components, niw.NIW):
    raise ValueError("LRVB covariances of a discovery need full-covariance (NIW) "
                     "components (a detector of model 'full').")
  return Chart(gmm.to_chart(gmm.State(params.concentration, params.components)),
               jnp.log(params.stick_a), jnp.log(params.stick_b))


def from_chart(chart: Chart) -> discovery.Params:
  state = gmm.from_chart(chart.globals_)
  return discovery.Params(state.concentration, jnp.exp(chart.log_stick_a),
                          jnp.exp(chart.log_stick_b), state.components)


def _objective(chart, y, priors):
  return discovery.elbo(from_chart(chart), y, priors)


def _functionals(chart, y, priors):
  del y, priors
  params = from_chart(chart)
  eta = params.concentration
  return (eta[:1] / jnp.sum(eta), eta[1:] / jnp.sum(eta), params.components.loc.reshape(-1))


class Covariances(NamedTuple):
  """cov (G, G) joint LRVB covariance of (novelty_weight (1,) E pi_0, class_weights (J,)
  E pi_j, means ((J+T) D,) E mu_k, known classes first); mean_field (G, G) the
  mean-field one (block diagonal); info; params (polished)."""
  cov: jax.Array
  mean_field: jax.Array
  info: lrvb.LRVBInfo
  params: discovery.Params

  def _slice(self, name):
    num, dim = self.params.components.loc.shape
    num_known = self.params.concentration.shape[0] - 1
    sizes = {"novelty_weight": 1, "class_weights": num_known, "means": num * dim}
    if name not in sizes:
      raise ValueError(f"name must be one of {FUNCTIONALS}, got {name!r}.")
    start = 0
    for n in FUNCTIONALS:
      if n == name:
        return slice(start, start + sizes[n])
      start += sizes[n]

  def block(self, name, mean_field: bool = False):
    s = self._slice(name)
    return (self.mean_field if mean_field else self.cov)[s, s]

  def sd(self, name, mean_field: bool = False):
    return lrvb.standard_deviations(self.block(name, mean_field))


@precision.float32_matmuls
def _mean_field(params: discovery.Params):
  """Cov_q of the same functionals (block diagonal: q factorises)."""
  eta = params.concentration
  total = jnp.sum(eta)
  p = eta / total
  dir_cov = (jnp.diag(p) - jnp.outer(p, p)) / (total + 1.0)        # (J+1, J+1), 0 = novel
  comps = params.components
  num, dim = comps.loc.shape
  means = comps.scale / (comps.mean_concentration * (comps.df - dim - 1.0))[:, None, None]
  return jax.scipy.linalg.block_diag(dir_cov, *means)


def posterior_covariance(params: discovery.Params, y, priors: discovery.Priors, *,
                         polish: int = 3, method: str = "dense") -> Covariances:
  """LRVB covariances of the novelty weight, the weights and the component means.

  Args:
    params: fitted ``discovery.Params`` (e.g. ``Discovery.params``).
    y: (M, D) test points in the detector's model space (``Discovery.transform`` applied).
    priors: ``Discovery.priors``.
    polish: Newton steps on the profiled ELBO before the Hessian (CAVI stops on a
      relative change, not at stationarity).
    method: "dense" or "cg" (``lrvb.covariance``).
  Returns:
    Covariances (``.sd("novelty_weight")`` etc.).
  """
  y = jnp.asarray(y)
  cov, info, chart = lrvb.polished_covariance(_objective, to_chart(params), _functionals,
                                              args=(y, priors), method=method,
                                              polish=polish)
  polished = from_chart(chart)
  return Covariances(cov, _mean_field(polished), info, polished)


def discovery_covariance(result: discovery.Discovery, x_test, **kwargs) -> Covariances:
  """``posterior_covariance`` of a ``discover`` result on its raw test features."""
  y = jnp.asarray(x_test, result.priors.alpha.dtype)
  if result.transform is not None:
    from dpmm_jax import preprocess
    y = preprocess.apply(result.transform, y)
  return posterior_covariance(result.params, y, result.priors, **kwargs)
