"""The simulator replay of the transition workload on the H20 preset (virtual time, ~2 s)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bench.policy_replay import (
    ADAPTIVE,
    PUBLISHED_H20,
    STATIC,
    ModeResult,
    PhaseResult,
    phases_for,
    replay,
    summarise,
)
from replicas.engines.sim_presets import Acceptance, AcceptanceTable

PHASES = ["low_1", "high_1", "low_2", "high_2"]


@pytest.fixture(scope="module")
def modes() -> dict:
    phases = phases_for("transition", requests=16, concurrency=8)
    results = {mode: asyncio.run(replay(mode, "h20-llama8b-ngram", phases, max_tokens=256))
               for mode in (*STATIC, *ADAPTIVE)}
    return summarise(results, PHASES)


def test_replay_reproduces_the_published_static_table(modes: dict) -> None:
    for mode, (overall, *per_phase) in PUBLISHED_H20.items():
        assert modes[mode]["throughput"] / overall == pytest.approx(1, abs=0.10), mode
        for name, published in zip(PHASES, per_phase, strict=True):
            assert modes[mode]["phases"][name] / published == pytest.approx(1, abs=0.15), \
                (mode, name)


def test_ema_loses_to_the_best_static_in_the_high_acceptance_phase(modes: dict) -> None:
    best_high = max(modes[m]["phases"]["high_2"] for m in STATIC)
    assert modes["ema"]["phases"]["high_2"] < 0.9 * best_high


def test_goodput_beats_the_best_static_and_tracks_the_oracle_per_phase(modes: dict) -> None:
    best_static = max(modes[m]["throughput"] for m in STATIC)
    assert modes["goodput"]["throughput"] >= 1.05 * best_static
    for name in PHASES:
        assert modes["goodput"]["phases"][name] >= 0.95 * modes["oracle"]["phases"][name], name
    # A phase change needs one switch, and a probe of the next tier may add one more.
    assert modes["goodput"]["switches"] <= 2 * len(PHASES)


def test_acceptance_mixture_matches_its_expected_run_length() -> None:
    acceptance, k = Acceptance(0.5, copy_share=0.25, copy_rate=0.999), 7
    runs = AcceptanceTable([acceptance]).draw(np.random.default_rng(0), k,
                                              np.zeros(20000, np.int64)).tolist()
    expected = sum(0.25 * 0.999 ** i + 0.75 * 0.5 ** i for i in range(1, k + 1))
    assert sum(runs) / len(runs) == pytest.approx(expected, rel=0.03)
    assert acceptance.mean_run(k) == pytest.approx(expected)
    assert max(runs) == k and min(runs) == 0


def test_the_oracle_weighs_each_phase_by_its_tokens() -> None:
    """The oracle runs each phase at the best static rate; a sweep's phases differ in size, so
    its overall rate is tokens over summed phase times, not a harmonic mean of rates."""
    def mode(*phases: tuple[int, float]) -> ModeResult:
        return ModeResult(phases={name: PhaseResult(tokens, seconds, tokens)
                                  for name, (tokens, seconds) in zip("ab", phases, strict=True)})

    modes = summarise({"static1": mode((100, 1.0), (900, 3.0)),
                       "static3": mode((100, 2.0), (900, 1.0))}, ["a", "b"])
    assert modes["oracle"]["phases"] == {"a": 100.0, "b": 900.0}
    assert modes["oracle"]["throughput"] == pytest.approx(1000 / 2.0)
