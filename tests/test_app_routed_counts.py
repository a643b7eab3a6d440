"""Routers -> hub: routed-not-admitted counts reach the effective concurrency, never blocking."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

from app import router
from app.router import RoutedReporter
from app.telemetry_hub import ClusterState


def test_hub_adds_routed_requests_not_yet_in_the_handler():
    hub = ClusterState(stale_after_s=3)
    hub.push("a", {"running": 4, "waiting": 2, "ongoing": 6, "active_k": 3}, now=0.0)
    hub.report_routed("router-1", {"a": 7}, now=0.0)
    hub.report_routed("router-2", {"a": 2, "b": 1}, now=0.0)
    view = hub.view("a")
    assert view["routed"] == 9
    assert view["effective_concurrency"] == 6 + (9 - 6)
    # Routed requests already in the handler are not counted twice.
    hub.report_routed("router-1", {"a": 3}, now=1.0)
    assert hub.view("a")["effective_concurrency"] == 6
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
    monkeypatch.setattr(router, "REFRESH_S", 0.2)

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
