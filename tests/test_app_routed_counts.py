"""Routers -> hub: routed-not-admitted counts reach the effective concurrency, never blocking."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

from app import router
from app.router import RoutedReporter
from app.telemetry_hub import ClusterState
from policies.class_acceptance import DEFAULT_CLASS


def test_hub_adds_routed_requests_not_yet_in_the_handler():
    hub = ClusterState(stale_after_s=3)
    hub.push("a", {"running": 4, "waiting": 2, "ongoing": 6, "active_k": 3}, now=0.0)
    hub.report_routed("router-1", {"a": 7}, now=0.0)
    hub.report_routed("router-2", {"a": 2, "b": 1}, now=0.0)
    view = hub.view("a")
    assert view["routed"] == 9
    assert view["in_transit"] == 9 - 6
    # Routed requests already in the handler are not counted twice.
    hub.report_routed("router-1", {"a": 3}, now=1.0)
    assert hub.view("a")["in_transit"] == 0
    # A router that went silent stops counting.
    hub.push("a", {"running": 4, "waiting": 2, "ongoing": 6, "active_k": 3}, now=3.5)
    assert hub.view("a")["routed"] == 3


@dataclass(frozen=True)
class _ReplicaID:
    unique_id: str


class _Recorder:
    """Stands in for the hub actor handle: records `report_routed.remote(...)` calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, int]] = []
        self.report_routed = SimpleNamespace(remote=lambda _router, counts: self.calls.append(
            counts))


def test_reporter_rate_limits_sends_the_latest_counts_and_refreshes(monkeypatch):
    monkeypatch.setattr(router, "REPORT_S", 0.05)
    monkeypatch.setattr(router, "REPORT_REFRESH_S", 0.2)

    async def scenario() -> list[dict[str, int]]:
        replica = _ReplicaID("r1")
        in_flight = {replica: 0}
        reporter = RoutedReporter(in_flight, "router-a")
        reporter.hub = _Recorder()
        for _ in range(5):  # a burst: one report now, one with the final count later
            in_flight[replica] += 1
            reporter.changed()
        assert reporter.hub.calls == [{"r1": 1}]
        await asyncio.sleep(0.1)
        assert reporter.hub.calls[-1] == {"r1": 5}
        await asyncio.sleep(0.25)  # unchanged but non-zero: refreshed for the hub
        assert len(reporter.hub.calls) >= 3 and reporter.hub.calls[-1] == {"r1": 5}
        in_flight[replica] = 0
        reporter.changed()
        await asyncio.sleep(0.1)
        calls = len(reporter.hub.calls)
        await asyncio.sleep(0.3)  # zero: no more refreshes
        assert len(reporter.hub.calls) == calls
        return reporter.hub.calls

    assert asyncio.run(scenario())[-1] == {}


def test_router_gathers_each_class_on_its_replicas_and_forgets_finished_requests():
    """The Serve router over stand-in replicas: greedy and sampled requests end up on
    different replicas, and completions release both the load and the class count."""
    gathering = object.__new__(router.ClassGatheringRouter)  # no Serve controller needed
    gathering.initialize_state()
    replicas = [SimpleNamespace(replica_id=_ReplicaID(name), routing_stats={})
                for name in ("r1", "r2")]

    def pending(request_id: str, request_class: str) -> SimpleNamespace:
        return SimpleNamespace(args=[{"request_class": request_class}],
                               metadata=SimpleNamespace(internal_request_id=request_id))

    async def route(request_id: str, request_class: str) -> str:
        request = pending(request_id, request_class)
        ranks = await gathering.choose_replicas(replicas, request)
        chosen = ranks[0][0].replica_id
        gathering.on_request_routed(request, chosen, None)
        return chosen.unique_id

    async def scenario() -> dict[str, set[str]]:
        placed: dict[str, set[str]] = {"greedy": set(), "sampled": set()}
        for i in range(6):
            request_class = "greedy" if i % 2 else "sampled"
            placed[request_class].add(await route(f"q{i}", request_class))
        return placed

    placed = asyncio.run(scenario())
    assert len(placed["greedy"]) == len(placed["sampled"]) == 1
    assert placed["greedy"] != placed["sampled"]
    for i in range(6):
        replica = next(r.replica_id for r in replicas
                       if (r.replica_id.unique_id in placed["greedy"]) == bool(i % 2))
        gathering.on_request_completed(replica, f"q{i}")
    assert sum(gathering.in_flight.values()) == 0
    assert all(not any(c.values()) for c in gathering.in_flight_classes.values())


def test_router_counts_other_routers_requests_in_the_class_share():
    """Two ingress replicas, two routers: what the other router sent shows in the replicas'
    reports per class, so this router sends greedy requests where the other's greedy ones are
    (equal loads otherwise: a coin toss without the per-class report)."""
    gathering = object.__new__(router.ClassGatheringRouter)
    gathering.initialize_state()
    reports = {"r1": {"ongoing_by_router": {"other": {"greedy": 3}}},
               "r2": {"ongoing_by_router": {"other": {"sampled": 3}}}}
    replicas = [SimpleNamespace(replica_id=_ReplicaID(name), routing_stats=stats)
                for name, stats in reports.items()]

    async def first_choice(request_class: str, request_id: str) -> str:
        request = SimpleNamespace(args=[{"request_class": request_class}],
                                  metadata=SimpleNamespace(internal_request_id=request_id))
        ranks = await gathering.choose_replicas(replicas, request)
        return ranks[0][0].replica_id.unique_id

    for i in range(8):  # the choice among equals is random: every draw must agree
        assert asyncio.run(first_choice("greedy", f"g{i}")) == "r1"
        assert asyncio.run(first_choice("sampled", f"s{i}")) == "r2"


def test_router_spills_a_class_from_a_replica_whose_reported_batch_is_full():
    """The replicas report their engine batch (`max_num_seqs`): r1 holds five greedy
    requests of another router and r2 two sampled ones. Without a limit a greedy request
    gathers on r1 (cost 5 against 6); with a batch of 4, r1 would queue two (cost 7)."""
    gathering = object.__new__(router.ClassGatheringRouter)
    gathering.initialize_state()
    request = SimpleNamespace(args=[{"request_class": "greedy"}],
                              metadata=SimpleNamespace(internal_request_id="q"))
    for batch, chosen in ((None, "r1"), (4, "r2")):
        reports = {"r1": {"ongoing_by_router": {"other": {"greedy": 5}}, "max_num_seqs": batch},
                   "r2": {"ongoing_by_router": {"other": {"sampled": 2}},
                          "max_num_seqs": batch}}
        replicas = [SimpleNamespace(replica_id=_ReplicaID(name), routing_stats=stats)
                    for name, stats in reports.items()]
        ranks = asyncio.run(gathering.choose_replicas(replicas, request))
        assert ranks[0][0].replica_id.unique_id == chosen


def _router_over(names: tuple[str, ...]) -> tuple[router.ClassGatheringRouter, list]:
    gathering = object.__new__(router.ClassGatheringRouter)  # no Serve controller needed
    gathering.initialize_state()
    return gathering, [SimpleNamespace(replica_id=_ReplicaID(name), routing_stats={})
                       for name in names]


def _request(request_id: str, request_class: str | None) -> SimpleNamespace:
    """A generation call (the ingress's payload) or, with no class, a `ready` probe."""
    args = [{"request_class": request_class}] if request_class else []
    return SimpleNamespace(args=args, metadata=SimpleNamespace(internal_request_id=request_id))


def test_a_health_probe_is_neither_counted_nor_remembered_as_a_class():
    gathering, replicas = _router_over(("r1", "r2"))
    probe = _request("p", None)
    ranks = asyncio.run(gathering.choose_replicas(replicas, probe))
    gathering.on_request_routed(probe, ranks[0][0].replica_id, None)
    assert not gathering.recent.get("greedy") and gathering.recent.last_class == {}
    assert sum(gathering.in_flight.values()) == 0 and not gathering._reserved


def test_a_request_retried_on_another_replica_releases_both_counts_in_any_order():
    for first_done in ("r1", "r2"):
        gathering, replicas = _router_over(("r1", "r2"))
        request = _request("q", "greedy")
        for replica in replicas:  # routed to r1, rejected, routed again to r2
            gathering.on_request_routed(request, replica.replica_id, None)
        order = sorted(replicas, key=lambda r: r.replica_id.unique_id != first_done)
        for replica in order:
            gathering.on_request_completed(replica.replica_id, "q")
        assert sum(gathering.in_flight.values()) == 0
        assert all(not any(c.values()) for c in gathering.in_flight_classes.values())


def test_requests_chosen_together_count_as_their_class_before_serve_confirms_them(monkeypatch):
    """A wave of one class: the second request sees the first's reservation as its own
    class on that replica, not as another class (which would price the replica as mixed)."""
    gathering, replicas = _router_over(("r1", "r2"))
    seen: list[list] = []
    rank = router.rank_replicas
    monkeypatch.setattr(router, "rank_replicas", lambda loads: seen.append(loads) or rank(loads))
    first = asyncio.run(gathering.choose_replicas(replicas, _request("a", "sampled")))
    asyncio.run(gathering.choose_replicas(replicas, _request("b", "sampled")))
    reserved_on = first[0][0].replica_id.unique_id
    load = next(load for load in seen[1] if load.replica_id == reserved_on)
    assert (load.load, load.same_class) == (1, 1)


def test_a_request_that_completes_before_serve_reports_it_routed_leaves_no_count():
    """Serve's order when the replica finishes while the router still awaits its accept:
    the completion first, then the routing. Nothing may stay counted."""
    gathering, replicas = _router_over(("r1", "r2"))
    request = _request("q", "greedy")
    ranks = asyncio.run(gathering.choose_replicas(replicas, request))
    chosen = ranks[0][0].replica_id
    gathering.on_request_completed(chosen, "q")
    gathering.on_request_routed(request, chosen, None)
    assert sum(gathering.in_flight.values()) == 0
    assert all(not any(c.values()) for c in gathering.in_flight_classes.values())
    assert not gathering._early and not gathering._reserved
    # The next request is counted as usual.
    gathering.on_request_routed(_request("next", "greedy"), chosen, None)
    assert gathering.in_flight[chosen] == 1


def test_a_retry_on_the_replica_that_rejected_it_is_counted_until_it_completes():
    """A rejected attempt completes (Serve cancels it) without being routed; the retry that
    lands on the same replica is a new routing, released by its own completion."""
    gathering, replicas = _router_over(("r1",))
    request = _request("q", "sampled")
    replica = replicas[0].replica_id
    asyncio.run(gathering.choose_replicas(replicas, request))
    gathering.on_request_completed(replica, "q")  # rejected, cancelled
    asyncio.run(gathering.choose_replicas(replicas, request))  # the retry
    gathering.on_request_routed(request, replica, None)
    assert gathering.in_flight[replica] == 1
    gathering.on_request_completed(replica, "q")
    assert gathering.in_flight[replica] == 0


def test_early_completions_are_remembered_only_a_while_and_up_to_a_bound(monkeypatch):
    gathering, replicas = _router_over(("r1",))
    replica = replicas[0].replica_id
    for i in range(router.EARLY_COMPLETIONS_MAX + 50):  # e.g. health probes, never routed
        gathering.on_request_completed(replica, f"probe{i}")
    assert len(gathering._early) == router.EARLY_COMPLETIONS_MAX
    assert "probe0" not in gathering._early
    clock = [time.monotonic() + router.EARLY_COMPLETION_S + 1]
    monkeypatch.setattr(router.time, "monotonic", lambda: clock[0])
    gathering.on_request_completed(replica, "late")
    assert list(gathering._early) == ["late"]


def test_without_an_event_loop_the_reporter_sends_once_and_schedules_nothing():
    """A router callback run outside any event loop: non-zero counts are sent once (no
    endless send -> refresh -> send recursion)."""
    replica = _ReplicaID("r1")
    reporter = RoutedReporter({replica: 2}, "router-a")
    reporter.hub = _Recorder()
    reporter.changed()
    assert reporter.hub.calls == [{"r1": 2}]


def test_a_payload_without_a_class_counts_as_the_class_the_replica_gives_it():
    gathering, replicas = _router_over(("r1",))
    replica = replicas[0].replica_id
    request = SimpleNamespace(args=[{}], metadata=SimpleNamespace(internal_request_id="q"))
    gathering.on_request_routed(request, replica, None)
    assert dict(gathering.in_flight_classes[replica]) == {DEFAULT_CLASS: 1}
