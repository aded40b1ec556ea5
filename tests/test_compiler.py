"""compiler.jit: top-level CPU calls compile with CPU_COMPILER_OPTIONS, staged calls with
the plain jax.jit, and the options change how programs are compiled, not what they give."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmm_jax
from dpmm_jax import api
from dpmm_jax import compiler
from dpmm_jax import discovery
from dpmm_jax import lddp
from dpmm_jax import stats as stats_lib
from dpmm_jax.models import coupled, diag, full, lowrank, tied

needs_options = pytest.mark.skipif(compiler.options() is None,
                                   reason="the options apply on the CPU backend only")


def _fn(x):
  return jnp.sin(x) * x + jnp.cumsum(x)


def _fresh():
  """A new function object: jax counts compilations per function, not per jit."""
  return lambda x: _fn(x)  # pylint: disable=unnecessary-lambda


@needs_options
def test_a_top_level_call_compiles_with_the_options():
  f = compiler.jit(_fresh())
  x = jnp.linspace(0.0, 1.0, 5)
  np.testing.assert_array_equal(f(x), jax.jit(_fn)(x))
  assert (f._plain._cache_size(), f._tuned._cache_size()) == (0, 1)
  assert f._cache_size() == 1


@needs_options
def test_calls_with_more_elements_than_the_threshold_compile_with_the_defaults(monkeypatch):
  """Large problems, where the run and not the compilation dominates, keep XLA's
  default emitters (the older ones made a large full-model fit 1.37x slower)."""
  monkeypatch.setattr(compiler, "SMALL_PROBLEM_ELEMENTS", 64)
  f = compiler.jit(_fresh())
  f(jnp.ones(64))
  assert (f._plain._cache_size(), f._tuned._cache_size()) == (0, 1)
  f(jnp.ones(65))
  f(jnp.ones(40))
  assert (f._plain._cache_size(), f._tuned._cache_size()) == (1, 2)
  assert compiler.is_small((jnp.ones(32), {"b": jnp.ones((4, 8))}))
  assert not compiler.is_small((jnp.ones(32), {"b": jnp.ones((4, 9))}))


@needs_options
def test_calls_inside_xla_defaults_compile_without_the_options():
  f = compiler.jit(_fresh())
  with compiler.xla_defaults():
    f(jnp.ones(3))
    with compiler.xla_defaults():
      pass
    f(jnp.ones(4))                    # still inside after an inner block closed
  f(jnp.ones(5))
  assert (f._plain._cache_size(), f._tuned._cache_size()) == (2, 1)


@needs_options
def test_coupled_scoring_takes_the_options_only_for_small_calls(monkeypatch):
  """The coupled scorer ran 1.97x slower with the options (RESULTS.md, session 25): a
  call over more than SMALL_PROBLEM_ELEMENTS point x class x dimension triples keeps
  XLA's defaults; the other scorers take the options whatever the call's size."""
  rng = np.random.default_rng(0)
  y = np.repeat(np.arange(3), 10)
  x = (rng.normal(size=(30, 2)) + 4 * rng.normal(size=(3, 2))[y]).astype(np.float32)
  dets = {m: dpmm_jax.fit_detector(x, y, m) for m in ("coupled", "diag")}
  monkeypatch.setattr(compiler, "SMALL_PROBLEM_ELEMENTS", 40)
  monkeypatch.setattr(compiler, "is_small", lambda args: True)
  evaluate = api._evaluate_chunk
  for model, rows, variant in (("coupled", 6, evaluate._tuned),    # 6 x 3 x 2 = 36 <= 40
                               ("coupled", 9, evaluate._plain),    # 54 > 40
                               ("diag", 9, evaluate._tuned)):
    before = variant._cache_size()
    s = dpmm_jax.score(dets[model], x[:rows] + 0.5, chunk_size=rows)  # shapes no test uses
    assert variant._cache_size() == before + 1, (model, rows)
    assert np.all(np.isfinite(np.asarray(s)))


@pytest.mark.parametrize("transform", ["jit", "grad", "scan", "checkpoint", "vmap",
                                       "vmap_of_grad", "jacfwd"])
def test_calls_inside_transformations_run_and_agree_with_jax_jit(transform):
  """jax rejects compiler_options on a jit staged into another program: there the plain
  jit is used (no error); vmap and jacfwd alone still compile a program of its own."""
  f, g = compiler.jit(_fn), jax.jit(_fn)
  x = jnp.linspace(0.0, 1.0, 5)
  xs = jnp.stack([x, 2 * x])
  apply = {
      "jit": lambda h: jax.jit(h)(x),
      "grad": lambda h: jax.grad(lambda v: h(v).sum())(x),
      "scan": lambda h: jax.lax.scan(lambda c, _: (h(c), None), x, None, length=2)[0],
      "checkpoint": lambda h: jax.grad(jax.checkpoint(lambda v: h(v).sum()))(x),
      "vmap": lambda h: jax.vmap(h)(xs),
      "vmap_of_grad": lambda h: jax.vmap(jax.grad(lambda v: h(v).sum()))(xs),
      "jacfwd": lambda h: jax.jacfwd(h)(x),
  }[transform]
  np.testing.assert_allclose(apply(f), apply(g), rtol=1e-6, atol=1e-7)


def test_the_environment_variable_switches_the_options_off(monkeypatch):
  monkeypatch.setenv(compiler.ENV_VAR, "0")
  assert compiler.options() is None
  f = compiler.jit(_fresh())
  f(jnp.ones(3))
  assert (f._plain._cache_size(), f._tuned._cache_size()) == (1, 0)


def test_options_this_jaxlib_does_not_know_fall_back_to_the_plain_jit(monkeypatch):
  """An unknown option would fail every compilation: the probe finds it and the calls
  compile without options."""
  monkeypatch.setattr(compiler, "CPU_COMPILER_OPTIONS", {"xla_no_such_option_anywhere": 1})
  monkeypatch.setattr(compiler, "_supported", [None])
  if jax.default_backend() == "cpu":
    assert not compiler._probe()
  assert compiler.options() is None
  f = compiler.jit(_fresh())
  np.testing.assert_array_equal(f(jnp.ones(3)), jax.jit(_fn)(jnp.ones(3)))
  assert f._tuned._cache_size() == 0


@needs_options
@pytest.mark.parametrize("module", [diag, full, coupled], ids=["diag", "full", "coupled"])
def test_em_fits_compiled_with_and_without_the_options_agree(module, monkeypatch):
  """Same EM path (iterations, step kinds) and the same hyperparameters to float32
  round-off.

  The classes' variances differ per class and per dimension, so every hyperparameter is
  well determined by the data. (With one scale per class, the coupled model's gamma_k
  explains all of it: its per-dimension df runs to the cap or to a flat optimum, 84.5 on
  one machine, where round-off in the M-step's gradient moved df by 1.5e-4 relative
  between the two compilations while the marginal likelihood agreed to 2e-7.)"""
  rng = np.random.default_rng(3)
  k, d, n = 6, 4, 30
  y = np.repeat(np.arange(k), n)
  x = (rng.normal(size=(k * n, d)) * rng.uniform(0.5, 2.0, size=(k, 1))[y]
       * rng.uniform(0.5, 2.0, size=(k, d))[y]
       + 3 * rng.normal(size=(k, d))[y]).astype(np.float32)
  stats = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), k, full=module is full)
  tuned_params, tuned_info = module.fit(stats)
  monkeypatch.setenv(compiler.ENV_VAR, "off")
  plain_params, plain_info = module.fit(stats)
  assert int(tuned_info.num_iters) == int(plain_info.num_iters)
  np.testing.assert_array_equal(tuned_info.step_kind, plain_info.step_kind)
  for a, b in zip(jax.tree_util.tree_leaves(tuned_params.hyper),
                  jax.tree_util.tree_leaves(plain_params.hyper)):
    np.testing.assert_allclose(a, b, rtol=2e-5)
  np.testing.assert_allclose(tuned_info.log_marginal_trace, plain_info.log_marginal_trace,
                             rtol=1e-6)


def _lowerings_during(fn):
  """How many programs jax lowered (traced to MLIR) while ``fn()`` ran."""
  count = [0]

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
      count[0] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    jax.block_until_ready(fn())
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return count[0]


@pytest.fixture(scope="module")
def small_fits():
  rng = np.random.default_rng(3)
  k, d, n = 6, 4, 30
  y = np.repeat(np.arange(k), n)
  x = (rng.normal(size=(k * n, d)) * rng.uniform(0.5, 2.0, size=(k, d))[y]
       + 3 * rng.normal(size=(k, d))[y]).astype(np.float32)
  diag_stats = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), k, full=False)
  full_stats = stats_lib.from_labels(jnp.asarray(x), jnp.asarray(y), k)
  priors = discovery.priors_from_detector(dpmm_jax.fit_detector(x, y, "diag"), 3)
  return dict(coupled=(coupled.fit(diag_stats)[0], diag_stats),
              diag=(diag.fit(diag_stats)[0], diag_stats),
              full=(full.fit(full_stats)[0], full_stats), tied=tied.fit(full_stats),
              lowrank=lowrank.fit(full_stats)[0], x=jnp.asarray(x[:20]),
              priors=priors, discovery_init=jax.tree_util.tree_map(
                  np.asarray, discovery.init_params(jax.random.key(1), x[:20], priors)))


_EAGER_CALLS = {
    "tied.log_predictive": lambda f: tied.log_predictive(f["tied"], f["x"]),
    "diag.log_predictive": lambda f: diag.log_predictive(f["diag"][0], f["x"]),
    "diag.log_marginal_likelihood":
        lambda f: diag.log_marginal_likelihood(f["diag"][0].hyper, f["diag"][1]),
    "diag.params_from_hyper": lambda f: diag.params_from_hyper(f["diag"][0].hyper, f["diag"][1]),
    "full.log_predictive": lambda f: full.log_predictive(f["full"][0], f["x"]),
    "full.log_marginal_likelihood":
        lambda f: full.log_marginal_likelihood(f["full"][0].hyper, f["full"][1]),
    "full.params_from_hyper": lambda f: full.params_from_hyper(f["full"][0].hyper, f["full"][1]),
    "coupled.log_predictive": lambda f: coupled.log_predictive(f["coupled"][0], f["x"]),
    "coupled.log_predictive_exact":
        lambda f: coupled.log_predictive_exact(f["coupled"][0], f["x"]),
    "coupled.posterior_mode":
        lambda f: coupled.posterior_mode(f["coupled"][0].hyper, f["coupled"][1]),
    "coupled.params_from_hyper":
        lambda f: coupled.params_from_hyper(f["coupled"][0].hyper, f["coupled"][1]),
    "coupled.log_marginal_likelihood":
        lambda f: coupled.log_marginal_likelihood(f["coupled"][0].hyper, f["coupled"][1]),
    "lowrank.log_predictive": lambda f: lowrank.log_predictive(f["lowrank"], f["x"]),
    "lowrank.params_from_hyper":
        lambda f: lowrank.params_from_hyper(f["full"][0].hyper, f["full"][1]),
    # The CAVI loop of novelty discovery and LDDP's k-means initialisation.
    "discovery.init_params":
        lambda f: discovery.init_params(jax.random.key(0), f["x"], f["priors"]),
    "discovery.fit": lambda f: discovery.fit(f["discovery_init"], f["x"], f["priors"]),
    "lddp.kmeans": lambda f: lddp.kmeans(f["x"], 3, jax.random.key(0)),
}


@pytest.mark.parametrize("name", sorted(_EAGER_CALLS))
def test_an_eager_call_of_a_model_function_compiles_one_program_once(name, small_fits):
  """The models' functions (and discovery's and LDDP's loops) are jitted themselves:
  called outside ``jit``, the first call compiles one program (not one per operation: up
  to 192 of them before, up to 10.7 s at K = 5, D = 15; benchmarks/RESULTS.md, session 30)
  and the second call at the same shapes lowers nothing (a loop that closes over its
  arguments, a Newton search or a loop over blocks of classes, was traced and compiled
  again at every call: 2.3 s per ``coupled.log_predictive`` call)."""
  call = functools.partial(_EAGER_CALLS[name], small_fits)
  assert _lowerings_during(call) <= 1      # 0 when an earlier test compiled it already
  assert _lowerings_during(call) == 0
