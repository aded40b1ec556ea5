"""The EM driver shared by the hierarchical models.

A model supplies two pure functions of (hyperparameters, statistics):
``step`` (E-step vmapped over classes + M-step, returning new hyperparameters and the
M-step's Newton info) and ``log_marginal_likelihood``. The driver iterates them in a
``lax.while_loop`` until the relative change of the log marginal likelihood falls below
``tol`` or ``max_iter`` is reached, and records the trace.

Concentrations whose optimum lies at infinity (``nu0`` when the class covariances are
truly tied, ``kappa0`` when the class means vary no more than their noise) are approached
by EM only linearly (``nu0`` grows by about ``N_k`` per iteration) while the log marginal
likelihood flattens, so EM stops on the tolerance at an arbitrary finite value or runs
into ``max_iter``. A model may therefore pass ``caps``: at the first iteration that
meets the tolerance, and every ``boundary_every`` iterations, the driver proposes moving
each concentration onto its cap where the marginal likelihood still increases there (the
KKT condition at an upper bound; by Fisher's identity the slope of the log marginal
likelihood is the M-step's, which is computed without cancellation, so one EM step from
the cap tells the slope's sign). The loop's own step makes these probes, one
concentration per extra pass of the loop, so the compiled loop holds a single copy of
the step. If anything moves,
the next iteration's EM step starts from the candidate, and its result is kept when its
log marginal likelihood is not lower than the plain iterate's by more than the tolerance
(otherwise EM resumes from the plain iterate; the trace records a flat step). EM then
goes on from there: the other hyperparameters are re-estimated, and the Newton
M-step, which starts at the cap, confirms it (``NewtonInfo.at_upper``).

Acceleration (SQUAREM, Varadhan & Roland 2008, scheme SqS3). Plain EM converges linearly
and creeps when the fraction of missing information is large (``nu0`` large, few points
per class). With ``extrapolate`` the driver runs cycles of two plain EM steps
x0 -> x1 = F(x0) -> x2 = F(x1) and then proposes the squared extrapolation
x' = x0 - 2 a r + a^2 v (r = x1 - x0, v = x2 - 2 x1 + x0, a = -|r| / |v| clipped to
[-a_max, -1]) in the unconstrained coordinates u = log(x - lower) of the named
concentrations, clipped to their caps. Each named field gets its own step length a
(a concentration creeping towards its cap while the others have settled is extrapolated
at its own rate; one shared a stalled such fits). Like a boundary candidate, the proposal is
evaluated by the next iteration's EM step (one copy of the step in the compiled loop):
F(x') is kept when its log marginal likelihood is finite and not lower than L(x2)
(monotone fallback: otherwise EM resumes from x2 and the trace records a flat step).
a_max starts at 1 (the first cycle's proposal is x2 itself), grows 4x when an accepted
step length reached it and shrinks 4x (not below 1) after a rejection. Convergence is
tested on plain EM steps only (an extrapolated or flat step never stops the loop), so
the stopping rule is the same as without acceleration; ``EMInfo.step_kind`` records
what every iteration was. Every iteration is one EM step and one evaluation of L, so
``num_iters`` counts the same work with and without acceleration.
"""
import functools
import numbers
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from dpmm_jax import compiler
from dpmm_jax import stats as stats_lib
from dpmm_jax.newton import NewtonInfo


class EMInfo(NamedTuple):
  """Diagnostics of an EM run.

  log_marginal_trace: (max_iter + 1,) log p(data | hyper) after 0, 1, ... iterations
    (NaN after the last one run).
  num_iters: EM iterations run.
  converged: relative change of the log marginal likelihood fell below tol.
  newton: NewtonInfo of the last M-step (per-element convergence and cap flags).
  step_kind: (max_iter + 1,) int32, what each iteration was (-1 at index 0 and after
    the last one run): ``PLAIN_STEP`` (an EM step from the previous iterate; only these
    can stop the loop), ``EXTRAPOLATED_STEP`` (an EM step from an accepted SQUAREM
    extrapolation), ``BOUNDARY_STEP`` (from an accepted boundary candidate),
    ``REJECTED_STEP`` (the proposal lowered L: the plain iterate is kept, a flat step).
  magnitude_trace: (max_iter + 1,) sum |terms| of L at each recorded iterate (the scale
    of its round-off; NaN after the last one run). A plain step that lowered L by at
    most ``NOISE_FLOOR_ULPS`` eps times it also counts as converged.
  """
  log_marginal_trace: jax.Array
  num_iters: jax.Array
  converged: jax.Array
  newton: Any
  step_kind: Any = None
  magnitude_trace: Any = None


# EMInfo.step_kind codes.
PLAIN_STEP, EXTRAPOLATED_STEP, BOUNDARY_STEP, REJECTED_STEP = 0, 1, 2, 3
# What carry["hyper"] is in run's loop: a plain iterate, a pending proposal, or a cap probe.
_POINT, _EXTRAPOLATION, _BOUNDARY, _PROBE = 0, 1, 2, 3
# SQUAREM step-length bound: initial value and growth / shrink factor.
_STEP_MAX0, _STEP_FACTOR = 1.0, 4.0


def squarem_proposal(x0, x1, x2, bounds: Dict[str, Tuple[float, float]], step_max):
  """SQUAREM (SqS3) extrapolation from two EM steps x1 = F(x0), x2 = F(x1).

  The named fields are mapped to u = log(x - lower) (so every proposal respects the
  lower limits), extrapolated with one step length per field, and clipped to
  [lower, upper]; the other fields are x2's.

  Args:
    x0, x1, x2: hyperparameter NamedTuples.
    bounds: {field: (lower, upper)} of the fields to extrapolate (scalars or arrays).
    step_max: () largest |a| (>= 1).
  Returns:
    (proposal like x2, a_at_max: whether some field's |a| was clipped to step_max).
  """
  fields = list(bounds)
  tiny = lambda x: jnp.finfo(x.dtype).tiny

  def to_u(x, f):
    v = getattr(x, f) - bounds[f][0]
    return jnp.log(jnp.maximum(v, tiny(v)))

  u0, u1, u2 = ([to_u(x, f) for f in fields] for x in (x0, x1, x2))
  r = [b - a for a, b in zip(u0, u1)]
  v = [c - 2.0 * b + a for a, b, c in zip(u0, u1, u2)]
  updates, at_max = {}, jnp.array(False)
  for f, a, rf, vf in zip(fields, u0, r, v):
    lower, upper = bounds[f]
    rr, vv = jnp.sum(jnp.square(rf)), jnp.sum(jnp.square(vf))
    ratio = jnp.sqrt(rr / jnp.where(vv > 0, vv, 1.0))
    step = jnp.where(vv > 0, jnp.clip(ratio, 1.0, step_max), 1.0)   # a = -step
    at_max = at_max | (step >= step_max)
    u = a + 2.0 * step * rf + step * step * vf
    x = lower + jnp.exp(u)
    x = jnp.clip(x, jnp.nextafter(jnp.asarray(lower, x.dtype), jnp.inf), upper)
    updates[f] = jnp.where(jnp.isfinite(x), x, getattr(x2, f))
  return x2._replace(**updates), at_max


class SharedEStep(NamedTuple):
  """A model whose M-step and log marginal likelihood start from the same E-step.

  Pass it to :func:`run` as ``step`` (with ``log_marginal_likelihood=None``). Each EM
  iteration needs the E-step twice: at the iterate, for the M-step, and at the new
  iterate, for L. ``run`` then evaluates both, and L at the initial point, with one
  copy of the E-step in the compiled loop (an inner loop of two passes), where separate
  functions would compile it three times. Each pass also forms L at its own input, so
  the first pass gives the initial L.

  e_step: (hyper, stats) -> E, any pytree (e.g. the coupled model's class grids and
    log joint densities over them).
  m_step: (hyper, stats, E) -> (new hyper, NewtonInfo).
  log_marginal_terms: (hyper, stats, E) -> additive terms of L at ``hyper``.
  """
  e_step: Callable
  m_step: Callable
  log_marginal_terms: Callable


# A plain EM step that lowers L by at most this many eps times the total size of L's
# terms ends EM as converged (round-off, see ``run``).
NOISE_FLOOR_ULPS = 8.0


def _sum_and_magnitude(terms):
  """(L, sum |terms|) of a log marginal likelihood given as an array of additive terms."""
  terms = jnp.asarray(terms)
  return jnp.sum(terms), jnp.sum(jnp.abs(terms))


def run(step: Union[Callable, SharedEStep], log_marginal_likelihood: Optional[Callable],
        init_hyper, stats, *,
        tol: float = 1e-6, max_iter: int = 100,
        caps: Optional[Dict[str, Tuple[Any, bool]]] = None,
        boundary: Optional[Callable] = None, boundary_every: int = 10,
        extrapolate: Optional[Dict[str, Tuple[float, float]]] = None,
        accelerate=True, trace_length: Optional[int] = None):
  """Runs EM to a relative tolerance on the log marginal likelihood.

  Args:
    step: (hyper, stats) -> (hyper, newton_info) ; one E-step and M-step. Or a
      ``SharedEStep``, whose M-step and L start from one E-step (compiled once).
    log_marginal_likelihood: (hyper, stats) -> its additive terms (any shape, e.g. per
      class; summed here) or the scalar. The terms' total size sets the round-off floor.
      None with a ``SharedEStep``.
    init_hyper: initial hyperparameter pytree.
    stats: SufficientStats.
    tol: relative tolerance |L_t - L_{t-1}| <= tol * max(1, |L_t|) on a plain EM step.
      A plain step that lowers L by no more than ``NOISE_FLOOR_ULPS`` eps sum|terms| also
      ends the loop as converged: L is then at its round-off floor (in float32 a small L
      made of large terms can wobble above tol * |L| forever).
    max_iter: iteration cap: a Python int, or an int32 scalar (may be traced) when
      ``trace_length`` is given.
    caps: optional {field: (cap value, strict)}: the boundary proposal of the module
      docstring. At an attempt each named concentration (a field of the hyperparameter
      NamedTuple) is probed at its cap by the loop's own EM step, one field per extra
      pass of the loop (not counted in ``num_iters``), and moves onto its cap where the
      step from there stays at it (``strict=False``, Newton-updated: new >= cap) or goes
      beyond it (``strict=True``, closed-form: new > cap), i.e. where the slope of L at
      the cap is positive (Fisher's identity). Tried at the first iteration that meets
      ``tol`` and every ``boundary_every`` iterations (a slow climb towards a cap may
      never meet it). The trace records the likelihood after an accepted boundary step,
      and ``converged`` still means that the last recorded change met ``tol``.
    boundary: optional (hyper, stats) -> hyper, any other boundary proposal, tried like
      ``caps`` (at most one of the two). It is compiled into the loop as it is: one
      that runs ``step`` adds a second copy of the step to the program.
    boundary_every: period (iterations) of the boundary attempts (static).
    extrapolate: optional {field: (lower, upper)}: the hyperparameter fields SQUAREM
      extrapolates (see module docstring) with their limits; None: plain EM.
    accelerate: bool (may be traced): use ``extrapolate``; False gives plain EM from the
      same compiled program.
    trace_length: static length (> max_iter) of EMInfo's traces; None: max_iter + 1.
      With it one compiled loop serves every max_iter below it (``jit_fit``); a traced
      max_iter of trace_length or more stops at trace_length - 1 iterations.
  Returns:
    (hyper, EMInfo).
  """
  if caps and boundary is not None:
    raise ValueError("em.run takes caps or boundary, not both.")
  if trace_length is None:
    length = max_iter + 1
  else:
    length = int(trace_length)
    if isinstance(max_iter, numbers.Integral) and not length > max_iter:
      raise ValueError(f"trace_length must exceed max_iter: got trace_length={length}, "
                       f"max_iter={max_iter} (em.trace_length(max_iter) gives one).")
    max_iter = jnp.minimum(max_iter, length - 1)    # the loop never writes past the trace
  shared = isinstance(step, SharedEStep)
  if shared:
    if log_marginal_likelihood is not None:
      raise ValueError("em.run: a SharedEStep computes L itself; pass "
                       "log_marginal_likelihood=None.")
    advance, newton_init, dtype = _shared_advance(step, init_hyper, stats)
    # L at the initial point comes from the loop's first pass (``first`` below).
    lml0 = mag0 = jnp.array(jnp.nan, dtype)
  else:
    def advance(hyper):
      new_hyper, newton = step(hyper, stats)
      return new_hyper, newton, None, log_marginal_likelihood(new_hyper, stats)
    lml0, mag0 = _sum_and_magnitude(log_marginal_likelihood(init_hyper, stats))
    _, newton0 = jax.eval_shape(step, init_hyper, stats)
    newton_init = _zeros_like(newton0)
  trace = jnp.full((length,), jnp.nan, lml0.dtype).at[0].set(lml0)
  mags = jnp.full((length,), jnp.nan, lml0.dtype).at[0].set(mag0)
  kinds = jnp.full((length,), -1, jnp.int32)
  enabled = jnp.asarray(accelerate, bool) & (extrapolate is not None)
  probe = _CapProbe(caps) if caps else None

  def small_change(new_lml, lml, magnitude):
    # Met the tolerance, or an EM step lowered L by no more than its round-off: L is a
    # sum of terms of total size ``magnitude``, so values that differ by less than a few
    # eps * magnitude are equal to working precision, and a plain EM step (which cannot
    # lower L in exact arithmetic) that does so has reached the floor.
    floor = NOISE_FLOOR_ULPS * jnp.finfo(new_lml.dtype).eps * magnitude
    return ((jnp.abs(new_lml - lml) <= tol * jnp.maximum(1.0, jnp.abs(new_lml)))
            | ((new_lml <= lml) & (lml - new_lml <= floor)))

  def cond(carry):
    # A cap probe under way always finishes (it decides whether the loop converged).
    go_on = (carry["it"] < max_iter) | (carry["kind"] == _PROBE)
    if shared:
      go_on = go_on | carry["first"]    # the first pass gives L at the initial point
    return go_on & ~carry["converged"]

  def iterate(carry, new_hyper, newton, new_terms):
    # When a proposal (boundary candidate or SQUAREM extrapolation) is pending,
    # carry["hyper"] is that proposal and this iteration's step evaluates it;
    # carry["fallback"] holds the plain EM iterate it competes with. During a cap probe
    # carry["hyper"] is that iterate with one field at its cap, and the step only tells
    # whether the field stays there. Evaluating both here, instead of with a second step
    # inside the proposal, keeps one copy of the step in the compiled loop.
    lml, it, kind = carry["lml"], carry["it"], carry["kind"]
    pending = (kind != _POINT) & (kind != _PROBE)
    new_lml, magnitude = _sum_and_magnitude(new_terms)
    fb_hyper, fb_newton, fb_small, fb_magnitude = carry["fallback"]
    # A boundary candidate may lower L by round-off (tol); an extrapolation may not.
    slack = jnp.where(kind == _BOUNDARY, tol * jnp.maximum(1.0, jnp.abs(lml)), 0.0)
    accept = jnp.isfinite(new_lml) & (new_lml >= lml - slack)
    reject = pending & ~accept
    new_hyper = _pick(reject, fb_hyper, new_hyper)
    newton = _pick(reject, fb_newton, newton)
    new_lml = jnp.where(reject, lml, new_lml)
    magnitude = jnp.where(reject, fb_magnitude, magnitude)
    small = jnp.where(reject, fb_small,
                      (kind != _EXTRAPOLATION) & small_change(new_lml, lml, magnitude))
    step_kind = jnp.where(reject, REJECTED_STEP, jnp.where(
        kind == _EXTRAPOLATION, EXTRAPOLATED_STEP,
        jnp.where(kind == _BOUNDARY, BOUNDARY_STEP, PLAIN_STEP)))
    proposal, new_kind, tried = new_hyper, jnp.array(_POINT, jnp.int32), carry["tried"]
    moved = jnp.array(False)
    attempt = ~pending & ((small & ~carry["tried"]) | ((it + 1) % boundary_every == 0))
    if boundary is not None or probe is not None:
      tried = tried | (attempt & small)
    if boundary is not None:
      candidate = jax.lax.cond(attempt, lambda h: boundary(h, stats), lambda h: h, new_hyper)
      moved = attempt & _differs(candidate, new_hyper)
      proposal = _pick(moved, candidate, proposal)
      new_kind = jnp.where(moved, _BOUNDARY, new_kind)
    step_max, at_max = carry["step_max"], carry["at_max"]
    if extrapolate is not None:
      # Two plain steps in a row (prev -> hyper -> new_hyper): propose the extrapolation.
      extrap = enabled & ~pending & carry["chain"] & ~small & ~moved
      squared, squared_at_max = squarem_proposal(carry["prev"], carry["hyper"], new_hyper,
                                                 extrapolate, step_max)
      proposal = _pick(extrap, squared, proposal)
      new_kind = jnp.where(extrap, _EXTRAPOLATION, new_kind)
      was_extrap = kind == _EXTRAPOLATION
      step_max = jnp.where(was_extrap & reject,
                           jnp.maximum(_STEP_MAX0, step_max / _STEP_FACTOR),
                           jnp.where(was_extrap & accept & carry["at_max"],
                                     step_max * _STEP_FACTOR, step_max))
      at_max = jnp.where(extrap, squared_at_max, at_max)
    converged = small & ~moved
    out = dict(carry, fallback=(new_hyper, newton, small, magnitude), prev=carry["hyper"],
               mags=carry["mags"].at[it + 1].set(magnitude),
               chain=~pending, step_max=step_max, kind=new_kind, at_max=at_max,
               kinds=carry["kinds"].at[it + 1].set(step_kind),
               hyper=proposal, lml=new_lml, trace=carry["trace"].at[it + 1].set(new_lml),
               it=it + 1, converged=converged, newton=newton, tried=tried)
    if probe is None:
      return out
    # An attempt starts a probe from the plain iterate; what this iteration would do
    # without it (propose an extrapolation, stop) waits for the probe's answer.
    started = dict(out, hyper=probe.candidate(new_hyper, 0), kind=_PROBE, probe_index=0,
                   probe_up=probe.no_moves(new_hyper), at_max=carry["at_max"],
                   converged=jnp.array(False),
                   deferred=(proposal, new_kind, at_max, converged))
    return _pick(attempt, started, out)

  def step_and_iterate(carry, new_hyper, newton, new_terms):
    if probe is None:
      return iterate(carry, new_hyper, newton, new_terms)
    # A cap probe's pass only records what the step did to the probed field. Its own
    # branch of a cond, rather than a select between its carry and the iteration's over
    # every leaf: the diagonal fit's optimised HLO is 14 % shorter and compiles 0.05-0.10 s
    # faster (K = 104, D = 64; session 29), with the same results to the bit.
    return jax.lax.cond(carry["kind"] == _PROBE,
                        lambda: probe.advance(carry, new_hyper),
                        lambda: iterate(carry, new_hyper, newton, new_terms))

  def body(carry):
    new_hyper, newton, input_terms, new_terms = advance(carry["hyper"])
    if not shared:
      return step_and_iterate(carry, new_hyper, newton, new_terms)
    # The first pass records L at the initial point (its step's input) and goes on as
    # an ordinary iteration from there; with max_iter = 0 it only records L.
    lml_in, magnitude_in = _sum_and_magnitude(input_terms)
    started = dict(carry, lml=lml_in, trace=carry["trace"].at[0].set(lml_in),
                   mags=carry["mags"].at[0].set(magnitude_in), first=jnp.array(False),
                   fallback=(carry["hyper"], newton_init, jnp.array(False), magnitude_in))
    out = step_and_iterate(_pick(carry["first"], started, carry), new_hyper, newton,
                           new_terms)
    return _pick(carry["first"] & (max_iter <= 0), started, out)

  init = dict(hyper=init_hyper, lml=lml0, trace=trace, mags=mags, kinds=kinds,
              it=jnp.array(0, jnp.int32),
              converged=jnp.array(False), newton=newton_init, tried=jnp.array(False),
              kind=jnp.array(_POINT, jnp.int32),
              fallback=(init_hyper, newton_init, jnp.array(False), mag0), prev=init_hyper,
              chain=jnp.array(False), step_max=jnp.asarray(_STEP_MAX0, lml0.dtype),
              at_max=jnp.array(False))
  if shared:
    init["first"] = jnp.array(True)
  if probe is not None:
    init.update(probe_index=jnp.array(0, jnp.int32), probe_up=probe.no_moves(init_hyper),
                deferred=(init_hyper, jnp.array(_POINT, jnp.int32), jnp.array(False),
                          jnp.array(False)))
  out = jax.lax.while_loop(cond, body, init)
  # A proposal still pending when max_iter is reached was never evaluated: keep the
  # plain iterate whose likelihood the trace records.
  hyper = _pick(out["kind"] != _POINT, out["fallback"][0], out["hyper"])
  newton = out["newton"]
  return hyper, EMInfo(out["trace"], out["it"], out["converged"], newton, out["kinds"],
                       out["mags"])


def _zeros_like(shapes):
  """Pytree of zeros shaped like a pytree of ShapeDtypeStructs."""
  return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _shared_advance(model: SharedEStep, init_hyper, stats):
  """(advance, zero NewtonInfo, L's dtype) for :func:`run` with a ``SharedEStep``.

  ``advance(hyper) -> (F(hyper), NewtonInfo, L terms at hyper, L terms at F(hyper))``
  runs two passes of one loop body: E-step and L at the pass's input, and on the first
  pass the M-step. The loop keeps the E-step's code single in the compiled program
  (XLA:CPU does not unroll it: the coupled fit's program keeps the loop).
  """
  def whole_step(hyper):
    e = model.e_step(hyper, stats)
    return model.m_step(hyper, stats, e), model.log_marginal_terms(hyper, stats, e)
  (hyper_shapes, newton_shapes), terms_shape = jax.eval_shape(whole_step, init_hyper)
  newton_init = _zeros_like(newton_shapes)
  cast = lambda tree, shapes: jax.tree_util.tree_map(
      lambda a, s: jnp.asarray(a, s.dtype), tree, shapes)

  def advance(hyper):
    def one_pass(i, carry):
      z, newton, input_terms, _ = carry
      e = model.e_step(z, stats)
      terms = jnp.asarray(model.log_marginal_terms(z, stats, e), terms_shape.dtype)
      new_z, newton = jax.lax.cond(
          i == 0, lambda: cast(model.m_step(z, stats, e), (hyper_shapes, newton_shapes)),
          lambda: (z, newton))
      return new_z, newton, jnp.where(i == 0, terms, input_terms), terms
    zeros = jnp.zeros(terms_shape.shape, terms_shape.dtype)
    hyper = cast(hyper, hyper_shapes)
    return jax.lax.fori_loop(0, 2, one_pass, (hyper, newton_init, zeros, zeros))

  return advance, newton_init, terms_shape.dtype


def _pick(flag, a, b):
  """Pytree a where flag, else b (leaf by leaf)."""
  return jax.tree_util.tree_map(lambda u, v: jnp.where(flag, u, v), a, b)


def _differs(a, b):
  """() bool: some leaf of pytree a differs from b's."""
  return jnp.any(jnp.stack([jnp.any(u != v) for u, v in zip(
      jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))]))


class _CapProbe:
  """The cap probe of :func:`run` (``caps``): its candidates and its bookkeeping.

  A probe starts from a plain iterate x (``carry["fallback"][0]``). Pass j steps from x
  with field j at its cap and records, per element, whether the step kept it there
  (``carry["probe_up"]``); after the last field the proposal is x with the recorded
  elements at their caps, evaluated by the next EM step like any boundary candidate. If
  nothing moves, the loop does what the attempt's iteration deferred
  (``carry["deferred"]``: its proposal, the kind of that proposal, SQUAREM's at-max flag
  and whether it converged).
  """

  def __init__(self, caps: Dict[str, Tuple[Any, bool]]):
    self.caps = caps
    self.fields = list(caps)

  def _cap(self, hyper, field):
    return jnp.full_like(getattr(hyper, field), self.caps[field][0])

  def no_moves(self, hyper):
    return tuple(jnp.zeros(jnp.shape(getattr(hyper, f)), bool) for f in self.fields)

  def candidate(self, hyper, index):
    """hyper with field ``index`` (may be traced) at its cap."""
    return hyper._replace(**{f: jnp.where(index == j, self._cap(hyper, f), getattr(hyper, f))
                             for j, f in enumerate(self.fields)})

  def advance(self, carry, stepped):
    """The carry after the pass that stepped from carry["hyper"] (field
    carry["probe_index"] at its cap) to ``stepped``."""
    base, index = carry["fallback"][0], carry["probe_index"]
    up = []
    for j, f in enumerate(self.fields):
      cap, new = self._cap(base, f), getattr(stepped, f)
      stays = new > cap if self.caps[f][1] else new >= cap
      up.append(jnp.where(index == j, stays, carry["probe_up"][j]))
    proposal = base._replace(**{f: jnp.where(u, self._cap(base, f), getattr(base, f))
                                for f, u in zip(self.fields, up)})
    moved = _differs(proposal, base)
    last = index == len(self.fields) - 1
    deferred_hyper, deferred_kind, deferred_at_max, deferred_converged = carry["deferred"]
    return dict(
        carry, probe_index=index + 1, probe_up=tuple(up),
        hyper=_pick(last, _pick(moved, proposal, deferred_hyper),
                   self.candidate(base, index + 1)),
        kind=jnp.where(last, jnp.where(moved, _BOUNDARY, deferred_kind), _PROBE),
        at_max=jnp.where(last & ~moved, deferred_at_max, carry["at_max"]),
        converged=last & deferred_converged & ~moved)


def merge_newton_info(*infos: NewtonInfo) -> NewtonInfo:
  """Combines the Newton reports of several concentration updates into one record."""
  return NewtonInfo(
      jnp.max(jnp.stack([jnp.max(i.num_iters) for i in infos])),
      jnp.all(jnp.stack([jnp.all(i.converged) for i in infos])),
      jnp.any(jnp.stack([jnp.any(i.at_upper) for i in infos])))


# A jitted fit's traces are at least this long (then doubled as max_iter needs): one
# compiled fit serves every max_iter up to the length less one (``jit_fit``).
MIN_TRACE_LENGTH = 128


def trace_length(max_iter: int) -> int:
  """Static trace length of a jitted fit run for ``max_iter`` iterations: the smallest
  ``MIN_TRACE_LENGTH * 2^j`` above max_iter (128 for the default 100 and anything less)."""
  length = MIN_TRACE_LENGTH
  while length <= max_iter:
    length *= 2
  return length


def _cut_traces(info: EMInfo, cut) -> EMInfo:
  return info._replace(log_marginal_trace=cut(info.log_marginal_trace),
                       step_kind=cut(info.step_kind), magnitude_trace=cut(info.magnitude_trace))


@functools.partial(compiler.jit, static_argnames=("size",))
def _trim(info: EMInfo, size: int) -> EMInfo:
  return _cut_traces(info, lambda a: None if a is None else a[:size])


def jit_fit(fit_hyper: Callable, params_from_hyper: Callable, static_argnames=()):
  """Jits a model's whole fit: EM for the hyperparameters, then its predictive parameters.

  ``max_iter`` is an ordinary (traced) argument and ``trace_length`` a static one, so one
  compilation serves every max_iter below the trace length; call it through
  :func:`run_jitted_fit`, which picks the length and trims the traces.

  Args:
    fit_hyper: ``(stats, *, max_iter, trace_length, **options) -> (hyper, EMInfo)``.
    params_from_hyper: ``(hyper, stats[, options]) -> Params``; it also receives
      ``options`` when the fit is called with that keyword (quadrature settings).
    static_argnames: further keywords that are compile-time constants.
  Returns:
    ``fit(stats, *, max_iter, trace_length, **options) -> (Params, EMInfo)`` (jitted),
    compiled once per shape, trace length and statics.
  """
  def fit(stats, **options):
    hyper, info = fit_hyper(stats, **options)
    extra = (options["options"],) if "options" in options else ()
    return params_from_hyper(hyper, stats, *extra), info

  return compiler.jit(fit, static_argnames=("trace_length",) + tuple(static_argnames))


# Statistics padded with empty classes hold at most this many elements (16 MB in
# float32); larger problems are fitted at their own K (their compilation is a small part
# of the fit, and padding would copy the per-class scatter).
PADDED_STATS_MAX_ELEMENTS = 1 << 22


def padded_num_classes(num_classes: int, elements_per_class: int) -> int:
  """The K a jitted fit is compiled for: 8 for K <= 8, above that K rounded up to a
  multiple of 2^(ceil(log2 K) - 3) (10, 12, ..., 16, 20, 24, ..., 32, 40, ...; less
  than 1/4 more classes), so that nearby class counts share one compiled fit; K itself
  when the padded statistics would hold more than ``PADDED_STATS_MAX_ELEMENTS``."""
  if num_classes <= 8:
    padded = 8
  else:
    step = 1 << ((num_classes - 1).bit_length() - 3)
    padded = -(-num_classes // step) * step
  if padded * elements_per_class > PADDED_STATS_MAX_ELEMENTS:
    return num_classes
  return padded


def _first_on_host(a, n: int):
  """The first n entries of a concrete array, cut with numpy (a transfer, no program)."""
  return jnp.asarray(np.asarray(a)[:n])


@functools.partial(compiler.jit, static_argnames=("num_classes",))
def _first_classes(per_class, num_classes: int):
  return jax.tree_util.tree_map(lambda a: a[:num_classes], per_class)


def run_jitted_fit(jitted_fit: Callable, stats, *, max_iter: int,
                   class_fields: Tuple[str, ...], **options):
  """Calls a :func:`jit_fit` function with the trace length for ``max_iter`` (a Python
  int) and returns (Params, EMInfo) with traces of length max_iter + 1.

  The statistics are padded with empty classes to ``padded_num_classes`` (EM leaves
  empty classes out of its sums: ``stats.nonempty_terms``), and the Params fields named
  in ``class_fields`` (those with a leading class axis) are cut back to the K classes.
  """
  num_classes = stats.num_classes
  if not compiler.is_traced(stats.count) and not np.any(np.asarray(stats.count) > 0):
    raise ValueError(f"The statistics hold no points (all {num_classes} class counts are 0): "
                     "EM has nothing to fit its hyperparameters to.")
  per_class = sum(int(np.prod(a.shape[1:])) for a in
                  (stats.count, stats.mean, stats.sq_dev, stats.scatter) if a is not None)
  padded = stats_lib.pad_classes(stats, padded_num_classes(num_classes, per_class))
  params, info = jitted_fit(padded, max_iter=max_iter, trace_length=trace_length(max_iter),
                            **options)
  if padded.num_classes != num_classes:
    per_class_params = {f: getattr(params, f) for f in class_fields}
    if compiler.is_traced(per_class_params):
      kept = _first_classes(per_class_params, num_classes)
    else:   # cut on the host: no compilation (0.04 s in a fresh process)
      kept = jax.tree_util.tree_map(lambda a: _first_on_host(a, num_classes),
                                    per_class_params)
    params = params._replace(**kept)
  if compiler.is_traced(info):
    return params, _trim(info, max_iter + 1)
  # Concrete traces are cut on the host: no program to compile for a cold fit.
  return params, _cut_traces(
      info, lambda a: None if a is None else _first_on_host(a, max_iter + 1))
