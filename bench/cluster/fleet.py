"""One simulated fleet under one mode (SIMULATOR): each replica a `SimulatedEngine` with the
real `TierPool`, `ControlLoop` and policy, the router's real ranking and the real telemetry hub,
driven by a discrete-event loop in virtual time."""

from __future__ import annotations

import heapq
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from app.router import RecentByClass, ReplicaLoad, pick_warm, rank_replicas, sample_candidates
from app.telemetry_hub import ClusterState
from bench.cluster.load import CLASSES, Arrival, token_shares
from bench.policy_replay import CANDIDATES, TELEMETRY_PERIOD_S
from bench.policy_replay import STATIC as EVERY_STATIC
from bench.policy_replay import policy_config as replay_policy_config
from bench.report import percentile
from policies.class_acceptance import ClassAcceptance, ClassPrior, class_counts
from policies.registry import build_policy
from policies.signals import ClusterView, Decision, Signals
from replicas.control_loop import ControlLoop
from replicas.engines.base import GenerationRequest, add_per_position, period_windows
from replicas.engines.sim_engine import SimulatedEngine
from replicas.engines.sim_presets import PRESETS, SimPreset
from replicas.tier_pool import TierPool

PRESET = "h20-llama8b-ngram"
# The static tiers but K=0, which is never the best static under this cost model and load: its
# default runs made 0.10x / 0.14x / 0.14x static3's goodput at 8 / 64 / 512 replicas (1198 /
# 54229 / 432560 against 11589 / 389324 / 3124772 tok/s), and took the longest of the statics.
STATIC = tuple(mode for mode in EVERY_STATIC if mode != "static0")
LOCAL = ("batch_table", "ema", "goodput_local")
CLUSTER = ("goodput_cluster", "goodput_routed")
ORACLE = "oracle_k"
MODES = (*STATIC, *LOCAL, *CLUSTER, ORACLE)
MAX_BATCH = 64  # each simulated engine's `max_num_seqs`
# Switches before this are start-up moves (every mode starts on one tier; `ema`'s slots
# leave their warm-up batches and first updates within it), not the steady rate.
WARMUP_S = 3.0


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
    window_accepted: list[int] = field(default_factory=lambda: [0] * max(CANDIDATES))
    window_drafted: list[int] = field(default_factory=lambda: [0] * max(CANDIDATES))
    cluster: Any = None

    def class_prior(self) -> ClassPrior:
        """As the replica deployment: what its requests' classes showed before."""
        return self.classes.prior(self.in_flight_classes, self.in_flight_class)

    @property
    def load(self) -> int:
        return len(self.in_flight)

    def take(self, arrival: Arrival, request_id: str, seed: int) -> None:
        """The request into the engine's queue, with its class, as the replica deployment
        keeps it for the request's windows."""
        entry = self.engine.submit(GenerationRequest(
            request_id=request_id, prompt="sim", max_tokens=arrival.max_tokens,
            request_class=arrival.request_class, seed=seed))
        self.in_flight[request_id] = Tracked(arrival, entry)
        self.in_flight_classes[arrival.request_class] += 1
        self.in_flight_class[request_id] = arrival.request_class
        self.class_tokens[arrival.request_class] = \
            self.class_tokens.get(arrival.request_class, 0) + arrival.max_tokens

    def telemetry(self) -> dict[str, Any]:
        """The period's stats (the cluster modes push them to the hub); first refreshes the
        per-class acceptance from the requests' windows, as the replica deployment does,
        hub or not (the replica's class prior, and through the hub the fleet's), and starts
        new windows."""
        self.classes.observe(class_counts(
            *period_windows(self.engine, self.in_flight_class), self.engine.kmax))
        counters = self.engine.counters()
        stats = {"running": counters.running, "waiting": counters.waiting,
                 "ongoing": self.load, "active_k": self.pool.active_k,
                 "window_accepted": self.window_accepted, "window_drafted": self.window_drafted,
                 "class_acceptance": dict(self.classes.own),
                 "class_fresh": self.classes.own_fresh}
        self.window_accepted = [0] * max(CANDIDATES)
        self.window_drafted = [0] * max(CANDIDATES)
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
    the batch's steady state at K, as `BatchAcceptance.steady` estimates it: each
    class keeps its share of the tokens (its share now, at the current K), so the batch makes
    1 / sum_c (w_c / L_c(K)) tokens per sequence-step. The batch as it is now would overstate
    a deep K for a mix: its copy-like requests leave sooner and the others take their slots.
    The shares are read off the batch, as the policy reads them, so right after a switch they
    still describe the previous K's mix (exact acceptance, not exact shares)."""

    reads_requests = False
    needs_requests = False
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


def mixed_tokens_per_s(preset: SimPreset, shares: dict[str, float], batch: int, k: int
                       ) -> float:
    """Tokens/s of one replica running `batch` requests of this class mix (token shares) at
    K, in the cost model. A class that needs more steps per token holds more of a mixed
    batch's slots, so the replica makes B / (t(B, K) * sum_c share_c / length_c(K))."""
    return batch / (preset.step_seconds(batch, k) * sum(
        share / (1 + preset.acceptance[CLASSES[c]].mean_run(k)) for c, share in shares.items()))


def tuned_batch_table(preset: SimPreset, shares: dict[str, float], max_batch: int
                      ) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` as a careful operator would write it
    for this fleet: at each batch size the one K that makes the most tokens/s for the run's
    class mix, from the cost model (an offline profile), in vLLM's [start, end, K] rows.
    vLLM ships no default table; its documentation's example ([1, 64] -> 3, [65, 128] -> 1,
    beyond -> 0) holds K=3 at every batch a replica here reaches, which is static3's row."""
    rows: list[list[int]] = []
    for batch in range(1, max_batch + 1):
        best = max(CANDIDATES, key=lambda k: mixed_tokens_per_s(preset, shares, batch, k))
        if rows and rows[-1][2] == best:
            rows[-1][1] = batch
        else:
            rows.append([batch, batch, best])
    return rows


def policy_for(mode: str, switch_margin: float | None = None,
               tpot_bound_s: float | None = None,
               batch_table: list[list[int]] | None = None,
               defined: dict[str, Any] | None = None) -> dict[str, Any]:
    """The policy config `mode`'s replicas run: `defined` (a `--define`d config) in place of
    the mode's own, and either way a `goodput` policy takes the run's switch margin and
    bound on time per token."""
    if defined is not None:
        config = dict(defined)
    elif mode.startswith("goodput"):
        config = replay_policy_config("goodput", PRESET)
        config["concurrency_source"] = "local" if mode == "goodput_local" else "effective"
    else:
        config = replay_policy_config(mode, PRESET)
        if mode in ("batch_table", "ema"):
            config["concurrency_source"] = "local"  # the engine's batch, as vLLM and SGLang do
        if mode == "batch_table" and batch_table is not None:
            config["num_speculative_tokens_per_batch_size"] = batch_table
    if config["name"] == "goodput":
        if switch_margin is not None:
            config["switch_margin"] = switch_margin
        if tpot_bound_s is not None:  # the operator's SLO, as `tpot_slo_ms` in a config
            config["tpot_slo_ms"] = 1000 * tpot_bound_s
    return config


async def build_fleet(mode: str, replicas: int, seed: int, switch_margin: float | None = None,
                      tpot_bound_s: float | None = None,
                      shares: dict[str, float] | None = None,
                      policy: dict[str, Any] | None = None) -> list[SimReplica]:
    """`replicas` simulated replicas running `mode`; `shares` (the run's token share per
    request class) tunes `batch_table`'s table; `policy`, a config given to the mode
    (`--define`), replaces the one the mode runs by default."""
    # Acceptance models named by request class: each request carries its class into the
    # engine, as the ingress's do in the app, and the engine's records of finished requests
    # name the classes the replicas learn.
    preset = replace(PRESETS[PRESET], acceptance={
        name: PRESETS[PRESET].acceptance[model] for name, model in CLASSES.items()})
    table = tuned_batch_table(PRESETS[PRESET], shares, MAX_BATCH) \
        if mode == "batch_table" and shares and policy is None else None
    fleet = []
    for i in range(replicas):
        engine = SimulatedEngine(preset, kmax=max(CANDIDATES), max_num_seqs=MAX_BATCH,
                                 seed=(seed, i))
        # Static modes start on their tier; adaptive ones on K=3, as the replay does.
        pool = TierPool(engine, CANDIDATES, initial_k=int(mode[6:]) if mode in EVERY_STATIC else 3)
        await pool.apply_initial()
        replica = SimReplica(f"r{i}", engine, pool)
        replica_policy = OracleK(engine, CANDIDATES) if mode == ORACLE else build_policy(
            policy_for(mode, switch_margin, tpot_bound_s, table, policy), CANDIDATES)
        # Every mode prices by what its own requests' classes showed, as a replica does
        # without the hub; the cluster modes also get the fleet's rates per class.
        replica.loop = ControlLoop(engine, pool, replica_policy, max_batch=engine.max_num_seqs,
                                   class_prior=replica.class_prior)
        fleet.append(replica)
    return fleet


def exchange_telemetry(fleet: list[SimReplica], hub: ClusterState, now: float,
                       with_cluster: bool) -> None:
    """One telemetry period: every replica measures its requests' classes (a replica does,
    hub or not); with the cluster view each also pushes to the hub and takes back the
    fleet's view and per-class rates."""
    for replica in fleet:
        stats = replica.telemetry()
        if with_cluster:
            view = hub.push(replica.replica_id, stats, now=now)
            replica.cluster = ClusterView.from_hub(view)
            replica.classes.fleet = view["class_acceptance"]
            replica.classes.fleet_fresh = view["class_fresh"]


async def simulate(mode: str, replicas: int, arrivals: list[Arrival], duration_s: float,
                   slo_ttft_s: float, slo_tpot_s: float, seed: int,
                   switch_margin: float | None = None, tpot_bound: bool = False,
                   policy: dict[str, Any] | None = None) -> ModeOutcome:
    """`mode`'s fleet through the arrivals. A mode of `MODES` routes and shares telemetry as
    its row of the table in `bench.cluster_sim` says; any other name is a mode `--define`d
    with `policy`, run as a local one (Ray Serve's routing, no hub)."""
    started = time.perf_counter()
    uses_cluster, gathering = mode in CLUSTER, mode == "goodput_routed"
    fleet = await build_fleet(mode, replicas, seed, switch_margin,
                              slo_tpot_s if tpot_bound else None, token_shares(arrivals),
                              policy)
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
                                     r.in_flight_classes[arrival.request_class],
                                     r.engine.max_num_seqs)
                         for r in candidates]
                pick = pick_warm(rank_replicas(loads)[0], recent_by_class.last_class,
                                 arrival.request_class, rng)
                recent_by_class.record(arrival.request_class, pick)
                target = int(pick[1:])
            else:  # Ray Serve's default: the less loaded of two random replicas
                a, b = rng.sample(range(replicas), 2) if replicas > 1 else (0, 0)
                target = a if fleet[a].load <= fleet[b].load else b
            replica = fleet[target]
            serial += 1
            replica.take(arrival, f"q{serial}", seed=serial)
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
        else:
            exchange_telemetry(fleet, hub, now, with_cluster=uses_cluster)
            if arrivals_left or any(r.in_flight for r in fleet):
                schedule(now + TELEMETRY_PERIOD_S, "hub", 0)
    outcome.switches = sum(r.pool.switch_count for r in fleet)
    outcome.gathered = sum(max(r.class_tokens.values(), default=0) for r in fleet) / \
        sum(sum(r.class_tokens.values()) for r in fleet)
    outcome.wall_s = time.perf_counter() - started
    return outcome


def summarise(outcome: ModeOutcome, replicas: int) -> dict[str, Any]:
    latencies = outcome.latencies
    replica_hours = replicas * outcome.end_s / 3600
    return {"goodput": outcome.slo_tokens / outcome.window_s,
            "slo_attainment": outcome.slo_requests / max(1, len(latencies)),
            "tpot_missed": outcome.tpot_missed / max(1, len(latencies)),
            "throughput": outcome.window_tokens / outcome.window_s,
            "p50_s": statistics.median(latencies),
            "p99_s": percentile(latencies, 99),
            "switches_per_replica_hour": outcome.switches / replica_hours,
            "steady_switches_per_replica_hour": outcome.steady_switches /
            (replicas * max(1e-9, outcome.window_s - WARMUP_S) / 3600),
            "gathered": outcome.gathered, "requests": len(latencies),
            "simulated_s": outcome.end_s, "wall_s": outcome.wall_s}
