"""Cluster simulation: SIMULATOR engines behind the real router ranking and telemetry-hub logic.

    python -m bench.cluster_sim                      # 8, 64 and 512 replicas, every mode
    python -m bench.cluster_sim --replicas 64 --duration 20 --json out.json
    python -m bench.cluster_sim --replicas 64 --duration 30 --rate 10 --burst-factor 1 \
        --seeds 1 --margins "" --json s.json --markdown s.md --plot s.png   # stationary load

Each replica is a `SimulatedEngine` (cost model and synthetic acceptance, not a model) with the
real `TierPool`, `ControlLoop` and policy. The router ranks with `app.router.rank_replicas`
(class gathering) from its in-flight counts per class, as the Serve router does; the hub is
`app.telemetry_hub.ClusterState`, exchanged with every replica each telemetry period. A
discrete-event loop in virtual time drives them all, so no Ray or HTTP is needed and a run
takes seconds.

The load is bursty and skewed: tenants with Zipf popularity, each sending one request class
(copy-heavy, code-like or chat-like acceptance); every few seconds a burst multiplies the rate
and comes mostly from one tenant. Modes:

| mode | policy | concurrency seen | cluster prior | routing |
|---|---|---|---|---|
| static1..static15 | static K | - | no | power of two choices (Ray Serve's default) |
| batch_table | vLLM's table | local batch | no | power of two choices |
| ema | SGLang's EMA | local batch | no | power of two choices |
| goodput_local | goodput | local batch | no | power of two choices |
| goodput_cluster | goodput | effective (cluster) | yes | power of two choices |
| goodput_routed | goodput | effective (cluster) | yes | class-gathering (`rank_replicas`) |
| oracle_k | best K from exact acceptance (a reference) | exact | - | power of two choices |

`oracle_k` is a SIMULATOR-only reference: each decision it knows every queued request's true
acceptance model and the true step cost, which no engine knows, and scores K as `goodput` does
(the batch's steady state), without margin or dwell. It is not a strict bound (it decides per
step, blind to the queue's future), but it shows what exact acceptance adds to the choice of K
under this load with Ray Serve's routing: about what a cluster view could add to it (routing
can add more: see the gathering bound).

Reported per mode: goodput (tokens of the requests that met the latency SLO, per second of
arrivals; the run drains, so a request counts wherever it finishes), the share of requests that
met the SLO, throughput while arrivals last, p50/p99 request latency, and tier switches per
replica-hour: over the whole run, and in the steady window (after `WARMUP_S`, until arrivals
end). The whole run's count is mostly two one-off transients a fleet in service does not repeat
each hour: every replica's first moves from its starting tier, and the walk back up the tiers
as the queues drain after the last arrival. The steady window is what a long-running fleet
would see. At the smaller fleets the goodput modes run again told the SLO's bound on time per
output token (`tpot_slo_ms`), against themselves without it.

Goodput at one offered load separates the modes only where some of them miss the SLO, and
near overload a small difference in throughput becomes a large one in goodput. So at one
fleet size (`--capacity-at`) each mode's capacity at the SLO is also found: the most
requests a second per replica, the burst pattern scaled, at which 90% of requests meet it
(DistServe's definition of goodput; `slo_capacity`).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import os
import random
import statistics
import time
from collections import Counter
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.router import RecentByClass, ReplicaLoad, pick_warm, rank_replicas, sample_candidates
from app.telemetry_hub import ClusterState
from bench.policy_replay import CANDIDATES
from bench.policy_replay import policy_config as replay_policy_config
from bench.report import print_table
from policies.class_acceptance import ClassAcceptance, ClassPrior, class_counts
from policies.goodput import GoodputConfig
from policies.registry import build_policy
from policies.signals import ClusterView, Decision, Signals
from replicas.control_loop import ControlLoop
from replicas.engines.base import GenerationRequest, add_per_position, period_windows
from replicas.engines.sim_engine import SimulatedEngine
from replicas.engines.sim_presets import PRESETS, SimPreset
from replicas.tier_pool import TierPool

PRESET = "h20-llama8b-ngram"
# Request classes and the preset acceptance they draw from (see sim_presets).
CLASSES = {"copy": "high_2", "code": "low_2", "chat": "low_1"}
STATIC = ("static1", "static3", "static7", "static15")
LOCAL = ("batch_table", "ema", "goodput_local")
CLUSTER = ("goodput_cluster", "goodput_routed")
ORACLE = "oracle_k"
MODES = (*STATIC, *LOCAL, *CLUSTER, ORACLE)
TELEMETRY_PERIOD_S = 0.5  # as the replica deployment's hub exchange
# The capacity search: rates found to this many requests/s per replica, from the load's own
# rate, stepped by this factor until the attainment target is bracketed.
CAPACITY_RESOLUTION = 0.05
CAPACITY_STEP = 1.25
# Switches before this are start-up moves (every mode starts on one tier; `ema`'s slots
# leave their warm-up batches and first updates within it), not the steady rate.
WARMUP_S = 3.0


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


@dataclass
class Tracked:
    arrival: Arrival
    entry: Any
    first_token_at: float | None = None


@dataclass(eq=False)  # identity: routers look replicas up in candidate lists
class SimReplica:
    replica_id: str
    engine: SimulatedEngine
    pool: TierPool
    loop: ControlLoop = field(init=False)
    busy: bool = False
    in_flight: dict[str, Tracked] = field(default_factory=dict)
    """By request id."""
    in_flight_classes: Counter[str] = field(default_factory=Counter)
    in_flight_class: dict[str, str] = field(default_factory=dict)
    """Request id -> class, kept with `in_flight`: a decision reads it for the running rows."""
    class_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens asked of this replica, per request class."""
    classes: ClassAcceptance = field(default_factory=ClassAcceptance)
    learns_classes: bool = False
    """Whether its per-class acceptance is kept (only modes with the cluster view read it)."""
    window_accepted: list[int] = field(default_factory=lambda: [0] * max(CANDIDATES))
    window_drafted: list[int] = field(default_factory=lambda: [0] * max(CANDIDATES))
    cluster: Any = None

    def class_prior(self) -> ClassPrior:
        """As the replica deployment: what its requests' classes showed before."""
        return self.classes.prior(self.in_flight_classes, self.in_flight_class)

    @property
    def load(self) -> int:
        return len(self.in_flight)

    def telemetry(self) -> dict[str, Any]:
        """The period's push to the hub; also refreshes the per-class acceptance (the
        replica's class prior, and the fleet's through the hub) and starts new windows."""
        counters = self.engine.counters()
        stats = {"running": counters.running, "waiting": counters.waiting,
                 "ongoing": self.load, "active_k": self.pool.active_k,
                 "window_accepted": self.window_accepted, "window_drafted": self.window_drafted,
                 "class_acceptance": dict(self.classes.own),
                 "class_fresh": self.classes.own_fresh}
        self.window_accepted = [0] * max(CANDIDATES)
        self.window_drafted = [0] * max(CANDIDATES)
        if self.learns_classes:  # as the replica deployment: from its requests' windows
            self.classes.observe(class_counts(
                *period_windows(self.engine, self.in_flight_class), self.engine.kmax))
        return stats


@dataclass
class ModeOutcome:
    window_s: float = 0.0
    window_tokens: int = 0
    """Tokens generated while arrivals lasted: under overload, the fleet's capacity."""
    tokens: int = 0
    slo_tokens: int = 0
    """Tokens of requests that met the SLO, wherever they finished (the run drains)."""
    slo_requests: int = 0
    tpot_missed: int = 0
    """Requests over the SLO's time per output token (whatever their time to first token)."""
    latencies: list[float] = field(default_factory=list)
    switches: int = 0
    steady_switches: int = 0
    """Switches from `WARMUP_S` until arrivals end."""
    gathered: float = 0.0
    """Token-weighted share of each replica's work that is its main request class: about the
    main class's token share when classes mix at random, 1 when each replica serves one."""
    end_s: float = 0.0
    wall_s: float = 0.0

    def finish(self, tracked: Tracked, now: float, slo_ttft_s: float, slo_tpot_s: float
               ) -> None:
        tokens = tracked.entry.generated
        self.latencies.append(now - tracked.arrival.at)
        self.tokens += tokens
        ttft = tracked.first_token_at - tracked.arrival.at
        tpot = (now - tracked.first_token_at) / max(1, tokens - 1)
        self.tpot_missed += tpot > slo_tpot_s
        if ttft <= slo_ttft_s and tpot <= slo_tpot_s:
            self.slo_tokens += tokens
            self.slo_requests += 1


class OracleK:
    """The K that maximises tokens/s, from the true acceptance of each request the next step
    will run and the true step cost (see `ORACLE`); no margin, no dwell. Tokens per step are
    the batch's steady state at K, as `policies.acceptance.steady_lengths` estimates it: each
    class keeps its share of the tokens (its share now, at the current K), so the batch makes
    1 / sum_c (w_c / L_c(K)) tokens per sequence-step. The batch as it is now would overstate
    a deep K for a mix: its copy-like requests leave sooner and the others take their slots.
    The shares are read off the batch, as the policy reads them, so right after a switch they
    still describe the previous K's mix (exact acceptance, not exact shares)."""

    name = ORACLE
    reads_requests = False
    decides_on_arrival = False

    def __init__(self, engine: SimulatedEngine, candidates: tuple[int, ...]):
        self.engine = engine
        self.candidates = candidates

    def decide(self, signals: Signals) -> Decision:
        batch = self.engine.next_batch_acceptance()
        size = sum(batch.values())
        if not size:
            return Decision(signals.current_k, "idle")

        now = {acceptance: n * (1 + acceptance.mean_run(signals.current_k))
               for acceptance, n in batch.items()}
        total = sum(now.values())

        def tokens_per_second(k: int) -> float:
            per_sequence_step = total / sum(tokens / (1 + acceptance.mean_run(k))
                                            for acceptance, tokens in now.items())
            return size * per_sequence_step / self.engine.preset.step_seconds(size, k)

        return Decision(max(self.candidates, key=tokens_per_second), "oracle")


def policy_for(mode: str, switch_margin: float | None = None,
               tpot_bound_s: float | None = None) -> dict[str, Any]:
    if mode.startswith("goodput"):
        config = replay_policy_config("goodput", PRESET)
        config["concurrency_source"] = "local" if mode == "goodput_local" else "effective"
        if switch_margin is not None:
            config["switch_margin"] = switch_margin
        if tpot_bound_s is not None:  # the operator's SLO, as `tpot_slo_ms` in a config
            config["tpot_slo_ms"] = 1000 * tpot_bound_s
        return config
    config = replay_policy_config(mode, PRESET)
    if mode in ("batch_table", "ema"):
        config["concurrency_source"] = "local"  # the engine's batch, as vLLM and SGLang do
    return config


async def simulate(mode: str, replicas: int, arrivals: list[Arrival], duration_s: float,
                   slo_ttft_s: float, slo_tpot_s: float, seed: int,
                   switch_margin: float | None = None, tpot_bound: bool = False
                   ) -> ModeOutcome:
    started = time.perf_counter()
    # Acceptance models named by request class: each request carries its class into the
    # engine, as the ingress's do in the app, and the engine's records of finished requests
    # name the classes the replicas learn.
    preset = replace(PRESETS[PRESET], acceptance={
        name: PRESETS[PRESET].acceptance[model] for name, model in CLASSES.items()})
    uses_cluster, gathering = mode in CLUSTER, mode == "goodput_routed"
    fleet = []
    for i in range(replicas):
        engine = SimulatedEngine(preset, kmax=max(CANDIDATES), max_num_seqs=64, seed=(seed, i))
        # Static modes start on their tier; adaptive ones on K=3, as the replay does.
        pool = TierPool(engine, CANDIDATES, initial_k=int(mode[6:]) if mode in STATIC else 3)
        await pool.apply_initial()
        replica = SimReplica(f"r{i}", engine, pool, learns_classes=uses_cluster)
        policy = OracleK(engine, CANDIDATES) if mode == ORACLE else \
            build_policy(policy_for(mode, switch_margin, slo_tpot_s if tpot_bound else None),
                         CANDIDATES)
        replica.loop = ControlLoop(
            engine, pool, policy,
            max_batch=engine.max_num_seqs,
            class_prior=replica.class_prior if uses_cluster else None)
        fleet.append(replica)
    hub = ClusterState(stale_after_s=3 * TELEMETRY_PERIOD_S)
    recent_by_class = RecentByClass()
    rng = random.Random(seed)
    outcome, serial = ModeOutcome(window_s=duration_s), 0
    events: list[tuple[float, int, str, int]] = [(a.at, i, "arrive", i)
                                                 for i, a in enumerate(arrivals)]
    heapq.heapify(events)
    order = len(arrivals)

    def schedule(at: float, kind: str, index: int) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, index))

    def start_step(index: int, now: float) -> None:
        replica = fleet[index]
        admitted = replica.engine.admit()
        replica.busy = True
        ends = now + replica.engine.step()
        for entry in admitted:  # every step gives each request at least one token
            replica.in_flight[entry.request.request_id].first_token_at = ends
        schedule(ends, "step", index)

    arrivals_left = len(arrivals)
    schedule(TELEMETRY_PERIOD_S, "hub", 0)
    while events:
        now, _, kind, index = heapq.heappop(events)
        if kind == "arrive":
            arrivals_left -= 1
            arrival = arrivals[index]
            if gathering:
                # As the Serve router: sampled candidates plus where the class went last.
                recent = [fleet[int(r[1:])] for r in recent_by_class.get(arrival.request_class)]
                candidates = sample_candidates(fleet, rng, recent)
                loads = [ReplicaLoad(r.replica_id, r.load,
                                     r.in_flight_classes[arrival.request_class])
                         for r in candidates]
                pick = pick_warm(rank_replicas(loads)[0], recent_by_class.last_class,
                                 arrival.request_class, rng)
                recent_by_class.record(arrival.request_class, pick)
                target = int(pick[1:])
            else:  # Ray Serve's default: the less loaded of two random replicas
                a, b = rng.randrange(replicas), rng.randrange(replicas)
                target = a if fleet[a].load <= fleet[b].load else b
            replica = fleet[target]
            serial += 1
            entry = replica.engine.submit(GenerationRequest(
                request_id=f"q{serial}", prompt="sim", max_tokens=arrival.max_tokens,
                request_class=arrival.request_class, seed=serial))
            replica.in_flight[entry.request.request_id] = Tracked(arrival, entry)
            replica.in_flight_classes[arrival.request_class] += 1
            replica.in_flight_class[entry.request.request_id] = arrival.request_class
            replica.class_tokens[arrival.request_class] = \
                replica.class_tokens.get(arrival.request_class, 0) + arrival.max_tokens
            if not replica.busy:
                start_step(target, now)
        elif kind == "step":
            replica = fleet[index]
            replica.busy = False
            for entry in replica.engine.just_finished:
                tracked = replica.in_flight.pop(entry.request.request_id)
                replica.in_flight_classes[tracked.arrival.request_class] -= 1
                del replica.in_flight_class[entry.request.request_id]
                outcome.finish(tracked, now, slo_ttft_s, slo_tpot_s)
            steps, _, change = await replica.loop.tick(replica.cluster if uses_cluster
                                                       else None)
            if change and WARMUP_S <= now < duration_s:
                outcome.steady_switches += 1
            for step in steps:  # counted when the step ends, as a replica learns of it
                if now <= duration_s:
                    outcome.window_tokens += step.generated_tokens
                add_per_position(replica.window_accepted, step.accepted_per_pos)
                add_per_position(replica.window_drafted, step.drafted_per_pos)
            outcome.end_s = now
            if replica.in_flight:
                start_step(index, now)
        else:  # the telemetry period: every replica pushes and reads its cluster view
            for replica in fleet:
                view = hub.push(replica.replica_id, replica.telemetry(), now=now)
                replica.cluster = ClusterView.from_hub(view)
                replica.classes.fleet = view["class_acceptance"]
                replica.classes.fleet_fresh = view["class_fresh"]
            if arrivals_left or any(r.in_flight for r in fleet):
                schedule(now + TELEMETRY_PERIOD_S, "hub", 0)
    outcome.switches = sum(r.pool.switch_count for r in fleet)
    outcome.gathered = sum(max(r.class_tokens.values(), default=0) for r in fleet) / \
        sum(sum(r.class_tokens.values()) for r in fleet)
    outcome.wall_s = time.perf_counter() - started
    return outcome


def summarise(outcome: ModeOutcome, replicas: int) -> dict[str, Any]:
    latencies = sorted(outcome.latencies)
    replica_hours = replicas * outcome.end_s / 3600
    return {"goodput": outcome.slo_tokens / outcome.window_s,
            "slo_attainment": outcome.slo_requests / max(1, len(latencies)),
            "tpot_missed": outcome.tpot_missed / max(1, len(latencies)),
            "throughput": outcome.window_tokens / outcome.window_s,
            "p50_s": statistics.median(latencies),
            "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "switches_per_replica_hour": outcome.switches / replica_hours,
            "steady_switches_per_replica_hour": outcome.steady_switches /
            (replicas * max(1e-9, outcome.window_s - WARMUP_S) / 3600),
            "gathered": outcome.gathered, "requests": len(latencies),
            "simulated_s": outcome.end_s, "wall_s": outcome.wall_s}


def verdicts(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    best_static = max(STATIC, key=lambda m: modes[m]["goodput"])
    best_local = max(LOCAL, key=lambda m: modes[m]["goodput"])
    best_cluster = max(CLUSTER, key=lambda m: modes[m]["goodput"])
    return {"best_static": best_static, "best_local": best_local, "best_cluster": best_cluster,
            "cluster_vs_best_local": modes[best_cluster]["goodput"] /
            modes[best_local]["goodput"],
            "cluster_vs_best_static": modes[best_cluster]["goodput"] /
            modes[best_static]["goodput"],
            "ema_switches_vs_cluster": switch_ratio(modes["ema"], modes[best_cluster]),
            "ema_steady_switches_vs_cluster": switch_ratio(modes["ema"], modes[best_cluster],
                                                           "steady_"),
            "oracle_vs_best_local": modes[ORACLE]["goodput"] / modes[best_local]["goodput"]}


def switch_ratio(ema: dict[str, Any], other: dict[str, Any], window: str = "") -> float:
    """How many times as often `ema` switches as `other` (`window`: "" for the whole run,
    "steady_" for the steady window); inf when `other` never switches."""
    key = f"{window}switches_per_replica_hour"
    return ema[key] / other[key] if other[key] else float("inf")


def gathering_bound(preset: SimPreset, shares: dict[str, float], batch: int
                    ) -> tuple[float, float]:
    """Tokens/s of one replica at `batch` for this class mix (token shares): every replica
    serving the mix at its best single K, against replicas that each serve one class at that
    class's best K (as many replicas per class as its work needs). It bounds what gathering
    similar requests can give in this cost model. A class that needs more steps per token
    holds more of a mixed batch's slots, so a mixed replica makes
    B / (t(B, K) * sum_c share_c / length_c(K)) tokens per second."""
    def length(request_class: str, k: int) -> float:
        return 1 + preset.acceptance[CLASSES[request_class]].mean_run(k)

    mixed = max(batch / (preset.step_seconds(batch, k) *
                         sum(share / length(c, k) for c, share in shares.items()))
                for k in CANDIDATES)
    gathered = 1 / sum(share * min(preset.step_seconds(batch, k) / (batch * length(c, k))
                                   for k in CANDIDATES) for c, share in shares.items())
    return mixed, gathered


def offered_tok_s_per_replica(arrivals: list[Arrival], duration_s: float, replicas: int
                              ) -> float:
    return sum(a.max_tokens for a in arrivals) / duration_s / replicas


def token_shares(arrivals: list[Arrival]) -> dict[str, float]:
    total = sum(a.max_tokens for a in arrivals)
    return {c: sum(a.max_tokens for a in arrivals if a.request_class == c) / total
            for c in CLASSES}


def report(runs: dict[int, dict[str, Any]]) -> str:
    parts = []
    for replicas, run in runs.items():
        modes = run["modes"]
        rows = [[m, f"{r['goodput']:.0f}", f"{r['slo_attainment']:.1%}",
                 f"{r['throughput']:.0f}", f"{r['p50_s']:.2f}",
                 f"{r['p99_s']:.2f}", f"{r['switches_per_replica_hour']:.0f}",
                 f"{r['steady_switches_per_replica_hour']:.0f}",
                 f"{r['gathered']:.2f}", r["requests"], f"{r['wall_s']:.1f}"]
                for m, r in modes.items()]
        parts.append(print_table(
            f"{replicas} REPLICAS (SIMULATOR, {run['arrivals']} requests, "
            f"{run['duration_s']:.0f} s of arrivals, offered "
            f"{run['offered_tok_s_per_replica']:.0f} tok/s per replica)",
            ["mode", "goodput tok/s", "SLO met", "throughput tok/s", "p50 s", "p99 s",
             "switches / replica-hour", "steady switches / replica-hour", "gathered",
             "requests", "wall s"], rows))
    verdict_columns = ["best static", "best local", "best cluster-aware",
                       "cluster / best local", "cluster / best static",
                       "ema switches / cluster's", "the same, steady window",
                       "oracle K / best local"]

    def verdict_cells(modes: dict[str, dict[str, Any]], v: dict[str, Any]) -> list[str]:
        return [*(f"{v[key]} ({modes[v[key]]['slo_attainment']:.1%} SLO)"
                  for key in ("best_static", "best_local", "best_cluster")),
                f"{v['cluster_vs_best_local']:.3f}", f"{v['cluster_vs_best_static']:.3f}",
                f"{v['ema_switches_vs_cluster']:.1f}x",
                f"{v['ema_steady_switches_vs_cluster']:.1f}x",
                f"{v['oracle_vs_best_local']:.3f}"]

    parts.append(print_table(
        "CLUSTER-AWARE VS LOCAL-ONLY (goodput ratios)", ["replicas", *verdict_columns],
        [[n, *verdict_cells(run["modes"], run["verdicts"])] for n, run in runs.items()]))
    longer = {n: r["longer"] for n, r in runs.items() if "longer" in r}
    if longer:
        parts.append(print_table(
            "THE SAME OVER A LONGER RUN (first seed; the default run ends before the overload "
            "shows)", ["replicas", "s of arrivals", *verdict_columns],
            [[n, f"{run['duration_s']:.0f}", *verdict_cells(run["modes"], run["verdicts"])]
             for n, run in longer.items()]))
    spread = [(n, r["duration_s"], r["seed_verdicts"])
              for n, r in [*runs.items(), *longer.items()] if "seed_verdicts" in r]
    if spread:
        def summary(values: list[float]) -> str:
            return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

        parts.append(print_table(
            "THE SAME ACROSS BURST PATTERNS (seeds; median, min-max)",
            ["replicas", "s of arrivals", "seeds", "cluster / best local",
             "cluster / best static", "ema switches / cluster's", "the same, steady window",
             "oracle K / best local"],
            [[n, f"{duration:.0f}", len(vs), summary([v["cluster_vs_best_local"] for v in vs]),
              summary([v["cluster_vs_best_static"] for v in vs]),
              summary([v["ema_switches_vs_cluster"] for v in vs]),
              summary([v["ema_steady_switches_vs_cluster"] for v in vs]),
              summary([v["oracle_vs_best_local"] for v in vs])] for n, duration, vs in spread]))
    margins = {n: r for n, r in runs.items() if "margins" in r}
    if margins:
        default = GoodputConfig.model_fields["switch_margin"].default
        rows = []
        for n, run in margins.items():
            base, ema = run["modes"]["goodput_routed"], run["modes"]["ema"]
            for margin, r in {f"{default} (default)": base, **run["margins"]}.items():
                rows.append([n, margin, f"{r['goodput'] / base['goodput']:.3f}",
                             f"{r['throughput'] / base['throughput']:.3f}",
                             f"{r['slo_attainment']:.1%}",
                             f"{r['switches_per_replica_hour']:.0f}",
                             f"{r['steady_switches_per_replica_hour']:.0f}",
                             f"{switch_ratio(ema, r):.1f}x",
                             f"{switch_ratio(ema, r, 'steady_'):.1f}x"])
        parts.append(print_table(
            "FEWER SWITCHES FOR A LARGER SWITCH MARGIN (goodput_routed, first seed)",
            ["replicas", "switch margin", "goodput / default's", "throughput / default's",
             "SLO met", "switches / replica-hour", "steady switches / replica-hour",
             "ema switches / these", "the same, steady window"], rows))
    bounded = {n: r for n, r in runs.items() if "tpot_bound" in r}
    if bounded:
        rows = []
        for n, run in bounded.items():
            best_local = run["verdicts"]["best_local"]
            for mode, r in run["tpot_bound"].items():
                base = run["modes"][mode]
                rows.append([n, mode, f"{r['goodput'] / base['goodput']:.3f}",
                             f"{r['throughput'] / base['throughput']:.3f}",
                             f"{base['slo_attainment']:.1%} -> {r['slo_attainment']:.1%}",
                             f"{base['tpot_missed']:.1%} -> {r['tpot_missed']:.1%}",
                             f"{base['switches_per_replica_hour']:.0f} -> "
                             f"{r['switches_per_replica_hour']:.0f}",
                             f"{base['steady_switches_per_replica_hour']:.0f} -> "
                             f"{r['steady_switches_per_replica_hour']:.0f}",
                             f"{r['goodput'] / run['modes'][best_local]['goodput']:.3f}"])
        parts.append(print_table(
            "WITH THE SLO'S BOUND ON TIME PER TOKEN (`tpot_slo_ms`; first seed; vs the same "
            "mode without)",
            ["replicas", "mode", "goodput / without", "throughput / without", "SLO met",
             "over the TPOT bound",
             "switches / replica-hour", "steady switches / replica-hour",
             "goodput / best local-only without"], rows))
    for n, run in runs.items():
        if "capacity" in run:
            parts.append(capacity_table(n, run["capacity"]))
    shares = next(iter(runs.values()))["token_shares"]
    bounds = {b: gathering_bound(PRESETS[PRESET], shares, b) for b in (16, 32, 64)}
    parts.append(print_table(
        "WHAT GATHERING CLASSES CAN GIVE AT MOST (cost model, tok/s per replica; token shares "
        + ", ".join(f"{c} {s:.0%}" for c, s in shares.items()) + ")",
        ["batch", "mixed, best single K", "one class per replica, its best K", "ratio"],
        [[b, f"{mixed:.0f}", f"{gathered:.0f}", f"{gathered / mixed:.3f}"]
         for b, (mixed, gathered) in bounds.items()]))
    return "\n\n".join(parts)


def capacity_table(replicas: int, capacity: dict[str, Any]) -> str:
    modes = capacity["modes"]
    best_static = max(modes[m]["rate_per_replica"] for m in STATIC)
    best_local = max(modes[m]["rate_per_replica"] for m in LOCAL)

    def ratio(rate: float, best: float) -> str:
        return f"{rate / best:.3f}" if best else "-"

    rows = [[m, f"{r['rate_per_replica']:.2f}", f"{r['offered_tok_s_per_replica']:.0f}",
             f"{r['slo_attainment']:.1%}", ratio(r["rate_per_replica"], best_local),
             ratio(r["rate_per_replica"], best_static), r["simulations"]]
            for m, r in modes.items()]
    return print_table(
        f"CAPACITY AT THE SLO ({replicas} replicas, {capacity['duration_s']:.0f} s of "
        f"arrivals, first seed: the most requests/s per replica, this burst pattern scaled, "
        f"at which {capacity['attainment']:.0%} of requests meet the SLO; to "
        f"{CAPACITY_RESOLUTION} requests/s)",
        ["mode", "requests/s per replica", "offered tok/s per replica", "SLO met there",
         "/ best local-only", "/ best static", "simulations"], rows)


def plot(runs: dict[int, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capacity = next(((n, r["capacity"]) for n, r in runs.items() if "capacity" in r), None)
    fig, axes = plt.subplots(1, 3 if capacity else 2, figsize=(18 if capacity else 12, 4.5))
    ax_g, ax_s = axes[:2]
    scales = list(runs)
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        xs = [j + i * width for j in range(len(scales))]
        ax_g.bar(xs, [runs[n]["modes"][mode]["goodput"] / n for n in scales], width, label=mode)
        ax_s.bar(xs, [runs[n]["modes"][mode]["steady_switches_per_replica_hour"]
                      for n in scales],
                 width, label=mode)
    for ax, title in ((ax_g, "goodput per replica (tok/s, SLO met)"),
                      (ax_s, "tier switches per replica-hour (steady window)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(scales))],
                      [f"{n} replicas" for n in scales])
        ax.set_title(title)
    ax_s.set_yscale("symlog")
    if capacity:
        n, found = capacity
        for i, mode in enumerate(MODES):
            axes[2].bar(i, found["modes"][mode]["rate_per_replica"], color=f"C{i}")
        axes[2].set_xticks([])
        axes[2].set_title(f"capacity at the SLO, {n} replicas (requests/s per replica at "
                          f"which {found['attainment']:.0%} meet it)", fontsize=9)
    handles, labels = ax_g.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(MODES), fontsize=7)
    fig.suptitle("Cluster simulation (SIMULATOR engines, real router ranking and hub logic)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)


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


def run_one(run: Run) -> dict[str, Any]:
    arrivals = workload(run.replicas, run.duration_s, run.shape, run.seed)
    outcome = asyncio.run(simulate(run.mode, run.replicas, arrivals, run.duration_s,
                                   run.slo_ttft_s, run.slo_tpot_s, run.seed, run.switch_margin,
                                   run.tpot_bound))
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


def submit(pool: Executor, args: argparse.Namespace, shape: LoadShape, replicas: int,
           modes: list[str], seed: int, duration_s: float,
           switch_margin: float | None = None, tpot_bound: bool = False
           ) -> dict[str, Future]:
    """Queue one simulation per mode; their summaries come back as the futures complete."""
    return {mode: pool.submit(run_one, Run(mode, replicas, duration_s, shape, seed,
                                           args.slo_ttft, args.slo_tpot, switch_margin,
                                           tpot_bound))
            for mode in modes}


def run_all(pool: Executor, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Every table's simulations, fleet by fleet; a fleet's all go to the pool at once (its
    modes, the other seeds, the longer run and the margins)."""
    modes = args.modes.split(",")
    shape = LoadShape(rate_per_replica=args.rate, burst_factor=args.burst_factor)
    runs: dict[int, dict[str, Any]] = {}
    for replicas in args.replicas:
        duration = args.duration or max(10.0, 480 / replicas)
        every_mode = set(MODES) <= set(modes)  # the verdict tables need them all
        with_extras = every_mode and replicas <= args.seeds_up_to
        run_longer = every_mode and args.longer > duration
        other_seeds = range(args.seed + 1, args.seed + args.seeds) if with_extras else ()
        default = submit(pool, args, shape, replicas, modes, args.seed, duration)
        seeds = [submit(pool, args, shape, replicas, modes, seed, duration) for seed in other_seeds]
        longer, longer_seeds = {}, []
        if run_longer:
            longer = submit(pool, args, shape, replicas, modes, args.seed, args.longer)
            longer_seeds = [submit(pool, args, shape, replicas, modes, seed, args.longer)
                            for seed in other_seeds]
        margins = {}
        if with_extras and args.margins:
            margins = {margin: submit(pool, args, shape, replicas, ["goodput_routed"], args.seed,
                                      duration, float(margin))
                       for margin in args.margins.split(",")}
        capacity = {mode: pool.submit(slo_capacity, Run(
            mode, replicas, args.capacity_duration, shape, args.seed, args.slo_ttft,
            args.slo_tpot), args.capacity_attainment)
            for mode in MODES} if every_mode and replicas == args.capacity_at else {}
        # The goodput modes again, told the SLO's bound on time per token (`tpot_slo_ms`).
        bounded = submit(pool, args, shape, replicas, [m for m in MODES if m.startswith(
            "goodput")], args.seed, duration, tpot_bound=True) if with_extras else {}
        results = {}
        for mode, future in default.items():
            results[mode] = result = future.result()
            print(f"{replicas:4d} replicas {mode:16s} goodput {result['goodput']:9.0f} "
                  f"tok/s  wall {result['wall_s']:5.1f} s", flush=True)
        arrivals = workload(replicas, duration, shape, args.seed)
        runs[replicas] = run = {
            "arrivals": len(arrivals), "duration_s": duration,
            "offered_tok_s_per_replica": offered_tok_s_per_replica(arrivals, duration,
                                                                   replicas),
            "token_shares": token_shares(arrivals), "modes": results}
        if not every_mode:
            continue
        run["verdicts"] = verdicts(results)
        if seeds:
            run["seed_verdicts"] = [run["verdicts"]] + [verdicts(collect(f)) for f in seeds]
        if longer:
            longer_results = collect(longer)
            run["longer"] = {"duration_s": args.longer, "modes": longer_results,
                             "verdicts": verdicts(longer_results)}
            if longer_seeds:
                run["longer"]["seed_verdicts"] = [run["longer"]["verdicts"]] + [
                    verdicts(collect(f)) for f in longer_seeds]
        if margins:
            run["margins"] = {margin: collect(f)["goodput_routed"]
                              for margin, f in margins.items()}
        if bounded:
            run["tpot_bound"] = collect(bounded)
        if capacity:
            run["capacity"] = {"duration_s": args.capacity_duration,
                               "attainment": args.capacity_attainment,
                               "modes": collect(capacity)}
    return runs


def collect(futures: dict[str, Future]) -> dict[str, dict[str, Any]]:
    return {mode: future.result() for mode, future in futures.items()}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--duration", type=float, default=None,
                        help="simulated seconds of arrivals (default: 480 / replicas, at "
                             "least 10: the same simulated work at every scale)")
    parser.add_argument("--rate", type=float, default=LoadShape.rate_per_replica,
                        help="requests per second per replica between bursts")
    parser.add_argument("--burst-factor", type=float, default=LoadShape.burst_factor,
                        help="rate multiplier during a burst (1: stationary load)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tpot", type=float, default=0.020)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench/results/cluster_sim.json"))
    parser.add_argument("--markdown", type=Path, default=Path("bench/results/cluster_sim.md"))
    parser.add_argument("--plot", type=Path, default=Path("bench/results/cluster_sim.png"))
    parser.add_argument("--seeds", type=int, default=5,
                        help="at fleets up to --seeds-up-to replicas, also run this many seeds "
                             "in all (other burst patterns), over the longer run too, and "
                             "report the verdicts' spread")
    parser.add_argument("--seeds-up-to", type=int, default=64)
    parser.add_argument("--longer", type=float, default=30.0,
                        help="at every fleet whose default run is shorter, also run every mode "
                             "over this many seconds of arrivals (0: no)")
    parser.add_argument("--margins", default="0.15,0.3,0.5",
                        help="at fleets up to --seeds-up-to replicas, also run goodput_routed "
                             "with these switch margins (seed --seed): what fewer switches cost")
    parser.add_argument("--capacity-at", type=int, default=64,
                        help="at this fleet size, also find each mode's capacity at the SLO: "
                             "the most requests/s per replica (this burst pattern, scaled) at "
                             "which --capacity-attainment of requests meet it (0: no)")
    parser.add_argument("--capacity-attainment", type=float, default=0.9,
                        help="share of requests that must meet the SLO at capacity")
    parser.add_argument("--capacity-duration", type=float, default=30.0,
                        help="simulated seconds of arrivals of each capacity run")
    parser.add_argument("--jobs", type=positive, default=os.cpu_count() or 1,
                        help="simulations run at once, one per worker process (each is "
                             "single-threaded; default: one per core)")
    args = parser.parse_args()
    with ProcessPoolExecutor(args.jobs) as pool:
        try:
            runs = run_all(pool, args)
        except BaseException:  # a failed run or Ctrl-C: do not wait for the queued ones
            pool.shutdown(cancel_futures=True)
            raise
    complete = {n: r for n, r in runs.items() if "verdicts" in r}
    text = report(complete) if complete else ""
    print(f"\nSIMULATOR preset {PRESET}; SLO: TTFT <= {args.slo_ttft} s and TPOT <= "
          f"{args.slo_tpot * 1000:.0f} ms\n\n{text}")
    args.json.write_text(json.dumps({"preset": PRESET, "slo_ttft_s": args.slo_ttft,
                                     "slo_tpot_s": args.slo_tpot, "runs": runs}, indent=2))
    if complete:
        args.markdown.write_text(text + "\n")
        plot(complete, args.plot)


if __name__ == "__main__":
    main()

