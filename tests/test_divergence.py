"""Tests of dpmm_jax.divergence (co-BPM) against exact oracles on tiny problems, against
Monte Carlo truths on beta-mixture products, and of its input checks.

The exact posterior over decision sequences is enumerated here in numpy, independently of
the library (boxes as explicit corners, counts by brute force).
"""
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats

from dpmm_jax import divergence as dv
from experiments import divergence_problems as dp
from tests.test_threads_and_cache import _programs_compiled

DELTA = 0.5
CHI2_LEVEL = 1e-3  # chi-square tests reject at this level (fixed seeds: deterministic)


# ----------------------------------------------------------------- numpy oracle

def _np_counts(points, boxes):
  out = []
  for lo, lev in boxes:
    hi = lo + 2.0 ** -lev
    out.append(int(np.sum(np.all((points >= lo) & (points < hi), axis=1))))
  return np.array(out)


def _np_log_post(boxes, x, y, dim, delta, sigma):
  l = len(boxes)
  lp = -sigma * l - special.gammaln(l) - (l - 1) * math.log(dim)
  log_vol = np.array([-np.sum(lev) * math.log(2.0) for _, lev in boxes])
  for pts in (x, y):
    n = _np_counts(pts, boxes)
    lp += (np.sum(special.gammaln(delta + n)) - special.gammaln(l * delta + n.sum())
           - l * special.gammaln(delta) + special.gammaln(l * delta))
    lp -= np.sum(n * log_vol)
  return lp


def _enumerate(x, y, dim, max_regions, delta, sigma):
  """{decision sequence: log posterior} for every sequence with <= max_regions boxes."""
  out = {}

  def rec(seq, boxes):
    out[tuple(seq)] = _np_log_post(boxes, x, y, dim, delta, sigma)
    if len(boxes) == max_regions:
      return
    for i in range(len(boxes)):
      for k in range(dim):
        lo, lev = boxes[i]
        mid = lo[k] + 2.0 ** -(lev[k] + 1)
        new_lev = lev.copy()
        new_lev[k] += 1
        up_lo = lo.copy()
        up_lo[k] = mid
        nb = list(boxes)
        nb[i] = (lo, new_lev)
        nb.append((up_lo, new_lev.copy()))
        rec(seq + [(i, k)], nb)

  rec([], [(np.zeros(dim), np.zeros(dim, int))])
  return out


def _key_of(state, index=None):
  """Decision sequence of a state (or of chain ``index`` of a numpy-converted batch)."""
  pick = (lambda a: np.asarray(a)) if index is None else (lambda a: a[index])
  l = int(pick(state.num_regions))
  parent, sdim = pick(state.parent), pick(state.split_dim)
  return tuple((int(parent[t]), int(sdim[t])) for t in range(1, l))


_split_jit = jax.jit(dv.split)


def _state_of(seq, x, y, max_regions, sigma):
  s = dv.init_state(x, y, jnp.ones(x.shape[0], bool), jnp.ones(y.shape[0], bool),
                    max_regions, DELTA, sigma)
  for i, k in seq:
    s, _, _ = _split_jit(s, jnp.int32(i), jnp.int32(k), x, y)
  return s


def _tiny(dim):
  """A small, structured pair in [0, 1)^dim (values off the dyadic grid)."""
  rng = np.random.default_rng(7 + dim)
  x = rng.beta(1.5, 4.0, size=(7, dim))
  y = rng.beta(4.0, 1.5, size=(6, dim))
  return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


TINY = {1: 5, 2: 4}  # dim -> max_regions (depth <= 4 decisions)


# ------------------------------------------------------------- exact posterior

@pytest.mark.parametrize("dim", [1, 2])
def test_collapsed_posterior_matches_enumeration(dim):
  x, y = _tiny(dim)
  max_regions = TINY[dim]
  sigma = dim + 1.0
  exact = _enumerate(np.asarray(x, np.float64), np.asarray(y, np.float64), dim,
                     max_regions, DELTA, sigma)
  assert len(exact) == sum(math.factorial(l - 1) * dim ** (l - 1)
                           for l in range(1, max_regions + 1))
  diffs = []
  for seq, lp in exact.items():
    s = _state_of(seq, x, y, max_regions, sigma)
    assert _key_of(s) == seq
    l = len(seq) + 1
    # Incremental counts equal brute-force counts of the enumerated boxes.
    boxes = [(np.asarray(s.lower[i], np.float64), np.asarray(s.level[i])) for i in range(l)]
    np.testing.assert_array_equal(np.asarray(s.count_x[:l]), _np_counts(np.asarray(x), boxes))
    np.testing.assert_array_equal(np.asarray(s.count_y[:l]), _np_counts(np.asarray(y), boxes))
    diffs.append(float(dv.log_posterior(s, DELTA, sigma)) - lp)
  diffs = np.array(diffs)
  assert np.ptp(diffs) < 1e-4 * max(1.0, np.max(np.abs(list(exact.values()))))


def _stack(states):
  return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *states)


@pytest.mark.parametrize("kernel", ["data", "uniform"])
def test_detailed_balance(kernel):
  """pi(s) P(s -> s') = pi(s') P(s' -> s) for every single and double move on d = 2,
  max_regions = 4, with pi from the numpy enumeration and P from the library's kernels."""
  dim, max_regions, sigma = 2, 4, 1.0
  x, y = _tiny(dim)
  exact = _enumerate(np.asarray(x, np.float64), np.asarray(y, np.float64), dim,
                     max_regions, DELTA, sigma)
  seqs = list(exact)
  states = _stack([_state_of(seq, x, y, max_regions, sigma) for seq in seqs])
  index = {seq: j for j, seq in enumerate(seqs)}
  log_pi = np.array([exact[s] for s in seqs])
  for order in (1, 2):
    fn = jax.jit(jax.vmap(lambda s: dv.transition_log_probs(s, x, y, kernel, DELTA, sigma,
                                                            order)))
    grow, shrink = (np.asarray(a, np.float64) for a in fn(states))
    checked = 0
    for j, seq in enumerate(seqs):
      l = len(seq) + 1
      total = np.exp(shrink[j]) + np.sum(np.exp(grow[j]))
      assert total <= 1.0 + 1e-5
      for move in zip(*np.nonzero(np.isfinite(grow[j]))):
        if order == 1:
          new = seq + ((int(move[0]), int(move[1])),)
        else:
          i, k, c, k2 = (int(v) for v in move)
          new = seq + ((i, k), (l if c else i, k2))
        target = index[new]
        lhs = log_pi[j] + grow[j][move]
        rhs = log_pi[target] + shrink[target]
        assert abs(lhs - rhs) < 1e-4 * max(1.0, abs(lhs)), (order, seq, new, lhs, rhs)
        checked += 1
    # Every state with room has grow moves; every reachable shrink is matched above.
    assert checked == sum(np.isfinite(shrink)) if order == 1 else checked > 0


@pytest.mark.parametrize("dim,kernel,double_moves",
                         [(1, "data", False), (1, "uniform", True),
                          (2, "data", True), (2, "uniform", False)])
def test_chain_visits_match_exact_posterior(dim, kernel, double_moves):
  """Final states of many independent chains vs the enumerated posterior (chi-square)."""
  x, y = _tiny(dim)
  max_regions, sigma = TINY[dim], 0.5
  exact = _enumerate(np.asarray(x, np.float64), np.asarray(y, np.float64), dim,
                     max_regions, DELTA, sigma)
  seqs = list(exact)
  log_pi = np.array([exact[s] for s in seqs])
  prob = np.exp(log_pi - special.logsumexp(log_pi))
  num_chains = 3000
  config = dv.Config(max_regions=max_regions, kernel=kernel, num_burnin=80, num_samples=1,
                     double_moves=double_moves)
  run = jax.jit(jax.vmap(dv.run_chain, in_axes=(0,) + (None,) * 7 + (None,)),
                static_argnums=8)
  out = run(jax.random.split(jax.random.PRNGKey(dim), num_chains), x, y,
            jnp.ones(x.shape[0], bool), jnp.ones(y.shape[0], bool), DELTA, sigma, 2.0,
            config)
  index = {s: j for j, s in enumerate(seqs)}
  counts = np.zeros(len(seqs))
  final_np = jax.tree_util.tree_map(np.asarray, out.final_state)
  for c in range(num_chains):
    counts[index[_key_of(final_np, c)]] += 1
  expected = prob * num_chains
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] < 5:  # fold a small remainder into the smallest kept bin
    j = np.argmin(exp[:-1])
    obs[j] += obs[-1]
    exp[j] += exp[-1]
    obs, exp = obs[:-1], exp[:-1]
  assert len(obs) >= 5
  p_value = stats.chisquare(obs, exp).pvalue
  assert p_value > CHI2_LEVEL, (p_value, obs, exp)
  # The incrementally tracked log posterior equals a recomputation at the end.
  final = jax.tree_util.tree_map(lambda a: a[0], out.final_state)
  assert abs(float(final.log_posterior) - float(dv.log_posterior(final, DELTA, sigma))) < 1e-3


# ----------------------------------------------------------- sampler pieces

@pytest.mark.parametrize("delta", [0.01, 0.5, 3.7])
def test_count_terms_give_the_data_kernel_its_lgamma_gains(delta):
  """The table holds lgamma(delta + m) for every count a box can reach (m = 0..max(N1, N2)),
  and the data kernel built from it equals g_ik computed with scipy in float64, both at
  one box (every point in it: the table's last entry) and after three halvings."""
  x, y = _tiny(2)
  for seq in ((), ((0, 0), (1, 1), (0, 1))):
    state = _state_of(seq, x, y, 6, 3.0)
    terms = dv.count_terms(delta, state)
    assert terms.log_gamma.shape == (max(x.shape[0], y.shape[0]) + 1,)
    np.testing.assert_allclose(np.asarray(terms.log_gamma),
                               special.gammaln(delta + np.arange(8.0)), rtol=2e-6, atol=2e-6)
    assert dv.count_terms(terms, state) is terms
    l = int(state.num_regions)
    halves = [np.asarray(h, np.float64)[:l] for h in dv.half_counts(state, x, y)]
    boxes = [np.asarray(c, np.float64)[:l, None] for c in (state.count_x, state.count_y)]
    g = (boxes[0] + boxes[1]) * math.log(2.0) + sum(
        special.gammaln(delta + u) + special.gammaln(delta + n - u) - special.gammaln(delta + n)
        for n, u in zip(boxes, halves))
    expected = g - special.logsumexp(g)
    for given in (delta, terms):
      logq = np.asarray(dv.proposal_log_probs(state, x, y, "data", given))
      np.testing.assert_allclose(logq[:l], expected, rtol=1e-5, atol=1e-5)
      assert np.all(np.isneginf(logq[l:]))


def test_log_gamma_sample_matches_gamma():
  for a in (0.5, 1.0, 7.3):
    draws = np.exp(np.asarray(dv.log_gamma_sample(jax.random.PRNGKey(3),
                                                  jnp.full((20000,), a))))
    assert stats.kstest(draws, stats.gamma(a).cdf).pvalue > CHI2_LEVEL
  tiny = dv.log_gamma_sample(jax.random.PRNGKey(4), jnp.full((1000,), 0.01))
  assert np.all(np.isfinite(np.asarray(tiny)))  # the draw itself underflows float32


def test_effective_sample_size():
  rng = np.random.default_rng(0)
  iid = rng.normal(size=(4, 2000))
  assert 0.8 * 8000 < dv.effective_sample_size(iid) < 1.2 * 8000
  rho = 0.9
  ar = np.zeros((4, 4000))
  for t in range(1, 4000):
    ar[:, t] = rho * ar[:, t - 1] + rng.normal(size=4)
  target = 16000 * (1 - rho) / (1 + rho)
  assert 0.7 * target < dv.effective_sample_size(ar) < 1.3 * target


def test_knn_kl_gaussians():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(3000, 2))
  y = rng.normal(size=(3000, 2)) * 1.5 + 0.5
  # KL(N(0, I) || N(m, s^2 I)) in 2-D.
  s2, m2 = 2.25, 0.5
  truth = 0.5 * (2 / s2 + 2 * 0.25 / s2 - 2 + 2 * math.log(s2))
  del m2
  for k in (1, 10):
    assert abs(dv.knn_kl(x, y, k) - truth) < 0.06


# ------------------------------------------------------------ sanity checks

ESTIMATE_SETTINGS = dict(num_chains=2, num_burnin=400, num_samples=300, max_regions=64)


def test_identical_samples_give_near_zero():
  """Same points in X and Y: every kind near 0 (one chain run, all kinds summarised)."""
  rng = np.random.default_rng(2)
  x = rng.beta(2.0, 5.0, size=(400, 2))
  u, v = dv.rescale(x, x.copy())
  config = dv.Config(max_regions=64, num_burnin=400, num_samples=300)
  run = jax.vmap(dv.run_chain, in_axes=(0,) + (None,) * 7 + (None,))
  out = run(jax.random.split(jax.random.PRNGKey(0), 2), jnp.asarray(u), jnp.asarray(v),
            jnp.ones(400, bool), jnp.ones(400, bool), DELTA, 3.0, 2.0, config)
  for kind, bound in (("tv", 0.08), ("hellinger", 0.08), ("kl", 0.03), ("alpha", 0.03)):
    res = dv.summarize(out, kind)
    assert 0 <= float(res.mean) < bound, (kind, res.mean)
    assert float(res.credible_interval[0]) <= float(res.mean) <= float(
        res.credible_interval[1])


def test_estimate_pads_samples_so_nearby_sizes_share_one_compiled_chain():
  assert [dv.padded_size(n) for n in (1, 64, 65, 100, 400, 1000, 1024, 1025)] == [
      64, 64, 80, 112, 448, 1024, 1024, 1280]
  for n in range(1, 5000, 7):
    assert n <= dv.padded_size(n) <= max(64, 1.25 * n), n
  for bad, error in ((0, ValueError), (-3, ValueError), (2.5, TypeError)):
    with pytest.raises(error, match="n must be a positive integer"):
      dv.padded_size(bad)
  # The shapes and settings of the two tests around this one (bare chain at 400 points,
  # estimate padded to 448), so the run's compilation cache serves all three.
  rng = np.random.default_rng(5)
  x, y = rng.beta(2.0, 5.0, size=(420, 2)), rng.beta(5.0, 2.0, size=(420, 2))
  res = dv.estimate(x[:400], y[:400], "hellinger", key=jax.random.PRNGKey(0),
                    **ESTIMATE_SETTINGS)
  # The masked padding rows change nothing: the draws of the chain on the bare samples.
  x01, y01 = dv.rescale(x[:400], y[:400])
  settings = dict(ESTIMATE_SETTINGS)
  num_chains = settings.pop("num_chains")
  config = dv.Config(**settings)
  bare = jax.vmap(dv.run_chain, in_axes=(0,) + (None,) * 8)(
      jax.random.split(jax.random.PRNGKey(0), num_chains), jnp.asarray(x01),
      jnp.asarray(y01), jnp.ones(400, bool), jnp.ones(400, bool), DELTA, x.shape[1] + 1.0,
      2.0, config)
  np.testing.assert_array_equal(np.asarray(res.samples),
                                np.asarray(bare.divergences)[..., dv.KINDS.index("hellinger")])
  # Other sizes in the same bucket (448 rows) reuse the compiled chain.
  _, compiled = _programs_compiled(lambda: dv.estimate(
      x[:420], y[:390], "hellinger", key=jax.random.PRNGKey(1), **ESTIMATE_SETTINGS))
  assert compiled == 0
  # So do other burn-in lengths and thinnings (loop bounds, not shapes), and they are
  # honoured: without burn-in the first draw follows one step from the single box (a
  # single move and a double move: at most 1 + 1 + 2 = 4 boxes); after 400 steps none is
  # that small.
  short, compiled = _programs_compiled(lambda: dv.estimate(
      x[:400], y[:400], "hellinger", key=jax.random.PRNGKey(0),
      **dict(ESTIMATE_SETTINGS, num_burnin=0)))
  assert compiled == 0
  assert np.all(np.asarray(short.num_regions)[:, 0] <= 4)
  assert np.all(np.asarray(res.num_regions)[:, 0] > 4)
  thinned, compiled = _programs_compiled(lambda: dv.estimate(
      x[:400], y[:400], "hellinger", key=jax.random.PRNGKey(0),
      **dict(ESTIMATE_SETTINGS, num_burnin=10, thin=3)))
  assert compiled == 0 and thinned.samples.shape == res.samples.shape


def test_disjoint_supports_give_tv_near_one():
  rng = np.random.default_rng(3)
  x = rng.uniform(size=(400, 2)) * [0.45, 1.0]
  y = rng.uniform(size=(400, 2)) * [0.45, 1.0] + [0.55, 0.0]
  res = dv.estimate(x, y, "tv", key=jax.random.PRNGKey(1), **ESTIMATE_SETTINGS)
  assert float(res.mean) > 0.95
  assert float(res.credible_interval[0]) > 0.93
  assert res.samples.shape == (2, 300)
  assert 0 < float(res.acceptance_rate) < 1
  assert float(res.effective_sample_size) > 10
  assert float(res.at_max_regions) == 0.0


# --------------------------------------------------- accuracy vs Monte Carlo

SIZES = (50, 250, 1250)


def _errors(problem, reps, seed):
  truth = dp.monte_carlo_truth(problem, 1_000_000, np.random.default_rng(seed))
  rng = np.random.default_rng(seed + 1)
  pairs, sizes = [], []
  for n in SIZES:
    for _ in range(reps):
      pairs.append(dp.sample_pair(problem, n, rng))
      sizes.append(n)
  xs, ys, vx, vy = dp.pad_pairs(pairs)
  dim = xs.shape[-1]
  config = dv.Config(max_regions=64, num_burnin=400, num_samples=200)
  run = jax.vmap(dv.run_chain, in_axes=(0, 0, 0, 0, 0, None, None, None, None))
  out = run(jax.random.split(jax.random.PRNGKey(seed), len(pairs)), xs, ys, vx, vy, DELTA,
            dim + 1.0, 2.0, config)
  est = np.asarray(out.divergences).mean(axis=1)  # (pairs, kinds)
  sizes = np.array(sizes)
  err = {kind: [np.mean(np.abs(est[sizes == n, j] - truth[kind])) for n in SIZES]
         for j, kind in enumerate(dv.KINDS)}
  knn = {k: np.mean([abs(dv.knn_kl(x, y, k) - truth["kl"])
                     for (x, y), n in zip(pairs, sizes) if n == SIZES[-1]]) for k in (1, 10)}
  return err, knn


@pytest.mark.parametrize("problem", ["d1", "d3"])
def test_error_shrinks_with_n(problem):
  """Mean |error| over replicates falls with n (TV, Hellinger, KL: at every step; alpha = 2,
  whose draws have a heavy right tail when Q's boxes are nearly empty, from n = 50 to 1250);
  in d = 1, co-BPM's KL error at n = 1250 is no worse than the kNN estimator with k = 1.
  (In d = 3 it is worse than kNN at these n: see docs/results/divergence_simulation.md.)"""
  err, knn = _errors(problem, reps=2, seed=11)
  for kind in ("tv", "hellinger", "kl"):
    assert err[kind][2] < err[kind][1] < err[kind][0], (kind, err[kind])
  assert err["alpha"][2] < err["alpha"][0], err["alpha"]
  if problem == "d1":
    assert err["kl"][2] <= knn[1], (err["kl"], knn)


# ------------------------------------------------------------ input checks

def test_input_validation():
  key = jax.random.PRNGKey(0)
  x = np.random.default_rng(0).normal(size=(20, 2))
  with pytest.raises(ValueError, match="kind"):
    dv.estimate(x, x, "js", key=key)
  with pytest.raises(ValueError, match="alpha"):
    dv.estimate(x, x, "alpha", key=key)
  with pytest.raises(ValueError, match="alpha"):
    dv.estimate(x, x, "alpha", alpha=1.0, key=key)
  with pytest.raises(ValueError, match="alpha"):
    dv.estimate(x, x, "tv", alpha=2.0, key=key)
  with pytest.raises(ValueError, match="kernel"):
    dv.estimate(x, x, "tv", kernel="gibbs", key=key)
  with pytest.raises(ValueError, match="same number of columns"):
    dv.estimate(x, x[:, :1], "tv", key=key)
  with pytest.raises(ValueError, match="empty"):
    dv.estimate(x[:0], x, "tv", key=key)
  with pytest.raises(ValueError, match="Y.*NaN"):
    dv.estimate(x, np.where(np.arange(20)[:, None] == 3, np.nan, x), "tv", key=key)
  with pytest.raises(ValueError, match="2-D"):
    dv.estimate(x[:, 0], x, "tv", key=key)
  with pytest.raises(ValueError, match="MAX_DIM"):
    dv.estimate(np.zeros((5, 11)), np.zeros((5, 11)), "tv", key=key)
  with pytest.raises(ValueError, match="max_regions"):
    dv.estimate(x, x, "tv", key=key, max_regions=1)
  with pytest.raises(ValueError, match="bounds"):
    dv.estimate(x, x, "tv", key=key, bounds=(0.0, 1.0))
  with pytest.raises(ValueError, match="credible_level"):
    dv.estimate(x, x, "tv", key=key, credible_level=1.0)
  with pytest.raises(TypeError, match="num_samples"):
    dv.estimate(x, x, "tv", key=key, num_samples=1.5)
  with pytest.raises(ValueError, match="distinct"):
    dv.knn_kl(np.zeros((5, 1)), np.ones((5, 1)), 1)
  with pytest.raises(ValueError, match="k = 10"):
    dv.knn_kl(x[:5], x, 10)
  with pytest.warns(RuntimeWarning, match="D = 6"):
    dv.check_samples(np.zeros((3, 6)), np.zeros((3, 6)))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    dv.check_samples(np.zeros((3, 5)), np.zeros((3, 5)))


def test_rescale_maps_into_unit_cube():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(30, 2)) * [1.0, 1e3]
  y = np.concatenate([rng.normal(size=(10, 2)), np.full((1, 2), 7.0)])
  u, v = dv.rescale(x, y)
  both = np.concatenate([u, v])
  assert both.min() > 0 and both.max() < 1
  const = np.ones((4, 1))
  u, v = dv.rescale(const, const)
  assert np.allclose(u, 0.5)
  u, v = dv.rescale(np.array([[0.0], [1.0]]), np.array([[0.5]]), bounds=(0.0, 1.0))
  assert u[1, 0] < 1.0 and u[0, 0] == 0.0 and v[0, 0] == 0.5


def test_experiment_binary_smoke(tmp_path):
  """The binary's sanity part at a tiny size: results, Markdown and figure are written.
  (The sample size and number of draws are the divergence notebook's quick ones, so the
  suite compiles their chain once for both; the burn-in is a loop bound.)"""
  from experiments import divergence as experiment  # pylint: disable=g-import-not-at-top
  res = experiment.run(str(tmp_path), quick=True, parts=("sanity",), sanity_n=150,
                       burnin=10, samples=20)
  assert set(res["sanity"]) == {"uniform_mixture", "nested_partitions"}
  for name in ("divergence_sanity.json", "divergence_sanity.md", "divergence_sanity.png"):
    assert (tmp_path / name).exists()
  md = (tmp_path / "divergence_sanity.md").read_text()
  assert "nested_partitions" in md and "true TV" in md
