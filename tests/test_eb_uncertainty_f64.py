"""Standard errors of the EB hyperparameters (dpmm_jax.eb_uncertainty), float64."""
import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dpmm_jax  # noqa: E402
from dpmm_jax import eb_uncertainty as eu  # noqa: E402
from dpmm_jax import stats as stats_lib  # noqa: E402
from dpmm_jax import synthetic  # noqa: E402
from dpmm_jax.models import coupled, diag, full  # noqa: E402


def _stats(num_classes, seed, nu0=6.0, dim=2):
  ds = synthetic.make_dataset(jax.random.PRNGKey(seed), num_classes=num_classes, dim=dim,
                              nu0=nu0, kappa0=1 / 25, num_train_per_class=20,
                              dtype=jnp.float64)
  return stats_lib.from_labels(ds.x_train, ds.y_train, num_classes, full=True)


def test_full_standard_errors_shrink_like_one_over_sqrt_k():
  ses = []
  for num_classes in (40, 160):
    st = _stats(num_classes, num_classes)
    params, info = full.fit(st, tol=1e-10, max_iter=500)
    assert bool(info.converged)
    res = eu.hyperparameter_standard_errors("full", st, params.hyper)
    assert res.ok and not np.any(res.at_cap)
    ses.append(res.standard_error)
  ratio = ses[0] / ses[1]                     # K grows 4x: SEs halve
  assert np.all((ratio > 1.6) & (ratio < 2.5)), ratio


def test_information_is_the_hessian_of_each_models_log_marginal_likelihood():
  """Finite differences of the models' own log marginal likelihoods in the chart."""
  st = _stats(30, 7, dim=2)
  h = 1e-3
  for name, module in (("diag", diag), ("coupled", coupled)):
    params, _ = module.fit(st, tol=1e-10, max_iter=500)
    hyper = params.hyper
    res = eu.hyperparameter_standard_errors(name, st, hyper)
    assert res.ok
    dim = st.dim

    @jax.jit
    def lml_jit(t, hyper=hyper, module=module, name=name):
      new = hyper._replace(df=jnp.exp(t[:dim]), mean_concentration=jnp.exp(t[dim:2 * dim]))
      if name == "coupled":
        new = new._replace(gamma_shape=jnp.exp(t[-1]))
      return module.log_marginal_likelihood(new, st)

    lml = lambda t: float(lml_jit(jnp.asarray(t)))

    t0 = res.estimate
    p = t0.size
    hess = np.zeros((p, p))
    for i in range(p):
      for j in range(p):
        ei, ej = np.eye(p)[i] * h, np.eye(p)[j] * h
        hess[i, j] = (lml(t0 + ei + ej) - lml(t0 + ei - ej) - lml(t0 - ei + ej)
                      + lml(t0 - ei - ej)) / (4 * h * h)
    np.testing.assert_allclose(np.linalg.inv(-hess), res.covariance, rtol=2e-3,
                               atol=1e-6)


def test_sandwich_estimating_equations_are_centred_at_the_estimate():
  st = _stats(30, 3)
  params, _ = full.fit(st, tol=1e-12, max_iter=500)
  per_class, a = eu._full_sandwich_pieces(params.hyper, st)
  total = np.asarray(jnp.sum(per_class, 0))
  scale = np.asarray(jnp.sqrt(jnp.sum(per_class ** 2, 0)))
  assert np.all(np.abs(total) <= 1e-4 * scale + 1e-9), total / scale
  res = eu.hyperparameter_standard_errors("full", st, params.hyper, prior_moments=True)
  plain = eu.hyperparameter_standard_errors("full", st, params.hyper)
  assert res.prior_moments and res.ok
  assert np.all(np.isfinite(res.standard_error)) and np.all(res.standard_error > 0)
  del a, plain


def test_cap_gives_infinite_standard_error_through_the_api():
  # Every class is the same 30 points shifted: identical scatters, so the ML nu0 is at
  # infinity (EM's cap); the class means are spread, so kappa0 stays finite.
  rng = np.random.default_rng(0)
  base = rng.normal(size=(30, 2))
  offsets = 5.0 * rng.normal(size=(20, 2))
  x = (base[None] + offsets[:, None]).reshape(-1, 2)
  y = np.repeat(np.arange(20), 30)
  _, report = dpmm_jax.fit_detector_with_info(x, y, model="full", preprocess=False,
                                              standard_errors=True)
  se = report.hyper_se
  assert se.names == ("log(nu0-D-1)", "log kappa0")
  assert report.at_cap and se.at_cap[0] and np.isinf(se.standard_error[0])
  assert np.isfinite(se.standard_error[1]) and se.ok
  _, plain = dpmm_jax.fit_detector_with_info(x, y, model="full", preprocess=False)
  assert plain.hyper_se is None


def test_bad_inputs():
  st = _stats(10, 0)
  with pytest.raises(ValueError, match="model"):
    eu.hyperparameter_standard_errors("tied", st, None)
  params, _ = coupled.fit(st, max_iter=5)
  with pytest.raises(ValueError, match="prior_moments"):
    eu.hyperparameter_standard_errors("coupled", st, params.hyper, prior_moments=True)
  with pytest.raises(ValueError, match="full statistics"):
    eu.hyperparameter_standard_errors("full", st._replace(scatter=None), None)
