"""`bench.step_scatter` reads back the step-time scatter the simulator was given, from decision
log lines in the replicas' format."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bench.step_scatter import read_windows, split, summarise
from replicas.engines.base import GenerationRequest
from replicas.engines.sim_engine import SimulatedEngine
from replicas.engines.sim_presets import PRESETS

WINDOW = 4  # steps a decision window holds (the app's decide_every_steps)


def decision_lines(jitter: float, drift: float, windows: int) -> list[str]:
    """One replica's decision log at one tier and batch: each window's mean step time beside
    the cost model's time for the step (what a well-fitted policy predicts)."""
    engine = SimulatedEngine(PRESETS["cpu-demo-draft"], kmax=3, max_num_seqs=8,
                             max_model_len=100_000, seed=(5, 0), step_jitter=jitter,
                             step_drift=drift)
    asyncio.run(engine.set_k(3))
    for i in range(8):
        engine.submit(GenerationRequest(f"r{i}", prompt="p", max_tokens=90_000,
                                        request_class="low", seed=i))
    engine.admit()
    model_ms = 1000 * PRESETS["cpu-demo-draft"].step_seconds(8, 3)
    lines = []
    for _ in range(windows):
        measured_ms = 1000 * np.mean([engine.step() for _ in range(WINDOW)])
        lines.append(f"DEBUG 2026-11-28 11:27:07,333 specserve_EngineReplica r1 -- decision "
                     f"K=3 -> 3: current tier is within the margin of the best {{'batch': "
                     f"8.0, 'score_current': 1.0, 'step_ms_current': {model_ms}, "
                     f"'draft_fill': np.float64(1.0), 'step_ms_measured': {measured_ms}}}")
    return lines


def test_the_scatter_the_simulator_was_given_is_read_back_from_its_windows() -> None:
    lines = decision_lines(jitter=0.36, drift=0.14, windows=1500)
    rows, pooled = summarise(read_windows({"replica.log": lines}), WINDOW)
    assert [row[:4] for row in rows] == [["replica.log", "3", "8", "1500"]]
    jitter, drift = pooled
    assert jitter == pytest.approx(0.36, rel=0.2)
    assert drift == pytest.approx(0.14, rel=0.25)
    _, steady = summarise(read_windows({"replica.log": decision_lines(
        jitter=0.36, drift=0.0, windows=1500)}), WINDOW)
    assert steady[1] < 0.06  # no slow part given, next to none read back


def test_windows_pair_only_with_the_next_decision_at_the_same_tier_and_batch() -> None:
    lines = [f"x -- decision K={k} -> {k}: held {{'batch': {batch}.0, "
             f"'step_ms_current': 10.0, 'step_ms_measured': {measured}}}"
             for k, batch, measured in [(1, 4, 10.0), (1, 4, 11.0), (3, 4, 12.0),
                                        (1, 4, 13.0), (1, 2, 14.0)]]
    lines.insert(1, "x -- decision K=1 -> 1: dwell {'batch': 4.0, 'step_ms_current': 10.0}")
    groups = read_windows({"log": lines})
    assert len(groups[("log", 1, 4)].ratios) == 3
    assert groups[("log", 1, 4)].pairs == []  # an untimed window, then K=3, broke each pair
    assert set(groups) == {("log", 1, 4), ("log", 3, 4), ("log", 1, 2)}


def test_a_window_scatter_splits_into_a_fresh_and_a_slow_part() -> None:
    assert split(0.04, 0.0, 4) == pytest.approx((0.4, 0.0))
    jitter, drift = split(0.05, 0.5, 4)
    assert jitter ** 2 / 4 + drift ** 2 == pytest.approx(0.05)
    assert split(0.05, 1.5, 4)[0] == 0.0  # more correlated than a slow part can make: all slow
