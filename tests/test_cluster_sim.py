"""The cluster simulation on a small fleet (virtual time, a few seconds of wall time)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from itertools import pairwise

import pytest

from app.telemetry_hub import ClusterState
from bench.cluster.fleet import (
    MODES,
    PRESET,
    WARMUP_S,
    OracleK,
    build_fleet,
    exchange_telemetry,
    mixed_tokens_per_s,
    policy_for,
    simulate,
    summarise,
    tuned_batch_table,
)
from bench.cluster.load import Arrival, LoadShape, workload
from bench.cluster.report import gathering_bound, report, verdicts
from bench.cluster.runs import CAPACITY_RESOLUTION, Run, run_one, slo_capacity
from bench.policy_replay import CANDIDATES
from bench.report import RatioInterval
from policies.batch_table import BatchTablePolicy
from policies.class_acceptance import class_counts
from policies.registry import build_policy
from policies.signals import REQUEST_WINDOW, Signals
from replicas.engines.base import GenerationRequest
from replicas.engines.sim_engine import SimulatedEngine
from replicas.engines.sim_presets import PRESETS

REPLICAS, DURATION_S = 4, 6.0


@pytest.fixture(scope="module")
def arrivals():
    return workload(REPLICAS, DURATION_S, LoadShape(), seed=1)


@pytest.mark.parametrize("mode", ["static3", "goodput_local", "goodput_routed", "oracle_k"])
def test_every_request_is_served_and_counted(arrivals, mode):
    outcome = asyncio.run(simulate(mode, REPLICAS, arrivals, DURATION_S, 2.0, 0.02, seed=1))
    summary = summarise(outcome, REPLICAS)
    assert summary["requests"] == len(arrivals)
    assert outcome.tokens == sum(a.max_tokens for a in arrivals)
    # Goodput counts SLO-meeting requests wherever they finish (the run drains).
    assert summary["goodput"] <= outcome.tokens / DURATION_S
    assert 0 <= summary["slo_attainment"] <= 1
    assert (summary["goodput"] == outcome.tokens / DURATION_S) == \
        (summary["slo_attainment"] == 1)
    assert summary["p50_s"] <= summary["p99_s"]
    assert 1 / 3 <= summary["gathered"] <= 1  # three classes
    assert outcome.steady_switches <= outcome.switches
    if mode.startswith("static"):
        assert outcome.switches == 0


def test_steady_switches_leave_out_the_start_up_and_the_drain(arrivals):
    """Start-up moves (inside the warm-up) and the drain after the last arrival count in the
    whole run's switches, not in the steady window's."""
    short = [a for a in arrivals if a.at < WARMUP_S]
    outcome = asyncio.run(simulate("goodput_routed", REPLICAS, short, WARMUP_S, 2.0, 0.02,
                                   seed=1))
    assert outcome.switches > 0 and outcome.steady_switches == 0
    full = asyncio.run(simulate("goodput_routed", REPLICAS, arrivals, DURATION_S, 2.0, 0.02,
                                seed=1))
    assert 0 < full.steady_switches < full.switches
    summary = summarise(full, REPLICAS)
    assert summary["steady_switches_per_replica_hour"] == pytest.approx(
        full.steady_switches / (REPLICAS * (DURATION_S - WARMUP_S) / 3600))


def test_a_run_in_a_worker_process_gives_the_same_numbers_as_in_process(arrivals):
    """The benchmark runs modes in worker processes that build their own arrivals: the
    numbers must not depend on where a run ran."""
    run = Run("goodput_routed", REPLICAS, DURATION_S, LoadShape(), 1, 2.0, 0.02)
    with ProcessPoolExecutor(1) as pool:
        remote = next(pool.map(run_one, [run]))
    local = summarise(asyncio.run(simulate("goodput_routed", REPLICAS, arrivals, DURATION_S,
                                           2.0, 0.02, seed=1)), REPLICAS)
    assert {k: v for k, v in remote.items() if k != "wall_s"} == \
        {k: v for k, v in local.items() if k != "wall_s"}


def test_a_larger_switch_margin_switches_less(arrivals):
    def switches(margin: float | None) -> int:
        return asyncio.run(simulate("goodput_routed", REPLICAS, arrivals, DURATION_S, 2.0,
                                    0.02, seed=1, switch_margin=margin)).switches

    default, wide = switches(None), switches(1.0)
    assert default > 0 and wide < default


EMA_OVER_THE_TIERS = {"name": "ema", "concurrency_source": "local", "1": [1, 3, 7, 15]}


def test_a_defined_mode_runs_its_config_in_place_of_the_modes_own():
    """`--define`: SGLang's EMA over the pool's tiers in one slot (as SGLang's own benchmark
    ran it) under a new name, or in place of the `ema` row's default slots."""
    async def slots(mode: str, policy: dict | None) -> set[tuple[int, tuple[int, ...]]]:
        fleet = await build_fleet(mode, 2, seed=1, policy=policy)
        return {(bound, tuple(slot.candidates)) for r in fleet
                for bound, slot in r.loop.policy.slots.items()}

    assert asyncio.run(slots("ema", None)) == {(1, (1, 3, 7)), (8, (0, 1, 3)), (32, (0, 1)),
                                               (64, (0,))}  # SGLang's default, snapped
    for mode in ("ema", "ema_tiers"):
        assert asyncio.run(slots(mode, EMA_OVER_THE_TIERS)) == {(1, (1, 3, 7, 15))}


def test_a_defined_goodput_config_still_takes_the_runs_margin_and_bound():
    """The margin table and the TPOT-bound runs vary a setting of whatever `goodput` config
    the mode runs, its own or a defined one."""
    defined = {"name": "goodput", "switch_margin": 0.1, "min_dwell_steps": 4}
    config = policy_for("goodput_routed", switch_margin=0.3, tpot_bound_s=0.02,
                        defined=defined)
    assert config == {**defined, "switch_margin": 0.3, "tpot_slo_ms": pytest.approx(20)}
    assert policy_for("goodput_routed", defined=defined) == defined
    assert defined["switch_margin"] == 0.1  # the definition itself is left as given


def test_a_defined_mode_serves_every_request_as_a_local_mode(arrivals):
    outcome = asyncio.run(simulate("ema_tiers", REPLICAS, arrivals, DURATION_S, 2.0, 0.02,
                                   seed=1, policy=EMA_OVER_THE_TIERS))
    assert len(outcome.latencies) == len(arrivals)
    assert outcome.tokens == sum(a.max_tokens for a in arrivals)
    # Its own policy ran: at a full batch the default slots hold K=0, these never do.
    default = asyncio.run(simulate("ema", REPLICAS, arrivals, DURATION_S, 2.0, 0.02, seed=1))
    assert summarise(outcome, REPLICAS) != summarise(default, REPLICAS)


def test_the_goodput_modes_can_take_the_slos_bound_on_time_per_token(arrivals):
    assert "tpot_slo_ms" not in policy_for("goodput_local")
    assert policy_for("goodput_routed", tpot_bound_s=0.02)["tpot_slo_ms"] == pytest.approx(20)
    assert "tpot_slo_ms" not in policy_for("ema", tpot_bound_s=0.02)

    def run(tpot_bound: bool) -> dict:
        return summarise(asyncio.run(simulate("goodput_local", REPLICAS, arrivals, DURATION_S,
                                              2.0, 0.02, seed=1, tpot_bound=tpot_bound)),
                         REPLICAS)

    bounded, free = run(True), run(False)
    # The bound reached the replicas' policies: they chose other tiers (the requests that
    # meet the SLO may still be the same ones).
    assert (bounded["throughput"], bounded["switches_per_replica_hour"]) != \
        (free["throughput"], free["switches_per_replica_hour"])
    for summary in (bounded, free):  # a request over the TPOT bound misses the SLO
        # (shares of one count: equal when every miss is a TPOT miss, up to rounding)
        assert 0 <= summary["tpot_missed"] <= 1 - summary["slo_attainment"] + 1e-12


def test_capacity_is_the_most_load_that_meets_the_attainment_target():
    """The rate found meets the target, a clearly higher one does not, and a stricter target
    takes no more load."""
    run = Run("static3", REPLICAS, DURATION_S, LoadShape(), 1, 2.0, 0.02)

    def attainment(rate: float) -> float:
        return run_one(replace(run, shape=LoadShape(rate_per_replica=rate)))["slo_attainment"]

    found = slo_capacity(run, 0.9)
    rate = found["rate_per_replica"]
    assert rate > CAPACITY_RESOLUTION
    assert found["slo_attainment"] == attainment(rate) >= 0.9
    assert attainment(1.5 * rate) < 0.9
    assert found["offered_tok_s_per_replica"] == pytest.approx(sum(
        a.max_tokens for a in workload(REPLICAS, DURATION_S, LoadShape(rate_per_replica=rate),
                                       1)) / DURATION_S / REPLICAS)
    assert slo_capacity(run, 0.99)["rate_per_replica"] <= rate


def test_workload_is_bursty_and_skewed(arrivals):
    classes = [a.request_class for a in arrivals]
    shares = {c: classes.count(c) / len(classes) for c in set(classes)}
    assert len(shares) == 3 and max(shares.values()) > 0.4  # Zipf tenants skew the mix
    per_second = [sum(1 for a in arrivals if s <= a.at < s + 1) for s in range(int(DURATION_S))]
    assert max(per_second) > 2 * min(per_second)  # bursts


def test_gathering_classes_pays_only_for_a_mix():
    preset = PRESETS[PRESET]
    mixed, gathered = gathering_bound(preset, {"copy": 1.0, "code": 0.0, "chat": 0.0}, 32)
    assert gathered == pytest.approx(mixed)
    mixed, gathered = gathering_bound(preset, {"copy": 0.5, "code": 0.0, "chat": 0.5}, 32)
    assert gathered > 1.05 * mixed


def _engine_with(request_class: str, requests: int, max_num_seqs: int = 64):
    engine = SimulatedEngine(PRESETS[PRESET], kmax=15, max_num_seqs=max_num_seqs)
    for i in range(requests):
        engine.submit(GenerationRequest(request_id=f"r{i}", prompt="sim", max_tokens=64,
                                        request_class=request_class))
    return engine


def test_next_batch_acceptance_counts_what_the_next_step_runs():
    engine = _engine_with("high_2", 6, max_num_seqs=4)
    engine.admit()
    engine.submit(GenerationRequest(request_id="x", prompt="sim", max_tokens=64,
                                    request_class="low_1"))
    # Four running, the rest wait: the batch limit decides, not the queue.
    assert engine.next_batch_acceptance() == Counter({PRESETS[PRESET].acceptance["high_2"]: 4})


@pytest.mark.parametrize(("request_class", "requests", "expected_k"),
                         [("high_2", 4, 15), ("low_1", 64, 1)])
def test_oracle_picks_the_true_best_k(request_class, requests, expected_k):
    """A copy-like batch of 4 runs deepest; a chat-like batch of 64 at K=1 (the preset's
    verify cost grows with batch x K past its knee)."""
    engine = _engine_with(request_class, requests)
    oracle = OracleK(engine, CANDIDATES)
    signals = Signals(current_k=3, steps=1, running=0, waiting=requests)
    preset, acceptance = PRESETS[PRESET], PRESETS[PRESET].acceptance[request_class]
    rate = {k: (1 + acceptance.mean_run(k)) / preset.step_seconds(requests, k)
            for k in CANDIDATES}
    assert oracle.decide(signals).k == max(rate, key=rate.get) == expected_k


def test_oracle_scores_a_mixed_batch_by_its_steady_state():
    """Half copy-like, half chat-like at batch 16: the batch as it is would run K=15, but
    there the copy-like requests leave 4x sooner and chat-like ones fill the batch; the batch's
    steady state, with each class keeping its share of the tokens, is best at K=3."""
    engine = _engine_with("high_2", 8)
    for i in range(8):
        engine.submit(GenerationRequest(request_id=f"c{i}", prompt="sim", max_tokens=64,
                                        request_class="low_1"))
    signals = Signals(current_k=3, steps=1, running=0, waiting=16)
    assert OracleK(engine, CANDIDATES).decide(signals).k == 3


def test_engine_batch_slots_serve_every_token_and_classes_land_as_modelled():
    """The engine runs its batch as arrays: every request gets exactly its tokens, a slot an
    abort frees goes to a waiting request, and the per-request windows, counted per class as a
    replica counts them, show each class's acceptance."""
    engine = SimulatedEngine(PRESETS[PRESET], kmax=15, max_num_seqs=4, seed=3)
    asyncio.run(engine.set_k(3))
    lengths = {f"r{i}": 20 + 7 * i for i in range(8)}
    for i, (request_id, max_tokens) in enumerate(lengths.items()):
        engine.submit(GenerationRequest(request_id=request_id, prompt="sim",
                                        max_tokens=max_tokens,
                                        request_class="high_2" if i % 2 else "low_1"))
    engine.admit()
    asyncio.run(engine.abort("r0"))  # running: its slot goes to the first waiting request
    assert [e.request.request_id for e in engine.admit()] == ["r4"]
    class_of = {r: "copy" if i % 2 else "chat" for i, r in enumerate(lengths)}
    finished, generated = {}, 0
    landed, drafted = Counter(), Counter()
    while len(finished) < len(lengths) - 1:
        engine.admit()
        engine.step()
        generated += engine.drain_steps()[-1].generated_tokens
        finished.update((e.request.request_id, e.generated) for e in engine.just_finished)
        for request_class, (hits, tries) in class_counts(engine.request_acceptance(), class_of,
                                                         engine.kmax).items():
            assert tries[:3] == [tries[0]] * 3 and tries[3] == 0  # K=3
            assert hits[0] >= hits[1] >= hits[2], "a draft lands after its prefix"
            landed[request_class] += hits[0]
            drafted[request_class] += tries[0]
    assert finished == {r: n for r, n in lengths.items() if r != "r0"}
    assert generated == sum(finished.values())  # r0 left before any step ran
    assert landed["copy"] / drafted["copy"] > 0.95 > 0.7 > landed["chat"] / drafted["chat"] > 0.25


def test_engine_reports_each_running_requests_last_verify_outcomes():
    """Per-request windows, as vLLM's engine reports them: each step adds one outcome per
    running request (the drafts it accepted, at the K in force), at most REQUEST_WINDOW are
    kept, and a request that left takes its window with it (its slot starts a new one)."""
    engine = SimulatedEngine(PRESETS[PRESET], kmax=15, max_num_seqs=3)
    for i in range(3):  # long enough to outlast the test
        engine.submit(GenerationRequest(request_id=f"r{i}", prompt="sim", max_tokens=800,
                                        request_class="low_1"))
    engine.admit()
    records = []
    for step in range(REQUEST_WINDOW + 5):
        engine.k = (0, 1, 3, 7)[step % 4]
        engine.step()
        records += engine.drain_steps()
    windows = {w.request_id: w for w in engine.request_acceptance()}
    assert len(windows) == 3
    for window in windows.values():
        assert window.drafted == tuple(r.k for r in records[-REQUEST_WINDOW:])
        assert all(a <= d for a, d in zip(window.accepted, window.drafted, strict=True))
    for step, record in enumerate(records[-REQUEST_WINDOW:]):
        assert sum(w.accepted[step] for w in windows.values()) == record.accepted_tokens
    asyncio.run(engine.abort("r0"))
    engine.submit(GenerationRequest(request_id="new", prompt="sim", max_tokens=64,
                                    request_class="high_2"))
    engine.admit()
    engine.step()
    reported = engine.request_acceptance()
    windows = {w.request_id: w for w in reported}
    assert set(windows) == {"r1", "r2", "new"}
    assert len(windows["new"].accepted) == 1 and len(windows["r1"].accepted) == REQUEST_WINDOW
    # The reused slot's older columns (r0's outcomes in the ring) are reported as zeros.
    row = reported.request_ids.index("new")
    assert not reported.drafted[row, :-1].any() and not reported.accepted[row, :-1].any()


@pytest.mark.parametrize("mode", ["goodput_local", "goodput_cluster"])
def test_every_mode_prices_by_its_own_classes_and_only_cluster_modes_by_the_fleets(mode):
    """A replica measures its requests' classes hub or not, as the replica deployment does,
    so a local mode prices a request by what its class showed on this replica; only the
    cluster modes also learn what the class showed on the others."""
    fleet = asyncio.run(build_fleet(mode, 2, seed=1))
    for replica, request_class in zip(fleet, ("copy", "chat"), strict=True):
        replica.take(Arrival(0.0, request_class, 200), f"{request_class}-1", seed=1)
        for _ in range(6):
            replica.engine.admit()
            replica.engine.step()
    hub = ClusterState(stale_after_s=1.5)
    for now in (0.5, 1.0):  # the first replica pushes before the second's rates are in
        exchange_telemetry(fleet, hub, now, with_cluster=mode == "goodput_cluster")
    copy_replica = fleet[0]
    assert set(copy_replica.classes.own) == {"copy"}
    prior = copy_replica.class_prior()
    assert prior.class_of == {"copy-1": "copy"} and "copy" in prior.by_class
    # ... and that is what the replica's control loop prices by, in every mode
    assert copy_replica.loop._class_prior == copy_replica.class_prior
    if mode == "goodput_local":
        assert copy_replica.cluster is None and not copy_replica.classes.fleet
    else:
        assert copy_replica.cluster is not None
        assert set(copy_replica.classes.fleet) == {"copy", "chat"}


def test_vllms_batch_table_is_tuned_to_the_runs_class_mix_as_an_operator_would():
    """The vLLM baseline gets the best table its schema can hold here: at every batch size
    the K that makes the most tokens/s for the mix, in vLLM's contiguous [start, end, K]
    rows (valid for the policy as is)."""
    preset = PRESETS[PRESET]
    shares = {"copy": 0.6, "code": 0.3, "chat": 0.1}
    rows = tuned_batch_table(preset, shares, 64)
    assert rows[0][0] == 1 and rows[-1][1] == 64
    assert all(a[1] + 1 == b[0] and a[2] != b[2] for a, b in pairwise(rows))
    for start, end, k in rows:
        for batch in (start, end):
            assert k == max(CANDIDATES, key=lambda c: mixed_tokens_per_s(preset, shares, batch, c))
    assert rows[0][2] > rows[-1][2], "deep when the batch is small, shallower when it is full"
    config = policy_for("batch_table", batch_table=rows)
    assert config["num_speculative_tokens_per_batch_size"] == rows
    assert config["concurrency_source"] == "local"
    assert isinstance(build_policy(config, CANDIDATES), BatchTablePolicy)


def test_a_slo_no_mode_meets_gives_no_ratios_rather_than_no_results():
    """Under a strict `--slo-tpot` every mode can have 0 goodput: the verdicts and the report
    give n/a where the base is 0 (they divided by it and raised before the JSON was written)."""
    summary = {"goodput": 0.0, "slo_attainment": 0.0, "tpot_missed": 1.0, "throughput": 900.0,
               "p50_s": 1.0, "p99_s": 2.0, "switches_per_replica_hour": 10.0,
               "steady_switches_per_replica_hour": 5.0, "gathered": 0.5, "requests": 10,
               "wall_s": 0.1}
    modes = {mode: dict(summary) for mode in MODES}
    found = verdicts(modes)
    assert all(math.isnan(found[key]) for key in
               ("cluster_vs_best_local", "cluster_vs_best_static", "oracle_vs_best_local"))
    run = {"arrivals": 10, "duration_s": 10.0, "offered_tok_s_per_replica": 100.0,
           "token_shares": {"copy": 0.5, "code": 0.3, "chat": 0.2}, "modes": modes,
           "verdicts": found, "seed_verdicts": [found, found],
           "margins": {"0.3": dict(summary)},
           "tpot_bound": {m: dict(summary) for m in MODES if m.startswith("goodput")}}
    text = report({8: json.loads(json.dumps(run))})  # through JSON, as written

    def cells(table: str) -> list[str]:
        row = next(line for line in text.split(table)[1].splitlines()
                   if line.startswith("| 8 |"))
        return [cell.strip() for cell in row.strip("|").split("|")]

    assert cells("CLUSTER-AWARE VS LOCAL-ONLY").count("n/a") == 3
    assert cells("ACROSS BURST PATTERNS").count("n/a") == 4
    assert "| 8 | 0.3 | n/a | 1.000 |" in text
    assert RatioInterval.of([1.1, math.nan]) is None


@pytest.mark.parametrize(("flags", "reason"), [
    (["--replicas", "0"], "not a positive count"),
    (["--duration", "0"], "not a positive number of seconds"),
    (["--modes", "static1,nope"], "unknown modes nope"),
    (["--modes", "static1", "--define", 'x={"name": "ema"}'], "'x' is defined but not in"),
    (["--modes", "oracle_k", "--define", 'oracle_k={"name": "ema"}'], "is a reference"),
    (["--modes", "x", "--define", 'x={"name": "ema", "ema_alpha": 2}'], "invalid ema"),
    (["--json", "/no/such/dir/x.json"], "its directory /no/such/dir does not exist"),
])
def test_a_command_that_cannot_run_or_keep_its_results_is_refused_at_once(flags, reason):
    done = subprocess.run([sys.executable, "-m", "bench.cluster_sim", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and reason in done.stderr
