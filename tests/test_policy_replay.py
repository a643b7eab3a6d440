"""The simulator replay of the transition workload on the H20 preset (virtual time, ~2 s), and
the simulator's acceptance models and presets."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from bench.cluster import fleet
from bench.policy_replay import (
    ADAPTIVE,
    CANDIDATES,
    PUBLISHED_H20,
    STATIC,
    TELEMETRY_PERIOD_S,
    ModeResult,
    PhaseResult,
    phases_for,
    pooled,
    replay,
    report,
    summarise,
)
from replicas.engines.base import GenerationRequest
from replicas.engines.sim_engine import SimulatedEngine
from replicas.engines.sim_presets import PRESETS, Acceptance, AcceptanceTable

PHASES = ["low_1", "high_1", "low_2", "high_2"]
RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


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


def test_the_statics_are_every_candidate_tier_in_the_replay_and_the_fleet() -> None:
    """The fleet leaves out K=0 alone (never its best static: see `bench.cluster.fleet`)."""
    assert [int(m.removeprefix("static")) for m in STATIC] == list(CANDIDATES)
    assert tuple(m for m in STATIC if m != "static0") == fleet.STATIC
    assert fleet.TELEMETRY_PERIOD_S == TELEMETRY_PERIOD_S


def test_the_oracle_offers_k0_where_the_adaptive_modes_run_it() -> None:
    """On cpu-demo the low phases run best at K=0, where `goodput` goes: the best static of
    each phase includes static0, so `goodput` there is about the oracle, not above it (1.10x
    to 1.11x when the statics began at K=1)."""
    phases = phases_for("transition", requests=16, concurrency=8)
    results = {mode: asyncio.run(replay(mode, "cpu-demo", phases, max_tokens=256))
               for mode in ("static0", "static1", "goodput")}
    modes = summarise(results, PHASES)
    for name in ("low_1", "low_2"):
        assert modes["oracle"]["phases"][name] == modes["static0"]["phases"][name]
        assert 0.95 < modes["goodput"]["phases"][name] / modes["oracle"]["phases"][name] \
            <= 1.01, name


def test_acceptance_mixture_matches_its_expected_run_length() -> None:
    acceptance, k = Acceptance(0.5, copy_share=0.25, copy_rate=0.999), 7
    table = AcceptanceTable([acceptance])
    runs = table.draw_runs(np.random.default_rng(0), k,
                           table.params[:, np.zeros(20000, np.int64)]).tolist()
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


def test_the_sweep_tables_say_each_phase_holds_one_class() -> None:
    """The replay's sweep is not the HTTP one (which mixes both classes in every phase): its
    tables' titles name each phase's class; the transition's names already do."""
    def tables(workload: str) -> str:
        phases = phases_for(workload, requests=16, concurrency=8)
        result = ModeResult(phases={p.name: PhaseResult(100, 1.0, 50) for p in phases})
        modes = summarise({"static1": result, "goodput": result}, [p.name for p in phases])
        return report(modes, phases, {"goodput": 1.0})

    note = "one class a phase: c1 low, c16 high, c64 low, c1_end high)"
    sweep = tables("sweep")
    assert f"### OVERALL AND PER PHASE (tok/s, simulated time; {note}" in sweep
    assert f"### RATIOS (vs best static = static1; per phase vs oracle; {note}" in sweep
    assert "one class a phase" not in tables("transition")


def test_a_replayed_agreement_lands_what_the_text_agrees_on_at_each_depth() -> None:
    """A drafter that agrees with the target at two positions of every three ("110"): at K=1
    a landed draft's bonus token skips the second match, so every other step lands; at K=3
    every step lands two. Through the engine's steps, each request at its own position in
    its text, as `step_runs` and `mean_run` count them; a text of '1's lands every draft."""
    acceptance = Acceptance(agreement="110")
    assert acceptance.mean_run(1) == pytest.approx(0.5) and acceptance.mean_run(3) == 2

    def engine_runs(k: int) -> list[int]:
        preset = dataclasses.replace(PRESETS["cpu-demo-draft"], acceptance={"high": acceptance})
        engine = SimulatedEngine(preset, kmax=7, max_num_seqs=2)
        asyncio.run(engine.set_k(k))
        for i in range(2):
            engine.submit(GenerationRequest(f"r{i}", prompt="p", max_tokens=120,
                                            request_class="high", seed=i))
        engine.admit()
        for _ in range(20):
            engine.step()
        return engine.request_acceptance().accepted[0].tolist()[-20:]

    assert engine_runs(1) == [1, 0] * 10
    assert engine_runs(3) == [2] * 20
    table = AcceptanceTable([Acceptance(agreement="1"), Acceptance(0.0)])
    runs = table.draw_runs(np.random.default_rng(0), 7, table.params[:, [0, 1]],
                           position=np.array([5, 5]))
    assert runs.tolist() == [7, 0]
    with pytest.raises(ValueError, match="'0' and '1'"):
        Acceptance(agreement="12")


def test_a_classes_request_types_are_dealt_by_seed_else_by_id() -> None:
    preset = PRESETS["cpu-demo-draft"]
    types = preset.acceptance["high"]

    def request(seed: int | None, request_id: str = "r") -> GenerationRequest:
        return GenerationRequest(request_id, prompt="p", max_tokens=8, request_class="high_1",
                                 seed=seed)

    assert [preset.acceptance_for(request(seed)) for seed in range(16)] == [*types, *types]
    by_id = {preset.acceptance_for(request(None, f"id{i}")) for i in range(64)}
    assert by_id == set(types)  # every type turns up, and an id always gets the same one
    assert preset.acceptance_for(request(None, "id7")) == \
        preset.acceptance_for(request(None, "id7"))
    assert preset.acceptance_for(request(3, "x")) == types[3]
    assert preset.acceptance["low"] == preset.acceptance_for(
        GenerationRequest("s", prompt="p", max_tokens=8, request_class="low_2", seed=5))


def test_the_ingress_classes_choose_the_acceptance_as_the_ingress_chose_them() -> None:
    """The app's requests come as "greedy" or "sampled" (the ingress's rule); a request at
    temperature 0.05 is sampled there, so the simulator must not draw copy-like acceptance
    for it (its rule for unlabelled requests, temperature <= 0.1, would)."""
    preset = PRESETS["cpu-demo"]

    def acceptance(request_class: str, temperature: float) -> object:
        return preset.acceptance_for(GenerationRequest(
            "r", prompt="p", max_tokens=8, temperature=temperature,
            request_class=request_class))

    assert acceptance("sampled", 0.05) == preset.acceptance["low"]
    assert acceptance("greedy", 0.0) == preset.acceptance["high"]
    assert acceptance("default", 0.05) == preset.acceptance["high"]
    assert acceptance("default", 0.8) == preset.acceptance["low"]


def test_the_draft_model_preset_is_the_engine_and_the_app_as_measured() -> None:
    """Step times within 8% of the engine benchmark's draft-model rows, and the acceptance
    lengths the high phases showed over HTTP under each static tier within 2% (the requests'
    types weighted by the steps they take); a model drafter offers no per-request caps."""
    preset = PRESETS["cpu-demo-draft"]
    rows = json.loads((RESULTS / "engine_bench.json").read_text())["by_depth"]
    measured = [(r["concurrency"], r["depth"], r["median_step_ms"] / 1000) for r in rows
                if r["drafter"] == "draft_model"]
    assert len(measured) == 10
    for batch, depth, seconds in measured:
        assert preset.step_seconds(batch, depth) == pytest.approx(seconds, rel=0.08), \
            (batch, depth)
    http = json.loads((RESULTS / "transition_http_draft_model_stop48a.json").read_text())
    types = preset.acceptance["high"]
    for k in (1, 3, 7, 15):
        steps = sum(1 / (1 + t.mean_run(k)) for t in types)
        simulated = len(types) / steps
        over_http = http["modes"][f"static{k}"]["phase_accept_len"]["high_1"]
        assert simulated == pytest.approx(over_http, rel=0.02), k


def test_simulated_engines_cap_drafts_where_the_apps_adapter_would() -> None:
    """Per-request draft caps need vLLM's synchronous scheduler (the CPU) and a drafter whose
    proposals cost nothing: prompt lookup on the CPU preset has them; the draft model does
    not, nor does the H20 preset, a GPU (as `VllmEngine.applies_draft_caps` on CUDA)."""
    assert SimulatedEngine(PRESETS["cpu-demo"]).applies_draft_caps
    assert not SimulatedEngine(PRESETS["cpu-demo-draft"]).applies_draft_caps
    assert not SimulatedEngine(PRESETS["h20-llama8b-ngram"]).applies_draft_caps


def test_class_priors_bring_the_second_high_phase_up_at_once() -> None:
    """On the cpu-demo preset the low phases run K=0, where nothing is drafted: without the
    request classes' past acceptance `goodput` waits for a probe at the start of each high
    phase; with it (as a replica of the app has it), the second high phase's greedy requests
    are known from the first, and their class brings the replica up as they arrive. The first
    high phase, with nothing known yet, is the same either way."""
    phases = phases_for("transition", requests=16, concurrency=8)
    plain, primed = ({name: phase.tokens / phase.seconds for name, phase in asyncio.run(
        replay("goodput", "cpu-demo", phases, max_tokens=256, class_priors=priors)
    ).phases.items()} for priors in (False, True))
    assert primed["high_2"] > 1.05 * plain["high_2"]
    assert primed["high_1"] == pytest.approx(plain["high_1"], rel=0.01)


def test_step_jitter_spreads_step_times_and_leaves_the_acceptance_draws_alone() -> None:
    """A machine's step times scatter about the cost model's: with `step_jitter` each step's
    time is the model's times a mean-one log-normal factor, from a random stream of its own,
    so the same seed lands the same drafts with or without it."""
    preset = PRESETS["cpu-demo-draft"]

    def run(jitter: float) -> tuple[list[float], list[int]]:
        engine = SimulatedEngine(preset, kmax=7, max_num_seqs=8, max_model_len=8192,
                                 seed=(3, 1), step_jitter=jitter)
        asyncio.run(engine.set_k(3))
        for i in range(8):
            engine.submit(GenerationRequest(f"r{i}", prompt="p", max_tokens=4000,
                                            request_class="high", seed=i))
        engine.admit()
        seconds = [engine.step() for _ in range(400)]
        return seconds, [step.accepted_tokens for step in engine.drain_steps()]

    steady, landed = run(0.0)
    jittered, landed_jittered = run(0.3)
    assert landed_jittered == landed
    assert len(set(steady)) == 1  # the same batch and K: one modelled time
    ratios = np.log(np.array(jittered) / steady[0])
    assert ratios.std() == pytest.approx(0.3, rel=0.15)
    assert np.mean(jittered) == pytest.approx(steady[0], rel=0.05)


def test_replays_under_several_seeds_pool_into_one_rate_per_phase() -> None:
    """A phase's pooled rate is its tokens over its seconds summed across the seeds (a long
    replay's, not the mean of the rates); switches are averaged."""
    def result(tokens: int, seconds: float, switches: int) -> ModeResult:
        return ModeResult(phases={"low_1": PhaseResult(tokens, seconds, tokens)},
                          timeline=[(seconds, 1)], switches=switches)

    one, two = result(100, 1.0, 2), result(300, 1.0, 4)
    both = pooled([one, two])
    assert both.phases["low_1"].tokens / both.phases["low_1"].seconds == 200.0
    assert both.switches == 3 and both.timeline == one.timeline
    assert pooled([one]) is one
