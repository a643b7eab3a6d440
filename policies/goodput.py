"""`goodput`: pick the K that maximises expected tokens per second, from measured costs.

    score(K) = B * (1 + q * sum_{k<K} p[k]) / step_time(B, K)

B is the replica's concurrency (by default its *effective* concurrency from the cluster view:
running + waiting + routed-not-admitted), q the share of sequence-steps that proposed drafts
at all (prompt lookup proposes nothing where the context has no match), p[k] the share of
proposals with more than k tokens accepted, and step_time(B, K) the engine step time, learned
online by the drafts a step verified: a tier K verifies the draft positions below K that
the drafter fills (every one for a draft model; prompt lookup fills fewer deep positions on a
copy and few of any on text without repeats, where a deep tier then costs about what K=0
does; see `DraftFill`).

Follows SmartSpec/TurboSpec (argmax of goodput over profiled latency) and vLLM's original
dynamic-SD proposal (argmax (1 + sum a_j) / ITL(B, K)). Differences:
- p[k] comes from per-position windows that count only drafts that reached position k, so the
  estimate stays unbiased when K changes; positions never drafted are filled from a prior (what
  the request classes now on the replica showed before, else the cluster's mean), else
  extrapolated geometrically. The class prior comes first: under class-gathering routing the
  cluster's mean describes other classes' traffic. The prior lends its conditional rates
  p[k] / p[k-1], carried on from this replica's own p[k-1], not its absolute ones (see
  `_continue`).
- Nothing measures positions deeper than the current K: at K=0 nothing shows that drafts
  started to land again, and at a shallow K the geometric extrapolation undersells drafters
  whose acceptance comes in runs (prompt lookup: a copied span lands whole). So after
  `probe_interval_steps` on a tier whose next tier's positions have no fresh evidence, the
  policy runs that next tier for one dwell period to measure (bounded exploration: at most two
  switches per interval; nothing else switches during a dwell). At K=0 the request classes
  now on the replica are a hint too: when their past acceptance (the fleet's, else this
  replica's) says a tier would win, the policy goes straight to the one it says wins instead
  of waiting out the interval. An old prior does not replace the probe (a class's traffic
  may change), a fresh one does: when another replica measured the next tier's positions for
  the request classes now here within the last few telemetry periods (`class_prior_fresh`),
  the probe would only repeat it, so the fleet probes a class about once an interval instead
  of once per replica.
- A batch that mixes requests whose drafts land with requests whose drafts fail is scored by
  its steady state, from the per-request outcomes an engine reports (vLLM's and the
  simulator do; see `steady_lengths`): 1 + q * sum p[k] is the mean over the batch as it is
  now, and a deeper K changes the batch (the landing requests finish sooner and the others
  take their slots).
- Step costs are measured on this replica every step (seeded by a profile table scaled to the
  measured level), not only profiled once, and interpolated piecewise in batch size so the
  regime knee is kept.
- A switch margin and a minimum dwell stop ping-pong; K=0 is an ordinary candidate. The
  dwell does not hold a tier when a request of a new class arrives (`Signals.new_class`):
  its class prices it before its first step (see `ControlLoop.tick`). The
  burden of proof is on drafting: a drafting tier within `DRAFT_TIE` of the floor is left
  for it without the margin, unless its drafter leaves its slots nearly empty, so its steps
  cost the floor's (see `_idle_drafter`).
- With `tpot_slo_ms`, only the tokens of requests the tier keeps within that time per
  output token count (DistServe's goodput; see `GoodputConfig.tpot_slo_ms`).
- A shift in first-position acceptance beyond `shift_threshold` restarts the acceptance
  estimate (and sets the lagging prior aside for a few decisions): at a phase change
  the decayed windows would otherwise hold the old traffic for several decisions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from policies.outcomes import survival_counts
from policies.signals import Decision, RequestWindows, Signals, StepCost

P = TypeVar("P")  # the point type of a cost table (see _predict_row)
# Acceptance assumed at the first position before any measurement or prior.
DEFAULT_PRIOR_FIRST = 0.5
# A shift in first-position acceptance counts only with this many drafts on both sides.
SHIFT_MIN_DRAFTS = 16
# After a shift, the prior is left out for this many updates: the fleet's decayed
# counts lag the same change.
PRIOR_PAUSE_UPDATES = 8
# A drafting tier is kept only while it beats the floor (K=0, or the smallest drafting tier:
# see `GoodputPolicy._floor`) by this share. The switch margin guards a move either way
# against noise, but a tier whose drafts buy nothing ties the floor: predicted cost never
# falls as K grows, so a tier measured cheaper than K=0 was, earlier and on a faster spell of
# the machine, scores the same as K=0 and the margin would hold it (over HTTP both replicas
# kept K=3 through a sampled phase where nothing landed). Only against the floor: between two
# drafting tiers that tie, the deeper one keeps measuring the deep positions (a replay that
# also left deep tiers for shallower ties fell from 1.52x to 1.36x the best static).
DRAFT_TIE = 0.01
# Per-request draft caps tried for each K (see `GoodputPolicy._evaluate`): a request drafts
# the positions whose drafts land with at least this chance. Free text lands at a few percent
# a position, code-like text at tens of percent for the first few, copies near 1.
CAP_THRESHOLDS = (0.05, 0.15, 0.3, 0.5)


class GoodputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["goodput"] = "goodput"
    concurrency_source: Literal["local", "effective"] = "effective"
    switch_margin: float = Field(0.05, ge=0)
    """A new K must beat the current one's score by this share."""
    min_dwell_steps: int = Field(8, ge=0)
    """Engine steps to stay on a tier after switching."""
    acceptance_decay: float = Field(0.7, gt=0, le=1)
    """Per-decision decay of the per-position acceptance windows."""
    shift_threshold: float = Field(0.3, gt=0, le=1)
    """When a window's first-position acceptance differs from the decayed estimate by more
    than this, the traffic changed (a new phase, a new mix): the estimate restarts from that
    window instead of decaying towards it. 1 never restarts."""
    prior_strength: float = Field(4.0, ge=0)
    """The prior counts as this many drafts at every position."""
    probe_interval_steps: int = Field(256, ge=1)
    """After this many engine steps on a tier, measure the next deeper tier when its positions
    have no fresh evidence (from K=0: the smallest positive tier)."""
    cost_decay: float = Field(0.98, gt=0, le=1)
    """Per-observation decay of a measured step cost (the EWMA takes 1 - decay of each new
    step): slow, because step wall times on a shared machine jitter by tens of percent."""
    draft_caps: bool = True
    """Cap each request's drafts at the positions worth verifying, where the engine can
    (`Signals.draft_caps_apply`): in a batch that mixes requests whose drafts land with
    requests whose drafts fail, one K for all either starves the first or makes every step
    verify the second's failing drafts."""
    min_draft_cap: int = Field(1, ge=1)
    """Drafts a capped request still verifies: its evidence that drafts land again (a cap of
    0 would measure nothing, and the cap would never lift)."""
    profile: list[tuple[int, int, float]] = Field(default_factory=list)
    """Seed step costs: (batch, draft tokens per sequence, seconds) rows, e.g. from
    `bench.engine_bench` at tiers the drafter fills (there the depth is K)."""
    tpot_slo_ms: float | None = Field(None, gt=0)
    """A bound on time per output token. When set, K is scored by the tokens a second of the
    requests it keeps within the bound (a request's step seconds over the tokens it gains a
    step), not of all: a deeper tier that lifts the batch's tokens/s by slowing the requests
    whose drafts fail past the bound does not pay (DistServe's goodput). While no tier keeps
    any request within it (a batch too large for the bound), every token counts again."""


class StepCostModel:
    """Per K, step seconds measured at each batch size, interpolated piecewise-linearly in
    batch size: it follows the knee between the memory-bound regime (flat in batch x K) and
    the compute-bound one, which one straight line would smear.

    Step wall times on a shared machine jitter by tens of percent, so two rules keep noise
    from choosing the tier:
    - a point is a running mean that becomes an EWMA (a new step weighs at least 1 - decay);
      a batch size seen for the first time starts from what its neighbours predict, worth
      `PRIOR_STEPS` steps, rather than from one raw sample;
    - at a batch size, predictions never fall as K grows (verifying more tokens does not cost
      less): a deep tier that looked cheap by luck would otherwise win with nothing accepted.

    A profile (`seed`) gives the shape across batch and K, not the level: in the serving app a
    step also carries prefills, streaming and the other processes on the machine, and costs
    more than the engine alone in `bench.engine_bench`. Unscaled, every tier not yet measured
    would look cheap, and the policy would cycle through them (each measurement making the
    next unmeasured tier the best). So profiled points not yet measured are scaled by the
    running ratio of measured steps to what the profile predicts for them.
    """

    PRIOR_STEPS = 4.0

    def __init__(self, decay: float):
        self.max_weight = math.inf if decay >= 1 else 1 / (1 - decay)
        self._points: dict[int, dict[int, _CostPoint]] = {}  # k -> batch -> point
        self._profile: dict[int, dict[int, float]] = {}  # k -> batch -> profiled seconds
        self._profiled: dict[tuple[int, int], float | None] = {}  # (batch, k) -> prediction
        self.scale, self._scale_weight = 1.0, self.PRIOR_STEPS
        """Measured step time over the profile's prediction (1 without a profile)."""

    def seed(self, cost: StepCost) -> None:
        """A profiled point, worth `PRIOR_STEPS` measured steps."""
        self._points.setdefault(cost.k, {})[cost.batch] = _CostPoint(
            cost.seconds, self.PRIOR_STEPS, measured=False)
        self._profile.setdefault(cost.k, {})[cost.batch] = cost.seconds
        self._profiled.clear()

    def observe(self, cost: StepCost) -> None:
        if cost.seconds <= 0 or cost.batch <= 0:
            return
        profiled = self._profiled_seconds(cost.batch, cost.k)
        if profiled is not None:
            self._scale_weight = min(self._scale_weight + 1, self.max_weight)
            self.scale += (cost.seconds / profiled - self.scale) / self._scale_weight
        point = self._points.get(cost.k, {}).get(cost.batch)
        if point is None or not point.measured:
            guess = self.predict(cost.batch, cost.k)
            point = _CostPoint(cost.seconds, 0.0) if guess is None else \
                _CostPoint(guess, self.PRIOR_STEPS)
            self._points.setdefault(cost.k, {})[cost.batch] = point
        point.weight = min(point.weight + 1, self.max_weight)
        point.seconds += (cost.seconds - point.seconds) / point.weight

    def _profiled_seconds(self, batch: int, k: int) -> float | None:
        """What the profile alone predicts for a step (None without a profile); memoised:
        every observed step asks, and the profile only changes when seeded."""
        key = (batch, k)
        if key not in self._profiled:
            self._profiled[key] = _predict_row(self._profile, float, batch, (k,)).get(k)
        return self._profiled[key]

    def known(self) -> list[int]:
        return sorted(self._points)

    def _value(self, point: _CostPoint) -> float:
        return point.seconds if point.measured else point.seconds * self.scale

    def predict_row(self, batch: int, ks: tuple[float, ...]) -> dict[float, float]:
        """Seconds of a step of `batch` sequences at each depth in `ks` (empty before any
        measurement or profile); an unmeasured depth is interpolated (or extrapolated)
        linearly in K between known neighbours."""
        return _predict_row(self._points, self._value, batch, ks)

    def predict(self, batch: int, k: float) -> float | None:
        return self.predict_row(batch, (k,)).get(k)


@dataclass(slots=True)
class _CostPoint:
    seconds: float
    weight: float
    """How many steps the mean stands for (capped: an EWMA from then on)."""
    measured: bool = True
    """False while the point is only profiled (its level is then scaled)."""


def _predict_row(table: dict[int, dict[int, P]], value: Callable[[P], float], batch: int,
                 ks: tuple[float, ...]) -> dict[float, float]:
    """Per K in `ks`, the cost at `batch` from a table of k -> batch -> point: piecewise-linear
    in batch per known K, made non-decreasing in K, then piecewise-linear in K.

    Only the depths measured on both sides of `batch` (or at it) take part while there are
    two: a depth seen at one far batch size would otherwise be extrapolated flat to every
    batch size, and, costs being made non-decreasing in K, lift every deeper tier with it
    (capped steps verify depths between the tiers: one such step at batch 64 priced K=15 at
    batch 1 at 82 ms against its measured 12)."""
    known = sorted(table)
    bracketing = [k for k in known if min(table[k]) <= batch <= max(table[k])]
    if len(bracketing) >= 2:
        known = bracketing
    if not known:
        return {}
    at_batch, floor = {}, 0.0
    for k in known:
        points = table[k]
        here = value(points[batch]) if batch in points else \
            _interpolate(batch, sorted(points), lambda b, points=points: value(points[b]))
        floor = max(floor, here)
        at_batch[k] = floor
    return {k: _interpolate(k, known, at_batch.__getitem__) for k in ks}


def _interpolate(x: float, known: list[int], value_at: Callable[[int], float]) -> float:
    """Piecewise-linear value at `x` from the sorted points `known`, extrapolating from the
    two nearest at either end; a single point means flat (memory-bound: cost does not grow)."""
    if x in known:
        return value_at(x)
    lower = [p for p in known if p < x]
    upper = [p for p in known if p > x]
    if lower and upper:
        x0, x1 = lower[-1], upper[0]
    elif len(known) >= 2:
        x0, x1 = (known[-2], known[-1]) if lower else (known[0], known[1])
    else:
        return value_at(known[0])
    y0, y1 = value_at(x0), value_at(x1)
    return max(1e-6, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class DraftFill:
    """How full the drafter keeps each draft position (decayed drafted / open slots per
    position), and from it the drafts a sequence verifies a step at a given depth: what a
    tier's step costs, whatever its K.

    Per position, not one share for the tier: prompt lookup proposes only where the context
    has a match, and a match runs out, so on a copy it fills the first positions and fewer
    deep ones (vLLM-CPU, batch 8: 0.96 of K=1's slots, 0.60 of K=15's), and on text without
    repeats few of any (0.07-0.11). One share measured at K=15 priced K=7 a quarter below
    the drafts it verifies, and a replica left K=15 for K=7 and came back within a dwell.
    Each position's rate is shrunk towards the one before it by `PRIOR_SLOTS` open slots
    (the first towards full: a draft model fills every slot), so a position measured on few
    slots, or not lately (deeper than the tiers run now; every position's counts decay),
    moves smoothly to continue the positions before it instead of keeping an old traffic's
    rate until its counts run out."""

    PRIOR_SLOTS = 4.0

    def __init__(self, width: int, decay: float):
        self.decay = decay
        self.drafted = np.zeros(width)
        self.slots = np.zeros(width)
        self._grid = np.arange(width + 1, dtype=float)
        self._verified = self._grid.copy()  # drafts verified at depth 0..width

    def update(self, drafted: Sequence[int], slots: Sequence[int]) -> None:
        width = len(self.slots)
        self.drafted = self.drafted * self.decay + _padded(drafted, width)
        self.slots = self.slots * self.decay + _padded(slots, width)
        rate, rates = 1.0, []
        for drafted_k, slots_k in zip(self.drafted.tolist(), self.slots.tolist(), strict=True):
            rate = min(1.0, (drafted_k + self.PRIOR_SLOTS * rate) / (slots_k + self.PRIOR_SLOTS))
            rates.append(rate)
        self._verified[1:] = np.cumsum(rates)

    def verified(self, depth: float) -> float:
        """Drafts a sequence verifies a step when it may draft `depth` positions."""
        return float(np.interp(depth, self._grid, self._verified))

    def verified_each(self, depths: np.ndarray) -> np.ndarray:
        """`verified` of each depth in an array."""
        return np.interp(depths, self._grid, self._verified)

    @property
    def share(self) -> float:
        """Of all the open slots, the share the drafter filled (1 until measured)."""
        slots = self.slots.sum()
        return min(1.0, self.drafted.sum() / slots) if slots else 1.0


def _padded(counts: Sequence[int], width: int) -> np.ndarray:
    padded = np.zeros(width)
    counts = counts[:width]
    padded[:len(counts)] = counts
    return padded


class AcceptanceWindow:
    """Decayed per-position counts: p[k] = accepted[k] / drafted[k], blended with a prior."""

    def __init__(self, kmax: int, decay: float, prior_strength: float,
                 shift_threshold: float = 1.0):
        self.decay = decay
        self.prior_strength = prior_strength
        self.shift_threshold = shift_threshold
        self.accepted = [0.0] * kmax
        self.drafted = [0.0] * kmax
        self._prior_paused = 0

    def update(self, accepted: tuple[int, ...], drafted: tuple[int, ...]) -> None:
        """Slide the windows when drafts arrived; at K=0 (no evidence at all) keep them.

        Positions deeper than the current K fade too, so their estimate moves to the
        extrapolation from the fresh, shallower positions rather than staying stale. A shift
        (see `GoodputConfig.shift_threshold`) restarts every position: a decay would take
        several decisions to forget the old traffic, and a high phase lasts tens of steps.
        """
        if not any(drafted):
            return
        if self._shifted(accepted, drafted):
            self.accepted = [0.0] * len(self.accepted)
            self.drafted = [0.0] * len(self.drafted)
            self._prior_paused = PRIOR_PAUSE_UPDATES
        elif self._prior_paused:
            self._prior_paused -= 1
        for k in range(len(self.accepted)):
            self.accepted[k] = self.accepted[k] * self.decay + (
                accepted[k] if k < len(accepted) else 0)
            self.drafted[k] = self.drafted[k] * self.decay + (drafted[k] if k < len(drafted) else 0)

    def _contradicts(self, prior: tuple[float, ...]) -> bool:
        """This replica's own first-position acceptance is far from the prior's: the prior
        describes other traffic (another phase, or other classes under acceptance-aware
        routing), so it says nothing about this replica's deeper positions either."""
        if not prior or self.drafted[0] < SHIFT_MIN_DRAFTS:
            return False
        return abs(self.accepted[0] / self.drafted[0] - prior[0]) > self.shift_threshold

    def _shifted(self, accepted: tuple[int, ...], drafted: tuple[int, ...]) -> bool:
        fresh, past = drafted[0] if drafted else 0, self.drafted[0]
        if fresh < SHIFT_MIN_DRAFTS or past < SHIFT_MIN_DRAFTS:
            return False
        return abs(accepted[0] / fresh - self.accepted[0] / past) > self.shift_threshold

    def uses_prior(self, prior: tuple[float, ...]) -> bool:
        """False while the prior is set aside: just after a shift, or when this replica's
        own first position contradicts it."""
        return bool(prior) and not self._prior_paused and not self._contradicts(prior)

    def rates(self, prior: tuple[float, ...]) -> list[float]:
        if not self.uses_prior(prior):
            prior = ()
        rates: list[float] = []
        for k in range(len(self.accepted)):
            guess = _continue(rates, prior, k)
            weight = self.drafted[k] + self.prior_strength
            rate = (self.accepted[k] + self.prior_strength * guess) / weight if weight else guess
            # Acceptance is a prefix: more than k accepted implies more than k-1 accepted.
            rates.append(min(rate, rates[-1]) if rates else rate)
        return rates


@dataclass(frozen=True)
class BatchAcceptance:
    """Per running request (columns): the chance that each draft position lands, its
    acceptance length at each depth, and its share of the tokens (see `batch_acceptance`)."""

    reach: np.ndarray
    """[kmax, rows]: r_k, the share of the request's steps that land draft position k."""
    lengths: np.ndarray
    """[kmax + 1, rows]: L_r(d) = 1 + sum_{k<d} r_k, tokens per step at depth d."""
    tokens: np.ndarray
    """[rows]: tokens the request generated in its window (all ones when none has outcomes)."""
    full_runs: np.ndarray
    """[rows]: drafts the request landed in its last step when it landed all of them (0
    when it missed one, or had none)."""

    def steady(self, ks: tuple[int, ...], caps: np.ndarray | None = None,
               verified: Callable[[np.ndarray], np.ndarray] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Per K in `ks`, once the batch's mix has settled there: (tokens per sequence-step,
        drafts verified per sequence). Each request drafts min(K, its cap) (`caps`, one per
        row; None: K for all) positions, of which the drafter fills `verified(depth)` (all
        without it), and keeps its share w_r of the tokens, so the batch makes
        1 / sum_r (w_r / L_r) tokens per sequence-step and holds each request in a share of
        its slots proportional to w_r / L_r. Drafts are mapped per request, then averaged:
        the drafter fills fewer deep positions, so the mean depth's drafts would overcharge
        a batch that caps some requests shallow and lets others draft deep."""
        depths = self._depths(np.array(ks)[:, None], caps)  # [ks, rows]
        slots = self.tokens / self.lengths[depths, np.arange(self.tokens.shape[0])]
        per_slot = slots.sum(axis=1)
        drafts = depths if verified is None else verified(depths)
        return self.tokens.sum() / per_slot, (slots * drafts).sum(axis=1) / per_slot

    def share_within(self, k: int, caps: np.ndarray | None, step_s: float,
                     bound_s: float) -> float:
        """The share of the batch's tokens (at K, in its steady state) made by requests
        whose seconds per token, `step_s` over the tokens they gain a step drafting
        min(K, cap), are within `bound_s`."""
        depths = self._depths(np.array(k), caps)
        within = step_s <= bound_s * self.lengths[depths, np.arange(self.tokens.shape[0])]
        return float(self.tokens[within].sum() / self.tokens.sum())

    def _depths(self, ks: np.ndarray, caps: np.ndarray | None) -> np.ndarray:
        """Drafts each request verifies a step at K: min(K, its cap), K for all without
        caps (`ks` broadcast against the rows)."""
        return np.minimum(ks, self.reach.shape[0] if caps is None else caps)

    def caps(self, threshold: float, least: int) -> np.ndarray:
        """Per request, the draft positions that land with at least `threshold`, never fewer
        than `least`, and twice the drafts it landed whole in its last step. r_k falls with
        k, so they are a prefix. The doubling is how a capped request shows what lies past
        its cap: a step that lands all of its drafts says nothing about the next position,
        so a request capped by a stale guess (the previous phase's traffic) would otherwise
        stay capped while it copies."""
        return np.maximum(np.maximum(least, (self.reach >= threshold).sum(axis=0)),
                          2 * self.full_runs)


def batch_acceptance(requests: RequestWindows, landing: list[float], prior_strength: float,
                     request_priors: Sequence[tuple[float, ...]] = (), depth: int = 0
                     ) -> BatchAcceptance | None:
    """Each running request's acceptance from its own verify outcomes; None when no request
    drafted in its window and none has a class prior.

    r_k, the request's share of steps with more than k drafts accepted, is the product of its
    conditional rates c_j = P(position j lands | positions before it landed) for j <= k. Each
    c_j is counted over the request's steps that drafted position j having landed the ones
    before it (`survival_counts`), shrunk with `prior_strength` steps towards a guess: what
    the request's class showed before (`request_priors`, one per row; () where unknown), else
    the replica's (`landing[0]`, its per-sequence-step rate, at the first position; its
    conditional rates past it). A step is evidence only about the positions it reached: a
    first step without drafts (vLLM's after a prefill) lowers c_0 alone. Counted per position
    instead, it lowered every position by the same shrinkage, compounded: a copy request two
    steps old was priced at 2.75 tokens a step at K=15 against its class's 12, and the
    replica left K=15 for K=3 at the start of every copy request. The class comes first: a
    request that just arrived has no outcomes yet, and the replica's rates describe the
    traffic before it, which at a change of phase is another class's (a replica fresh from
    copy traffic priced new sampled requests as copy and kept a deep K into the sampled
    phase).

    A request's share of the tokens is what it made in its window; one without outcomes
    yet (just taken, or waiting) weighs as a request that ran the others' mean steps at its
    class's acceptance length at `depth` (the tier running now): it takes a slot as they do.
    Weighed 0, a new request of another class would count for nothing in a busy batch.

    Vectorised over requests (see `policies.outcomes`).
    """
    kmax, rows = len(landing), len(requests)
    if not rows or not kmax:
        return None
    drafted, landed = requests.clipped(kmax)
    first, conditional = _guesses(landing, request_priors, rows)
    if not drafted.any() and first is None:
        return None
    guess = np.array(conditional, dtype=float)  # [kmax, rows]; row 0 set here
    guess[0] = landing[0] if first is None else first
    at_risk, beyond = (counts.T for counts in survival_counts(drafted, landed, kmax))
    if prior_strength:
        reach = (beyond + prior_strength * guess) / (at_risk + prior_strength)
    else:  # without a prior, a position no step reached has no evidence: the guess stands
        reach = np.where(at_risk > 0, beyond / np.maximum(at_risk, 1), guess)
    np.cumprod(reach, axis=0, out=reach)  # r_k per position (rows) and request (columns)
    lengths = np.ones((kmax + 1, rows))  # L_r(d) for d = 0..kmax
    np.cumsum(reach, axis=0, out=lengths[1:])
    lengths[1:] += 1
    tokens = landed.sum(axis=1) + requests.lengths  # a step: its landed drafts and one more
    if drafted.shape[1]:
        last_drafted, last_landed = drafted[:, -1], landed[:, -1]
        full_runs = np.where(last_landed == last_drafted, last_drafted, 0)
    else:  # no request has outcomes yet (just admitted)
        full_runs = np.zeros(rows, np.int64)
    new = requests.lengths == 0
    if new.all():  # only requests without outcomes yet (priced by class): alike
        tokens = np.ones(rows)
    elif new.any():
        tokens = tokens.astype(float)
        tokens[new] = requests.lengths[~new].mean() * lengths[min(depth, kmax), new]
    return BatchAcceptance(reach, lengths, tokens, full_runs)


def steady_lengths(requests: RequestWindows, landing: list[float], prior_strength: float,
                   ks: tuple[int, ...], request_priors: Sequence[tuple[float, ...]] = ()
                   ) -> dict[int, float] | None:
    """Tokens per sequence-step at each depth in `ks` once the batch's mix has settled there,
    every request drafting K (see `batch_acceptance`, `BatchAcceptance.steady`); None without
    outcomes or class priors.

    Speculation changes a batch's mix: requests whose drafts land finish in fewer steps at a
    deeper K, and their slots go to requests whose drafts fail. The mean over the batch as it
    is now overstates a deeper K for a mixed batch, and once there it still prefers the deep
    K at that K's own, thinner mix.
    """
    batch = batch_acceptance(requests, landing, prior_strength, request_priors)
    if batch is None:
        return None
    per_step, _ = batch.steady(ks)
    return dict(zip(ks, per_step.tolist(), strict=True))


def _scores(parts: dict[int, tuple[float, float]], batch: int) -> dict[int, float]:
    """Tokens/s per K from `GoodputPolicy._evaluate`'s (tokens per sequence-step, seconds)."""
    return {k: batch * length / seconds for k, (length, seconds) in parts.items()}


def _guesses(landing: list[float], request_priors: Sequence[tuple[float, ...]], rows: int
             ) -> tuple[np.ndarray | None, np.ndarray]:
    """Per request, the guess at the first position (None when no request has a class
    prior: `landing[0]` for all) and the conditional rate at each position past it
    ([kmax, rows]; row 0 unused): its class's (see `_class_conditionals`), else the
    replica's."""
    kmax = len(landing)
    replica = _conditionals(landing)
    if not any(request_priors):
        return None, np.broadcast_to(replica[:, None], (kmax, rows))
    # A few classes, many requests: one column per distinct prior, the replica's last.
    distinct: dict[tuple[float, ...], int] = {}
    column = np.fromiter((distinct.setdefault(prior, len(distinct)) if prior else -1
                          for prior in request_priors), np.int64, rows)
    firsts = np.array([prior[0] for prior in distinct] + [landing[0]])
    table = np.column_stack([_class_conditionals(prior, kmax) for prior in distinct]
                            + [replica])
    return firsts[column], table[:, column]


@lru_cache(maxsize=256)
def _class_conditionals(prior: tuple[float, ...], kmax: int) -> np.ndarray:
    """A class's conditional rates p[k] / p[k-1] at positions 1..kmax-1 (position 0 unused),
    extended geometrically past the positions the class measured. Memoised: a class's rates
    change once a telemetry period, and every decision of every replica holding it asks."""
    return _conditionals(_extended(prior[:kmax], kmax))


def _conditionals(rates: Sequence[float]) -> np.ndarray:
    """p[k] / p[k-1] at each position past the first (position 0 unused)."""
    return np.array([0.0] + [_ratio(rates[k], rates[k - 1]) for k in range(1, len(rates))])


def _ratio(rate: float, previous: float) -> float:
    """The conditional rate p[k] / p[k-1], at most 1 (0 once nothing lands)."""
    return min(1.0, rate / previous) if previous > 0 else 0.0


def _continue(rates: list[float], prior: tuple[float, ...], k: int) -> float:
    """The guess for p[k] given this replica's rates before it: the prior's conditional
    rate p[k] / p[k-1] applied to this replica's own p[k-1] (equal to prior[k] while the
    replica has measured nothing), else the geometric extrapolation.

    Anchored, not the prior's p[k] itself: the fleet's deep positions are measured by the
    replicas that chose to draft deep, where drafts landed best, so its absolute rates there
    run above what a replica that measured less at the first positions will see (a K=1
    replica priced K=3 at the fleet's rates, switched, measured less and switched back)."""
    if k >= len(prior):
        return _extrapolate(rates)
    if not rates:
        return prior[0]
    return rates[-1] * _ratio(prior[k], prior[k - 1])


def _extended(rates: Sequence[float], width: int) -> list[float]:
    """`rates` continued to `width` positions by `_extrapolate`, one position at a time."""
    full = list(rates)
    while len(full) < width:
        full.append(_extrapolate(full))
    return full


def _extrapolate(rates: list[float]) -> float:
    """The next position's p[k], continuing the last conditional acceptance rate.

    With one known position the conditional rate is p[0] itself: the usual i.i.d. model
    p[k] = a^(k+1) (SmartSpec, the DSDE paper's baselines).
    """
    if not rates:
        return DEFAULT_PRIOR_FIRST
    conditional = rates[0] if len(rates) == 1 else (
        rates[-1] / rates[-2] if rates[-2] > 0 else 0.0)
    return rates[-1] * min(1.0, conditional)


class GoodputPolicy:
    name = "goodput"
    reads_requests = True
    decides_on_arrival = True

    def __init__(self, config: GoodputConfig, candidates: tuple[int, ...]):
        self.config = config
        self.candidates = candidates
        self.costs = StepCostModel(config.cost_decay)
        for batch, k, seconds in config.profile:
            self.costs.seed(StepCost(batch, k, seconds))
        self.acceptance_width = max(1, max(candidates))
        self.acceptance = AcceptanceWindow(self.acceptance_width, config.acceptance_decay,
                                           config.prior_strength, config.shift_threshold)
        self._steps_on_tier = 0
        self._share = (0.0, 0.0)  # decayed (sequence-steps that proposed, that could have)
        self.fill = DraftFill(self.acceptance_width, config.acceptance_decay)
        self._steps = 0
        self._last_drafted = [0] * max(1, max(candidates))  # step count when last drafted

    def _batch(self, signals: Signals) -> int:
        return signals.verify_batch(signals.effective_concurrency if
                                    self.config.concurrency_source == "effective"
                                    else signals.local_batch)

    def scores(self, signals: Signals, rates: list[float], share: float | None = None
               ) -> dict[int, float]:
        """Expected tokens/s per candidate (empty until some step cost is known; only the
        tokens within `tpot_slo_ms` when set), with drafts proposed at a share `share` of
        the sequence-steps (default: the measured `draft_share`)."""
        return _scores(self._evaluate(signals, rates, share)[0], self._batch(signals))

    def _evaluate(self, signals: Signals, rates: list[float], share: float | None = None
                  ) -> tuple[dict[int, tuple[float, float]], dict[int, dict[str, int]]]:
        """Per candidate (see `scores`): (tokens per sequence-step, step seconds);
        and per K the per-request draft caps assumed there (none: every request drafts K).

        Where the engine applies caps (see `GoodputConfig.draft_caps`), each K is scored
        with the best of a few cap sets: each request drafts the positions that land with at
        least a threshold (`CAP_THRESHOLDS`), or all K. Scored, not derived from a marginal
        price: the step cost is not linear in the drafts (flat up to a knee on a GPU), and a
        price taken from the average slope capped a copy-only batch at one draft. Cap sets
        are tried from the loosest threshold up, and each must beat the best score so far
        (uncapped, or a looser set) by the switch margin: the least capping that pays."""
        ks = self.candidates
        share = self.draft_share if share is None else share
        landing = [share * rate for rate in rates]
        batch = self._batch(signals)
        requests = batch_acceptance(signals.requests, landing, self.config.prior_strength,
                                    signals.request_priors, signals.current_k)
        if requests is None:  # no per-request outcomes: the batch's mean as it is now
            options = [(None, [1 + sum(landing[:k]) for k in ks],
                        [self.fill.verified(k) for k in ks])]
        else:
            thresholds = CAP_THRESHOLDS if self.config.draft_caps and \
                signals.draft_caps_apply else ()
            options = []
            for caps in (None, *(requests.caps(t, self.config.min_draft_cap)
                                 for t in thresholds)):
                per_step, per_sequence = requests.steady(ks, caps, self.fill.verified_each)
                options.append((caps, per_step.tolist(), per_sequence.tolist()))
        # A tier costs what the drafts it would verify cost (see `DraftFill`).
        depths = {d for _, _, drafts in options for d in drafts}
        seconds = self.costs.predict_row(batch, tuple(depths))
        bound_s = None if self.config.tpot_slo_ms is None else self.config.tpot_slo_ms / 1000
        parts, chosen = self._best_options(options, ks, seconds, requests, bound_s,
                                           signals.current_k)
        if bound_s is not None and parts and not any(length for length, _ in parts.values()):
            # No tier keeps any request within the bound: the most tokens drain the queue.
            parts, chosen = self._best_options(options, ks, seconds, requests, None,
                                               signals.current_k)
        ids = signals.requests.request_ids
        return parts, {k: {} if caps is None else {
            request_id: cap for request_id, cap in zip(ids, caps.tolist(), strict=True)
            if cap < k} for k, caps in chosen.items()}

    def _best_options(self, options: list[tuple[np.ndarray | None, list[float], list[float]]],
                      ks: tuple[int, ...], seconds: dict[float, float],
                      requests: BatchAcceptance | None, bound_s: float | None, current: int
                      ) -> tuple[dict[int, tuple[float, float]], dict[int, np.ndarray | None]]:
        """Per K, the best of `options` (caps, tokens per sequence-step, drafts per sequence
        at each K): its (tokens per sequence-step, step seconds), counting only the tokens
        of requests within `bound_s` per token when given; and the caps it takes.

        The bound is looser by the switch margin on the `current` tier and tighter by it on
        the others: a request's tokens count or not, so a step time that jitters across
        the bound moves a score by the request's whole share, which the margin on scores
        alone does not absorb."""
        parts: dict[int, tuple[float, float]] = {}
        chosen: dict[int, np.ndarray | None] = {}
        band = 1 + self.config.switch_margin
        for caps, lengths, drafts in options:
            # Caps must earn the switch margin over the looser choice before them: a batch of
            # one class differs request to request only by the noise of 30-step windows.
            needed = 1.0 if caps is None else band
            for k, length, depth in zip(ks, lengths, drafts, strict=True):
                cost = seconds.get(depth)
                if cost is None:
                    continue
                if bound_s is not None:
                    banded_s = bound_s * band if k == current else bound_s / band
                    # A batch mean without per-request outcomes: all of its tokens or none.
                    length *= float(cost <= banded_s * length) if requests is None else \
                        requests.share_within(k, caps, cost, banded_s)
                if k in parts and length / cost <= needed * parts[k][0] / parts[k][1]:
                    continue
                parts[k] = (length, cost)
                chosen[k] = caps
        return parts, chosen

    @property
    def draft_share(self) -> float:
        """Share of sequence-steps at K > 0 that proposed drafts (1 until measured)."""
        proposed, ran = self._share
        return proposed / ran if ran else 1.0

    def decide(self, signals: Signals) -> Decision:
        self.acceptance.update(signals.accepted_per_pos, signals.drafted_per_pos)
        if signals.drafting_sequence_steps:
            decay = self.config.acceptance_decay
            self._share = (self._share[0] * decay + min(signals.drafts,
                                                        signals.drafting_sequence_steps),
                           self._share[1] * decay + signals.drafting_sequence_steps)
            self.fill.update(signals.drafted_per_pos, signals.slots_per_pos)
        for cost in signals.step_costs:
            self.costs.observe(cost)
        self._steps_on_tier += signals.steps
        self._steps += signals.steps
        for pos, drafted in enumerate(signals.drafted_per_pos):
            if drafted:
                self._last_drafted[pos] = self._steps
        current = signals.current_k
        prior = signals.class_prior or (signals.cluster.acceptance_prior if signals.cluster
                                        else ())
        rates = self.acceptance.rates(prior)
        parts, caps_by_k = self._evaluate(signals, rates)
        if current not in parts:
            return Decision(current, "no cost data yet")
        scores = _scores(parts, self._batch(signals))
        best = max(scores, key=lambda k: (scores[k], -k))  # ties go to the smaller K
        inputs = {"batch": float(max(1, signals.effective_concurrency)),
                  "score_current": scores[current], "score_best": scores[best],
                  # Why a score is what it is: tokens per sequence-step and the step's ms.
                  "tokens_current": parts[current][0], "tokens_best": parts[best][0],
                  "step_ms_current": 1000 * parts[current][1],
                  "step_ms_best": 1000 * parts[best][1],
                  "first_draft": rates[0], "draft_share": self.draft_share,
                  # The share of the current tier's slots the drafter is expected to fill.
                  "draft_fill": self.fill.verified(current) / current if current
                  else self.fill.share}
        if caps_by_k.get(current):  # requests whose drafts are capped below K
            inputs["capped_requests"] = float(len(caps_by_k[current]))
        if signals.class_prior:
            inputs["class_hint"] = signals.class_prior[0]
        # The dwell holds a tier against noisy measurements; a new class's arrival is news.
        if self._steps_on_tier < self.config.min_dwell_steps and not signals.new_class:
            return Decision(current, "dwell", inputs, caps_by_k.get(current))
        deeper = [k for k in self.candidates if k > current]
        expected = self._tier_the_classes_expect(signals, deeper) \
            if current == 0 and deeper else None
        if expected is not None:
            self._steps_on_tier = 0
            tier, caps = expected
            return Decision(tier, "probe: these request classes landed drafts before",
                            inputs, caps)
        interval = self.config.probe_interval_steps
        if deeper and self._steps_on_tier >= interval and \
                self._steps - self._last_drafted[deeper[0] - 1] >= interval and \
                not self._fleet_measured(signals, deeper[0]):
            self._steps_on_tier = 0
            # The probe's first window goes out uncapped, to measure the new positions (the
            # dwell decisions after it send the tier's caps again).
            return Decision(deeper[0], "probe: measure the next tier's positions", inputs)
        if best != current and scores[best] > scores[current] * (1 + self.config.switch_margin):
            self._steps_on_tier = 0
            return Decision(best, f"goodput {scores[best]:.0f} > {scores[current]:.0f} tok/s",
                            inputs, caps_by_k.get(best))
        floor = self._floor(signals)
        if floor < current and scores[floor] * (1 + DRAFT_TIE) >= scores[current] and \
                not self._idle_drafter(signals, current, floor):
            self._steps_on_tier = 0  # drafting must earn its margin; this tier buys nothing
            return Decision(floor, f"drafts at K={current} buy nothing over K={floor}",
                            inputs, caps_by_k.get(floor))
        return Decision(current, "current tier is within the margin of the best", inputs,
                        caps_by_k.get(current))

    def _idle_drafter(self, signals: Signals, tier: int, floor: int) -> bool:
        """Whether `tier` verifies less than one draft per sequence a step (the drafter
        leaves its slots nearly all empty: prompt lookup on text without repeats) and is
        predicted to cost what `floor` does. Such a tier is not left for a tie: its steps are
        the floor's steps, and it keeps drafting where a match turns up, so a copy that
        starts lands at once (at K=0 it would first wait for a probe or a class hint). A
        tier that fills its slots and is measured as cheap as the floor is still left: its
        drafts are verified, and the measurement is a fast spell of the machine."""
        depth, floor_depth = self.fill.verified(tier), self.fill.verified(floor)
        if depth >= 1:
            return False
        seconds = self.costs.predict_row(self._batch(signals), (floor_depth, depth))
        return floor_depth in seconds and \
            seconds[depth] <= seconds[floor_depth] * (1 + DRAFT_TIE)

    def _floor(self, signals: Signals) -> int:
        """Where a tier whose drafts buy nothing goes without the margin: K=0, when the
        request classes' hint can bring the replica back once drafts would land again
        (K=0 drafts nothing, so measures nothing); else the smallest drafting tier."""
        if signals.class_prior:
            return self.candidates[0]
        return min((k for k in self.candidates if k > 0), default=self.candidates[0])

    def _fleet_measured(self, signals: Signals, tier: int) -> bool:
        """Whether other replicas measured `tier`'s positions for these request classes just
        now, and the prior built from them is in use: then a probe here would only repeat
        their measurement."""
        return signals.class_prior_fresh >= tier and \
            self.acceptance.uses_prior(signals.class_prior)

    def _tier_the_classes_expect(self, signals: Signals, deeper: list[int]
                                 ) -> tuple[int, dict[str, int]] | None:
        """At K=0: the tier that would win if drafts landed as these request classes' did
        before, when one would beat K=0 by the margin, with the draft caps the hint gives
        there. Straight there, not through the smallest tier: a high phase that starts while
        the replica runs K=0 lasts a few seconds, and each tier on the way costs a dwell
        (half a second at batch 8 on this machine). Checked only after a few dwells without
        drafting, so a hint that turns out wrong (the classes' statistics then fall) costs
        one dwell now and then. Scored as any decision is (each request by its own class
        where known, the batch's steady state), so a tier the hint picks is one the next
        decision keeps."""
        if not signals.class_prior or self._steps - self._last_drafted[0] < 4 * \
                self.config.min_dwell_steps:
            return None
        hint = _extended(signals.class_prior, self.acceptance_width)
        # `draft_share` describes the traffic before K=0 and may be stale: the hint alone.
        parts, caps_by_k = self._evaluate(signals, hint, share=1.0)
        # Against K=0 of the same evaluation: with `tpot_slo_ms` both then count the same
        # tokens (the fallback to every token may hold in one evaluation and not another).
        hinted = _scores(parts, self._batch(signals))
        best = max(deeper, key=lambda k: (hinted.get(k, -1.0), -k))
        if best not in hinted or 0 not in hinted or \
                hinted[best] <= hinted[0] * (1 + self.config.switch_margin):
            return None
        return best, caps_by_k[best]
