"""Router ranking, telemetry-hub view and control-loop folding: the pure cluster logic."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from app.router import (
    RANK_SAMPLE,
    RecentByClass,
    ReplicaLoad,
    gathering_cost,
    others_in_handler,
    pick_warm,
    rank_replicas,
    sample_candidates,
)
from app.telemetry_hub import PRIOR_DECAY, ClusterState
from observability.metrics import ReplicaMetrics
from observability.tracing import ActiveSpans
from policies.class_acceptance import (
    FRESH_PERIODS,
    ClassAcceptance,
    blend_rates,
    class_counts,
    fleet_average,
    mixture,
    rates_from_counts,
)
from policies.registry import build_policy
from policies.signals import ClusterView, Decision, RequestAcceptance, RequestWindows, Signals
from replicas.control_loop import ControlLoop, fold_steps
from replicas.engines.base import GenerationRequest, StepRecord, period_windows
from replicas.engines.sglang_engine import SglangEngine
from replicas.engines.sim_engine import SimulatedEngine
from replicas.engines.sim_presets import PRESETS
from replicas.engines.spec import EngineSpec
from replicas.replica import EngineReplica
from replicas.tier_pool import TierPool


def test_router_prefers_an_idle_replica_then_the_least_loaded():
    replicas = [ReplicaLoad("idle", 0), ReplicaLoad("busy", 9, 9), ReplicaLoad("busier", 12)]
    assert rank_replicas(replicas) == [["idle"], ["busy", "busier"]]
    # Among replicas of one class only (or of none), plain load decides.
    assert rank_replicas([ReplicaLoad("a", 5, 5), ReplicaLoad("b", 3, 3)])[0] == ["b"]
    assert rank_replicas([ReplicaLoad("a", 4), ReplicaLoad("b", 4)]) == [["a", "b"]]


def test_router_gathers_a_class_until_its_replicas_are_three_times_as_loaded():
    # Of 20 requests on "copying", 20 are of this class; "chatting" holds none of it.
    copying, chatting = ReplicaLoad("copying", 20, 20), ReplicaLoad("chatting", 8, 0)
    assert rank_replicas([copying, chatting])[0] == ["copying"]
    # With affinity 2 a foreign request counts three times: the pure replica wins up to 3x
    # the load of a replica of the other class, then the burst spills.
    assert rank_replicas([ReplicaLoad("copying", 23, 23), chatting])[0] == ["copying"]
    assert rank_replicas([ReplicaLoad("copying", 25, 25), chatting])[0] == ["chatting"]
    # A mixed replica sits in between: half of its load of the class.
    assert gathering_cost(ReplicaLoad("mixed", 10, 5)) == pytest.approx(20)
    assert rank_replicas([copying, chatting], affinity=0)[0] == ["chatting"]


def test_router_prices_each_request_that_would_wait_behind_a_full_batch():
    # Below the batch limit the limit changes nothing; at it, the new request would wait.
    assert gathering_cost(ReplicaLoad("copying", 7, 7, batch_limit=8)) == pytest.approx(7)
    assert gathering_cost(ReplicaLoad("copying", 8, 8, batch_limit=8)) == pytest.approx(9)
    assert gathering_cost(ReplicaLoad("copying", 12, 12, batch_limit=8)) == pytest.approx(17)
    assert gathering_cost(ReplicaLoad("idle", 0, 0, batch_limit=1)) == 0
    # A burst of one class spills from its full replicas sooner than without the limit:
    # "chatting" (8 requests, none of this class) costs 24.
    chatting = ReplicaLoad("chatting", 8, 0, batch_limit=16)
    assert rank_replicas([ReplicaLoad("copying", 20, 20), chatting])[0] == ["copying"]
    assert rank_replicas([ReplicaLoad("copying", 20, 20, batch_limit=16), chatting])[0] == \
        ["chatting"]


def test_router_sends_a_class_where_it_went_last_when_replicas_tie():
    """One request at a time over two idle replicas: each class settles on its own replica
    (a random pick would move copy requests onto the replica a sampled one just left at
    K=0), and a replica nothing went to comes before one the other class holds."""
    rng, recent, picks = random.Random(0), RecentByClass(), []
    for request_class in ["greedy", "sampled"] * 20:
        pick = pick_warm(["a", "b"], recent.last_class, request_class, rng)
        recent.record(request_class, pick)
        picks.append((request_class, pick))
    by_class = {c: {p for rc, p in picks if rc == c} for c in ("greedy", "sampled")}
    assert len(by_class["greedy"]) == len(by_class["sampled"]) == 1
    assert by_class["greedy"] != by_class["sampled"]
    assert pick_warm(["a", "b"], {"a": "sampled"}, "greedy", rng) == "b"
    # Only among the tied: the ranking still decides first.
    assert pick_warm(["b"], {"a": "greedy"}, "greedy", rng) == "b"
    # Nothing to tell them apart: either, at random.
    assert {pick_warm(["a", "b"], {}, "greedy", random.Random(s)) for s in range(20)} == \
        {"a", "b"}


def test_router_remembers_where_each_class_went_for_sampled_fleets():
    recent = RecentByClass(size=2)
    for replica in ("r1", "r2", "r1", "r3"):
        recent.record("greedy", replica)
    assert recent.get("greedy") == ["r3", "r1"] and recent.get("sampled") == []
    recent.record("sampled", "r1")
    assert recent.last_class == {"r1": "sampled", "r2": "greedy", "r3": "greedy"}
    fleet = [f"r{i}" for i in range(100)]
    sample = sample_candidates(fleet, random.Random(0), also=["r7", "r8"])
    assert {"r7", "r8"} <= set(sample) and len(sample) <= RANK_SAMPLE + 2
    assert len(set(sample)) == len(sample)
    assert sample_candidates(fleet[:5], random.Random(0), also=["r7"]) == fleet[:5]


def test_router_takes_only_the_other_routers_share_of_a_report_in_all_and_per_class():
    # The replica's last report still shows six of this router's requests, all finished since:
    # the router counts its own itself.
    just_finished = {"ongoing_by_router": {"me": {"greedy": 6}}}
    assert others_in_handler("me", "greedy", just_finished) == (0, 0)
    # Another router has three greedy and one sampled request there; a direct call (no router
    # id) one more sampled.
    shared = {"ongoing_by_router": {"me": {"greedy": 2}, "other": {"greedy": 3, "sampled": 1},
                                    None: {"sampled": 1}}}
    assert others_in_handler("me", "greedy", shared) == (5, 3)
    assert others_in_handler("me", "sampled", shared) == (5, 2)
    assert others_in_handler("me", "greedy", {}) == (0, 0)  # no report yet


def test_hub_view_counts_requests_in_transit_and_builds_the_prior():
    hub = ClusterState(stale_after_s=3)
    hub.push("a", {"running": 4, "waiting": 3, "ongoing": 9, "active_k": 7,
                   "window_accepted": [8, 4], "window_drafted": [10, 10]}, now=0.0)
    view = hub.push("b", {"running": 1, "waiting": 0, "ongoing": 1, "active_k": 1,
                          "window_accepted": [2, 0], "window_drafted": [10, 0]}, now=0.5)
    hub.report_routed("router-1", {"a": 11}, now=0.5)
    assert hub.view("a")["in_transit"] == 11 - 9
    assert view["acceptance_prior"] == (0.5, 0.4)
    # A replica that stopped pushing leaves the view.
    hub.push("b", {"running": 0, "waiting": 0, "ongoing": 0, "active_k": 1}, now=4.0)
    assert set(hub.replicas) == {"b"}


def test_hub_prior_is_the_decayed_fleet_sum_and_forgets_a_silent_replica():
    """The hub keeps running fleet totals (a push costs O(K), not O(replicas)): they must
    equal the decayed sums of the replicas still pushing."""
    hub = ClusterState(stale_after_s=1.0)
    windows = {"a": ([6, 3], [10, 10]), "b": ([1, 0], [10, 2]), "c": ([9, 8], [10, 10])}
    for round_ in range(3):
        for rid, (accepted, drafted) in windows.items():
            if rid == "c" and round_ > 0:
                continue  # c pushes once, then falls silent
            hub.push(rid, {"window_accepted": accepted, "window_drafted": drafted},
                     now=round_ * 0.5)
    d = sum(PRIOR_DECAY ** i for i in range(3))  # a and b pushed the same window thrice
    assert hub.acceptance_prior() == (pytest.approx((7 * d + 9) / (20 * d + 10)),
                                      pytest.approx((3 * d + 8) / (12 * d + 10)))
    hub.push("a", {"window_accepted": [0, 0], "window_drafted": [0, 0]}, now=1.6)
    assert set(hub.replicas) == {"a", "b"}  # c has been silent for over 1 s
    a = PRIOR_DECAY * d  # a's counts decayed once more
    assert hub.acceptance_prior() == (pytest.approx((6 * a + d) / (10 * a + 10 * d)),
                                      pytest.approx(3 * a / (10 * a + 2 * d)))


def test_hub_averages_each_class_per_position_over_the_replicas_that_measured_it():
    state = ClusterState()
    state.push("a", {"class_acceptance": {"greedy": (0.9, 0.8), "sampled": (0.1,)}}, now=0.0)
    view = state.push("b", {"class_acceptance": {"greedy": (0.7,)}}, now=1.0)
    assert view["class_acceptance"] == {"greedy": (pytest.approx(0.8), pytest.approx(0.8)),
                                        "sampled": (0.1,)}
    assert fleet_average([]) == {}


def test_hub_tells_each_class_the_deepest_positions_any_replica_measured_lately():
    state = ClusterState()
    state.push("a", {"class_fresh": {"greedy": 3, "sampled": 1}}, now=0.0)
    view = state.push("b", {"class_fresh": {"greedy": 1}}, now=1.0)
    assert view["class_fresh"] == {"greedy": 3, "sampled": 1}


def test_class_positions_stay_fresh_for_a_few_periods_and_the_prior_takes_the_shallowest():
    classes = ClassAcceptance()
    classes.observe({"copy": ([8, 6, 4], [10, 10, 10])})  # K=3 measured three positions
    classes.observe({"copy": ([8], [10]), "chat": ([3], [10])})  # then K=1: one
    assert classes.own_fresh == {"copy": 3, "chat": 1}
    for _ in range(FRESH_PERIODS):
        classes.observe({"copy": ([8], [10])})
    assert classes.own_fresh == {"copy": 1}, "positions 2-3 and chat went stale"
    classes.fleet = {"chat": (0.3, 0.1, 0.05)}
    classes.fleet_fresh = {"chat": 3}
    # Every class held must be covered: copy is fresh to 1 position here and unknown elsewhere.
    assert classes.prior(Counter(copy=2, chat=1)).fresh == 1
    assert classes.prior(Counter(chat=1)).fresh == 3
    assert classes.prior(Counter(copy=1, other=0)).fresh == 1


def test_fold_keeps_per_position_counts_unbiased_across_k_changes():
    steps = [StepRecord(running=2, waiting=0, k=7, wall_s=0.02, drafts=2, draft_tokens=14,
                        accepted_tokens=6, accepted_per_pos=(2, 2, 1, 1, 0, 0, 0),
                        drafted_per_pos=(2,) * 7),
             StepRecord(running=2, waiting=1, k=1, wall_s=0.0, drafts=2, draft_tokens=2,
                        accepted_tokens=2, accepted_per_pos=(2,) + (0,) * 6,
                        drafted_per_pos=(2,) + (0,) * 6)]
    signals = fold_steps(steps, (0, 1, 7), current_k=1)
    assert signals.drafted_per_pos[:3] == (4, 2, 2)
    assert signals.accepted_per_pos[:3] == (4, 2, 1)
    assert (signals.running, signals.waiting, signals.steps) == (2, 1, 2)
    assert [c.depth for c in signals.step_costs] == [7], "a step of unknown time is left out"
    assert signals.slots_per_pos[:7] == (4,) + (2,) * 6
    assert sum(signals.slots_per_pos) == 2 * 7 + 2 * 1


def test_fold_leaves_prefill_steps_out_of_the_cost_model_but_counts_their_drafts():
    decode = StepRecord(running=4, waiting=0, k=7, wall_s=0.02, drafts=4, draft_tokens=28,
                        accepted_tokens=20, accepted_per_pos=(4,) * 5 + (0,) * 2,
                        drafted_per_pos=(4,) * 7)
    with_prompts = StepRecord(running=8, waiting=0, k=7, wall_s=0.09, drafts=4,
                              draft_tokens=28, accepted_tokens=20,
                              accepted_per_pos=(4,) * 5 + (0,) * 2, drafted_per_pos=(4,) * 7,
                              prefill_tokens=300)
    signals = fold_steps([decode, with_prompts], (0, 1, 7), current_k=7)
    assert [(c.batch, c.seconds) for c in signals.step_costs] == [(4, 0.02)]
    assert signals.accepted_tokens == 40 and signals.drafted_per_pos[0] == 8


def test_fold_prices_a_step_by_the_drafts_it_verified():
    """At K=7, one of four sequences proposed 6 drafts: the step verified 1.5 per sequence,
    and its cost is recorded at depth 2 (rounded), not at its tier."""
    step = StepRecord(running=4, waiting=0, k=7, wall_s=0.02, drafts=1, draft_tokens=6,
                      accepted_tokens=6, accepted_per_pos=(1,) * 6 + (0,),
                      drafted_per_pos=(1,) * 6 + (0,))
    signals = fold_steps([step], (0, 1, 7), current_k=7)
    assert [(c.batch, c.depth) for c in signals.step_costs] == [(4, 2)]
    assert sum(signals.slots_per_pos) == 28


def test_simulator_outputs_do_not_depend_on_k_and_control_loop_switches():
    async def run(k: int) -> list[int]:
        engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, time_scale=0.0)
        await engine.start()
        pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=k)
        await pool.apply_initial()
        loop = ControlLoop(engine, pool, build_policy({"name": "static", "k": k},
                                                      pool.candidates))
        ids: list[int] = []
        async for chunk in engine.generate(GenerationRequest("r", prompt="a b c",
                                                             max_tokens=40, temperature=0)):
            ids.extend(chunk.token_ids)
            await loop.tick()
        steps = engine.counters()
        await engine.shutdown()
        assert steps.draft_tokens == steps.drafts * k
        return ids

    outputs = [asyncio.run(run(k)) for k in (0, 3, 15)]
    assert len(outputs[0]) == 40 and outputs[0] == outputs[1] == outputs[2]


def test_a_simulated_stream_read_late_names_each_chunks_own_tokens():
    """The engine runs ahead of a slow reader: every chunk still carries its own positions'
    tokens, and the output is the one a prompt gives at any speed."""
    async def run(reader_delay_s: float) -> tuple[list[int], list[int]]:
        engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, time_scale=0.0)
        await engine.start()
        await engine.set_k(7)
        ids, counts = [], []
        async for chunk in engine.generate(GenerationRequest("r", prompt="a b c",
                                                             max_tokens=60, temperature=0)):
            ids.extend(chunk.token_ids)
            counts.append(chunk.completion_tokens)
            await asyncio.sleep(reader_delay_s)
        await engine.shutdown()
        return ids, counts

    (fast, _), (slow, counts) = asyncio.run(run(0.0)), asyncio.run(run(0.01))
    assert slow == fast and len(slow) == 60 and len(set(slow)) > 1
    assert counts == sorted(counts) and counts[-1] == 60


def test_a_simulator_step_that_fails_ends_every_reader_with_the_error():
    """A step that raises stops the step loop: the readers waiting on it (running and still
    queued) get the error instead of waiting forever, a later request is refused at once,
    and the health check reports the loop gone."""
    async def run() -> list[BaseException | None]:
        engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, max_num_seqs=1, time_scale=0.0)
        steps = 0
        real_step = engine.step

        def failing_step() -> float:
            nonlocal steps
            steps += 1
            if steps == 3:
                raise FloatingPointError("a broken step")
            return real_step()

        engine.step = failing_step
        await engine.start()

        async def read(request_id: str) -> BaseException | None:
            try:
                async for _ in engine.generate(GenerationRequest(
                        request_id, prompt="a b c", max_tokens=50, temperature=0)):
                    pass
            except RuntimeError as error:
                return error
            return None

        # The second request waits for the first's slot (max_num_seqs=1) when the step fails.
        outcomes = list(await asyncio.wait_for(asyncio.gather(read("a"), read("b")), 5))
        outcomes.append(await asyncio.wait_for(read("c"), 5))
        with pytest.raises(RuntimeError):
            await engine.check_health()
        return outcomes

    outcomes = asyncio.run(run())
    assert all(isinstance(error, RuntimeError) and "a broken step" in str(error)
               for error in outcomes), outcomes


def test_a_simulator_stream_closed_while_queued_takes_its_request_out():
    """A reader that leaves while its request still waits for a slot takes it out of the
    queue: it never runs, and the request behind it takes the slot."""
    async def run() -> tuple[int, int]:
        engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, max_num_seqs=1, time_scale=0.0)
        await engine.start()
        first = engine.generate(GenerationRequest("first", prompt="a b", max_tokens=40))
        await anext(first)  # "first" holds the only slot
        queued = engine.generate(GenerationRequest("queued", prompt="c d", max_tokens=40))
        reading = asyncio.ensure_future(anext(queued))
        await asyncio.sleep(0)
        assert engine.counters().waiting == 1
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        await queued.aclose()
        waiting = engine.counters().waiting
        async for _ in first:
            pass
        generated = engine.counters().generated_tokens
        await engine.shutdown()
        return waiting, generated

    waiting, generated = asyncio.run(run())
    assert waiting == 0
    assert generated == 40  # "first" alone: the closed request never ran


def test_a_simulator_abort_ends_the_reader_of_a_running_stream():
    """Aborting a running streamed request from outside its reader ends the reader's stream
    with a last chunk whose finish reason is "abort" (as vLLM's), instead of leaving it
    waiting for chunks that never come."""
    async def run() -> list[str | None]:
        engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, time_scale=0.0)
        await engine.start()
        reasons = []
        async for chunk in engine.generate(GenerationRequest("r", prompt="a", max_tokens=500)):
            reasons.append(chunk.finish_reason)
            if len(reasons) == 2:
                await engine.abort("r")
        await engine.shutdown()
        return reasons

    reasons = asyncio.run(asyncio.wait_for(run(), 5))
    assert reasons[-1] == "abort" and reasons[:-1] == [None] * (len(reasons) - 1)


def test_a_simulator_not_running_refuses_a_request_at_once():
    """Before `start` and after `shutdown` a request is refused, not queued for no one."""
    async def refused(engine: SimulatedEngine) -> None:
        with pytest.raises(RuntimeError, match="not running"):
            async for _ in engine.generate(GenerationRequest("r", prompt="a", max_tokens=5)):
                pass

    async def run() -> None:
        engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, time_scale=0.0)
        await asyncio.wait_for(refused(engine), 5)
        await engine.start()
        await engine.shutdown()
        await asyncio.wait_for(refused(engine), 5)

    asyncio.run(run())


@pytest.mark.parametrize(("policy", "sees_requests"),
                         [({"name": "goodput"}, True), ({"name": "stability"}, True),
                          ({"name": "ema"}, False), ({"name": "static", "k": 3}, False)])
def test_control_loop_hands_request_windows_to_the_policies_that_read_them(policy,
                                                                          sees_requests):
    """The engine's per-request outcomes reach goodput and stability (as on a vLLM replica);
    the loop does not build them for policies that never look."""
    engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, max_num_seqs=4)
    for i in range(4):
        engine.submit(GenerationRequest(f"r{i}", prompt="a b c", max_tokens=200))
    pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=3)
    asyncio.run(pool.apply_initial())
    loop = ControlLoop(engine, pool, build_policy(policy, pool.candidates))
    engine.admit()
    for _ in range(loop.decide_every_steps):
        engine.step()
    asyncio.run(loop.tick())
    requests = loop.stats.last_signals.requests
    assert len(requests) == (4 if sees_requests else 0)
    assert all(len(r.drafted) == loop.decide_every_steps for r in requests)


def test_an_engine_that_prepares_its_tiers_at_start_up_is_given_no_other() -> None:
    """SGLang builds a state per tier when it starts and runs no other: a candidate list
    naming another K is refused at start-up and at run time (the pool keeping its list),
    where it would otherwise fail at the first switch to that K, between engine steps."""
    engine = SglangEngine(EngineSpec(engine="sglang", drafter="eagle",
                                     drafter_model="/models/eagle", kmax=7, tiers=(0, 1, 3)))
    assert engine.prepared_tiers == (0, 1, 3, 7)
    with pytest.raises(ValueError, match=r"candidate K \[2\] was not prepared"):
        TierPool(engine, (0, 2, 7))
    pool = TierPool(engine, (0, 1, 7), initial_k=1)
    with pytest.raises(ValueError, match=r"candidate K \[5\] was not prepared"):
        asyncio.run(pool.set_candidates([0, 1, 5]))
    assert pool.candidates == (0, 1, 7) and pool.active_k == 1
    with pytest.raises(ValueError, match="not a tier prepared at start-up"):
        asyncio.run(engine.set_k(5))


def test_a_policy_that_needs_per_request_outcomes_is_refused_on_an_engine_without_them():
    """SGLang's adapter reports no per-request outcomes: there `stability` would answer "no
    request history yet" at every decision and never move K. The loop refuses it when built
    with it and when it is set later (keeping the policy it had); the simulator, which
    reports them as vLLM does, serves it."""
    engine = SglangEngine(EngineSpec(engine="sglang", drafter="eagle",
                                     drafter_model="/models/eagle", kmax=7, tiers=(0, 1, 3, 7)))
    pool = TierPool(engine, (0, 1, 3, 7))
    stability = build_policy({"name": "stability"}, pool.candidates)
    with pytest.raises(ValueError, match="per-request verify outcomes"):
        ControlLoop(engine, pool, stability)
    loop = ControlLoop(engine, pool, build_policy({"name": "goodput"}, pool.candidates))
    goodput = loop.policy
    with pytest.raises(ValueError, match="per-request verify outcomes"):
        loop.replace_policy(stability)
    assert loop.policy is goodput
    simulator = SimulatedEngine(PRESETS["cpu-demo"], kmax=7)
    assert ControlLoop(simulator, TierPool(simulator, (0, 1, 3, 7)), stability).policy \
        is stability


def test_control_loop_times_each_decision_on_its_own():
    """The decision-time histogram takes each decision's wall time: one slow decision must
    show in its tail, not be averaged away with the fast ones before it."""
    engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, max_num_seqs=4)
    engine.submit(GenerationRequest("r0", prompt="a b c", max_tokens=400))
    pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=3)
    asyncio.run(pool.apply_initial())
    static = build_policy({"name": "static", "k": 3}, pool.candidates)
    delays = iter([0.0, 0.0, 0.0, 0.05])

    class Timed:
        reads_requests, needs_requests, decides_on_arrival = False, False, False

        def decide(self, signals):
            time.sleep(next(delays))
            return static.decide(signals)

    loop = ControlLoop(engine, pool, Timed())
    engine.admit()
    seen = []
    for _ in range(4):
        for _ in range(loop.decide_every_steps):
            engine.step()
        asyncio.run(loop.tick())
        seen.append(loop.stats.last_decision_seconds)
    assert max(seen[:3]) < 0.01
    assert seen[3] >= 0.05


@pytest.mark.parametrize(("start_k", "arriving", "tier"), [(15, "chat", 0), (0, "copy", 15)])
def test_goodput_takes_the_tier_a_new_class_wants_before_its_first_step(start_k, arriving,
                                                                      tier):
    """A request of a class the replica did not hold arrives: the loop decides at its next
    tick, with no step in the window, and the request (no outcomes yet, in the engine's
    queue) is priced by its class. A second request of a class already held waits for a
    window of steps, as does a policy that does not price by class. The dwell does not hold
    the old tier: it guards against noisy measurements, and the arrival is news."""
    classes = ClassAcceptance()
    classes.own = {"copy": (0.97,) * 15, "chat": (0.02, 0.0)}
    held: dict[str, str] = {}

    def run(policy: dict) -> ControlLoop:
        engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, max_num_seqs=8)
        pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=start_k)
        asyncio.run(pool.apply_initial())
        held.clear()
        loop = ControlLoop(engine, pool, build_policy(policy, pool.candidates),
                           class_prior=lambda: classes.prior(Counter(held.values()), held))
        for i in range(2):
            held[f"r{i}"] = arriving
            engine.submit(GenerationRequest(f"r{i}", prompt="a b c", max_tokens=50))
            asyncio.run(loop.tick())
        return loop

    # A fresh policy is within its dwell: an arrival is decided all the same.
    loop = run({"name": "goodput",
                "profile": [[b, k, 0.008 + 0.0005 * b * k] for b in (1, 8) for k in (0, 15)]})
    assert loop.stats.decisions == 1 and loop.stats.last_signals.steps == 0
    assert loop.pool.active_k == tier
    signals = loop.stats.last_signals
    assert signals.requests.request_ids == ("r0",) and signals.waiting == 1
    assert run({"name": "ema"}).stats.decisions == 0


def test_an_arrival_decision_keeps_the_engines_batch_and_needs_a_measured_class():
    """A busy replica decides on a window, then a request of a new class arrives: the
    decision on its arrival has no step in its window, and sees the engine's running
    requests of the last step (not 0, with every held request counted as waiting). A class
    no replica has measured triggers nothing: its class would price it no better than the
    replica's own rates. A new policy decides on its first arrival again."""
    classes = ClassAcceptance()
    classes.own = {"chat": (0.02, 0.0)}
    held: dict[str, str] = {}
    engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, max_num_seqs=8)
    pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=3)
    asyncio.run(pool.apply_initial())
    loop = ControlLoop(engine, pool, build_policy({"name": "goodput"}, pool.candidates),
                       class_prior=lambda: classes.prior(Counter(held.values()), held))

    def arrive(request_id: str, request_class: str) -> None:
        held[request_id] = request_class
        engine.submit(GenerationRequest(request_id, prompt="a b c", max_tokens=200))

    for i in range(4):
        arrive(f"u{i}", "unmeasured")
    asyncio.run(loop.tick())
    assert loop.stats.decisions == 0  # a class nobody measured: no decision on arrival
    engine.admit()
    for _ in range(loop.decide_every_steps):
        engine.step()
    asyncio.run(loop.tick())
    assert loop.stats.decisions == 1 and loop.stats.last_signals.running == 4
    arrive("c0", "chat")
    asyncio.run(loop.tick())
    signals = loop.stats.last_signals
    assert loop.stats.decisions == 2 and signals.steps == 0 and signals.new_class
    assert (signals.running, signals.waiting) == (4, 1)
    arrive("c1", "chat")  # a class held at the last decision
    asyncio.run(loop.tick())
    assert loop.stats.decisions == 2
    loop.replace_policy(build_policy({"name": "goodput"}, pool.candidates))
    asyncio.run(loop.tick())
    assert loop.stats.decisions == 3 and loop.stats.last_signals.new_class


def test_the_replicas_effective_concurrency_is_what_its_policy_sees_between_decisions_too():
    """The replica's gauge and its policy count one way: the engine's running and waiting at
    its last step, the requests the replica holds that the engine did not run then as
    waiting, and the requests in transit. Requests taken after a decision count at once."""
    classes = ClassAcceptance()
    held: dict[str, str] = {}
    engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, max_num_seqs=4)
    pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=3)
    asyncio.run(pool.apply_initial())
    loop = ControlLoop(engine, pool, build_policy({"name": "static", "k": 3}, pool.candidates),
                       class_prior=lambda: classes.prior(Counter(held.values()), held))
    cluster = ClusterView(in_transit=2)

    def decide() -> Signals:
        for _ in range(loop.decide_every_steps):
            engine.step()
        asyncio.run(loop.tick(cluster))
        return loop.stats.last_signals

    for i in range(6):  # four run, two wait in the engine's queue
        held[f"r{i}"] = "default"
        engine.submit(GenerationRequest(f"r{i}", prompt="a b c", max_tokens=200))
    engine.admit()
    assert decide().effective_concurrency == 4 + 2 + 2
    assert loop.effective_concurrency(len(held), cluster) == 8
    held.update({f"new{i}": "default" for i in range(3)})  # taken, not yet in the engine
    assert loop.effective_concurrency(len(held), cluster) == 4 + 5 + 2
    assert decide().effective_concurrency == 11


def test_request_windows_gain_an_empty_row_per_request_not_among_them():
    windows = RequestWindows.of([RequestAcceptance("a", (1, 2), (2, 2))]).with_new(["a", "b"])
    assert windows.request_ids == ("a", "b")
    assert windows.lengths.tolist() == [2, 0]
    assert windows.drafted.tolist() == [[2, 2], [0, 0]]
    assert RequestWindows().with_new(["c"]).request_ids == ("c",)
    # Up to the batch's free slots, the first taken first: a queue beyond them waits.
    assert windows.with_new(["c", "d"], limit=1).request_ids == ("a", "b", "c")
    step = StepRecord(running=1, waiting=3, k=0, wall_s=0.01)
    held = ClassAcceptance().prior(Counter(chat=4),
                                   {"a": "chat", "x": "chat", "y": "chat", "z": "chat"})
    signals = fold_steps([step], (0, 1), 0, requests=RequestWindows.of(
        [RequestAcceptance("a", (0,), (0,))]), max_batch=2, class_prior=held)
    assert signals.requests.request_ids == ("a", "x") and signals.waiting == 3


def test_request_windows_join_rows_of_any_width():
    first = RequestWindows.of([RequestAcceptance("a", (1, 2, 0), (2, 2, 2))])
    second = RequestWindows.of([RequestAcceptance("b", (3,), (3,))])
    joined = RequestWindows.joined([first, RequestWindows(), second])
    assert joined.request_ids == ("a", "b") and joined.lengths.tolist() == [3, 1]
    assert joined.drafted.tolist() == [[2, 2, 2], [0, 0, 3]]
    assert list(joined) == [*first, *second]
    assert len(RequestWindows.joined([])) == 0


def test_a_replica_learns_the_class_of_requests_that_finish_between_two_periods():
    """Requests that start and finish between two telemetry periods: none runs at the
    period, yet their outcomes reach their class's acceptance (the engine keeps a finished
    request's window, with its class, until read). Read once: the next period has none."""
    engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, max_num_seqs=4)
    asyncio.run(engine.set_k(3))
    assert len(period_windows(engine, {})[0]) == 0  # a replica's first period: a reader
    for i in range(2):
        engine.submit(GenerationRequest(f"r{i}", prompt="a b c", max_tokens=12 + 4 * i,
                                        request_class="high"))
    engine.admit()
    last_seen = {}
    while engine.counters().running:
        running = engine.request_acceptance()
        last_seen.update((r.request_id, r) for r in running)
        engine.step()
    windows, class_of = period_windows(engine, {})
    assert set(windows.request_ids) == {"r0", "r1"} and set(class_of.values()) == {"high"}
    for finished in windows:  # every step it ran: the ones seen before, and its last
        assert finished.drafted[:-1] == last_seen[finished.request_id].drafted
        assert finished.accepted[:-1] == last_seen[finished.request_id].accepted
        assert finished.drafted[-1] == 3
    assert class_counts(windows, class_of, width=15).keys() == {"high"}
    assert len(period_windows(engine, {})[0]) == 0


def test_hub_keeps_the_newest_fleet_wide_change_whatever_the_arrival_order():
    hub = ClusterState()
    newer = {"policy": {"name": "static", "k": 7}, "issued_at": 20.0}
    older = {"policy": {"name": "static", "k": 3}, "issued_at": 10.0}
    hub.set_override(newer, newer["issued_at"])
    hub.set_override(older, older["issued_at"])  # a late report of an older change
    assert hub.view("any")["policy_override"] == newer
    hub.set_override(None, 30.0)  # a redeployed user_config supersedes both
    assert hub.view("any")["policy_override"] is None


def test_hub_merges_successive_fleet_wide_changes_for_replicas_started_later():
    """A policy, then tiers, then a stream interval: a replica started after all three
    applies all three (it applied only the last before)."""
    hub = ClusterState()
    for change in ({"policy": {"name": "static", "k": 3}, "issued_at": 1.0},
                   {"candidates": [0, 3, 7], "initial_k": 7, "issued_at": 2.0},
                   {"stream_interval_ms": 0, "issued_at": 3.0},
                   {"candidates": [0, 1, 3], "issued_at": 4.0}):
        hub.set_override(change, change["issued_at"])
    assert hub.view("any")["policy_override"] == {
        "policy": {"name": "static", "k": 3}, "candidates": [0, 1, 3],
        "stream_interval_ms": 0, "issued_at": 4.0}  # the old tiers' initial_k dropped


def test_class_counts_tally_each_class_per_position_from_request_windows():
    """As a replica reports its classes: per position, steps that drafted it and steps that
    landed it, pooled over the class's requests; a request without a class is "default"."""
    windows = RequestWindows.of([
        RequestAcceptance("a", accepted=(3, 1, 0), drafted=(3, 3, 3)),
        RequestAcceptance("b", accepted=(5,), drafted=(3,)),  # at most what it drafted
        RequestAcceptance("c", accepted=(0, 1), drafted=(0, 1)),
        RequestAcceptance("d", accepted=(0,), drafted=(0,))])  # never drafted: left out
    counts = class_counts(windows, {"a": "copy", "b": "copy", "d": "chat"}, width=4)
    assert counts == {"copy": ([3, 2, 2, 0], [4, 4, 4, 0]), "default": ([1, 0, 0, 0],
                                                                     [1, 0, 0, 0])}


def test_class_prior_weighs_classes_by_their_requests_over_the_positions_all_measured():
    own, fleet = {"copy": (0.9, 0.9, 0.9), "code": (0.6, 0.4)}, {"chat": (0.3, 0.1, 0.05),
                                                                  "copy": (0.8, 0.8, 0.8)}
    # The fleet's rates for a class first (more evidence); the replica's own fill a class
    # the hub has not heard of (code). Positions beyond the shortest are left to the policy.
    assert mixture(Counter(copy=3, chat=1), own, fleet) == pytest.approx(
        ((3 * 0.8 + 0.3) / 4, (3 * 0.8 + 0.1) / 4, (3 * 0.8 + 0.05) / 4))
    assert mixture(Counter(copy=1, code=1), own, fleet) == pytest.approx((0.7, 0.6))
    assert mixture(Counter(unknown=5, copy=0), own, fleet) == ()


def test_class_rates_decay_per_position_and_keep_the_positions_a_shallow_k_left_alone():
    assert rates_from_counts([8, 4, 0], [10, 10, 0]) == (0.8, 0.4)  # a prefix: K=2
    assert blend_rates(None, (0.8, 0.4)) == (0.8, 0.4)
    assert blend_rates((0.8, 0.4, 0.2), (0.5,)) == pytest.approx((0.71, 0.4, 0.2))
    classes = ClassAcceptance()
    classes.observe({"greedy": ([9, 9], [10, 10]), "sampled": ([0, 0], [0, 0])})
    assert classes.own == {"greedy": (0.9, 0.9)}, "a class that drafted nothing says nothing"
    assert classes.prior(Counter(greedy=2))[:2] == ((0.9, 0.9), 2)
    prior = classes.prior(Counter(greedy=1, sampled=1), {"g": "greedy", "s": "sampled"})
    assert prior.request_rates("g") == (0.9, 0.9), "a request is priced by its own class"
    assert prior.request_rates("s") == () and prior.request_rates("x") == ()


def test_simulator_caps_a_requests_drafts_and_its_step_cost_follows():
    """Two requests at K=15, one capped at 1: a step verifies 16 drafts, not 30, costs what
    16 drafts cost, counts the 14 closed slots, and the capped request's window says 1."""
    async def run() -> tuple[SimulatedEngine, list]:
        engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, max_num_seqs=4)
        for name, request_class in (("copy", "high"), ("free", "low")):
            engine.submit(GenerationRequest(name, prompt="a b c", max_tokens=200,
                                            request_class=request_class))
        engine.admit()
        await engine.set_draft_caps({"free": 1, "gone": 3})  # unknown ids are ignored
        return engine, [engine.step() for _ in range(3)]

    engine, seconds = asyncio.run(run())
    steps = engine.drain_steps()
    # The free request, capped at 1, leaves positions 1-14 closed; the copy drafts all 15.
    assert all((s.draft_tokens, s.draft_slots) == (16, 16) for s in steps)
    assert all(s.slots_per_pos == (2,) + (1,) * 14 for s in steps)
    assert seconds[0] == pytest.approx(engine.preset.step_seconds(2, 15, 16))
    assert seconds[0] < engine.preset.step_seconds(2, 15)
    windows = engine.request_acceptance()
    drafted = dict(zip(windows.request_ids, windows.drafted[:, -1].tolist(), strict=True))
    assert drafted == {"copy": 15, "free": 1}
    asyncio.run(engine.set_draft_caps({}))  # new caps replace the old: none left
    engine.step()
    assert engine.drain_steps()[0].draft_tokens == 30


def test_control_loop_sends_a_policys_caps_and_lifts_them_for_a_policy_without():
    class Capping:
        reads_requests, needs_requests, decides_on_arrival = False, False, False

        def decide(self, signals: Signals) -> Decision:
            assert signals.draft_caps_apply
            return Decision(15, "cap", draft_caps={"r0": 1})

    engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15, max_num_seqs=4)
    for i in range(2):
        engine.submit(GenerationRequest(f"r{i}", prompt="a b c", max_tokens=200))
    pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=15)
    asyncio.run(pool.apply_initial())
    loop = ControlLoop(engine, pool, Capping())
    engine.admit()

    def window() -> list[int]:
        for _ in range(loop.decide_every_steps):
            engine.step()
        steps, _, _ = asyncio.run(loop.tick())
        return [s.draft_tokens for s in steps]

    window()
    assert window() == [16] * loop.decide_every_steps
    loop.replace_policy(build_policy({"name": "static", "k": 15}, pool.candidates))
    window()
    assert window() == [30] * loop.decide_every_steps


@pytest.mark.parametrize(("candidates", "initial_k"), [
    ((0, 1), 3), ((0, 99), None), ((3, 1), None), ((), None),
    # Not coerced: a client's JSON mistakes, not tier lists.
    ("0137", None), ((0, 1.9, "3"), None), ((0, True), None), ((0, 1), True)])
def test_a_bad_candidate_change_leaves_the_pool_as_it_was(candidates, initial_k):
    engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15)
    pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=7)
    asyncio.run(pool.apply_initial())
    with pytest.raises(ValueError):
        asyncio.run(pool.set_candidates(candidates, initial_k))
    assert (pool.candidates, pool.active_k, engine.k) == ((0, 1, 3, 7, 15), 7, 7)
    change = asyncio.run(pool.set_candidates((0, 2, 5)))
    assert (pool.candidates, pool.active_k, change.from_k) == ((0, 2, 5), 5, 7)


def test_a_tier_the_engine_refuses_leaves_the_pool_as_it_was():
    """SGLang refuses a tier it did not prepare at start-up: the new candidates must not stay
    with the old tier active outside them."""
    class Refusing(SimulatedEngine):
        async def set_k(self, k: int) -> None:
            if k == 5:
                raise RuntimeError("K=5 is not a prepared tier")
            await super().set_k(k)

    engine = Refusing(PRESETS["cpu-demo"], kmax=15)
    pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=7)
    asyncio.run(pool.apply_initial())
    with pytest.raises(RuntimeError):
        asyncio.run(pool.set_candidates((0, 2, 5)))
    assert (pool.candidates, pool.active_k, engine.k) == ((0, 1, 3, 7, 15), 7, 7)


@pytest.fixture
def bare_replica() -> Iterator[EngineReplica]:
    """An engine replica on the simulator at static K=7, built without Serve."""
    class Replica(EngineReplica):
        def __del__(self) -> None:  # the real one shuts down a started replica's engine
            pass

    engine = SimulatedEngine(PRESETS["cpu-demo"], kmax=15)
    replica = object.__new__(Replica)  # no Serve replica context needed
    replica.replica_id, replica.engine = "r", engine
    replica.pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=7)
    asyncio.run(replica.pool.apply_initial())
    replica.policy_config = {"name": "static", "k": 7}
    replica.loop = ControlLoop(engine, replica.pool, build_policy(replica.policy_config,
                                                                  replica.pool.candidates))
    replica.metrics = ReplicaMetrics("r", replica.pool.candidates)
    replica.active_spans = ActiveSpans()
    replica.stream_interval_s = 0.05
    replica._profile = []
    try:
        yield replica
    finally:
        replica.metrics.shutdown()


@pytest.mark.parametrize("policy", ["goodput", None, {"name": "nope"}])
def test_a_replica_given_a_bad_policy_with_new_candidates_changes_neither(policy, bare_replica):
    """The candidates come first in a change, but a policy that cannot be built must not
    leave the replica on the new tiers under its old policy."""
    replica = bare_replica
    policy_before = replica.loop.policy
    with pytest.raises(ValueError):
        asyncio.run(replica._apply_config({"policy": policy, "candidates": [0, 2, 5],
                                           "stream_interval_ms": 0}))
    assert (replica.pool.candidates, replica.pool.active_k) == ((0, 1, 3, 7, 15), 7)
    assert replica.loop.policy is policy_before and replica.stream_interval_s == 0.05
    asyncio.run(replica._apply_config({"policy": {"name": "static", "k": 2},
                                       "candidates": [0, 2, 5]}))
    assert (replica.pool.candidates, replica.pool.active_k) == ((0, 2, 5), 2)


@pytest.mark.parametrize("change", [{"policy": {"name": "static", "k": 5}},
                                    {"candidates": [0, 1, 3]}])
def test_a_static_k_outside_the_tiers_is_refused_not_rounded(change, bare_replica):
    """A static policy promises its K: K=5 among tiers without it, or tiers that drop the
    static K in force, leave the replica as it was, with a reason that names the tiers."""
    with pytest.raises(ValueError, match=r"static K=\d+ is not one of the candidate tiers"):
        asyncio.run(bare_replica._apply_config(change))
    assert (bare_replica.pool.candidates, bare_replica.pool.active_k) == ((0, 1, 3, 7, 15), 7)
    assert bare_replica.loop.policy.k == 7


def test_one_change_brought_twice_at_once_is_applied_once(bare_replica, monkeypatch):
    """The admin broadcast and the hub's view can bring the same run-time change together,
    and applying it awaits the tier pool: the second must not start over the first (its
    policy rebuilt twice), and an older change that arrives late must not undo a newer."""
    replica = bare_replica
    switching = replica.engine.set_k

    async def slow_set_k(k: int) -> None:
        await asyncio.sleep(0.01)  # the pool's switch yields, as a real engine's does
        await switching(k)

    monkeypatch.setattr(replica.engine, "set_k", slow_set_k)
    built: list[object] = []
    monkeypatch.setattr(replica.loop, "replace_policy",
                        lambda policy, replace=replica.loop.replace_policy:
                        (built.append(policy), replace(policy)))
    newer = {"policy": {"name": "static", "k": 3}, "issued_at": 20.0}
    older = {"policy": {"name": "static", "k": 15}, "issued_at": 10.0}

    async def scenario() -> list[bool]:
        replica._applied_issued_at, replica._config_lock = 0.0, asyncio.Lock()
        return list(await asyncio.gather(replica._apply_in_order(newer, 20.0),
                                         replica._apply_in_order(newer, 20.0),
                                         replica._apply_in_order(older, 10.0)))

    assert asyncio.run(scenario()) == [True, False, False]
    assert len(built) == 1 and replica.pool.active_k == 3


def test_goodput_sent_without_a_profile_takes_the_one_the_replica_was_given(bare_replica):
    """Back to `goodput` after another policy ({"name": "goodput"}): the step costs are the
    machine's, so the deployment's profile comes back with it; `profile: []` is kept."""
    profile = [[1, 0, 0.002], [1, 7, 0.004], [8, 0, 0.005], [8, 7, 0.012]]
    for change in ({"name": "goodput", "profile": profile}, {"name": "static", "k": 3},
                   {"name": "goodput"}):
        asyncio.run(bare_replica._apply_config({"policy": change}))
    assert [list(row) for row in bare_replica.policy_config["profile"]] == profile
    assert bare_replica.loop.policy.costs.predict(8, 7) == pytest.approx(0.012)
    asyncio.run(bare_replica._apply_config({"policy": {"name": "goodput", "profile": []}}))
    assert bare_replica.policy_config["profile"] == []
    assert bare_replica.loop.policy.costs.predict(8, 7) is None


@pytest.mark.parametrize("interval", ["fast", -1, True, float("inf")])
def test_a_replica_changes_its_stream_interval_at_run_time(interval, bare_replica):
    """`stream_interval_ms` alone changes the interval of the streams that start after it
    (the streaming benchmark alternates intervals on one app); a bad value changes nothing."""
    with pytest.raises(ValueError, match="stream_interval_ms"):
        asyncio.run(bare_replica._apply_config({"stream_interval_ms": interval}))
    assert bare_replica.stream_interval_s == 0.05
    asyncio.run(bare_replica._apply_config({"stream_interval_ms": 0}))
    assert bare_replica.stream_interval_s == 0
    assert bare_replica.loop.policy.k == 7, "the policy stays"


def test_switches_made_at_once_apply_one_after_the_other():
    """The control loop and a reconfiguration switching together: the pool's tier is always
    the one the engine was last set to, and each switch starts from the one before."""
    class SlowEngine(SimulatedEngine):
        async def set_k(self, k: int) -> None:
            await asyncio.sleep(0.03 if k == 3 else 0.001)  # a utility call to the engine
            await super().set_k(k)

    async def scenario() -> tuple[TierPool, SimulatedEngine, list]:
        engine = SlowEngine(PRESETS["cpu-demo"], kmax=15)
        pool = TierPool(engine, (0, 1, 3, 7, 15), initial_k=0)
        await pool.apply_initial()
        changes = await asyncio.gather(pool.switch(3), pool.switch(7),
                                       pool.set_candidates((0, 7, 15), initial_k=15))
        return pool, engine, changes

    pool, engine, changes = asyncio.run(scenario())
    assert [(c.from_k, c.to_k) for c in changes] == [(0, 3), (3, 7), (7, 15)]
    assert pool.active_k == engine.k == 15 and pool.switch_count == 3


def test_the_control_loop_reports_how_many_steps_ran_at_the_old_tier_after_a_switch():
    """An engine that takes up a new K three steps late (its next steps were scheduled): the
    loop reports 3 once the first step at the new K comes back, and nothing for the steps
    of the window the decision read, which ran before it."""
    class LateEngine(SimulatedEngine):
        def __init__(self) -> None:
            super().__init__(PRESETS["cpu-demo"], kmax=15)
            self.pending: tuple[int, int] | None = None  # (new K, steps still at the old)

        async def set_k(self, k: int) -> None:
            self.pending = (k, 3)

        def step(self) -> float:
            if self.pending is not None:
                k, left = self.pending
                self.pending = None if left == 0 else (k, left - 1)
                if left == 0:
                    self.k = k
            return super().step()

    async def scenario() -> list[int]:
        engine = LateEngine()
        pool = TierPool(engine, (0, 7), initial_k=0)
        await pool.apply_initial()
        lags: list[int] = []
        loop = ControlLoop(engine, pool, build_policy({"name": "static", "k": 7}, (0, 7)),
                           decide_every_steps=2, on_switch_lag=lags.append)
        engine.submit(GenerationRequest("r", prompt="a", max_tokens=200, temperature=0))
        engine.admit()
        for _ in range(12):
            engine.step()
            await loop.tick()
        assert pool.switch_count == 1 and engine.k == 7
        return lags

    assert asyncio.run(scenario()) == [3]
