"""Scale machinery: compile counts, chunking equivalence, the blocked / spectral / series
fast paths against direct references.

Speed itself is measured by benchmarks/run.py (tables with ratios), never asserted here.
Tolerances are float32: a sum of n terms of size s carries ~sqrt(n) eps s of round-off
(eps = 1.2e-7); each bound below leaves a margin of ~10 over that and is far below the
O(1) error of a wrong formula.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special as sps

from dpmm_jax import api
from dpmm_jax import blocks
from dpmm_jax import em
from dpmm_jax import linalg
from dpmm_jax import quadrature
from dpmm_jax import stats as stats_lib
from dpmm_jax.conjugate import nix
from dpmm_jax.models import coupled, diag, full
from tests import coupled_reference
from tests.test_stats import _numpy_stats


def _labelled(seed, n, num_classes, dim, offset=10.0, sort=False):
  rng = np.random.default_rng(seed)
  y = rng.integers(0, num_classes, n).astype(np.int32)
  if sort:
    y = np.sort(y)
  mix = rng.normal(size=(num_classes, dim, dim)) / np.sqrt(dim) + np.eye(dim)
  x = (np.einsum("nd,nde->ne", rng.normal(size=(n, dim)), mix[y])
       + 3.0 * rng.normal(size=(num_classes, dim))[y] + offset)
  return x.astype(np.float32), y


def _assert_matches_reference(got, x, y, num_classes, rtol=2e-5):
  count, mean, scatter, _, _ = _numpy_stats(x, y, num_classes)
  np.testing.assert_array_equal(np.asarray(got.count), count)
  np.testing.assert_allclose(got.mean, mean, rtol=rtol, atol=rtol * (np.abs(mean).max() + 1))
  scale = np.abs(scatter.sum(0)).max()
  if got.scatter is not None:
    np.testing.assert_allclose(got.scatter, scatter, rtol=rtol, atol=rtol * scale)
  np.testing.assert_allclose(got.sq_dev, np.einsum("kdd->kd", scatter), rtol=rtol,
                             atol=rtol * scale)
  np.testing.assert_allclose(got.pooled_scatter, scatter.sum(0), rtol=rtol, atol=rtol * scale)


# ------------------------------------------------------------------------- statistics
def test_window_work_list_covers_every_row_once():
  rng = np.random.default_rng(0)
  block = 32
  sizes = np.asarray(stats_lib._window_sizes(block))
  np.testing.assert_array_equal(sizes, [8, 16, 32])
  counts = rng.integers(0, 100, 9).astype(np.int32)
  counts[3] = 0
  n = int(counts.sum())
  k, start, length, branch, num = map(np.asarray, stats_lib._class_windows(
      jnp.asarray(counts), block, n // block + len(counts)))
  num = int(num)
  covered = np.zeros(n, int)
  offsets = np.cumsum(counts) - counts
  for i in range(num):
    assert 0 < length[i] <= sizes[branch[i]]
    assert branch[i] == 0 or sizes[branch[i] - 1] < length[i]      # smallest window
    assert offsets[k[i]] <= start[i] and start[i] + length[i] <= offsets[k[i]] + counts[k[i]]
    covered[start[i]:start[i] + length[i]] += 1
  np.testing.assert_array_equal(covered, 1)


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("block_size", [8, 24, 128])
def test_from_labels_matches_reference_for_any_window(sort, block_size):
  x, y = _labelled(1, 700, 6, 5, sort=sort)
  y[::37] = -1                                  # ignored rows anywhere in the sort
  y[y == 4] = 9                                 # class 4 empty, label 9 out of range
  got = stats_lib.from_labels(x, y, 6, block_size=block_size)
  _assert_matches_reference(got, x, y, 6)
  np.testing.assert_array_equal(np.asarray(got.scatter),
                                np.swapaxes(np.asarray(got.scatter), -1, -2))


def test_update_equals_merge_of_chunk_statistics():
  x, y = _labelled(2, 900, 4, 3, offset=100.0)
  a = stats_lib.from_labels(x[:500], y[:500], 4)
  merged = stats_lib.merge(a, stats_lib.from_labels(x[500:], y[500:], 4))
  updated = stats_lib.finalize(stats_lib.update(a, x[500:], y[500:]))
  for name in ("count", "mean", "sq_dev", "scatter", "pooled_scatter"):
    want = np.asarray(getattr(merged, name))
    np.testing.assert_allclose(getattr(updated, name), want, rtol=2e-5,
                               atol=2e-5 * np.abs(want).max(), err_msg=name)
  _assert_matches_reference(updated, x, y, 4)


@pytest.mark.parametrize("full_stats", [True, False])
def test_streaming_a_memmap_compiles_once_and_matches(tmp_path, full_stats):
  num_classes, dim = 3, 7          # a shape no other test uses: a fresh compilation
  x, y = _labelled(3, 1234, num_classes, dim, offset=50.0)
  np.save(tmp_path / "x.npy", x)
  np.save(tmp_path / "y.npy", y)
  xm = np.load(tmp_path / "x.npy", mmap_mode="r")
  ym = np.load(tmp_path / "y.npy", mmap_mode="r")
  before = stats_lib._update_jit._cache_size()
  got = stats_lib.from_arrays(xm, ym, num_classes, full=full_stats, chunk_size=100)
  assert stats_lib._update_jit._cache_size() - before == 1        # 13 chunks, 1 trace
  _assert_matches_reference(got, x, y, num_classes)
  again = stats_lib.from_arrays(xm, ym, num_classes, full=full_stats, chunk_size=100)
  assert stats_lib._update_jit._cache_size() - before == 1
  np.testing.assert_array_equal(np.asarray(again.mean), np.asarray(got.mean))


def test_release_pages_keeps_memmap_contents(tmp_path):
  x = np.arange(40000, dtype=np.float32).reshape(4000, 10)
  np.save(tmp_path / "x.npy", x)
  xm = np.load(tmp_path / "x.npy", mmap_mode="r")
  chunks = [c for c, _ in stats_lib.iterate_chunks(xm, np.zeros(4000, np.int32), 999)]
  # Copies: a device array made from a chunk that aliased the map would read (and map in
  # again) its released pages.
  assert not any(np.shares_memory(c, xm) for c in chunks)
  np.testing.assert_array_equal(np.concatenate(chunks), x)
  np.testing.assert_array_equal(np.asarray(xm[:5]), x[:5])      # re-read after release


# -------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("block_size", [1, 3, 7, 10])
def test_class_blocks_equal_unblocked(block_size):
  rng = np.random.default_rng(4)
  a = jnp.asarray(rng.normal(size=(10, 3, 2)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(10,)), jnp.float32)
  xs = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)

  def scores(per_class):
    aa, bb = per_class
    return (jnp.einsum("md,kde->mk", xs, aa) + bb[None]) ** 2

  def per_class_fn(per_class):
    aa, bb = per_class
    return {"s": jnp.sum(aa, (1, 2)) * bb, "t": aa * 2.0}

  np.testing.assert_allclose(blocks.map_class_blocks(scores, (a, b), block_size),
                             scores((a, b)), rtol=1e-6)
  got = blocks.map_blocks(per_class_fn, (a, b), block_size)
  want = per_class_fn((a, b))
  np.testing.assert_allclose(got["s"], want["s"], rtol=1e-6)
  np.testing.assert_allclose(got["t"], want["t"], rtol=1e-6)


def test_class_blocks_skip_the_blocks_before_a_traced_first_block():
  rng = np.random.default_rng(5)
  a = jnp.asarray(rng.normal(size=(10, 3)), jnp.float32)
  xs = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
  scores = lambda aa: xs @ aa.T + 1.0                               # never zero here
  full = np.asarray(scores(a))

  @jax.jit
  def skipped(first):
    return blocks.map_class_blocks(scores, a, 2, first)

  for first in (0, 1, 3):
    got = np.asarray(skipped(first))
    np.testing.assert_array_equal(got[:, :2 * first], 0.0)
    np.testing.assert_allclose(got[:, 2 * first:], full[:, 2 * first:], rtol=1e-6)
  with pytest.raises(ValueError, match="two or more blocks"):
    blocks.map_class_blocks(scores, a, 10, 1)


# ---------------------------------------------------------------------- compilation
def _fit_traces(module, st, **kw):
  before = module._fit._cache_size()
  jax.block_until_ready(module.fit(st, **kw))
  return module._fit._cache_size() - before


@pytest.mark.parametrize("module", [diag, coupled, full])
def test_fit_traces_once_per_shape(module):
  num_classes, dim = 3, 9                         # shape private to this test
  x1, y1 = _labelled(5, 300, num_classes, dim)
  x2, y2 = _labelled(6, 300, num_classes, dim)
  st1 = stats_lib.from_labels(x1, y1, num_classes, full=module is full)
  st2 = stats_lib.from_labels(x2, y2, num_classes, full=module is full)
  assert _fit_traces(module, st1, max_iter=20) == 1
  assert _fit_traces(module, st2, max_iter=20) == 0          # new data, same shape
  assert _fit_traces(module, st2, max_iter=7, tol=1e-4) == 0   # traced scalars, max_iter too


def test_api_scoring_traces_once_for_all_chunks():
  x, y = _labelled(7, 400, 3, 11)
  det = api.fit_detector(x, y, model="diag")
  before = api._evaluate_chunk._cache_size()
  api.score(det, np.concatenate([x, x[:53]]), chunk_size=64)    # 8 chunks + a short one
  assert api._evaluate_chunk._cache_size() - before == 1


def test_api_scoring_batches_of_varying_size_share_compilations():
  x, y = _labelled(8, 400, 3, 13)
  det = api.fit_detector(x, y, model="diag")
  reference = np.asarray(api.score(det, x[:60]))
  before = api._evaluate_chunk._cache_size()
  # Sizes up to 32 share one padded shape, 33..64 the next power of two.
  for size in (5, 17, 30, 32):
    np.testing.assert_allclose(api.score(det, x[:size]), reference[:size], rtol=1e-6)
  assert api._evaluate_chunk._cache_size() - before <= 1
  for size in (33, 47, 60):
    np.testing.assert_allclose(api.score(det, x[:size]), reference[:size], rtol=1e-6)
  assert api._evaluate_chunk._cache_size() - before <= 2


@pytest.mark.parametrize("model", ["tied", "diag", "full", "coupled", "lowrank"])
def test_api_scoring_of_nearby_class_counts_shares_one_compiled_scorer(model, monkeypatch):
  """Detectors with K = 3 and K = 5 (dimension private to this test) are scored by one
  program compiled for 8 classes, and their scores are the model's own: log N_k +
  log p(x | D_k) per class and logsumexp_k - log p(x), computed here without the API.
  A call with more point x class x dimension triples than the small-problem bound, or
  whose padded parameters would exceed their bound, is scored at its own K."""
  x, y = _labelled(9, 600, 5, 15)
  xt = _labelled(10, 40, 5, 15)[0] + 2.0
  dets = [api.fit_detector(x[y < k], y[y < k], model=model) for k in (3, 5)]
  before = api._evaluate_chunk._cache_size()
  module = api._MODULES[model]

  def padded_with_numpy(params, k):   # the reference's own padding: one program at K = 8
    pad = lambda a: np.concatenate([np.asarray(a)] + [np.asarray(a)[:1]] * (8 - k))
    return params._replace(**{f: jax.tree_util.tree_map(pad, getattr(params, f))
                              for f in module.CLASS_FIELDS})

  for det in dets:
    got_class, got = api.class_scores(det, xt), api.score(det, xt)
    k = det.num_classes
    assert got_class.shape == (40, k)
    z = api.preprocess_lib.apply(det.transform, jnp.asarray(xt))
    class_lp, prior_lp = module.log_predictive(padded_with_numpy(det.params, k), z)
    want_class = det.params.log_counts + class_lp[:, :k]
    np.testing.assert_allclose(got_class, want_class, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, sps.logsumexp(np.asarray(want_class), axis=-1)
                               - np.asarray(prior_lp), rtol=1e-5, atol=1e-5)
  assert api._evaluate_chunk._cache_size() - before == 1, model
  small = api._padded_for_scoring(dets[0], 40)
  assert small.num_classes == 8
  np.testing.assert_array_equal(small.params.log_counts[3:], -np.inf)
  many_rows = api.compiler.SMALL_PROBLEM_ELEMENTS // (3 * dets[0].input_dim) + 1
  assert api._padded_for_scoring(dets[0], many_rows) is dets[0]
  monkeypatch.setattr(api, "_PADDED_SCORING_MAX_ELEMENTS", 8 * small.input_dim)
  assert api._padded_for_scoring(dets[0], 40) is dets[0]


# ---------------------------------------------------------------- full covariance
def _full_stats(seed, num_classes, dim, per_class):
  x, y = _labelled(seed, num_classes * per_class, num_classes, dim, offset=5.0)
  return stats_lib.from_labels(x, y, num_classes)


@pytest.mark.parametrize("dim,tridiagonal_from", [(12, None), (40, 32)])
def test_spectral_em_equals_blocked_em(dim, tridiagonal_from, monkeypatch):
  if tridiagonal_from:   # eigenvalues from the tridiagonal form (D >= 256 by default)
    monkeypatch.setattr(full, "_TRIDIAGONAL_EIGVALS_MIN_DIM", tridiagonal_from)
  st = _full_stats(8, 3, dim, 2 * dim)
  hyper, info = full.fit_hyper(st, max_iter=8, tol=0.0, accelerate=False)
  blocked_hyper, blocked_info = em.run(full.em_step, full.log_marginal_likelihood,
                                       full.init_hyper(st), st, tol=0.0, max_iter=8)
  np.testing.assert_allclose(info.log_marginal_trace, blocked_info.log_marginal_trace,
                             rtol=2e-5)
  np.testing.assert_allclose(hyper.df, blocked_hyper.df, rtol=2e-4)
  np.testing.assert_allclose(hyper.mean_concentration, blocked_hyper.mean_concentration,
                             rtol=2e-4)


# Jitted once here: called eagerly, each operation would compile on its own.
_TRIANGULAR_INVERSE = jax.jit(linalg.triangular_inverse)
_FULL_LOG_PREDICTIVE = jax.jit(full.log_predictive)


@pytest.mark.parametrize("dim", [1, 3, 129, 301])
def test_triangular_inverse_matches_numpy(dim):
  # 129 and 301 pad the triangle (to 130 = 65 x 2 and 304 = 76 x 4 rows).
  rng = np.random.default_rng(9)
  a = rng.normal(size=(2, dim, dim))
  chol = np.linalg.cholesky(np.einsum("kij,klj->kil", a, a) / dim + np.eye(dim))
  got = _TRIANGULAR_INVERSE(jnp.asarray(chol, jnp.float32))
  np.testing.assert_allclose(np.asarray(got, np.float64) @ chol, np.broadcast_to(
      np.eye(dim), chol.shape), atol=2e-5)
  assert got.shape == chol.shape and np.all(np.triu(np.asarray(got[0]), 1) == 0)
  single = _TRIANGULAR_INVERSE(jnp.asarray(chol[1], jnp.float32))   # no batch axis
  np.testing.assert_array_equal(single, got[1])


def test_full_scorer_calls_no_lapack_kernel():
  """The full model's scorer runs in XLA alone: a LAPACK call (the OpenBLAS bundled with
  scipy) leaves busy-waiting threads that halved its speed beside XLA's pool when the
  user has not limited them (see ``threads``)."""
  st = _full_stats(10, 3, 40, 80)
  params, _ = full.fit(st, max_iter=2)
  text = jax.jit(full.log_predictive).lower(params, jnp.zeros((8, 40))).as_text()
  assert "lapack" not in text and "custom_call" not in text


def test_full_score_inverts_the_factors_once_per_call(monkeypatch):
  """``score`` hands every chunk the inverses from one ``full.inverse_factors`` call (an
  inversion per chunk cost ~13 % of a 2048-row chunk's time at K = 120, D = 768); above
  the memory limit each chunk inverts its own. Both give ``full.log_predictive``'s scores."""
  dim = 24
  x, y = _labelled(12, 4 * 3 * dim, 4, dim, offset=5.0)
  det = api.fit_detector(x, y, model="full", preprocess=False)
  xt = np.asarray(x[:150]) + 0.5
  class_lp, prior_lp = _FULL_LOG_PREDICTIVE(det.params, jnp.asarray(xt))
  want = np.asarray(jax.nn.logsumexp(det.params.log_counts + class_lp, -1) - prior_lp)
  inverse = api._inverse_for_all_chunks(det)
  assert isinstance(inverse, full.InverseFactors)
  np.testing.assert_allclose(inverse.class_inv, _TRIANGULAR_INVERSE(
      det.params.class_pred.chol_scale), rtol=1e-6, atol=1e-6)
  with_inverse = _FULL_LOG_PREDICTIVE(det.params, jnp.asarray(xt), inverse)
  np.testing.assert_allclose(with_inverse[0], class_lp, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(with_inverse[1], prior_lp, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(api.score(det, xt, chunk_size=32), want, rtol=1e-5, atol=1e-4)
  monkeypatch.setattr(api, "_ONE_INVERSE_PER_CALL_MAX_ELEMENTS", 4 * dim * dim - 1)
  assert api._inverse_for_all_chunks(det) is None
  np.testing.assert_allclose(api.score(det, xt, chunk_size=32), want, rtol=1e-5, atol=1e-4)
  assert api._inverse_for_all_chunks(api.fit_detector(x, y, model="diag")) is None


def test_full_scoring_matches_triangular_solves(monkeypatch):
  # Triangular inverse from 4 x 4 blocks, four levels of doubling, 4 padding rows.
  monkeypatch.setattr(linalg, "_SUBSTITUTION_MAX", 4)
  dim = 60
  st = _full_stats(10, 3, dim, 2 * dim)
  params, _ = full.fit(st, max_iter=5)
  rng = np.random.default_rng(11)
  x = (5.0 + 2.0 * rng.normal(size=(40, dim))).astype(np.float32)
  class_lp, prior_lp = jax.jit(full.log_predictive)(params, x)   # traced with the patch
  pred = params.class_pred
  x64 = np.asarray(x, np.float64)
  for k in range(3):
    chol = np.asarray(pred.chol_scale[k], np.float64)
    z = np.linalg.solve(chol, (x64 - np.asarray(pred.loc[k], np.float64)).T)
    df = float(pred.df[k])
    want = (sps.gammaln(0.5 * (df + dim)) - sps.gammaln(0.5 * df)
            - 0.5 * dim * np.log(df * np.pi) - np.sum(np.log(np.diag(chol)))
            - 0.5 * (df + dim) * np.log1p(np.sum(z * z, 0) / df))
    np.testing.assert_allclose(class_lp[:, k], want, rtol=1e-5, atol=2e-3)
  assert prior_lp.shape == (40,) and np.all(np.isfinite(prior_lp))


def test_aliased_row_counts_are_padded_and_cut_back():
  """512 rows (a multiple of 512) are scored with 8 zero rows appended, which run faster
  (``linalg.pad_aliased_rows``); the scores equal those of row counts that are not padded,
  for the full model and for ``class_mahalanobis_sq`` with inverted factors."""
  x = jnp.ones((512, 3))
  padded, m = linalg.pad_aliased_rows(x)
  assert m == 512 and padded.shape == (520, 3) and not np.any(np.asarray(padded[512:]))
  assert linalg.pad_aliased_rows(x[:511])[0].shape == (511, 3)
  assert linalg.pad_aliased_rows(x[:0])[0].shape == (0, 3)
  dim = 16
  st = _full_stats(13, 3, dim, 4 * dim)
  params, _ = full.fit(st, max_iter=5)
  rng = np.random.default_rng(14)
  xt = (3.0 + rng.normal(size=(512, dim))).astype(np.float32)
  class_lp, prior_lp = _FULL_LOG_PREDICTIVE(params, jnp.asarray(xt))
  assert class_lp.shape == (512, 3) and prior_lp.shape == (512,)
  parts = [_FULL_LOG_PREDICTIVE(params, jnp.asarray(xt[s])) for s in (slice(0, 500),
                                                                     slice(500, 512))]
  np.testing.assert_allclose(class_lp, np.concatenate([p[0] for p in parts]), rtol=1e-5,
                             atol=1e-4)
  np.testing.assert_allclose(prior_lp, np.concatenate([p[1] for p in parts]), rtol=1e-5,
                             atol=1e-4)
  inv = _TRIANGULAR_INVERSE(params.class_pred.chol_scale)
  maha = jax.jit(linalg.class_mahalanobis_sq, static_argnames="inverted")
  got = maha(jnp.asarray(xt), params.class_pred.loc, inv, inverted=True)
  want = maha(jnp.asarray(xt), params.class_pred.loc, params.class_pred.chol_scale)
  assert got.shape == (512, 3)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------------- diagonal t
def test_diag_scoring_matches_float64_including_huge_df():
  rng = np.random.default_rng(12)
  num_classes, dim = 4, 16
  df = np.exp(rng.uniform(np.log(3.0), np.log(1e6), size=(num_classes, dim)))
  loc = rng.normal(size=(num_classes, dim))
  scale_sq = rng.uniform(0.5, 2.0, size=(num_classes, dim))
  x = rng.normal(size=(30, dim)) * 2.0
  terms = diag.t_terms(*(jnp.asarray(a, jnp.float32) for a in (df, loc, scale_sq)))
  got = diag.t_terms_block(jnp.asarray(x, jnp.float32), terms)
  from scipy import stats as st
  want = st.t.logpdf(x[:, None, :], df[None], loc[None], np.sqrt(scale_sq)[None]).sum(-1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-3)


# ------------------------------------------------------------------------ coupled
# Jitted once per shape: called eagerly, each runs op by op and compiles every operation
# (a test of three such calls spent ~15 s in compilation).
_coupled_params = jax.jit(coupled.params_from_hyper)
_coupled_log_predictive = jax.jit(coupled.log_predictive)


def _coupled_stats(seed, num_classes, dim, per_class):
  rng = np.random.default_rng(seed)
  n = num_classes * per_class
  y = np.repeat(np.arange(num_classes), per_class).astype(np.int32)
  gamma = rng.gamma(10.0, 0.1, size=num_classes)
  x = (rng.normal(size=(n, dim)) * np.sqrt(gamma)[y, None] * rng.uniform(0.5, 2.0, dim)
       + 2.0 * rng.normal(size=(num_classes, dim))[y])
  return x.astype(np.float32), y, stats_lib.from_labels(x.astype(np.float32), y,
                                                         num_classes, full=False)


def _mixture_reference(params, x):
  """(M, K) float64 sum over the stored P nodes (the quadrature rule itself)."""
  return _node_sum_reference(x, params.class_df, params.class_loc, params.class_scale_sq,
                             params.class_log_weights)


def _node_sum_reference(x, df, loc, scale_sq, log_weights):
  """(M, K) float64 log sum_p w_p prod_d St(x_d | df_d, loc_d, scale_sq_pd) for
  (K, D) df, loc, (K, P, D) scale_sq and (K, P) log_weights (normalised here)."""
  x = np.asarray(x, np.float64)
  df = np.asarray(df, np.float64)[None, :, None, :]
  loc = np.asarray(loc, np.float64)[None, :, None, :]
  ssq = np.asarray(scale_sq, np.float64)[None]
  lw = np.asarray(log_weights, np.float64)
  z = (x[:, None, None, :] - loc) ** 2 / (df * ssq)
  lt = (sps.gammaln(0.5 * (df + 1)) - sps.gammaln(0.5 * df) - 0.5 * np.log(np.pi * df * ssq)
        - 0.5 * (df + 1) * np.log1p(z))
  return sps.logsumexp(lt.sum(-1) + lw[None] - sps.logsumexp(lw, -1)[None, :, None], -1)


def test_coupled_prior_on_its_grid_matches_the_sum_over_its_nodes():
  # The prior is scored as pseudo-classes of the classes' node count, each carrying its
  # share of the prior's mass; on the grid path (no point tilts the prior off its grid)
  # their logsumexp must be the prior's own P0-node sum.
  rng = np.random.default_rng(2)
  y = np.repeat(np.arange(7), 2).astype(np.int32)
  x = (rng.normal(size=(14, 3)) * np.exp(rng.normal(size=7))[y, None]
       + 2.0 * rng.normal(size=(7, 3))[y]).astype(np.float32)
  params, _ = coupled.fit(stats_lib.from_labels(x, y, 7, full=False))
  h = params.hyper
  test_x = (np.asarray(h.loc) + rng.normal(size=(400, 3)) * np.sqrt(np.asarray(h.var)))
  test_x = test_x.astype(np.float32)
  on_grid = ~np.asarray(coupled._tilt_needs_point_grid(test_x, params.prior_tail))[:, 0]
  assert on_grid.sum() >= 16, on_grid.sum()
  test_x = test_x[on_grid]
  assert params.prior_log_weights.shape[0] % params.class_scale_sq.shape[1] != 0  # a padded chunk
  _, prior_lp = _coupled_log_predictive(params, test_x)
  ref = _node_sum_reference(test_x, *(v[None] for v in coupled._prior_mixture(params)))
  np.testing.assert_allclose(prior_lp, ref[:, 0], rtol=0, atol=2e-4)


def test_coupled_prior_grid_nodes_below_the_smallest_float_get_no_mass():
  # At small alpha0 the prior grid reaches u = log gamma ~ -100, below float32's
  # smallest normal number: those nodes' gamma is stored as 0 and their scales are not
  # representable. The fixed-grid prior must stay finite and equal to the float64 sum
  # over every node (which gives those nodes their negligible mass).
  _, _, st = _coupled_stats(5, 4, 6, 10)
  fitted, _ = coupled.fit(st)
  params = _coupled_params(fitted.hyper._replace(gamma_shape=jnp.float32(0.2)), st)
  assert np.sum(np.asarray(params.prior_gamma) == 0) >= 3     # the case under test
  h = params.hyper
  grid = quadrature.gamma_prior_grid(h.gamma_shape, coupled.QuadratureOptions().prior_nodes)
  df, loc, scale_sq = nix.predictive(nix.prior(h.loc, h.var, h.df, h.mean_concentration))
  node_scale = (np.exp(np.asarray(grid.nodes, np.float64))[:, None]
                * np.asarray(scale_sq, np.float64))
  rng = np.random.default_rng(5)
  test_x = (np.asarray(h.loc) + 3.0 * rng.normal(size=(64, 6)) * np.sqrt(np.asarray(h.var)))
  test_x = test_x.astype(np.float32)
  _, prior_lp = jax.jit(coupled.log_predictive_exact)(params, test_x)
  ref = _node_sum_reference(test_x, np.broadcast_to(df, loc.shape)[None], loc[None],
                            node_scale[None], params.prior_log_weights[None])
  np.testing.assert_allclose(prior_lp, ref[:, 0], rtol=0, atol=2e-4)


def test_coupled_per_point_window_stays_where_its_exponentials_are_finite():
  # EM can take nu0 and alpha0 to their floors (here 0.001 and 0.03, as a fit with one
  # class 1e9 times wider than the others did). A class of unit spread under a prior
  # scale of 1e17 then has its mode of u clipped at -30, and its normaliser's posterior
  # of u is exp(0.034 t) wide on the left (Laplace sd ~17): the old window reached
  # t ~ -3,600, where e^-t overflows float32, and the class constant was NaN. Every point
  # takes the per-point path here; within 1e-3 nats of the float64 reference.
  dim, n, var0, df0, kappa0, alpha0 = 8, 20, 1e17, 0.001, 1e-15, 0.03
  rng = np.random.default_rng(5)
  x0 = rng.normal(size=(n, dim)).astype(np.float32)
  hyper = coupled.Hyper(jnp.zeros(dim), jnp.full(dim, var0), jnp.full(dim, df0),
                        jnp.full(dim, kappa0), jnp.float32(alpha0))
  st = stats_lib.from_labels(jnp.asarray(x0), jnp.zeros(n, jnp.int32), 1, full=False)
  params = _coupled_params(hyper, st)
  assert np.isfinite(np.asarray(params.class_tail.const)).all()
  test_x = x0.mean(0) + np.array([0.0, 1.0, 3.0, 10.0])[:, None] * rng.normal(size=(4, dim))
  test_x = test_x.astype(np.float32)
  assert np.asarray(coupled._tilt_needs_point_grid(test_x, params.class_tail)).all()
  class_lp, _ = _coupled_log_predictive(params, test_x)
  ref = coupled_reference.log_predictive(x0.astype(np.float64), test_x.astype(np.float64),
                                         np.zeros(dim), np.full(dim, var0), df0, kappa0,
                                         alpha0, u_range=(-700.0, 10.0))
  np.testing.assert_allclose(class_lp[:, 0], ref, rtol=0, atol=1e-3)


def test_a_nan_pair_does_not_stop_the_other_pairs_mode_search():
  # The per-point path's Newton loop runs until the largest step of the block is small.
  # A pair whose step is NaN must not end it for the others (NaN > tol is False): a class
  # 1000 spreads away needs ~10 steps to reach its mode.
  _, _, st = _coupled_stats(3, 3, 4, 20)
  params, _ = coupled.fit(st)
  tail = jax.tree_util.tree_map(lambda a: jnp.concatenate([a[:1], a[:1]]), params.class_tail)
  far = np.asarray(params.class_loc[0]) + 1000.0 * np.sqrt(np.asarray(params.class_scale_sq[0, 0]))
  w = (jnp.asarray(far, jnp.float32) - tail.loc) ** 2 * tail.inv_scale        # (2, D)
  w = w.at[1].set(jnp.nan)[None]
  per_pair = jax.tree_util.tree_map(lambda leaf: leaf[None], tail)
  alone, _ = jax.jit(coupled._laplace_log_integral, static_argnums=3)(
      jax.tree_util.tree_map(lambda a: a[:, :1], per_pair), w[:, :1], tail.half_df1[None, :1], 24)
  both, _ = jax.jit(coupled._laplace_log_integral, static_argnums=3)(
      per_pair, w, tail.half_df1[None], 24)
  assert np.isfinite(alone[0, 0])
  np.testing.assert_allclose(both[0, 0], alone[0, 0], rtol=1e-6)


def test_coupled_narrow_posteriors_use_few_terms_and_keep_accuracy():
  # N_k D = 128,000 observations per class: the posterior of gamma_k is narrow, and EM
  # drives most nu0_d to the 1e6 cap (the float32 cancellation case of the tail path).
  x, y, st = _coupled_stats(13, 4, 64, 2000)
  params, _ = coupled.fit(st)
  orders = np.asarray(coupled.scoring_orders(params))
  assert np.all((orders >= 0) & (orders <= 8)), orders      # no class pays P nodes
  rng = np.random.default_rng(14)
  test_x = np.concatenate([x[rng.integers(0, len(x), 60)], 1.5 * rng.normal(size=(20, 64)),
                           6.0 * rng.normal(size=(10, 64))]).astype(np.float32)
  class_lp, prior_lp = map(np.asarray, _coupled_log_predictive(params, test_x))
  # float64 references: 20,001 nodes in u = log gamma (tests/coupled_reference.py).
  hyper = [np.asarray(v, np.float64) for v in params.hyper]
  x64, y = np.asarray(x, np.float64), np.asarray(y)
  for k in range(4):
    ref = coupled_reference.log_predictive(x64[y == k], test_x.astype(np.float64), *hyper)
    np.testing.assert_allclose(class_lp[:, k], ref, rtol=0, atol=3e-3)
  ref_prior = coupled_reference.log_predictive(x64[:0], test_x.astype(np.float64), *hyper)
  np.testing.assert_allclose(prior_lp, ref_prior, rtol=0, atol=1e-3)


def test_coupled_wide_posteriors_fall_back_to_all_nodes():
  # 24 observations per class and a vague prior on gamma (alpha0 = 1): wide posteriors.
  x, y, st = _coupled_stats(15, 5, 4, 6)
  params = _coupled_params(coupled.init_hyper(st, gamma_shape=1.0), st)
  assert np.all(np.asarray(coupled.scoring_orders(params)) == -1)
  test_x = x[:25] * 1.2
  np.testing.assert_allclose(_coupled_log_predictive(params, test_x)[0],
                             _mixture_reference(params, test_x), rtol=1e-5, atol=1e-3)


def test_coupled_series_bound_is_respected_at_every_order():
  # Force each order on a narrow class and compare with the exact node sum.
  x, y, st = _coupled_stats(16, 2, 32, 1500)
  params, _ = coupled.fit(st)
  terms = coupled.mixture_terms(params.class_df, params.class_loc, params.class_scale_sq,
                                params.class_log_weights)
  xt = jnp.asarray(np.concatenate([x[:20], 2.0 * x[20:30]]))
  exact = coupled._exact_block(xt, terms)
  needed = int(np.max(np.asarray(terms.level)))
  series = jax.jit(coupled._series_block)       # the order is traced: one compilation
  for level, order in enumerate(coupled.SERIES_ORDERS):
    got = series(order, xt, terms)
    err = float(jnp.max(jnp.abs(got - exact)))
    if level >= needed:
      assert err < 2e-3, (order, err)
  assert float(jnp.max(jnp.abs(series(0, xt, terms) - exact))) > 1e-3


# -------------------------------------------------------------------- benchmark smoke
def test_benchmark_script_runs_a_tiny_grid(tmp_path):
  import importlib.util
  import os
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "run.py")
  spec = importlib.util.spec_from_file_location("bench_run", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = tmp_path / "table.md"
  # The smallest sizes: one end-to-end run (no CPU-bound process beside), one cold-start
  # model on a tiny problem.
  rows = bench.main(["--grid", "40,3,6,500", "--workdir", str(tmp_path / "data"),
                     "--chunk-rows", "128", "--score-chunk", "16", "--markdown", str(out),
                     "--end-to-end", "alone", "--cold-problem", "4,3,6",
                     "--cold-models", "full"])
  assert len(rows) == 1 and set(rows[0]["models"]) == {"tied", "diag", "coupled", "full"}
  for name, r in rows[0]["models"].items():
    assert r["auroc"] > 0.5 and r["score_s"] > 0, name      # OOD classes beat chance
  text = out.read_text()
  assert "| 40 | 3 | 6 | 500 |" in text and "| 40 | 3 | 6 | full |" in text
  import re
  # End to end: fit_detectors time, then one line per model.
  assert re.search(r"\| 40 \| 3 \| 6 \| 500 \| nothing \| [0-9.]+ \| full \|", text), text
  # The preprocessing components, and the job ratio with them (smaller than without).
  r = rows[0]
  assert r["pre_raw_s"] > 0 and r["pre_apply_s"] > 0 and r["pre_s"] >= r["pre_raw_s"]
  e = r["e2e"][0]
  comp = r["stats_s"] + sum(m["fit_s"] + m["score_s"] for m in r["models"].values())
  line = next(l for l in text.splitlines() if "| nothing |" in l and "| full |" in l)
  plain, with_pre = (float(v) for v in line.split("|")[12:14])
  assert plain == float(f"{e['job_s'] / comp:.2f}"), line
  assert with_pre == float(f"{e['job_s'] / (comp + r['pre_s']):.2f}") < plain, line
  assert "| full | 4 | 3 | 6 |" in text                            # cold start
  assert not os.listdir(tmp_path / "data")          # the feature files are removed


def test_backend_comparison_script_runs_on_the_cpu(tmp_path):
  # Without an accelerator benchmarks/backends.py compares the CPU with itself: this
  # exercises the accelerator code path (device placement, the default-precision rerun).
  import importlib.util
  import os
  here = os.path.dirname(__file__)
  spec = importlib.util.spec_from_file_location(
      "bench_backends", os.path.join(here, "..", "benchmarks", "backends.py"))
  backends = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(backends)
  out = tmp_path / "backends.md"
  status = backends.main(["--classes", "3", "--dim", "4", "--per-class", "10", "--test", "20",
                          "--models", "rmds", "--matmul-side", "128", "--markdown", str(out)])
  assert status == 0
  text = out.read_text()
  assert "| cpu | 128 |" in text
  # The CPU against itself: no difference at all, and within tolerance.
  assert "| rmds |" in text and "| 0.0e+00 | 1.0000 | 0.0e+00 |" in text and "| yes |" in text
