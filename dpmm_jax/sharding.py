"""Statistics and scores over a ``jax.sharding`` mesh: rows split across devices.

Sufficient statistics are sums over rows, and scores are computed row by row, so both
parallelise over the data axis with no change to the models:

* **Statistics.** Each device keeps its own partial sums of the centred products. Per
  chunk only the per-class counts and sums of ``x - m`` (K x D numbers) are summed across
  devices (``psum``), giving every device the same running class means; each device then
  adds ``sum (x - m)(x - m')^T`` over *its* rows to its partial scatter (``stats``'s
  batched Welford update, exact). The partials are summed once at the end. The result is
  the single-device statistics up to float summation order.
* **Scores.** The test points are split across devices and every device evaluates the
  model's ``log_predictive`` (or the detector's score) on its rows with the fitted
  parameters replicated.

The same code runs on one CPU, on several accelerators of one host and on several hosts:
on a multi-host system call ``jax.distributed.initialize()`` first in every process, build
the mesh over ``jax.devices()`` (all processes' devices) and let every process feed its
own rows (``process_rows`` / ``from_chunks(..., per_process=True)``); see
BUILD.md ("Several hosts"). Tests run it on 8 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""
import functools
from typing import Callable, Iterable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dpmm_jax import preprocess as preprocess_lib
from dpmm_jax import scores as scores_lib
from dpmm_jax import stats as stats_lib
from dpmm_jax import validation

DATA_AXIS = "data"


def data_mesh(devices=None, axis_name: str = DATA_AXIS) -> Mesh:
  """A one-dimensional mesh over ``devices`` (default: all devices of all processes)."""
  devices = jax.devices() if devices is None else list(devices)
  return Mesh(np.asarray(devices), (axis_name,))


def _axis(mesh: Mesh) -> str:
  if len(mesh.axis_names) != 1:
    raise ValueError(f"Expected a one-dimensional data mesh, got axes {mesh.axis_names}.")
  return mesh.axis_names[0]


def num_shards(mesh: Mesh) -> int:
  return int(mesh.devices.size)


def shard_rows(x, mesh: Mesh):
  """Places an (N, ...) host array with its rows split across the mesh (N divisible)."""
  return jax.device_put(x, NamedSharding(mesh, P(_axis(mesh))))


def replicate(tree, mesh: Mesh):
  """Places a pytree of arrays on every device of the mesh."""
  return jax.device_put(tree, NamedSharding(mesh, P()))


def process_rows(num_rows: int) -> Tuple[int, int]:
  """[start, stop) of the rows this process should read when ``num_rows`` rows are split
  evenly across ``jax.process_count()`` processes (the last takes the remainder)."""
  per = num_rows // jax.process_count()
  start = jax.process_index() * per
  stop = num_rows if jax.process_index() == jax.process_count() - 1 else start + per
  return start, stop


# ------------------------------------------------------------------------- statistics
def _partial_specs(axis, full: bool):
  """Specs of the streaming state: count, mean replicated; partial sums per device."""
  return stats_lib.SufficientStats(P(), P(), P(axis), P(axis) if full else None, P(axis))


@functools.partial(jax.jit, static_argnames=("mesh", "block_size"), donate_argnums=(0,))
def _sharded_update(state, x, y, mesh, block_size):
  axis = _axis(mesh)
  specs = _partial_specs(axis, state.scatter is not None)

  def local(st, xl, yl):
    st = st._replace(sq_dev=st.sq_dev[0], pooled_scatter=st.pooled_scatter[0],
                     scatter=None if st.scatter is None else st.scatter[0])
    new = stats_lib._update(st, xl, yl, block_size, axis_name=axis)
    return new._replace(sq_dev=new.sq_dev[None], pooled_scatter=new.pooled_scatter[None],
                        scatter=None if new.scatter is None else new.scatter[None])

  return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(axis), P(axis)),
                       out_specs=specs)(state, x, y)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnums=(0,))
def _sum_partials(state, mesh):
  del mesh
  total = state._replace(
      sq_dev=jnp.sum(state.sq_dev, 0), pooled_scatter=jnp.sum(state.pooled_scatter, 0),
      scatter=None if state.scatter is None else jnp.sum(state.scatter, 0))
  return stats_lib.finalize(total)


def _empty_state(num_classes, dim, full, dtype, mesh):
  """Zero streaming state, created directly on the devices (each holds its partials)."""
  shards = num_shards(mesh)
  specs = _partial_specs(_axis(mesh), full)
  shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)

  def zeros():
    z = functools.partial(jnp.zeros, dtype=dtype)
    return stats_lib.SufficientStats(
        z((num_classes,)), z((num_classes, dim)), z((shards, num_classes, dim)),
        z((shards, num_classes, dim, dim)) if full else None, z((shards, dim, dim)))

  return jax.jit(zeros, out_shardings=shardings)()


def _global_rows(local, mesh, rows_per_process):
  """Global row-sharded array from this process's rows (all processes call this)."""
  sharding = NamedSharding(mesh, P(_axis(mesh)))
  shape = (rows_per_process * jax.process_count(),) + local.shape[1:]
  return jax.make_array_from_process_local_data(sharding, local, shape)


def from_chunks(chunks: Iterable[Tuple[np.ndarray, np.ndarray]], num_classes: int,
                mesh: Mesh, full: bool = True, chunk_size: Optional[int] = None,
                dtype=None, block_size: int = 128) -> stats_lib.SufficientStats:
  """Streams statistics with every chunk's rows split across the mesh.

  On several processes (after ``jax.distributed.initialize()``) each process passes its
  *own* chunks; the processes step together (a process that runs out contributes
  all-padding chunks until every process is done) and the result is the statistics of
  the union of all processes' rows, replicated everywhere.

  Args:
    chunks: iterable of ((n_i, D) features, (n_i,) labels in 0..K-1) of this process
      (checked like ``stats.from_chunks``).
    num_classes: K.
    mesh: data mesh (``data_mesh``).
    full: accumulate per-class full scatter.
    chunk_size: rows per process per step; every chunk is padded (label -1) to this
      size rounded up to a multiple of the local device count (one compilation).
    dtype: accumulation dtype (default: the first chunk's float dtype).
    block_size: maximal rows per per-class product window.
  Returns:
    SufficientStats (replicated on the mesh).
  """
  local_devices = max(1, num_shards(mesh) // jax.process_count())
  iterator = iter(chunks)
  state, dim, pending, offset = None, None, [], 0
  multi = jax.process_count() > 1
  while True:
    if not pending:
      item = next(iterator, None)
      if item is not None:
        xc, yc = validation.stats_chunk(item[0], item[1], num_classes, offset, dim)
        offset += xc.shape[0]
        xc, yc = np.asarray(xc), np.asarray(yc)
        if chunk_size is None:
          chunk_size = xc.shape[0]
        pending = [(xc[s:s + chunk_size], yc[s:s + chunk_size])
                   for s in range(0, xc.shape[0], chunk_size)]
        if dim is None:
          dim = xc.shape[1]
          dtype = jnp.asarray(xc[:1]).dtype if dtype is None else dtype
    have = bool(pending)
    if multi:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      flags = multihost_utils.process_allgather(np.asarray([have, dim or 0, chunk_size or 0]))
      if not np.any(flags[:, 0]):
        break
      dim = dim or int(np.max(flags[:, 1]))
      chunk_size = chunk_size or int(np.max(flags[:, 2]))
      dtype = jnp.float32 if dtype is None else dtype
    elif not have:
      break
    rows = -(-chunk_size // local_devices) * local_devices
    if have:
      xs, ys = pending.pop(0)
    else:
      xs, ys = np.zeros((0, dim), np.float32), np.zeros((0,), np.int32)
    xs, ys = stats_lib._pad_chunk(np.asarray(xs, dtype), np.asarray(ys, np.int32), rows)
    if state is None:
      state = _empty_state(num_classes, dim, full, dtype, mesh)
    if multi:
      xg, yg = _global_rows(xs, mesh, rows), _global_rows(ys, mesh, rows)
    else:
      xg, yg = shard_rows(xs, mesh), shard_rows(ys, mesh)
    state = _sharded_update(state, xg, yg, mesh=mesh, block_size=block_size)
  if state is None:
    raise ValueError("sharding.from_chunks received no data.")
  return _sum_partials(state, mesh=mesh)


def from_labels(x, y, num_classes: int, mesh: Mesh, full: bool = True,
                block_size: int = 128) -> stats_lib.SufficientStats:
  """Statistics of one in-memory (N, D) array with its rows split across the mesh."""
  x = np.asarray(x)
  return from_chunks([(x, np.asarray(y))], num_classes, mesh, full=full,
                     chunk_size=x.shape[0], block_size=block_size)


def from_arrays(x, y, num_classes: int, mesh: Mesh, full: bool = True,
                chunk_size: int = 65536, dtype=None,
                block_size: int = 128) -> stats_lib.SufficientStats:
  """Statistics of (possibly memory-mapped) arrays, ``chunk_size`` rows per step."""
  return from_chunks(stats_lib.iterate_chunks(x, y, chunk_size), num_classes, mesh,
                     full=full, chunk_size=min(chunk_size, x.shape[0]), dtype=dtype,
                     block_size=block_size)


# ----------------------------------------------------------------------------- scores
def map_rows(fn: Callable, params, x, mesh: Mesh):
  """``fn(params, x)`` with the rows of ``x`` split across the mesh.

  Args:
    fn: (params, (m, D) rows) -> pytree of arrays with leading axis m (jittable).
    params: pytree, replicated on every device.
    x: (M, D) host or device array; padded (last row repeated) to a multiple of the
      number of devices and the padding dropped from the result.
  Returns:
    fn's outputs for all M rows (sharded by rows).
  """
  axis = _axis(mesh)
  x = jnp.asarray(x)
  m = x.shape[0]
  rows = -(-m // num_shards(mesh)) * num_shards(mesh)
  if rows != m:
    x = jnp.concatenate([x, jnp.repeat(x[-1:], rows - m, 0)])
  out = _map_rows_jit(fn, params, shard_rows(x, mesh), mesh)
  return jax.tree_util.tree_map(lambda a: a[:m], out)


@functools.partial(jax.jit, static_argnames=("fn", "mesh"))
def _map_rows_jit(fn, params, x, mesh):
  axis = _axis(mesh)
  return jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(axis))(params, x)


def log_predictive(model, params, x, mesh: Mesh):
  """``model.log_predictive(params, x)`` (model: a module of ``dpmm_jax.models``) with
  the test points split across the mesh: (class (M, K), prior (M,))."""
  return map_rows(model.log_predictive, params, x, mesh)


def _detector_score(det, x):
  # Same arithmetic as api.score for the DPMM models, on one shard of rows.
  from dpmm_jax.models import coupled, diag, full, tied  # pylint: disable=g-import-not-at-top
  if det.transform is not None:
    x = preprocess_lib.apply(det.transform, x)
  module = {"tied": tied, "full": full, "diag": diag, "coupled": coupled}[det.model]
  class_lp, prior_lp = module.log_predictive(det.params, x)
  return scores_lib.dpmm_score(det.params.log_counts, class_lp, prior_lp)


def score(det, x, mesh: Mesh, chunk_size: int = 8192):
  """(M,) DPMM score of a fitted DPMM ``api.Detector``, rows split across the mesh and
  processed ``chunk_size`` rows (all devices together) at a time."""
  if det.model not in ("tied", "full", "diag", "coupled"):
    raise ValueError(f"sharding.score supports the DPMM models, got {det.model!r}.")
  x = np.asarray(x)
  m = x.shape[0]
  rows = min(chunk_size, m)
  parts = []
  for start in range(0, m, rows):
    xc = x[start:start + rows]
    n = xc.shape[0]
    if n < rows:  # one shape for every chunk: one compilation
      xc = np.concatenate([xc, np.repeat(xc[-1:], rows - n, 0)])
    parts.append(jnp.asarray(map_rows(_detector_score, det, xc, mesh))[:n])
  return jnp.concatenate(parts)
