"""The engine benchmark's measurement order, on the simulator engine (the benchmark itself
runs real vLLM; its timing is not checked here)."""

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from bench.engine_bench import (
    TIERS,
    WORKLOADS,
    markdown,
    measure,
    switch_cost,
    switch_targets,
)
from replicas.engines.sim_engine import SimulatedEngine
from replicas.engines.sim_presets import PRESETS
from replicas.tier_pool import TierPool


class RecordingPool(TierPool):
    """A tier pool that remembers every tier it was asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[int] = []

    async def switch(self, k: int):
        self.asked.append(k)
        return await super().switch(k)


T = TypeVar("T")


def on_simulator(initial_k: int, body: Callable[[SimulatedEngine, RecordingPool], Awaitable[T]]
                 ) -> tuple[T, list[int]]:
    """`body` run on a started simulator engine and its recording pool: its result, and the
    tiers the pool was asked for."""
    async def run():
        engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=max(TIERS), time_scale=0.0)
        await engine.start()
        pool = RecordingPool(engine, TIERS, initial_k=initial_k)
        await pool.apply_initial()
        try:
            return await body(engine, pool), pool.asked
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def test_engine_bench_warms_every_tier_then_interleaves_them_in_alternating_order():
    async def body(engine: SimulatedEngine, pool: RecordingPool):
        rows, _ = await measure(engine, pool, "ngram", rounds=3, max_tokens=16,
                                concurrencies=(1, 2))
        return rows

    rows, asked = on_simulator(0, body)
    forward, backward = list(TIERS), list(reversed(TIERS))
    # Per workload and batch: a warm-up pass, then rounds taking the tiers forward, backward,
    # forward, so no tier is always measured first.
    assert asked == (forward + forward + backward + forward) * (len(WORKLOADS) * 2)
    assert {(r.workload, r.concurrency, r.k) for r in rows} == \
        {(w, c, k) for w in WORKLOADS for c in (1, 2) for k in TIERS}
    assert all(r.speedup_vs_k0 == 1.0 for r in rows if r.k == 0)
    accept = {(r.workload, r.concurrency, r.k): r.accept_len for r in rows}
    # Every round's tokens count: copy text lands drafts, sampled free text almost none.
    assert accept[("copy", 2, 15)] > 8 > 2 > accept[("free", 2, 15)]


def test_the_switch_cost_goes_from_k0_to_every_drafting_tier_in_turn():
    """Each drafting tier is switched to and back from K=0 (before, odd switches went to
    K=3 and K=15 only, so K=1 and K=7 were never timed)."""
    assert switch_targets(10) == [0, 1, 0, 3, 0, 7, 0, 15, 0, 1]
    assert set(switch_targets(8)) == set(TIERS)
    assert switch_targets(0) == []


def _switch_cost(switches: int):
    return on_simulator(3, lambda engine, pool: switch_cost(engine, pool, switches))


def test_the_switch_cost_times_the_switches_it_makes():
    cost, asked = _switch_cost(8)
    assert asked == switch_targets(8)
    assert cost["switches"] == 8 and 0 <= cost["median_ms"] <= cost["p99_ms"]


def test_no_switches_timed_reads_n_a():
    """`--switches 0`: nothing timed, no median to take."""
    cost, asked = _switch_cost(0)
    assert asked == [] and cost == {"switches": 0, "median_ms": None, "p99_ms": None}
    table = markdown({"rows": [], "by_depth": [], "acceptance": [],
                      "switch_cost": {"ngram": cost}})
    assert "| ngram | 0 | n/a | n/a |" in table
