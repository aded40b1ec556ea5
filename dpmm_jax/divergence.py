"""co-BPM: Bayesian two-sample divergence estimation on a coupled binary partition.

Yang, Su & Wong, "co-BPM: a Bayesian Model for Divergence Estimation" (2014). Two samples
``X`` (N1, D) and ``Y`` (N2, D) are mapped to the unit cube by one common affine map
(phi-divergences are invariant under a bijection applied to both distributions). A shared
binary partition of ``[0, 1)^D`` into ``l`` boxes ``r_1..r_l`` is built by a decision
sequence ``A_l = (a_1, ..., a_{l-1})``: decision ``a_t`` halves one of the ``t`` current
boxes along one of the ``D`` coordinates (``t * D`` choices). Given the partition each sample
has a piecewise-constant density ``p_j(x) = sum_i m_ji 1{x in r_i} / |r_i|`` with
``m_j ~ Dir(delta 1_l)``. With the masses integrated out,

    pi(A_l, l | X, Y)  propto  p(A_l, l) * prod_{j=1,2} beta(delta + n_j.) / beta(delta 1_l)
                               * prod_i |r_i|^{-(n_1i + n_2i)},

``beta`` the multinomial Beta function and ``n_ji`` the count of sample ``j`` in box ``i``;
given the partition, ``m_j | A_l ~ Dir(delta + n_j.)``. Each posterior draw gives a
divergence ``D_phi = sum_i m_2i phi(m_1i / m_2i)`` (the volumes cancel).

Reconstruction choices (the paper's displayed equations are missing from our copy):

* Prior: ``p(A_l, l) propto exp(-sigma l) / ((l - 1)! D^(l - 1))`` for ``1 <= l <= L``:
  a geometric prior on the number of boxes, and all ``(l-1)! D^(l-1)`` decision sequences of
  length ``l - 1`` equally likely. This is the only normalisation under which the paper's
  uniform kernel (``p(l+1|l) / (l D)``) makes the ``l D`` cancel in the acceptance ratio,
  which the paper says simplifies when ``p(l'|l) = p(l|l')``; ``sigma = D + 1``.
  The other reading, ``exp(-sigma l)`` for every decision sequence, is improper: the
  number of sequences that build one partition grows like (l - 1)!, faster than
  ``exp(sigma l)``, and in a d = 3, n = 1250 test every chain ran to the ``max_regions``
  cap (127 of 128 boxes). Under the normalised prior the paper's sigma keeps partitions
  coarse in 3-D (``docs/results/divergence_prior.md``); ``sigma=`` is the knob.
* ``L = max_regions`` truncates the prior: ``p(L+1|L) = 0`` and ``p(L-1|L) = 1``;
  ``p(2|1) = 1``; otherwise ``p(l+1|l) = p(l-1|l) = 1/2``.
* Data-guided kernel: the new halving ``a = (i, k)`` (box ``i``, coordinate ``k``) is drawn
  with probability proportional to the posterior gain of that halving,
  ``q(a | A_l) propto pi(A_l + a) / pi(A_l)``, which depends only on the X and Y counts of the
  two halves of box ``i``:
  ``exp(g_ik)``, ``g_ik = sum_j [lgamma(delta + u_j) + lgamma(delta + n_ji - u_j)
  - lgamma(delta + n_ji)] + (n_1i + n_2i) log 2``. Its MH acceptance ratio then depends only
  on ``logsumexp_a g`` and ``l`` (the "smaller set of parameters" of the paper).
* Moves: ``l -> l + 1`` appends a halving; ``l -> l - 1`` drops the last decision; the
  chain is a Metropolis-Hastings chain on decision sequences (different sequences that give
  the same boxes are different states).
* Added moves (not in the paper; ``double_moves=False`` gives the paper's chain): each
  sweep also runs (a) a double move that adds or drops two nested halvings at once, with a
  data-guided kernel proportional to the posterior gain of both; without it the chain
  cannot cross a halving that is useless alone (P and Q symmetric about 1/2: the
  first halving costs ~9 nats at n = 1250 and the chain stayed at one box for thousands of
  steps), and (b) an order move that rotates a decision to or from the end of the
  sequence when the partition is unchanged (always accepted: symmetric proposal, equal
  posterior); without it only the last decision can ever be dropped, and chains froze in
  the first deep partition they reached.
* Boxes are half-open ``[lower, lower + 2^-level)``; a halved box keeps its lower half and
  the new box (index ``l``) is the upper half. A point exactly on the midpoint goes up.
* Divergences (all phi-divergences of ``P = p_1`` from ``Q = p_2``):
  ``tv = 1/2 sum |m1 - m2|``; ``hellinger = sqrt(1 - sum sqrt(m1 m2))`` (the Hellinger
  distance, in [0, 1]); ``kl = sum m1 log(m1 / m2)``; ``alpha``: Csiszar's
  ``(sum m1^a m2^(1-a) - 1) / (a (a - 1))`` (``a = 2`` gives chi^2 / 2, ``a -> 1`` KL).
* Rescaling: by default the pooled per-coordinate range ``[min, max]``, widened on each side
  by ``range / (N1 + N2)`` (about the expected gap between a sample's extreme and its
  support's edge), so that every point lies strictly inside the unit cube; or given
  ``bounds``. A constant coordinate gets a unit range.

Shapes: N1, N2 points, D dimensions, L = max_regions, S kept samples, C chains.

The estimator is meant for low dimensions: a partition with a few dozen boxes cannot
resolve more than ~5 coordinates; ``estimate`` warns above ``RECOMMENDED_MAX_DIM`` and
refuses above ``MAX_DIM``.
"""
import functools
import math
import numbers
import warnings
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from dpmm_jax import entry_points
from dpmm_jax import precision
from dpmm_jax import validation

KINDS = ("tv", "hellinger", "kl", "alpha")
KERNELS = ("data", "uniform")
RECOMMENDED_MAX_DIM = 5
MAX_DIM = 10
_LOG2 = math.log(2.0)
_MIN_PADDED_SIZE = 64


class Config(NamedTuple):
  """Static settings of the chain (hashable: used as a jit static argument).

  Attributes:
    max_regions: L, the largest number of boxes (fixed table size).
    kernel: "data" (data-guided halving proposal) or "uniform".
    num_burnin: steps discarded at the start of each chain.
    num_samples: S, kept posterior draws per chain.
    thin: steps between kept draws.
    double_moves: add the two-halving move after each single move (see ``double_step``).
  """
  max_regions: int = 128
  kernel: str = "data"
  double_moves: bool = True
  num_burnin: int = 2000
  num_samples: int = 1000
  thin: int = 1


class PartitionState(NamedTuple):
  """A decision sequence and the region tables it induces (masked beyond num_regions).

  Attributes:
    num_regions: () int32, l (number of boxes; l - 1 decisions).
    lower: (L, D) lower corners of the boxes.
    level: (L, D) int32 number of halvings of each box along each coordinate
      (box width 2^-level).
    parent: (L,) int32, parent[t] = the box halved by decision t (t = 1..l-1) to create box t.
    split_dim: (L,) int32, the coordinate of decision t.
    count_x, count_y: (L,) int32 box counts n_1i, n_2i.
    assign_x: (N1,) int32 box of each X point (-1 for padding).
    assign_y: (N2,) int32 box of each Y point (-1 for padding).
    log_posterior: () log pi(A_l, l | X, Y) up to a constant (see ``log_posterior``).
  """
  num_regions: jax.Array
  lower: jax.Array
  level: jax.Array
  parent: jax.Array
  split_dim: jax.Array
  count_x: jax.Array
  count_y: jax.Array
  assign_x: jax.Array
  assign_y: jax.Array
  log_posterior: jax.Array


class ChainOutput(NamedTuple):
  """What one chain returns.

  Attributes:
    divergences: (S, 4) per kept draw: tv, hellinger, kl, alpha (order of ``KINDS``).
    num_regions: (S,) int32 number of boxes of each kept draw.
    acceptance_rate: () fraction of accepted proposals over all steps, burn-in included
      (single and double moves counted separately).
    final_state: the last PartitionState.
  """
  divergences: jax.Array
  num_regions: jax.Array
  acceptance_rate: jax.Array
  final_state: PartitionState


class DivergenceEstimate(NamedTuple):
  """Result of ``estimate`` (a pytree of arrays).

  Attributes:
    mean: () posterior mean of the divergence.
    credible_interval: (2,) equal-tailed credible interval at ``credible_level``.
    samples: (C, S) posterior draws of the divergence, per chain.
    acceptance_rate: () mean MH acceptance rate over chains.
    effective_sample_size: () ESS of the pooled draws (Geyer's initial monotone sequence on
      the chain-averaged autocorrelation).
    num_regions: (C, S) number of boxes of each draw.
    at_max_regions: () fraction of draws at the cap ``max_regions`` (should be ~0).
  """
  mean: jax.Array
  credible_interval: jax.Array
  samples: jax.Array
  acceptance_rate: jax.Array
  effective_sample_size: jax.Array
  num_regions: jax.Array
  at_max_regions: jax.Array


# ------------------------------------------------------------------ model pieces

def _up_prob(l, max_regions):
  """p(l + 1 | l): 1 at l = 1, 0 at l = L, 1/2 otherwise."""
  return jnp.where(l <= 1, 1.0, jnp.where(l >= max_regions, 0.0, 0.5))


def _log_prior(l, dim, sigma):
  """log p(A_l, l) = -sigma l - log((l - 1)!) - (l - 1) log D (up to a constant)."""
  l = jnp.asarray(l, jnp.float32)
  return -sigma * l - lax.lgamma(l) - (l - 1.0) * jnp.log(jnp.float32(dim))


def log_posterior(state: PartitionState, delta, sigma):
  """Collapsed log posterior log pi(A_l, l | X, Y) of a state, up to a constant.

  ``log p(A_l, l) + sum_j [sum_i lgamma(delta + n_ji) - lgamma(l delta + n_j)
  - l lgamma(delta) + lgamma(l delta)] + log 2 * sum_i (n_1i + n_2i) sum_k level_ik``.
  """
  dim = state.lower.shape[-1]
  l = state.num_regions
  mask = jnp.arange(state.count_x.shape[0]) < l
  lf = l.astype(jnp.float32)
  out = _log_prior(l, dim, sigma)
  c = jnp.stack([state.count_x, state.count_y]).astype(jnp.float32)  # (2, L)
  n = jnp.sum(jnp.where(mask, c, 0.0), axis=-1)
  per_box = jnp.sum(jnp.where(mask, lax.lgamma(delta + c), 0.0), axis=-1)
  lg = _stacked_lgamma(lf * delta + n[0], lf * delta + n[1], delta, lf * delta)
  for j in (0, 1):  # X, then Y
    out += per_box[j] - lg[j] - lf * lg[2] + lg[3]
  depth = jnp.sum(state.level, axis=-1).astype(jnp.float32)
  out += _LOG2 * jnp.sum(jnp.where(mask, (state.count_x + state.count_y) * depth, 0.0))
  return out


def init_state(x, y, valid_x, valid_y, max_regions: int, delta, sigma) -> PartitionState:
  """The one-box partition (l = 1). x: (N1, D), y: (N2, D), valid_*: bool masks."""
  dim = x.shape[-1]
  ix = jnp.where(valid_x, 0, -1).astype(jnp.int32)
  iy = jnp.where(valid_y, 0, -1).astype(jnp.int32)
  zeros = jnp.zeros((max_regions,), jnp.int32)
  state = PartitionState(
      num_regions=jnp.int32(1),
      lower=jnp.zeros((max_regions, dim), x.dtype),
      level=jnp.zeros((max_regions, dim), jnp.int32),
      parent=zeros, split_dim=zeros,
      count_x=zeros.at[0].set(jnp.sum(valid_x).astype(jnp.int32)),
      count_y=zeros.at[0].set(jnp.sum(valid_y).astype(jnp.int32)),
      assign_x=ix, assign_y=iy, log_posterior=jnp.float32(0.0))
  return state._replace(log_posterior=log_posterior(state, delta, sigma))


def _midpoint(state, i, k):
  return state.lower[i, k] + jnp.ldexp(jnp.ones((), state.lower.dtype),
                                       -(state.level[i, k] + 1))


def split(state: PartitionState, i, k, x, y):
  """Appends decision (box i, coordinate k): box i keeps its lower half, box l is the upper.

  Counts are updated incrementally (only the points of box i move). Returns the new state
  (log_posterior not updated) and the upper-half counts (u_x, u_y).
  """
  t = state.num_regions
  mid = _midpoint(state, i, k)
  new_level = state.level[i].at[k].add(1)
  move_x = (state.assign_x == i) & (jnp.take(x, k, axis=1) >= mid)
  move_y = (state.assign_y == i) & (jnp.take(y, k, axis=1) >= mid)
  u_x = jnp.sum(move_x).astype(jnp.int32)
  u_y = jnp.sum(move_y).astype(jnp.int32)
  new = state._replace(
      num_regions=t + 1,
      lower=state.lower.at[t].set(state.lower[i].at[k].set(mid)),
      level=state.level.at[i].set(new_level).at[t].set(new_level),
      parent=state.parent.at[t].set(i), split_dim=state.split_dim.at[t].set(k),
      count_x=state.count_x.at[i].add(-u_x).at[t].set(u_x),
      count_y=state.count_y.at[i].add(-u_y).at[t].set(u_y),
      assign_x=jnp.where(move_x, t, state.assign_x),
      assign_y=jnp.where(move_y, t, state.assign_y))
  return new, u_x, u_y


def drop(state: PartitionState) -> PartitionState:
  """Removes the last decision (requires num_regions >= 2; log_posterior not updated)."""
  t = jnp.maximum(state.num_regions - 1, 1)
  i, k = state.parent[t], state.split_dim[t]
  return state._replace(
      num_regions=t,
      level=state.level.at[i, k].add(-1),
      count_x=state.count_x.at[i].add(state.count_x[t]).at[t].set(0),
      count_y=state.count_y.at[i].add(state.count_y[t]).at[t].set(0),
      assign_x=jnp.where(state.assign_x == t, i, state.assign_x),
      assign_y=jnp.where(state.assign_y == t, i, state.assign_y))


class CountTerms(NamedTuple):
  """The concentration ``delta`` and ``lgamma(delta + m)`` for every count m = 0..max_count.

  The MH moves need ``lgamma(delta + count)`` at integer counts only (``_split_gain``), on
  (L, D) and (L, D, 2, D) tables: one table per chain, read by index, replaces an
  ``lgamma`` per use. XLA expands each ``lgamma`` into a few hundred instructions wherever
  it occurs: with the six per gain the chain compiled in 3.7-4.4 s instead of 2.4-3.4 s at
  D = 2-3, and 4 chains x 300 steps at D = 3 ran in 0.34-0.35 s instead of 0.13-0.14 s
  (``benchmarks/RESULTS.md``, session 27). The functions that take ``delta`` accept a
  ``CountTerms`` in its place (``run_chain`` builds it once).

  Attributes:
    delta: () Dirichlet concentration.
    log_gamma: (max_count + 1,) lgamma(delta + m).
  """
  delta: jax.Array
  log_gamma: jax.Array


def count_terms(delta, state: "PartitionState") -> CountTerms:
  """``CountTerms`` for the counts a state's samples can reach (``delta`` itself if it
  already is one). Counts are at most max(N1, N2)."""
  if isinstance(delta, CountTerms):
    return delta
  delta = jnp.asarray(delta, jnp.float32)
  max_count = max(state.assign_x.shape[-1], state.assign_y.shape[-1])
  return CountTerms(delta, lax.lgamma(delta + jnp.arange(max_count + 1, dtype=jnp.float32)))


def _delta(delta):
  """The concentration of ``delta`` (a number or ``CountTerms``)."""
  return delta.delta if isinstance(delta, CountTerms) else delta


def _stacked_lgamma(*args):
  """lgamma of each argument (broadcast to one shape), as one ``lax.lgamma`` of a stack.

  XLA expands every lgamma into a few hundred instructions at each place it occurs (with
  lgamma swapped for log1p, the chain of ``run_chain`` at D = 2, L = 16 compiled in 5.8 s
  instead of 8.2 s); one lgamma over a stack instead of several side by side keeps one
  copy. Values are the same. Meant for scalar terms (``_level_gain``, ``log_posterior``).
  """
  args = jnp.broadcast_arrays(*[jnp.asarray(a, jnp.float32) for a in args])
  return lax.lgamma(jnp.stack(args))


def _split_gain(n_x, n_y, u_x, u_y, terms: CountTerms):
  """g: the box-specific part of log pi(A + (i,k)) - log pi(A) (integer counts of box i
  and of its upper half), with lgamma(delta + count) read from ``terms``."""
  lg = terms.log_gamma
  out = jnp.asarray(n_x + n_y, jnp.float32) * _LOG2
  for n, u in ((n_x, u_x), (n_y, u_y)):
    out += lg[u] + lg[n - u] - lg[n]
  return out


def _level_gain(l, state, delta, sigma):
  """c(l): the part of log pi(A_l + a) - log pi(A_l) shared by every halving a."""
  dim = state.lower.shape[-1]
  lf = jnp.asarray(l, jnp.float32)
  out = -sigma - jnp.log(lf * dim)
  d = jnp.asarray(_delta(delta), jnp.float32)
  args = []
  for count in (state.count_x, state.count_y):
    n = jnp.sum(jnp.where(jnp.arange(count.shape[0]) < state.num_regions, count, 0))
    n = n.astype(jnp.float32)
    args += [lf * d + n, (lf + 1.0) * d + n, d, (lf + 1.0) * d, lf * d]
  lg = _stacked_lgamma(*args)
  for j in (0, 5):  # X, then Y
    out += lg[j] - lg[j + 1] - lg[j + 2] + lg[j + 3] - lg[j + 4]
  return out


def _point_bits(state, data, assign):
  """Per point: its box (clipped), upper-half bits (N, D) and quarter bits (N, D).

  The quarter bit along k is the upper-half bit of the point's half-box along k.
  """
  max_regions = state.count_x.shape[0]
  box = jnp.clip(assign, 0, max_regions - 1)
  width = jnp.ldexp(jnp.ones((), state.lower.dtype), -state.level[box])
  lower = state.lower[box]
  upper = data >= lower + 0.5 * width
  quarter = jnp.where(upper, data >= lower + 0.75 * width, data >= lower + 0.25 * width)
  return box, upper & (assign >= 0)[:, None], quarter


def half_counts(state: PartitionState, x, y):
  """(L, D) counts of X and of Y in the upper half of each box along each coordinate."""
  max_regions = state.count_x.shape[0]

  def one(data, assign):
    box, upper, _ = _point_bits(state, data, assign)
    return jax.ops.segment_sum(upper.astype(jnp.int32), box, num_segments=max_regions)

  return one(x, state.assign_x), one(y, state.assign_y)


def quarter_counts(state: PartitionState, x, y):
  """(L, D, 2, D) counts for two nested halvings: box i halved along k, then its child c
  (0 = lower half, 1 = upper half) halved along k'; entry [i, k, c, k'] counts the points
  in the upper half of that child along k'. Returned for X and for Y."""
  max_regions, dim = state.lower.shape
  eye = jnp.eye(dim, dtype=bool)

  def one(data, assign):
    box, upper, quarter = _point_bits(state, data, assign)
    valid = (assign >= 0)[:, None, None, None]
    side = jnp.stack([~upper, upper], axis=-1)  # (N, k, c)
    bits = jnp.where(eye[None], quarter[:, :, None], upper[:, None, :])  # (N, k, k')
    ind = side[:, :, :, None] & bits[:, :, None, :] & valid
    return jax.ops.segment_sum(ind.astype(jnp.int32), box, num_segments=max_regions)

  return one(x, state.assign_x), one(y, state.assign_y)


def _box_mask(state):
  return jnp.arange(state.count_x.shape[0]) < state.num_regions


def proposal_log_probs(state: PartitionState, x, y, kernel: str, delta):
  """(L, D) log q(a | A_l) of each halving a = (box, coordinate); -inf for absent boxes."""
  dim = state.lower.shape[-1]
  valid = _box_mask(state)[:, None] & jnp.ones((1, dim), bool)
  if kernel == "uniform":
    logq = -jnp.log(state.num_regions.astype(jnp.float32) * dim)
    return jnp.where(valid, logq, -jnp.inf)
  if kernel != "data":
    raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}.")
  hx, hy = half_counts(state, x, y)
  g = _split_gain(state.count_x[:, None], state.count_y[:, None], hx, hy,
                  count_terms(delta, state))
  g = jnp.where(valid, g, -jnp.inf)
  return g - jax.nn.logsumexp(g)


def double_proposal_log_probs(state: PartitionState, x, y, kernel: str, delta):
  """(L, D, 2, D) log q2(a, a' | A_l) of a halving a = (i, k) followed by halving child c of
  box i along k'. Data-guided: proportional to the posterior gain of both halvings."""
  dim = state.lower.shape[-1]
  valid = _box_mask(state)[:, None, None, None] & jnp.ones((1, dim, 2, dim), bool)
  if kernel == "uniform":
    logq = -jnp.log(state.num_regions.astype(jnp.float32) * dim * 2 * dim)
    return jnp.where(valid, logq, -jnp.inf)
  if kernel != "data":
    raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}.")
  terms = count_terms(delta, state)
  hx, hy = half_counts(state, x, y)
  qx, qy = quarter_counts(state, x, y)
  nx, ny = state.count_x[:, None], state.count_y[:, None]
  g1 = _split_gain(nx, ny, hx, hy, terms)  # (L, D)
  child_x = jnp.stack([nx - hx, hx], axis=-1)[..., None]  # (L, D, 2, 1)
  child_y = jnp.stack([ny - hy, hy], axis=-1)[..., None]
  g2 = _split_gain(child_x, child_y, qx, qy, terms)  # (L, D, 2, D)
  g = jnp.where(valid, g1[:, :, None, None] + g2, -jnp.inf)
  return g - jax.nn.logsumexp(g)


def _up_prob2(l, max_regions):
  """Probability that a double move proposes l -> l + 2 (else l -> l - 2)."""
  return jnp.where(l + 2 > max_regions, 0.0, jnp.where(l <= 2, 1.0, 0.5))


def _split_move(base, i, k, x, y, delta, sigma):
  """Halves box i of ``base`` along k; returns (state, log pi gain)."""
  grown, u_x, u_y = split(base, i, k, x, y)
  gain = (_level_gain(base.num_regions, base, delta, sigma)
          + _split_gain(base.count_x[i], base.count_y[i], u_x, u_y,
                        count_terms(delta, base)))
  return grown, gain


def _double_split(base, i, k, c, k2, x, y, delta, sigma):
  """Halves box i along k, then child c of it (0: box i, 1: the new box) along k2."""
  boxes = jnp.stack([i, jnp.where(c == 1, base.num_regions, i)]).astype(jnp.int32)
  dims = jnp.stack([k, k2]).astype(jnp.int32)

  def halve(t, carry):  # a loop, not two inlined halvings: one copy in the program
    state, gain = carry
    state, g = _split_move(state, boxes[t], dims[t], x, y, delta, sigma)
    return state, gain + g

  return lax.fori_loop(0, 2, halve, (base, jnp.zeros_like(base.log_posterior)))


def split_log_ratio(state, i, k, u_x, u_y, logq_ik, delta, sigma):
  """log MH ratio of the single move A_l -> A_l + (i, k) (the reverse move's is its negative).

  Returns (log ratio, log pi gain).
  """
  max_regions = state.lower.shape[0]
  gain = (_level_gain(state.num_regions, state, delta, sigma)
          + _split_gain(state.count_x[i], state.count_y[i], u_x, u_y,
                        count_terms(delta, state)))
  l = state.num_regions
  log_up = jnp.log(_up_prob(l, max_regions))
  log_down = jnp.log1p(-_up_prob(l + 1, max_regions))
  return gain + log_down - log_up - logq_ik, gain


def _tree_where(cond, a, b):
  return jax.tree_util.tree_map(lambda u, v: jnp.where(cond, u, v), a, b)


def _finish(state, up, base, grown, gain, log_ratio, u_accept):
  """MH accept/reject of the pair (base, grown) in the direction ``up``; u_accept ~ U(0, 1)."""
  log_alpha = jnp.where(up, log_ratio, -log_ratio)
  accept = jnp.log(u_accept) < log_alpha
  base_lp = jnp.where(up, state.log_posterior, state.log_posterior - gain)
  grown = grown._replace(log_posterior=base_lp + gain)
  base = base._replace(log_posterior=base_lp)
  return _tree_where(accept, _tree_where(up, grown, base), state), accept


# Random numbers. Each move takes its uniforms from one vector, drawn by one
# ``jax.random.uniform`` per sweep (``mcmc_step``): every ``jax.random`` call site compiles
# its own copy of the threefry generator, and with a split, a uniform and a categorical
# per move they made up about half of the chain's compile time (with every draw swapped
# for a constant, 4.2 s instead of 8.2 s at D = 2, L = 16). Values lie in
# [tiny, 1): the Gumbel noise -log(-log u) of a categorical draw stays finite.

def _uniforms(key, n):
  return jax.random.uniform(key, (n,), minval=jnp.finfo(jnp.float32).tiny)


def _gumbel_argmax(logits, u):
  """A draw from the categorical distribution with these logits (flattened index), by the
  Gumbel-max trick with u ~ U(0, 1) of logits' size."""
  return jnp.argmax(logits.reshape(-1) - jnp.log(-jnp.log(u)))


def _single_size(state):
  """Uniforms one single move uses: direction, acceptance, one per halving (L D)."""
  return 2 + state.lower.size


def _double_size(state):
  """Uniforms one double move uses: direction, acceptance, one per pair (L D 2 D)."""
  return 2 + 2 * state.lower.size * state.lower.shape[-1]


_ROTATE_SIZE = 2


def single_step(state: PartitionState, key, x, y, kernel: str, delta, sigma):
  """One Metropolis-Hastings step of the paper's chain. Returns (state, accepted).

  With probability p(l+1|l) propose appending a halving drawn from the kernel; otherwise
  propose dropping the last decision. Both are written as the pair (base, base + a), base
  being the current state (grow) or the state without its last decision (shrink), so one
  table evaluation and one halving serve both directions (vmap-friendly, no branches).
  """
  return _single_step(state, _uniforms(key, _single_size(state)), x, y, kernel, delta, sigma)


def _single_step(state, u, x, y, kernel, delta, sigma):
  """``single_step`` with its uniforms u: (_single_size(state),)."""
  max_regions, dim = state.lower.shape
  delta = count_terms(delta, state)
  l = state.num_regions
  up = u[0] < _up_prob(l, max_regions)
  base = _tree_where(up, state, drop(state))
  logq = proposal_log_probs(base, x, y, kernel, delta)
  # Both kernels draw from logq (the uniform kernel's is flat over the l D halvings).
  flat = _gumbel_argmax(logq, u[2:])
  new_i, new_k = flat // dim, flat % dim
  last = jnp.maximum(l - 1, 1)
  i = jnp.where(up, new_i, state.parent[last]).astype(jnp.int32)
  k = jnp.where(up, new_k, state.split_dim[last]).astype(jnp.int32)
  grown, gain = _split_move(base, i, k, x, y, delta, sigma)
  lb = base.num_regions
  log_ratio = (gain + jnp.log1p(-_up_prob(lb + 1, max_regions))
               - jnp.log(_up_prob(lb, max_regions)) - logq[i, k])
  return _finish(state, up, base, grown, gain, log_ratio, u[1])


def _last_two(state):
  """The last two decisions as a double move: (i, k, c, k2, valid)."""
  l = state.num_regions
  t = jnp.maximum(l - 2, 1)
  i, k = state.parent[t], state.split_dim[t]
  p, k2 = state.parent[jnp.maximum(l - 1, 1)], state.split_dim[jnp.maximum(l - 1, 1)]
  valid = (l >= 3) & ((p == i) | (p == t))
  return i, k, (p == t).astype(jnp.int32), k2, valid


def double_step(state: PartitionState, key, x, y, kernel: str, delta, sigma):
  """A Metropolis-Hastings step that adds or drops two nested halvings at once.

  Not in the paper: its single moves cannot cross a split that is useless by itself but
  makes a useful one possible (e.g. P bimodal, Q flat, both symmetric about 1/2: halving at
  1/2 loses ~(log n) of posterior, halving a half again gains a lot). Grow: draw (a, a'),
  a = (i, k) and a' halving child c of box i along k', from the double kernel. Shrink:
  drop the last two decisions if the last one halves a child of the one before (otherwise
  the move is impossible and rejected). Returns (state, accepted).
  """
  return _double_step(state, _uniforms(key, _double_size(state)), x, y, kernel, delta, sigma)


def _double_step(state, u, x, y, kernel, delta, sigma):
  """``double_step`` with its uniforms u: (_double_size(state),)."""
  max_regions = state.lower.shape[0]
  delta = count_terms(delta, state)
  l = state.num_regions
  up = u[0] < _up_prob2(l, max_regions)
  base = _tree_where(up, state, drop(drop(state)))
  logq = double_proposal_log_probs(base, x, y, kernel, delta)
  flat = _gumbel_argmax(logq, u[2:])
  new = jnp.unravel_index(flat, logq.shape)
  di, dk, dc, dk2, valid = _last_two(state)
  i, k, c, k2 = (jnp.where(up, a, b).astype(jnp.int32)
                 for a, b in zip(new, (di, dk, dc, dk2)))
  grown, gain = _double_split(base, i, k, c, k2, x, y, delta, sigma)
  lb = base.num_regions
  log_ratio = (gain + jnp.log1p(-_up_prob2(lb + 2, max_regions))
               - jnp.log(_up_prob2(lb, max_regions)) - logq[i, k, c, k2])
  log_ratio = jnp.where(up | valid, log_ratio, jnp.inf)  # impossible shrink: reject
  return _finish(state, up, base, grown, gain, log_ratio, u[1])


def rotate(state: PartitionState, t, to_end):
  """Moves decision t to the end of the sequence (``to_end``) or the last decision to
  position t, relabelling the boxes; returns (state, valid).

  Valid when the partition is unchanged: to the end, if no later decision halves box t or
  the box decision t halved; from the end, if the last decision's box exists before step
  t and no decision from t on halves it. Then the two sequences have the same boxes, hence
  the same posterior.
  """
  max_regions = state.count_x.shape[0]
  l = state.num_regions
  last = l - 1
  r = jnp.arange(max_regions)
  later = (r > t) & (r <= last)
  from_t = (r >= t) & (r < last)
  valid_to = ~jnp.any(later & ((state.parent == t) | (state.parent == state.parent[t])))
  p_last = state.parent[last]
  valid_from = (p_last < t) & ~jnp.any(from_t & (state.parent == p_last))
  valid = (t >= 1) & (t < last) & jnp.where(to_end, valid_to, valid_from)
  # old label -> new label, and new label -> old label.
  new_of_old = jnp.where(to_end,
                         jnp.where(r < t, r, jnp.where(r == t, last,
                                                       jnp.where(r <= last, r - 1, r))),
                         jnp.where(r < t, r, jnp.where(r == last, t,
                                                       jnp.where(r < last, r + 1, r))))
  old_of_new = jnp.zeros_like(r).at[new_of_old].set(r)
  relabel = lambda a: jnp.where(a >= 0, new_of_old[jnp.clip(a, 0, max_regions - 1)], a)
  rotated = state._replace(
      lower=state.lower[old_of_new], level=state.level[old_of_new],
      count_x=state.count_x[old_of_new], count_y=state.count_y[old_of_new],
      parent=jnp.where(r >= 1, new_of_old[state.parent[old_of_new]], 0),
      split_dim=state.split_dim[old_of_new],
      assign_x=relabel(state.assign_x), assign_y=relabel(state.assign_y))
  return rotated, valid


def rotate_step(state: PartitionState, key):
  """Order move: pick t uniformly in 1..l-2 and a direction; rotate if valid (always
  accepted: the proposal is symmetric and the posterior unchanged). Returns (state, moved).
  """
  return _rotate_step(state, _uniforms(key, _ROTATE_SIZE))


def _rotate_step(state, u):
  """``rotate_step`` with its uniforms u: (2,)."""
  count = jnp.maximum(state.num_regions - 2, 1)    # t in 1..max(l - 2, 1)
  t = 1 + jnp.minimum(jnp.floor(u[0] * count).astype(jnp.int32), count - 1)
  to_end = u[1] < 0.5
  rotated, valid = rotate(state, t, to_end)
  return _tree_where(valid, rotated, state), valid


def mcmc_step(state: PartitionState, key, x, y, kernel: str, delta, sigma,
              double_moves: bool = True):
  """One sweep: a single-move MH step, then (if ``double_moves``) a double-move MH step and
  an order move (``rotate_step``).

  Each step leaves pi(A_l, l | X, Y) invariant (detailed balance), so their composition
  does too. All three moves take their uniforms from one draw. Returns (state, number of
  accepted single and double moves).
  """
  double = double_moves and state.lower.shape[0] >= 3
  delta = count_terms(delta, state)
  n1, n2 = _single_size(state), _double_size(state)
  u = _uniforms(key, n1 + (n2 + _ROTATE_SIZE if double else 0))
  state, acc = _single_step(state, u[:n1], x, y, kernel, delta, sigma)
  acc = acc.astype(jnp.int32)
  if double:
    state, acc2 = _double_step(state, u[n1:n1 + n2], x, y, kernel, delta, sigma)
    acc += acc2.astype(jnp.int32)
    state, _ = _rotate_step(state, u[n1 + n2:])
  return state, acc


def transition_log_probs(state: PartitionState, x, y, kernel: str, delta, sigma,
                         order: int = 1):
  """Exact one-step transition probabilities of ``single_step`` (order 1) or
  ``double_step`` (order 2) out of ``state`` (for checks on tiny problems).

  Returns:
    log_grow: log P(state -> state + move) for every grow move: (L, D) for order 1,
      (L, D, 2, D) for order 2; -inf where impossible.
    log_shrink: () log P(state -> state without its last ``order`` decisions) (-inf where
      impossible).
  """
  max_regions, dim = state.lower.shape
  l = state.num_regions
  delta = count_terms(delta, state)
  if order == 1:
    up_prob = _up_prob
    logq = proposal_log_probs(state, x, y, kernel, delta)
    base = drop(state)
    last = jnp.maximum(l - 1, 1)
    moves = (state.parent[last], state.split_dim[last])
    valid = l > 1

    def grow_fn(s, mv):
      return _split_move(s, *mv, x, y, delta, sigma)

    base_logq = proposal_log_probs(base, x, y, kernel, delta)
  else:
    up_prob = _up_prob2
    logq = double_proposal_log_probs(state, x, y, kernel, delta)
    base = drop(drop(state))
    *moves, valid = _last_two(state)
    moves = tuple(moves)

    def grow_fn(s, mv):
      return _double_split(s, *mv, x, y, delta, sigma)

    base_logq = double_proposal_log_probs(base, x, y, kernel, delta)

  def log_ratio(s, mv, lq):
    _, gain = grow_fn(s, mv)
    ls = s.num_regions
    return (gain + jnp.log1p(-up_prob(ls + order, max_regions))
            - jnp.log(up_prob(ls, max_regions)) - lq[mv])

  idx = jnp.indices(logq.shape).reshape(logq.ndim, -1).T
  ratios = jax.vmap(lambda m: log_ratio(state, tuple(m), logq))(idx).reshape(logq.shape)
  grow = logq + jnp.minimum(ratios, 0.0) + jnp.log(up_prob(l, max_regions))
  grow = jnp.where(jnp.isfinite(logq), grow, -jnp.inf)
  r = log_ratio(base, moves, base_logq)
  shrink = jnp.log1p(-up_prob(l, max_regions)) + jnp.minimum(-r, 0.0)
  return grow, jnp.where(valid, shrink, -jnp.inf)


# ------------------------------------------------------------------ divergences

def _divergences_from_log_masses(log_m1, log_m2, mask, alpha):
  """(4,) tv, hellinger, kl, alpha-divergence of two masked probability vectors."""
  m1 = jnp.where(mask, jnp.exp(log_m1), 0.0)
  m2 = jnp.where(mask, jnp.exp(log_m2), 0.0)
  tv = 0.5 * jnp.sum(jnp.abs(m1 - m2))
  bc = jnp.sum(jnp.where(mask, jnp.exp(0.5 * (log_m1 + log_m2)), 0.0))
  hel = jnp.sqrt(jnp.clip(1.0 - bc, 0.0, 1.0))
  kl = jnp.sum(jnp.where(mask, m1 * (log_m1 - log_m2), 0.0))
  s = jnp.sum(jnp.where(mask, jnp.exp(alpha * log_m1 + (1.0 - alpha) * log_m2), 0.0))
  alpha_div = (s - 1.0) / (alpha * (alpha - 1.0))
  return jnp.stack([tv, hel, jnp.maximum(kl, 0.0), jnp.maximum(alpha_div, 0.0)])


def log_gamma_sample(key, shape, attempts: int = 8):
  """log of Gamma(shape, 1) draws, elementwise (any shape > 0, also tiny ones).

  Marsaglia & Tsang (2000) for shape + 1 >= 1 with a fixed number of vectorised attempts
  (each accepted with probability > 0.95, so all ``attempts`` fail with probability
  < 1e-10; then the last candidate is used), and ``G(a) = G(a + 1) U^(1/a)`` in log space,
  which stays finite for the small Dirichlet parameters (delta = 1/2 on empty boxes) where
  the gamma draw itself underflows float32. Exists because ``jax.random.loggamma`` compiles
  a rejection while-loop that dominated the chain's compile time.
  """
  shape = jnp.asarray(shape, jnp.float32)
  # One uniform draw serves every attempt's normal and acceptance test and the final
  # power (each jax.random call site compiles its own generator).
  uniforms = jax.random.uniform(key, (2 * attempts + 1,) + shape.shape, minval=1e-30)
  a = shape + 1.0
  d = a - 1.0 / 3.0
  c = 1.0 / jnp.sqrt(9.0 * d)
  open_interval = jnp.maximum(2.0 * uniforms[:attempts] - 1.0, jnp.nextafter(-1.0, 0.0))
  z = jnp.sqrt(2.0) * lax.erf_inv(open_interval)  # standard normal
  u = uniforms[attempts:2 * attempts]
  v = jnp.maximum(1.0 + c * z, 1e-12) ** 3
  ok = (1.0 + c * z > 0) & (jnp.log(u) < 0.5 * z * z + d - d * v + d * jnp.log(v))
  first = jnp.argmax(jnp.concatenate([ok, jnp.ones((1,) + shape.shape, bool)]), axis=0)
  first = jnp.minimum(first, attempts - 1)
  log_v = jnp.take_along_axis(jnp.log(v), first[None], axis=0)[0]
  log_g = jnp.log(d) + log_v  # log Gamma(shape + 1)
  return log_g + jnp.log(uniforms[-1]) / shape


def draw_divergences(state: PartitionState, key, delta, alpha):
  """Draws m_j ~ Dir(delta + n_j.) on the state's boxes; returns (4,) divergences."""
  mask = jnp.arange(state.count_x.shape[0]) < state.num_regions
  counts = jnp.stack([state.count_x, state.count_y]).astype(jnp.float32)  # (2, L)
  g = jnp.where(mask, log_gamma_sample(key, delta + counts), -jnp.inf)  # one sampler call
  log_m = g - jax.nn.logsumexp(g, axis=-1, keepdims=True)
  return _divergences_from_log_masses(log_m[0], log_m[1], mask, alpha)


def run_chain(key, x, y, valid_x, valid_y, delta, sigma, alpha, config: Config) -> ChainOutput:
  """One co-BPM chain: burn-in, then S kept draws every ``thin`` steps (all in lax loops).

  Vmappable over keys (chains) and over (x, y, valid_x, valid_y) (pairs of samples padded to
  common sizes). Compiled once per shape and per ``config`` less its burn-in and thinning:
  those two are loop bounds of the compiled chain, so runs that differ only in them share
  one program (``_chain``).

  Args:
    key: PRNG key.
    x: (N1, D) first sample in [0, 1)^D (padding rows arbitrary).
    y: (N2, D) second sample in [0, 1)^D.
    valid_x: (N1,) bool, False for padding rows; valid_y likewise (N2,).
    delta: Dirichlet concentration (1/2 in the paper).
    sigma: prior penalty per box (D + 1 in the paper).
    alpha: order of the alpha-divergence column.
    config: ``Config`` (a Python value, not traced).
  Returns:
    ChainOutput.
  """
  return _chain(key, x, y, valid_x, valid_y, delta, sigma, alpha, config.num_burnin,
                config.thin, config._replace(num_burnin=0, thin=1))


@functools.partial(jax.jit, static_argnames=("config",))
def _chain(key, x, y, valid_x, valid_y, delta, sigma, alpha, num_burnin, thin,
           config: Config) -> ChainOutput:
  """``run_chain`` with the burn-in length and the thinning as traced () ints (the static
  ``config``'s own are unused)."""
  delta = jnp.float32(delta)
  sigma = jnp.float32(sigma)
  alpha = jnp.float32(alpha)
  num_burnin = jnp.asarray(num_burnin, jnp.int32)
  thin = jnp.asarray(thin, jnp.int32)
  state = init_state(x, y, valid_x, valid_y, config.max_regions, delta, sigma)
  terms = count_terms(delta, state)

  # Step t of the burn-in uses fold_in(k_burn, t); step t before draw j uses
  # fold_in(step key of draw j, t) and the draw its own key: keys for any number of
  # steps without a step-count-sized array.
  k_burn, k_keep = jax.random.split(key)
  keep_pairs = jax.vmap(jax.random.split)(jax.random.split(k_keep, config.num_samples))
  # Segment 0 is the burn-in (its draw is discarded), segment j >= 1 the thin steps before
  # draw j: one loop over segments holds a single copy of the MCMC step and of the draw,
  # which halves the compiled program against a burn-in loop beside a draw loop.
  seg = jnp.arange(config.num_samples + 1, dtype=jnp.int32)
  seg_len = jnp.where(seg == 0, num_burnin, thin)
  step_base = jnp.concatenate([k_burn[None], keep_pairs[:, 0]])
  div_keys = jnp.concatenate([keep_pairs[:1, 1], keep_pairs[:, 1]])

  def segment(carry, xs):
    base, length, k_div = xs

    def body(t, c):
      s, n_acc = c
      s, acc = mcmc_step(s, jax.random.fold_in(base, t), x, y, config.kernel, terms, sigma,
                         config.double_moves)
      return s, n_acc + acc

    carry = lax.fori_loop(0, length, body, carry)
    s = carry[0]
    return carry, (draw_divergences(s, k_div, delta, alpha), s.num_regions)

  (state, n_acc), (divs, nreg) = lax.scan(segment, (state, jnp.int32(0)),
                                          (step_base, seg_len, div_keys))
  divs, nreg = divs[1:], nreg[1:]
  moves = 2 if (config.double_moves and config.max_regions >= 3) else 1
  total = moves * (num_burnin + config.num_samples * thin)
  return ChainOutput(divs, nreg, n_acc / jnp.maximum(total, 1).astype(jnp.float32), state)


# ------------------------------------------------------------------ diagnostics

def effective_sample_size(samples) -> float:
  """ESS of (C, S) draws: chain-averaged autocorrelation, Geyer's initial monotone sequence.

  ``ESS = C S / (-1 + 2 sum_{t} P_t)`` with ``P_t = rho_2t + rho_2t+1`` summed while
  positive and made non-increasing; rho from the chains' FFT autocovariances with the
  between-chain variance folded in (as in Stan's ``ess_bulk`` without rank-normalisation).
  Constant draws give ESS = C S.
  """
  x = np.asarray(samples, np.float64)
  if x.ndim == 1:
    x = x[None]
  c, s = x.shape
  if s < 4:
    return float(c * s)
  centred = x - x.mean(axis=1, keepdims=True)
  nfft = 1 << int(math.ceil(math.log2(2 * s)))
  f = np.fft.rfft(centred, nfft, axis=1)
  acov = np.fft.irfft(f * np.conj(f), nfft, axis=1)[:, :s] / s
  within = acov[:, 0].mean() * s / (s - 1.0)
  var_plus = within * (s - 1.0) / s
  if c > 1:
    var_plus += x.mean(axis=1).var(ddof=1)
  if not np.isfinite(var_plus) or var_plus <= 1e-300:
    return float(c * s)
  rho = 1.0 - (within - acov.mean(axis=0)) / var_plus
  rho[0] = 1.0
  pairs = rho[:-1:2] + rho[1::2]
  total = 0.0
  prev = np.inf
  for p in pairs:
    if p <= 0:
      break
    p = min(p, prev)
    total += p
    prev = p
  tau = max(-1.0 + 2.0 * total, 1.0 / math.log10(max(c * s, 10)))
  return float(c * s / tau)


# ------------------------------------------------------------------ public one-call API

def _check_dims(dim: int) -> None:
  if dim > MAX_DIM:
    raise ValueError(f"co-BPM is a low-dimensional estimator: got D = {dim} > MAX_DIM = "
                     f"{MAX_DIM}; project the samples first (e.g. a few principal components).")
  if dim > RECOMMENDED_MAX_DIM:
    warnings.warn(f"co-BPM with D = {dim} > {RECOMMENDED_MAX_DIM}: partitions with a few "
                  "dozen boxes resolve few coordinates; expect a biased estimate.",
                  RuntimeWarning, stacklevel=3)


def check_samples(x, y):
  """Validates the two samples; returns float numpy arrays (N1, D), (N2, D)."""
  x = validation.features(x, "X")
  y = validation.features(y, "Y")
  if x.shape[1] != y.shape[1]:
    raise ValueError(f"X and Y must have the same number of columns, got X {x.shape} and "
                     f"Y {y.shape}.")
  _check_dims(x.shape[1])
  return x, y


def rescale(x, y, bounds=None):
  """Maps both samples by one affine map into [0, 1)^D (see the module docstring).

  Args:
    x: (N1, D), y: (N2, D) numpy arrays.
    bounds: None (pooled range widened by range / (N1 + N2) each side) or a pair
      (lower, upper) of scalars or (D,) arrays containing every point.
  Returns:
    (x01, y01) float32 numpy arrays in [0, 1).
  """
  pooled = np.concatenate([x, y], axis=0).astype(np.float64)
  if bounds is None:
    lo, hi = pooled.min(axis=0), pooled.max(axis=0)
    span = hi - lo
    span = np.where(span > 0, span, 1.0)
    margin = span / pooled.shape[0]
    lo, hi = lo - margin, hi + margin
    lo = np.where(pooled.max(axis=0) > pooled.min(axis=0), lo, pooled.min(axis=0) - 0.5)
    hi = np.where(pooled.max(axis=0) > pooled.min(axis=0), hi, pooled.min(axis=0) + 0.5)
  else:
    try:
      lo, hi = bounds
    except (TypeError, ValueError):
      raise TypeError("bounds must be None or a pair (lower, upper).") from None
    lo = np.broadcast_to(np.asarray(lo, np.float64), (x.shape[1],))
    hi = np.broadcast_to(np.asarray(hi, np.float64), (x.shape[1],))
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(hi > lo)):
      raise ValueError("bounds must be finite with upper > lower in every coordinate.")
    if np.any(pooled < lo) or np.any(pooled > hi):
      raise ValueError("bounds must contain every point of X and Y.")
  below_one = np.nextafter(np.float32(1.0), np.float32(0.0))

  def to_unit(a):
    return np.clip((a - lo) / (hi - lo), 0.0, below_one).astype(np.float32)

  return to_unit(x), to_unit(y)


def padded_size(n: int) -> int:
  """The number of rows ``estimate`` pads a sample of n points to: at least 64, else the
  smallest multiple of 2^(floor(log2 n) - 2) that holds n (at most 25 % padding, four sizes
  per doubling), so that samples of nearby sizes share one compiled chain."""
  validation.positive_int(n, "n")
  if n <= _MIN_PADDED_SIZE:
    return _MIN_PADDED_SIZE
  step = 2 ** (int(n).bit_length() - 3)
  return -(-int(n) // step) * step


def _pad_rows(a):
  """(padded (padded_size(N), D) array, (padded_size(N),) mask of the real rows)."""
  n = a.shape[0]
  padded = np.zeros((padded_size(n),) + a.shape[1:], a.dtype)
  padded[:n] = a
  return padded, np.arange(padded.shape[0]) < n


@entry_points.public_call
def estimate(X, Y, kind: str, *, key, alpha: Optional[float] = None, kernel: str = "data",
             num_chains: int = 4, num_burnin: int = 2000, num_samples: int = 1000,
             thin: int = 1, max_regions: int = 128, double_moves: bool = True,
             delta: float = 0.5,
             sigma: Optional[float] = None, bounds=None,
             credible_level: float = 0.95) -> DivergenceEstimate:
  """co-BPM posterior of the divergence of the distribution of X from that of Y.

  Args:
    X: (N1, D) first sample (P).
    Y: (N2, D) second sample (Q).
    kind: "tv", "hellinger", "kl" (KL(P || Q)) or "alpha" (then give ``alpha``).
    key: JAX PRNG key.
    alpha: order of the alpha-divergence (kind "alpha" only; alpha not 0 or 1).
    kernel: "data" (data-guided halving proposal) or "uniform".
    num_chains: C independent chains (vmapped).
    num_burnin: discarded steps per chain.
    num_samples: S kept draws per chain.
    thin: steps between kept draws.
    max_regions: L, cap on the number of boxes (table size).
    double_moves: also run the two-halving move (not in the paper; see ``double_step``).
    delta: Dirichlet concentration (1/2, Jeffreys).
    sigma: prior penalty per box (default D + 1).
    bounds: None (pooled range, widened) or (lower, upper) box for the rescaling.
    credible_level: mass of the equal-tailed credible interval.
  Returns:
    DivergenceEstimate. Both samples are padded with masked rows to ``padded_size`` (at
    most 25 % more rows) before the chains run: the draws are the same, and samples of
    nearby sizes reuse one compiled chain.
  Raises:
    ValueError / TypeError: bad shapes, empty or non-finite samples, D > MAX_DIM, unknown
      kind or kernel, bad settings.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  if kind == "alpha":
    if alpha is None:
      raise ValueError('kind="alpha" needs alpha=.')
    validation.positive(abs(float(alpha)), "alpha")
    if not np.isfinite(alpha) or alpha in (0.0, 1.0):
      raise ValueError(f"alpha must be finite and not 0 or 1, got {alpha}.")
  elif alpha is not None:
    raise ValueError(f"alpha= is only used with kind='alpha', got kind={kind!r}.")
  if kernel not in KERNELS:
    raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}.")
  for name, v in (("num_chains", num_chains), ("num_samples", num_samples), ("thin", thin)):
    validation.positive_int(v, name)
  if isinstance(num_burnin, bool) or not isinstance(num_burnin, numbers.Integral) or num_burnin < 0:
    raise ValueError(f"num_burnin must be a non-negative integer, got {num_burnin!r}.")
  validation.positive_int(max_regions, "max_regions")
  if max_regions < 2:
    raise ValueError(f"max_regions must be at least 2, got {max_regions}.")
  validation.positive(delta, "delta")
  if not 0 < credible_level < 1:
    raise ValueError(f"credible_level must be in (0, 1), got {credible_level}.")
  validation.prng_key(key)
  x, y = check_samples(X, Y)
  dim = x.shape[1]
  sigma = float(dim + 1) if sigma is None else float(validation.positive(sigma, "sigma"))
  x01, y01 = rescale(x, y, bounds)
  config = Config(max_regions=int(max_regions), kernel=kernel, num_burnin=int(num_burnin),
                  num_samples=int(num_samples), thin=int(thin),
                  double_moves=bool(double_moves))
  keys = jax.random.split(key, num_chains)
  # Padding rows are masked out of every count, so the draws are those of the unpadded
  # samples; sizes in one bucket (``padded_size``) reuse the compiled chain.
  (x_pad, valid_x), (y_pad, valid_y) = _pad_rows(x01), _pad_rows(y01)
  run = jax.vmap(run_chain, in_axes=(0, None, None, None, None, None, None, None, None))
  out = run(keys, jnp.asarray(x_pad), jnp.asarray(y_pad), jnp.asarray(valid_x),
            jnp.asarray(valid_y), delta, sigma, 2.0 if alpha is None else alpha, config)
  return summarize(out, kind, credible_level, max_regions)


def summarize(out: ChainOutput, kind: str, credible_level: float = 0.95,
              max_regions: Optional[int] = None) -> DivergenceEstimate:
  """Turns vmapped chain outputs (C chains) into a DivergenceEstimate for one kind."""
  draws = np.asarray(out.divergences)[..., KINDS.index(kind)]
  draws = draws.reshape(-1, draws.shape[-1])
  tail = 0.5 * (1.0 - credible_level)
  lo, hi = np.quantile(draws, [tail, 1.0 - tail])
  nreg = np.asarray(out.num_regions).reshape(draws.shape)
  cap = max_regions if max_regions is not None else out.final_state.count_x.shape[-1]
  return DivergenceEstimate(
      mean=jnp.asarray(draws.mean(), jnp.float32),
      credible_interval=jnp.asarray([lo, hi], jnp.float32),
      samples=jnp.asarray(draws),
      acceptance_rate=jnp.asarray(np.mean(np.asarray(out.acceptance_rate)), jnp.float32),
      effective_sample_size=jnp.asarray(effective_sample_size(draws), jnp.float32),
      num_regions=jnp.asarray(nreg),
      at_max_regions=jnp.asarray(np.mean(nreg >= cap), jnp.float32))


# ------------------------------------------------------------------ kNN baseline

@precision.float32_matmuls
def knn_kl(X, Y, k: int = 1, chunk: int = 2048) -> float:
  """Perez-Cruz (2008) k-nearest-neighbour estimate of KL(P || Q) from X ~ P, Y ~ Q.

  ``KL ~ (D / N1) sum_i log(s_k(x_i) / r_k(x_i)) + log(N2 / (N1 - 1))`` with ``r_k`` the
  distance from x_i to its k-th nearest neighbour in X without itself and ``s_k`` to its
  k-th nearest neighbour in Y (Euclidean; numpy, chunked brute force in float64).

  Raises:
    ValueError: bad samples, k < 1, k > N1 - 1 or k > N2, or duplicate points (r_k = 0).
  """
  x, y = check_samples(X, Y)
  x = x.astype(np.float64)
  y = y.astype(np.float64)
  validation.positive_int(k, "k")
  n1, n2 = x.shape[0], y.shape[0]
  if k > n1 - 1 or k > n2:
    raise ValueError(f"k = {k} needs at least k + 1 points in X and k in Y, got N1 = {n1}, "
                     f"N2 = {n2}.")

  def kth(points, ref, exclude_self):
    out = np.empty(points.shape[0])
    kk = k + 1 if exclude_self else k
    for start in range(0, points.shape[0], chunk):
      p = points[start:start + chunk]
      d2 = np.maximum(np.sum(p * p, 1)[:, None] + np.sum(ref * ref, 1)[None, :]
                      - 2.0 * p @ ref.T, 0.0)
      if exclude_self:
        d2[np.arange(p.shape[0]), start + np.arange(p.shape[0])] = -1.0  # self is first
      out[start:start + chunk] = np.partition(d2, kk - 1, axis=1)[:, kk - 1]
    return np.sqrt(np.maximum(out, 0.0))

  r = kth(x, x, True)
  s = kth(x, y, False)
  if np.any(r <= 0) or np.any(s <= 0):
    raise ValueError("knn_kl needs distinct points: a k-th neighbour distance is 0 "
                     "(duplicated rows); remove duplicates or add jitter.")
  dim = x.shape[1]
  return float(dim * np.mean(np.log(s / r)) + math.log(n2 / (n1 - 1.0)))
