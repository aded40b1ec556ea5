"""Matrix products in true float32 on every backend.

JAX computes a float32 matrix product at the backend's default precision: full float32 on
CPU, but TensorFloat-32 (10-bit mantissa, relative error about 5e-4 per product) on NVIDIA
GPUs from Ampere on, and bfloat16 passes on TPU. The library's scores are differences of
large quadratic forms (``|x|^2 - 2 x.m + |m|^2`` in whitened coordinates, scatter matrices
accumulated over a million rows, Cholesky factors of near-singular covariances): at TF32
these lose two to four significant digits, enough to reorder OOD scores.

``float32_matmuls`` wraps a function so that every matrix product traced inside it
(``@``, ``jnp.dot``, ``jnp.einsum``, ``lax.dot_general`` with no explicit precision) is
computed at ``Precision.HIGHEST``. It is a trace-time setting: it applies whether the
function is called eagerly, under the library's ``jax.jit`` or inside the user's own
``jit``/``vmap``/``grad``, and it changes nothing outside the wrapped function (the user's
own products keep their precision). On CPU it changes nothing at all (CPU products are
always full float32).

Every library function that contains a matrix product carries this decorator; a test
(``tests/test_precision.py``) checks that statically and in the traced programs.
"""
import functools

import jax

# The value handed to jax.default_matmul_precision inside library functions.
MATMUL_PRECISION = "highest"


def float32_matmuls(fn):
  """Decorator: run ``fn`` with ``jax.default_matmul_precision("highest")``.

  Place it directly above the ``def`` (below ``jax.jit`` and other decorators), so that the
  setting is active while the body is traced.
  """

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    with jax.default_matmul_precision(MATMUL_PRECISION):
      return fn(*args, **kwargs)

  return wrapper
