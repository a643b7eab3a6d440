"""The cluster simulation's load (SIMULATOR): open-loop arrivals from tenants that each send one
request class, with bursts that come mostly from one tenant at a time."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Request classes and the preset acceptance they draw from (see sim_presets).
CLASSES = {"copy": "high_2", "code": "low_2", "chat": "low_1"}


@dataclass(frozen=True)
class Arrival:
    at: float
    request_class: str
    max_tokens: int


@dataclass(frozen=True)
class LoadShape:
    """Open-loop arrivals per replica: a base rate with bursts from one tenant at a time."""

    rate_per_replica: float = 9.0
    """Requests per second per replica between bursts. With the bursts the expected mean is
    17.3 requests (4430 tokens) a second per replica, 85-92% of the 4800-5200 tok/s a
    saturated replica sustains on this class mix (static3 to goodput_routed, measured); each
    burst goes well past it, so the SLO binds. One burst pattern can offer more than the
    mean (the report prints the offered load): seed 0 offers 5300-6300 tok/s per replica, at
    or above capacity, so queues grow for as long as arrivals last and a longer run meets
    the SLO less. At 6 every adaptive mode meets the SLO for every request."""
    burst_factor: float = 5.0
    burst_every_s: float = 5.0
    burst_s: float = 1.5
    burst_tenant_share: float = 0.8
    """Share of a burst's requests that come from the bursting tenant."""
    tenants: int = 12
    zipf_s: float = 1.1
    max_tokens: tuple[int, int] = (128, 384)


def workload(replicas: int, duration_s: float, shape: LoadShape, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    # Bursts draw from their own stream: runs at other rates see the same bursts.
    bursts = random.Random(f"bursts-{seed}")
    names = list(CLASSES)
    tenant_class = [names[i % len(names)] for i in range(shape.tenants)]
    weights = [1 / (i + 1) ** shape.zipf_s for i in range(shape.tenants)]
    arrivals, now = [], 0.0
    burst_start, burst_tenant = -1.0, 0
    next_burst = bursts.uniform(0, shape.burst_every_s)
    while True:
        if now >= next_burst:
            burst_start, next_burst = next_burst, next_burst + bursts.expovariate(
                1 / shape.burst_every_s) + shape.burst_s
            burst_tenant = bursts.choices(range(shape.tenants), weights)[0]
        bursting = burst_start <= now < burst_start + shape.burst_s
        rate = replicas * shape.rate_per_replica * (shape.burst_factor if bursting else 1)
        now += rng.expovariate(rate)
        if now >= duration_s:
            return arrivals
        tenant = burst_tenant if bursting and rng.random() < shape.burst_tenant_share else \
            rng.choices(range(shape.tenants), weights)[0]
        arrivals.append(Arrival(now, tenant_class[tenant], rng.randint(*shape.max_tokens)))


def offered_tok_s_per_replica(arrivals: list[Arrival], duration_s: float, replicas: int
                              ) -> float:
    return sum(a.max_tokens for a in arrivals) / duration_s / replicas


def token_shares(arrivals: list[Arrival]) -> dict[str, float]:
    total = sum(a.max_tokens for a in arrivals)
    return {c: sum(a.max_tokens for a in arrivals if a.request_class == c) / total
            for c in CLASSES}
