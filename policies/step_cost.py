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
    """Per draft depth (draft tokens per sequence a step verified), step seconds measured at
    each batch size, interpolated piecewise-linearly in batch size: it follows the knee
    between the memory-bound regime (flat in batch x depth) and the compute-bound one, which
    one straight line would smear.

    Step wall times on a shared machine jitter by tens of percent, so two rules keep noise
    from choosing the tier:
    - a point is a running mean that becomes an EWMA (a new step weighs at least 1 - decay);
      a batch size seen for the first time starts from what its neighbours predict, worth
      `PRIOR_STEPS` steps, rather than from one raw sample;
    - at a batch size, predictions never fall as the depth grows (verifying more tokens does
      not cost less): a deep tier that looked cheap by luck would otherwise win with nothing
      accepted.

    A profile (`seed`) gives the shape across batch and depth, not the level: in the serving
    app a step also carries prefills, streaming and the other processes on the machine, and
    costs more than the engine alone in `bench.engine_bench`. Unscaled, every tier not yet
    measured would look cheap, and the policy would cycle through them (each measurement
    making the next unmeasured tier the best). So profiled points not yet measured are
    scaled by the running ratio of measured steps to what the profile predicts for them.
    """

    PRIOR_STEPS = 4.0

    def __init__(self, decay: float):
        self.max_weight = math.inf if decay >= 1 else 1 / (1 - decay)
        self._points: _CostTable[_CostPoint] = _CostTable()
        self._profile: _CostTable[float] = _CostTable()  # profiled seconds
        # (batch, depth) -> prediction
        self._profiled: dict[tuple[int, int], float | None] = {}
        self.scale, self._scale_weight = 1.0, self.PRIOR_STEPS
        """Measured step time over the profile's prediction (1 without a profile)."""

    def seed(self, cost: StepCost) -> None:
        """A profiled point, worth `PRIOR_STEPS` measured steps."""
        self._points.set(cost.depth, cost.batch, _CostPoint(cost.seconds, self.PRIOR_STEPS,
                                                            measured=False))
        self._profile.set(cost.depth, cost.batch, cost.seconds)
        self._profiled.clear()

    def observe(self, cost: StepCost) -> None:
        if cost.seconds <= 0 or cost.batch <= 0:
            return
        profiled = self._profiled_seconds(cost.batch, cost.depth)
        if profiled is not None:
            self._scale_weight = min(self._scale_weight + 1, self.max_weight)
            self.scale += (cost.seconds / profiled - self.scale) / self._scale_weight
        point = self._points.get(cost.depth, cost.batch)
        if point is None or not point.measured:
            guess = self.predict(cost.batch, cost.depth)
            point = _CostPoint(cost.seconds, 0.0) if guess is None else \
                _CostPoint(guess, self.PRIOR_STEPS)
            self._points.set(cost.depth, cost.batch, point)
        point.weight = min(point.weight + 1, self.max_weight)
        point.seconds += (cost.seconds - point.seconds) / point.weight
        point.steps += 1

    def profile_rows(self, min_steps: int) -> list[StepCost]:
        """What this model now predicts at each point it holds, by batch then depth, in a
        profile's form (`GoodputConfig.profile`): a point measured from at least `min_steps`
        steps as measured, a point only profiled scaled to the measured level (`scale`), so
        the rows are one complete profile at one level; a point measured from fewer steps is
        left out (its neighbours interpolate it). A deployment can start from it instead of
        the profile it was given."""
        rows = []
        # Copies: the admin route may read this while the control loop observes steps.
        for depth, by_batch in list(self._points.points.items()):
            for batch, point in list(by_batch.items()):
                if not point.measured or point.steps >= min_steps:
                    rows.append(StepCost(batch, depth, self._value(point)))
        return sorted(rows, key=lambda cost: (cost.batch, cost.depth))

    def _profiled_seconds(self, batch: int, depth: int) -> float | None:
        """What the profile alone predicts for a step (None without a profile); memoised:
        every observed step asks, and the profile only changes when seeded."""
        key = (batch, depth)
        if key not in self._profiled:
            self._profiled[key] = _predict_row(self._profile, float, batch, (depth,)).get(depth)
        return self._profiled[key]

    def _value(self, point: _CostPoint) -> float:
        return point.seconds if point.measured else point.seconds * self.scale

    def predict_row(self, batch: int, depths: tuple[float, ...]) -> dict[float, float]:
        """Seconds of a step of `batch` sequences at each depth in `depths` (empty before any
        measurement or profile); an unmeasured depth is interpolated (or extrapolated)
        linearly in depth between known neighbours."""
        return _predict_row(self._points, self._value, batch, depths)

    def predict(self, batch: int, depth: float) -> float | None:
        return self.predict_row(batch, (depth,)).get(depth)


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
    weight: float
    """How many steps the mean stands for (capped: an EWMA from then on)."""
    measured: bool = True
    """False while the point is only profiled (its level is then scaled)."""
    steps: int = 0
    """Steps observed at the point (its weight also counts the prior it started from)."""


def _predict_row(table: _CostTable[P], value: Callable[[P], float], batch: int,
                 depths: tuple[float, ...]) -> dict[float, float]:
    """Per depth in `depths`, the cost at `batch` from a table of depth -> batch -> point:
    piecewise-linear in batch per known depth, made non-decreasing in depth, then
    piecewise-linear in depth.

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
    at_batch, floor = {}, 0.0
    for depth in known:
        points = table.points[depth]
        here = value(points[batch]) if batch in points else \
            _interpolate(batch, batches[depth], lambda b, points=points: value(points[b]))
        floor = max(floor, here)
        at_batch[depth] = floor
    return {d: _interpolate(d, known, at_batch.__getitem__) for d in depths}


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
