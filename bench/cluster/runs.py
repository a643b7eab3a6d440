"""A simulation as a plain value a worker process can take (`Run`), and the search for a
mode's capacity at the SLO."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from typing import Any

from bench.cluster.fleet import simulate, summarise
from bench.cluster.load import LoadShape, offered_tok_s_per_replica, workload

# The capacity search: rates found to this many requests/s per replica, from the load's own
# rate, stepped by this factor until the attainment target is bracketed.
CAPACITY_RESOLUTION = 0.05
CAPACITY_STEP = 1.25


@dataclass(frozen=True)
class Run:
    """One simulation: a mode on a fleet under one burst pattern. Plain values, so a worker
    process can take it and build the arrivals itself (they are a function of these)."""

    mode: str
    replicas: int
    duration_s: float
    shape: LoadShape
    seed: int
    slo_ttft_s: float
    slo_tpot_s: float
    switch_margin: float | None = None
    tpot_bound: bool = False
    """Whether the goodput modes bound time per output token at the SLO's (`tpot_slo_ms`)."""
    policy: dict[str, Any] | None = None
    """The policy config the mode was `--define`d with; None: the mode's own."""


def run_one(run: Run) -> dict[str, Any]:
    arrivals = workload(run.replicas, run.duration_s, run.shape, run.seed)
    outcome = asyncio.run(simulate(run.mode, run.replicas, arrivals, run.duration_s,
                                   run.slo_ttft_s, run.slo_tpot_s, run.seed, run.switch_margin,
                                   run.tpot_bound, run.policy))
    return summarise(outcome, run.replicas)


def slo_capacity(run: Run, attainment: float) -> dict[str, Any]:
    """The most requests a second per replica (`rate_per_replica`; the burst pattern scales
    with it) at which at least `attainment` of the requests meet the SLO: DistServe's
    goodput, the load a fleet takes at its SLO. Bisection over `run`'s own burst pattern,
    from its rate: the attainment falls as the rate rises (not strictly: the bursts keep
    their times while the arrivals between them come sooner), so what is found is a rate
    that meets the target with one at most `CAPACITY_RESOLUTION` above it that does not."""
    tried: dict[float, float] = {}

    def meets(rate: float) -> bool:
        shape = replace(run.shape, rate_per_replica=rate)
        tried[rate] = run_one(replace(run, shape=shape))["slo_attainment"]
        return tried[rate] >= attainment

    low, high, rate = 0.0, math.inf, run.shape.rate_per_replica
    while math.isinf(high) or not low:
        if meets(rate):
            low, rate = rate, rate * CAPACITY_STEP
        else:
            high, rate = rate, rate / CAPACITY_STEP
        if math.isfinite(high) and high < CAPACITY_RESOLUTION:
            break  # not even a trickle meets the target
    while high - low > CAPACITY_RESOLUTION:
        middle = (low + high) / 2
        if meets(middle):
            low = middle
        else:
            high = middle
    arrivals = workload(run.replicas, run.duration_s,
                        replace(run.shape, rate_per_replica=low), run.seed) if low else []
    return {"rate_per_replica": low, "slo_attainment": tried.get(low, 0.0),
            "offered_tok_s_per_replica": offered_tok_s_per_replica(
                arrivals, run.duration_s, run.replicas), "simulations": len(tried)}
