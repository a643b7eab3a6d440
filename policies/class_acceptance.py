"""What the request classes on a replica did before: per class, a decayed p[k] per position.

A request class is set where the request enters (the ingress: greedy or sampled; the cluster
simulation: copy-, code- or chat-like). A replica keeps, for each class, p[k] (the share of
its drafts with more than k accepted) blended across telemetry periods, and pushes it to the
hub, which averages the fleet's per class. The replica's policy then sees the mixture over the
requests it now holds (the fleet's rates for each class, else its own) as its acceptance prior
and, at K=0 where nothing is drafted, as its only hint that drafts would land.

Each class's rates also say how deep they are fresh: the leading positions some replica
measured within the last `FRESH_PERIODS` telemetry periods. A replica whose classes' next
positions another replica measured just now need not run a deeper tier itself to measure them:
one replica's probe serves every replica holding that class.

Why per class rather than one fleet-wide prior: under class-gathering routing a replica serves
mostly one class, and the fleet's mean describes the others. A chat-like replica in a
copy-heavy fleet saw deep positions priced at the copy traffic's acceptance, switched to a deep
K, measured it, and switched back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from policies.outcomes import position_counts
from policies.signals import RequestWindows

Rates = tuple[float, ...]
"""p[k] per draft position, over the positions that were measured (a prefix: a draft reaches
position k only through the positions before it)."""
WEIGHT_NEW = 0.3
"""Weight of a telemetry period's fresh rate in the decayed one (about the last 3 periods)."""
DEFAULT_CLASS = "default"
"""The class of a request that entered without one."""
GREEDY_CLASS, SAMPLED_CLASS = "greedy", "sampled"
"""The classes the app's ingress gives requests, by their temperature."""
FRESH_PERIODS = 8
"""A measured position stays fresh this many telemetry periods (4 s at the app's 0.5 s, about
the steps `goodput` waits between probes at 16 ms a step)."""


class ClassPrior(NamedTuple):
    """What the classes of the requests on a replica showed before (see `mixture`)."""

    rates: Rates = ()
    fresh: int = 0
    """Leading positions of `rates` that some replica measured within the last
    `FRESH_PERIODS` telemetry periods for every class held, not only the classes `rates`
    weighs: a held class nobody measured lately makes it 0 (see `fresh_depth`)."""
    by_class: Mapping[str, Rates] = {}
    """Per class held, what it showed before (classes nobody measured are left out): a
    request that has not drafted yet is priced by its class, not by the replica's recent
    traffic, which may be another class's."""
    class_of: Mapping[str, str] = {}
    """Request id -> class, for the requests on the replica (the caller's own mapping, not a
    copy: read afresh at each decision)."""

    def request_rates(self, request_id: str) -> Rates:
        """What the request's class showed before; () when its class is unknown."""
        return self.by_class.get(self.class_of.get(request_id, ""), ())


def class_counts(windows: RequestWindows, class_of: Mapping[str, str], width: int
                 ) -> dict[str, tuple[list[int], list[int]]]:
    """Per request class that drafted, per position: (steps that landed it, steps that
    drafted it), from the running requests' recent verify outcomes (`class_of`: request id ->
    class). Windows overlap from one telemetry period to the next, so these make a rate, not a
    count to add up."""
    classes = [class_of.get(request_id, DEFAULT_CLASS) for request_id in windows.request_ids]
    names = sorted(set(classes))
    index = {name: i for i, name in enumerate(names)}
    drafted, landed = position_counts(*windows.clipped(width),
                                      np.array([index[c] for c in classes], np.int64),
                                      len(names), width)
    return {name: (landed[i].tolist(), drafted[i].tolist()) for i, name in enumerate(names)
            if drafted[i, 0]}


def rates_from_counts(accepted: Sequence[float], drafted: Sequence[float]) -> Rates:
    """p[k] = accepted[k] / drafted[k], within [0, 1], for the leading positions drafted at
    least once (counts may be sums of decayed or subtracted reports, hence not whole)."""
    rates = []
    for landed, offered in zip(accepted, drafted, strict=False):
        if offered < 1:
            break  # no evidence at this depth: the policy extrapolates
        rates.append(min(1.0, max(0.0, landed / offered)))
    return tuple(rates)


def blend_rates(old: Rates | None, fresh: Rates) -> Rates:
    """Per position, a decayed rate in which each new period weighs `WEIGHT_NEW`; a position
    measured on one side only keeps that side's value (a shallow K measures no deep position,
    which keeps its past)."""
    old = old or ()
    return tuple(old[k] + WEIGHT_NEW * (fresh[k] - old[k]) if k < len(old) and k < len(fresh)
                 else fresh[k] if k < len(fresh) else old[k]
                 for k in range(max(len(old), len(fresh))))


def class_rates(request_class: str, own: Mapping[str, Rates], fleet: Mapping[str, Rates]
                ) -> Rates:
    """The fleet's rates for a class (the hub's mean, more evidence, this replica's
    included), else the replica's own (no hub, or a class the hub has not heard of yet);
    () when neither measured it."""
    return fleet.get(request_class) or own.get(request_class) or ()


def mixture(requests_per_class: Mapping[str, int], own: Mapping[str, Rates],
            fleet: Mapping[str, Rates]) -> Rates:
    """Mean p[k] of the requests on a replica, given how many of each class it holds (each
    class's rates as `class_rates` gives them). Covers the positions
    every weighed class has measured (the policy extrapolates beyond); () when none is known."""
    weighed = [(count, class_rates(c, own, fleet)) for c, count in requests_per_class.items()
               if count > 0]
    weighed = [(count, rates) for count, rates in weighed if rates]
    if not weighed:
        return ()
    total = sum(count for count, _ in weighed)
    scaled = [[count * rate for rate in rates] for count, rates in weighed]
    # Per position, the classes' count * rate there (as many positions as the shortest has).
    return tuple(sum(position) / total for position in zip(*scaled, strict=False))


def fresh_depth(requests_per_class: Mapping[str, int], own: Mapping[str, int],
                fleet: Mapping[str, int]) -> int:
    """Leading positions freshly measured for every class held (by this replica or any)."""
    held = [max(own.get(c, 0), fleet.get(c, 0)) for c, count in requests_per_class.items()
            if count > 0]
    return min(held, default=0)


def fleet_fresh(reports: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Per class, the deepest fresh measurement any replica reports (the hub's view)."""
    deepest: dict[str, int] = {}
    for report in reports:
        for request_class, depth in report.items():
            deepest[request_class] = max(depth, deepest.get(request_class, 0))
    return deepest


def fleet_average(reports: Iterable[Mapping[str, Rates]]) -> dict[str, Rates]:
    """Per class and position, the mean over the replicas that measured it (the hub's view)."""
    sums: dict[str, list[list[float]]] = {}  # class -> per position [total, replicas]
    for report in reports:
        for request_class, rates in report.items():
            entry = sums.setdefault(request_class, [])
            entry.extend([0.0, 0] for _ in range(len(rates) - len(entry)))
            for k, rate in enumerate(rates):
                entry[k][0] += rate
                entry[k][1] += 1
    return {c: tuple(total / n for total, n in entry) for c, entry in sums.items()}


class ClassAcceptance:
    """One replica's per-class rates (`own`, what it pushes) and the fleet's (from the hub),
    each with its fresh depth (`own_fresh`, `fleet_fresh`)."""

    def __init__(self) -> None:
        self.own: dict[str, Rates] = {}
        self.fleet: dict[str, Rates] = {}
        self.fleet_fresh: dict[str, int] = {}
        self._period = 0
        self._measured: dict[str, list[int]] = {}  # class -> period each position was measured
        self.own_fresh: dict[str, int] = {}
        """Per class, the leading positions this replica measured in the last periods (as of
        the last `observe`, the only change to what it counts)."""

    def observe(self, counts: Mapping[str, tuple[Sequence[float], Sequence[float]]]) -> None:
        """One period's (accepted, drafted) per position for each class that drafted."""
        self._period += 1
        for request_class, (accepted, drafted) in counts.items():
            fresh = rates_from_counts(accepted, drafted)
            if fresh:
                self.own[request_class] = blend_rates(self.own.get(request_class), fresh)
                measured = self._measured.setdefault(request_class, [])
                measured.extend([0] * (len(fresh) - len(measured)))
                measured[:len(fresh)] = [self._period] * len(fresh)
        self.own_fresh = self._fresh_depths()

    def _fresh_depths(self) -> dict[str, int]:
        depths = {}
        for request_class, measured in self._measured.items():
            depth = 0
            while depth < len(measured) and self._period - measured[depth] < FRESH_PERIODS:
                depth += 1
            if depth:
                depths[request_class] = depth
        return depths

    def prior(self, requests_per_class: Mapping[str, int],
              class_of: Mapping[str, str] | None = None) -> ClassPrior:
        """For the requests now on the replica: how many of each class, and which request is
        of which (`class_of`: request id -> class)."""
        rates = mixture(requests_per_class, self.own, self.fleet)
        fresh = fresh_depth(requests_per_class, self.own_fresh, self.fleet_fresh)
        by_class = {c: known for c, count in requests_per_class.items()
                    if count > 0 and (known := class_rates(c, self.own, self.fleet))}
        return ClassPrior(rates, min(fresh, len(rates)), by_class, class_of or {})
