"""Every matrix product in the library runs at Precision.HIGHEST (true float32 on GPUs).

Two checks: statically, every function of the package that contains a matrix product is
wrapped by ``precision.float32_matmuls`` (itself or an enclosing function); and in the
traced programs of statistics, fits and scoring of every model, every ``dot_general``
carries ``Precision.HIGHEST`` while a product the caller writes next to them keeps the
caller's precision.
"""
import ast
import pathlib

import jax
import jax.extend  # pylint: disable=unused-import  (ClosedJaxpr, Jaxpr)
import jax.numpy as jnp
import numpy as np
import pytest

import dpmm_jax
from dpmm_jax import functional
from dpmm_jax import precision
from dpmm_jax import preprocess
from dpmm_jax import stats as stats_lib
from dpmm_jax.models import coupled, diag, full, lowrank, mahalanobis, tied

PACKAGE = pathlib.Path(dpmm_jax.__file__).parent
PRODUCT_CALLS = {"dot", "matmul", "einsum", "tensordot", "inner", "vdot", "dot_general",
                 "outer", "kron"}


def _is_product(node) -> bool:
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
    return True
  return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in PRODUCT_CALLS)


def _is_wrapped(fn: ast.FunctionDef) -> bool:
  return any(isinstance(d, ast.Attribute) and d.attr == "float32_matmuls"
             for d in fn.decorator_list)


def _unwrapped_products(tree):
  """(line, enclosing function names) of products with no wrapped enclosing function."""
  found = []

  def visit(node, enclosing):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      enclosing = enclosing + (node,)
    elif _is_product(node) and not any(_is_wrapped(f) for f in enclosing):
      found.append((node.lineno, "/".join(f.name for f in enclosing) or "<module>"))
    for child in ast.iter_child_nodes(node):
      visit(child, enclosing)

  visit(tree, ())
  return found


def test_every_library_product_is_wrapped():
  missing = []
  for path in sorted(PACKAGE.rglob("*.py")):
    for line, where in _unwrapped_products(ast.parse(path.read_text())):
      missing.append(f"{path.relative_to(PACKAGE.parent)}:{line} in {where}")
  assert not missing, "matrix products outside precision.float32_matmuls:\n" + "\n".join(
      missing)


def test_the_static_check_finds_an_unwrapped_product():
  source = ("@precision.float32_matmuls\ndef good(a):\n  return a @ a\n\n"
            "def bad(a):\n  return jnp.einsum('ij,jk', a, a)\n")
  assert _unwrapped_products(ast.parse(source)) == [(6, "bad")]


def _dot_precisions(closed_jaxpr):
  """Precision parameters of every dot_general in a (closed) jaxpr, sub-jaxprs included."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(eqn.params["precision"])
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)

  walk(closed_jaxpr.jaxpr)
  return found


HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def _assert_all_highest(fn, *args):
  precisions = _dot_precisions(jax.make_jaxpr(fn)(*args))
  assert precisions, "no matrix product traced"
  assert all(p == HIGHEST for p in precisions), precisions


@pytest.fixture(scope="module")
def problem():
  rng = np.random.default_rng(0)
  k, d, n_k = 4, 6, 12
  centres = rng.normal(size=(k, d)) * 3.0
  x = np.concatenate([c + rng.normal(size=(n_k, d)) for c in centres]).astype(np.float32)
  y = np.repeat(np.arange(k), n_k).astype(np.int32)
  test = rng.normal(size=(10, d)).astype(np.float32)
  return x, y, test, k


def test_statistics_and_preprocessing_trace_highest(problem):
  x, y, test, k = problem
  _assert_all_highest(lambda a, b: stats_lib.from_labels(a, b, k), x, y)
  stats = stats_lib.from_labels(x, y, k)
  _assert_all_highest(stats_lib.total_covariance, stats)     # what preprocess.fit rotates
  transform = preprocess.fit(stats)                            # (host-side: not traceable)
  _assert_all_highest(lambda t, a: preprocess.apply(t, a), transform, test)


@pytest.mark.parametrize("module", [full, diag, coupled, lowrank, tied, mahalanobis],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_fits_trace_highest(problem, module):
  x, y, _, k = problem
  stats = stats_lib.from_labels(x, y, k)
  _assert_all_highest(lambda s: module.fit(s), stats)


@pytest.mark.parametrize("model", dpmm_jax.MODELS)
def test_scoring_traces_highest_and_leaves_the_callers_products_alone(problem, model):
  x, y, test, _ = problem
  det = dpmm_jax.fit_detector(x, y, model=model)

  def caller(a):
    # The caller's own product, traced next to the library's, keeps its precision.
    return functional.score(det, a), a @ a.T

  jaxpr = jax.make_jaxpr(caller)(jnp.asarray(test))
  precisions = _dot_precisions(jaxpr)
  assert precisions.count(None) == 1, precisions
  assert all(p == HIGHEST for p in precisions if p is not None)
  assert len(precisions) > 1, precisions       # the library traced products of its own


def test_the_setting_does_not_leak_to_the_caller():
  before = jax.config.jax_default_matmul_precision
  precision.float32_matmuls(lambda: None)()
  assert jax.config.jax_default_matmul_precision == before
