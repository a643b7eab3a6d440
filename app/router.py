"""The cluster request router: least effective load first, then the tier that fits the request.

Ranking (`rank_replicas`, pure, also used by the cluster simulation), over all replicas up to
`RANK_SAMPLE` of them and over a random sample of that many in larger fleets:
1. load: this router's requests in flight to the replica plus the other routers' (see
   below);
2. among replicas within a slack of the least loaded (`load_slack` requests, or a share of
   the least load when that is larger), acceptance fit: the replica whose recent traffic lands
   drafts most like this request's class is expected to (first-draft acceptance, reported by
   the replicas), then the tier: deepest for a class that accepts most drafts, shallowest for
   one that accepts few. Similar requests gather on the same replicas, so each replica's
   policy sees a uniform stream and can run the depth that suits it.

The request class comes with the request (`payload["request_class"]`, set by the ingress:
`greedy` (temperature 0) or `sampled`); its expected acceptance is learned from the replicas'
reported per-class acceptance and falls back to greedy = high, sampled = low.

Loads stay fresh: a replica reports its handler's requests per router (each router stamps the
payloads it routes with its id). A router counts its own requests itself, exactly and at once,
and takes from the report only the other routers' share. (Taking the larger of the report and
its own count left a replica that had just finished a batch looking busy until its next
report: a whole phase of requests then went to the other replica.)

The router also tells the telemetry hub how many requests it has in flight to each replica
(`RoutedReporter`): fire-and-forget actor calls, at most one per `REPORT_S`, refreshed while
any are in flight, so the hub's effective concurrency counts what the routers sent. The hub's
handle comes with the replicas' routing stats. Serve counts a request as routed once the replica
accepted it (rejection protocol), so the hub's routed-minus-in-handler difference is the
in-transit window and completions not yet seen by the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import Counter, defaultdict
from typing import Any, NamedTuple, TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

HIGH_ACCEPTANCE = 0.5
LOAD_SLACK_RATIO = 0.25
# Large fleets: rank a random sample of this many replicas (routing stays O(1) per request,
# as Ray Serve's power-of-two-choices does with two).
RANK_SAMPLE = 16
DEFAULT_CLASS_ACCEPTANCE = {"greedy": 0.8, "sampled": 0.1}
REPORT_S = 0.1
RESERVATION_S = 5.0
# Re-report unchanged non-zero counts this often: the hub forgets silent routers after 3 s.
REFRESH_S = 1.0
T = TypeVar("T")
logger = logging.getLogger("ray.serve")


class ReplicaLoad(NamedTuple):  # a tuple: routers build one per candidate per request
    replica_id: str
    load: int
    active_k: int
    acceptance: float | None = None
    """The replica's recent first-draft acceptance (None before it has drafted)."""


def replica_load(router_id: str, own_in_flight: int, stats: dict[str, Any]) -> int:
    """This router's requests in flight to the replica, plus the other routers' requests in
    its handler as of its last report (`ongoing` less this router's share of it)."""
    mine = (stats.get("ongoing_by_router") or {}).get(router_id, 0)
    return own_in_flight + max(0, int(stats.get("ongoing", 0)) - mine)


def expected_acceptance(request_class: str, reports: list[dict[str, float]]) -> float:
    """Mean reported acceptance of the class across replicas, else the default guess."""
    values = [r[request_class] for r in reports if r.get(request_class) is not None]
    if values:
        return sum(values) / len(values)
    return DEFAULT_CLASS_ACCEPTANCE.get(request_class, HIGH_ACCEPTANCE)


def rank_replicas(replicas: list[ReplicaLoad], acceptance: float, load_slack: int = 1,
                  load_slack_ratio: float = LOAD_SLACK_RATIO) -> list[list[str]]:
    """Ranks of replica ids, best first (see the module docstring). The slack is the larger
    of `load_slack` requests and `load_slack_ratio` of the least load: at batch 30, one
    request of difference is noise, and a slack that small would never let tier fit decide."""
    if not replicas:
        return []
    least = min(r.load for r in replicas)
    slack = max(load_slack, int(load_slack_ratio * least))
    near = [r for r in replicas if r.load <= least + slack]
    deep_first = acceptance >= HIGH_ACCEPTANCE

    def fit(r: ReplicaLoad) -> tuple[float, int, int]:
        # Closest traffic first (a replica that has not drafted yet is a middling match),
        # then the tier that suits the request, then load.
        distance = abs(acceptance - r.acceptance) if r.acceptance is not None else 0.25
        return round(distance, 2), -r.active_k if deep_first else r.active_k, r.load

    scored = [(fit(r), r.replica_id) for r in near]  # fit once per replica: a hot path
    top = min(score for score, _ in scored)
    best = [replica_id for score, replica_id in scored if score == top]
    rest = sorted((r for r in replicas if r.replica_id not in best), key=lambda r: r.load)
    return [best, [r.replica_id for r in rest]] if rest else [best]


def sample_candidates(replicas: list[T], rng: random.Random) -> list[T]:
    """All replicas up to `RANK_SAMPLE`, else a random sample of that many."""
    return replicas if len(replicas) <= RANK_SAMPLE else rng.sample(replicas, RANK_SAMPLE)


class RoutedReporter:
    """Sends a router's in-flight counts to the hub without ever waiting for it."""

    def __init__(self, in_flight: dict[ReplicaID, int], router_id: str):
        self.router_id = router_id
        self.hub: Any = None
        self._in_flight = in_flight
        self._last_sent = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0

    def changed(self) -> None:
        """Counts changed: send now, or as soon as the rate limit allows."""
        if self.hub is not None:
            self._schedule(REPORT_S - (time.monotonic() - self._last_sent))

    def _schedule(self, delay: float) -> None:
        due = time.monotonic() + delay
        if self._timer is not None:
            if self._due <= due:
                return  # an earlier report is already planned
            self._timer.cancel()
            self._timer = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop in this thread: report now rather than never
            delay = 0
        if delay <= 0:
            self._send()
        else:
            self._timer, self._due = loop.call_later(delay, self._send), due

    def _send(self) -> None:
        self._timer = None
        self._last_sent = time.monotonic()
        counts = {rid.unique_id: n for rid, n in self._in_flight.items() if n}
        with contextlib.suppress(Exception):  # the hub may be restarting; next report retries
            self.hub.report_routed.remote(self.router_id, counts)  # result never awaited
        if counts:
            self._schedule(REFRESH_S)


class TierAwareRouter(RequestRouter):
    """Ray Serve request router for engine replicas (alpha API, ray 2.60)."""

    def initialize_state(self, load_slack: int = 1, **kwargs: Any) -> None:
        self.load_slack = load_slack
        self.in_flight: defaultdict[ReplicaID, int] = defaultdict(int)
        self._request_replica: dict[str, ReplicaID] = {}
        # Chosen, not yet confirmed routed: requests that arrive together (a new wave) must
        # not all see the same counts and pick the same replica.
        self._reserved: dict[str, tuple[ReplicaID, float]] = {}
        self.router_id = uuid.uuid4().hex
        self.reporter = RoutedReporter(self.in_flight, self.router_id)
        self.rng = random.Random()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        payload = _payload(pending_request)
        if payload is not None:  # the replica counts its requests per router (replica_load)
            payload["router_id"] = self.router_id
        request_id = pending_request.metadata.internal_request_id if pending_request else None
        self._reserved.pop(request_id, None)  # a retry chooses afresh
        reserved = self._reserved_counts()
        candidate_replicas = sample_candidates(candidate_replicas, self.rng)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = []
        reports = []
        for replica in candidate_replicas:
            stats = replica.routing_stats or {}
            self.reporter.hub = stats.get("hub") or self.reporter.hub
            loads.append(ReplicaLoad(replica.replica_id.unique_id,
                                     replica_load(self.router_id,
                                                  self.in_flight.get(replica.replica_id, 0) +
                                                  reserved[replica.replica_id], stats),
                                     int(stats.get("active_k", 0)),
                                     stats.get("first_acceptance")))
            reports.append(stats.get("class_acceptance") or {})
        request_class = payload.get("request_class", "greedy") if payload else "greedy"
        acceptance = expected_acceptance(request_class, reports)
        best, *rest = rank_replicas(loads, acceptance, self.load_slack)
        pick = self.rng.choice(best)  # Serve tries the first rank first: make it one replica
        ranks = [[pick], *([[r for r in best if r != pick]] if len(best) > 1 else []), *rest]
        if request_id is not None:
            self._reserved[request_id] = (by_id[pick].replica_id, time.monotonic())
        logger.debug("routing a request of acceptance %.2f over %s: %s", acceptance, loads,
                     ranks)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def _reserved_counts(self) -> Counter[ReplicaID]:
        """Reservations per replica; one Serve never confirmed (the request was cancelled
        while queued) lapses after `RESERVATION_S`."""
        now = time.monotonic()
        for request_id in [r for r, (_, at) in self._reserved.items()
                           if now - at > RESERVATION_S]:
            del self._reserved[request_id]
        return Counter(replica for replica, _ in self._reserved.values())

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self._reserved.pop(pending_request.metadata.internal_request_id, None)
        self.in_flight[replica_id] += 1
        self._request_replica[pending_request.metadata.internal_request_id] = replica_id
        self.reporter.changed()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._request_replica.pop(internal_request_id, None) is not None:
            self.in_flight[replica_id] = max(0, self.in_flight[replica_id] - 1)
            self.reporter.changed()


def _payload(pending_request: PendingRequest | None) -> dict[str, Any] | None:
    """The ingress's request payload (a dict, the call's first argument), if that is what
    is being routed."""
    if pending_request is None or not pending_request.args:
        return None
    payload = pending_request.args[0]
    return payload if isinstance(payload, dict) else None
