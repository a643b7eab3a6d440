"""The cluster request router: gather each request class on few replicas, without queueing.

Ranking (`rank_replicas`, pure, also used by the cluster simulation), over all replicas up to
`RANK_SAMPLE` of them and over a random sample of that many in larger fleets (plus the last
`RECENT_PER_CLASS` replicas this router sent the request's class to, so a large fleet still
finds where the class gathers): least

    load * (1 + affinity * (1 - same_class / load))        (an idle replica costs 0)
        + queue_weight * max(0, load + 1 - batch_limit)

where `load` counts the replica's requests in flight (below), `same_class` those of the
request's class and `batch_limit` the replica's engine batch (`max_num_seqs`, in its routing
stats). With `affinity` 2, a replica that holds only this class is preferred over a mixed one
up to three times as loaded, so similar requests gather and each replica's policy sees a
uniform stream and runs the depth that suits it (copy-like traffic deep, chat-like shallow),
while a burst that piles up on its class's replicas still spills to the others. A batch
mixing both must run one K for all. The second line prices the wait: each request the
replica would hold beyond a full batch, the new one included, waits for a slot before its
first token, so a bursting class spills sooner once its replicas' batches are full (in the
cluster simulation: capacity at the SLO 1.1% under the best local-only mode without it, 3.9%
over it with it; see the README). In the cluster simulation this rule keeps 88-99% of each
replica's batch in one class, where a rule that ranked by reported acceptance kept 71-81%.

The request class comes with the request (`payload["request_class"]`, set by the ingress:
`greedy` (temperature under 1e-5, which vLLM samples as argmax) or `sampled`; without one,
the replicas' `DEFAULT_CLASS`).

Loads stay fresh: a replica reports its handler's requests per router and class (each router
stamps the payloads it routes with its id). A router counts its own requests itself, exactly
and at once, and takes from the report only the other routers' share, in all and of the
class. (Taking the larger of the report and its own count left a replica that had just
finished a batch looking busy until its next report: a whole phase of requests then went to
the other replica.)

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
from collections import Counter, OrderedDict, defaultdict
from typing import Any, NamedTuple, TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from app.telemetry_hub import STALE_AFTER_S
from policies.class_acceptance import DEFAULT_CLASS

CLASS_AFFINITY = 2.0
# Cost of each request a replica would hold beyond its batch limit (see the module docstring).
# In stop 59's cluster-simulation experiment 1 and 2 took about the same capacity at the SLO
# (3.9% and 4.3% over the best local-only mode; 3.9% reproduced in stop 60's tables); 1 gave up
# less of gathering's gain under sustained overload.
QUEUE_WEIGHT = 1.0
# Large fleets: rank a random sample of this many replicas (routing stays O(1) per request,
# as Ray Serve's power-of-two-choices does with two).
RANK_SAMPLE = 16
RECENT_PER_CLASS = 4
REPORT_S = 0.1
RESERVATION_S = 5.0
# Completions that found their request not routed yet (see `on_request_completed`) are kept
# this long, and at most this many (probes and rejected attempts leave some too).
EARLY_COMPLETION_S = 5.0
EARLY_COMPLETIONS_MAX = 1024
# Re-report unchanged non-zero counts this often: the hub forgets silent routers after
# `telemetry_hub.STALE_AFTER_S`.
REPORT_REFRESH_S = STALE_AFTER_S / 3
T = TypeVar("T")
logger = logging.getLogger("ray.serve")


class ReplicaLoad(NamedTuple):  # a tuple: routers build one per candidate per request
    replica_id: str
    load: int
    same_class: int = 0
    """Of `load`, requests of the class being routed."""
    batch_limit: int | None = None
    """The replica's engine batch (`max_num_seqs`), when it reports one."""


def others_in_handler(router_id: str, request_class: str, stats: dict[str, Any]
                      ) -> tuple[int, int]:
    """The other routers' requests in the replica's handler as of its last report (per router
    and class: `ongoing_by_router`), in all and of `request_class`. This router counts its own
    itself, fresher than any report."""
    others = [classes for router, classes in (stats.get("ongoing_by_router") or {}).items()
              if router != router_id]
    return (sum(sum(classes.values()) for classes in others),
            sum(classes.get(request_class, 0) for classes in others))


def gathering_cost(replica: ReplicaLoad, affinity: float = CLASS_AFFINITY) -> float:
    """The replica's load, inflated by the share of it that is another class, plus the
    requests it would queue behind a full batch."""
    if replica.load <= 0:
        return 0.0
    cost = replica.load * (1 + affinity * (1 - replica.same_class / replica.load))
    if replica.batch_limit is not None:
        cost += QUEUE_WEIGHT * max(0, replica.load + 1 - replica.batch_limit)
    return cost


def rank_replicas(replicas: list[ReplicaLoad], affinity: float = CLASS_AFFINITY
                  ) -> list[list[str]]:
    """Ranks of replica ids, best first: the least gathering cost (ties together), then the
    rest by cost (see the module docstring)."""
    if not replicas:
        return []
    scored = sorted((gathering_cost(r, affinity), r.replica_id) for r in replicas)
    top = scored[0][0]
    best = [replica_id for cost, replica_id in scored if cost <= top]
    rest = [replica_id for cost, replica_id in scored if cost > top]
    return [best, rest] if rest else [best]


def pick_warm(tied: list[str], last_class: dict[str, str], request_class: str,
              rng: random.Random) -> str:
    """One of equally ranked replicas (ids): one whose last request was of this class, else
    one that has had none, else any. Idle replicas tie, and at low concurrency every request
    meets a tie: sent where its class went last, it finds the tier and the acceptance windows
    of its class already in place (a copy request that lands on a replica a sampled one just
    brought down to K=0 spends its first steps there), and each class settles on its own
    replicas."""
    def warmth(replica_id: str) -> int:
        last = last_class.get(replica_id)
        return 0 if last == request_class else 1 if last is None else 2

    warmest = min(map(warmth, tied))
    return rng.choice([replica_id for replica_id in tied if warmth(replica_id) == warmest])


class RecentByClass:
    """The last few distinct replicas (ids) each request class was sent to, and the class
    each replica was sent last (`last_class`, for `pick_warm`)."""

    def __init__(self, size: int = RECENT_PER_CLASS):
        self.size = size
        self._recent: dict[str, list[str]] = {}
        self.last_class: dict[str, str] = {}

    def get(self, request_class: str) -> list[str]:
        return self._recent.get(request_class, [])

    def record(self, request_class: str, replica_id: str) -> None:
        recent = self._recent.setdefault(request_class, [])
        if replica_id in recent:
            recent.remove(replica_id)
        recent.insert(0, replica_id)
        del recent[self.size:]
        self.last_class[replica_id] = request_class


def sample_candidates(replicas: list[T], rng: random.Random, also: list[T] = ()) -> list[T]:
    """All replicas up to `RANK_SAMPLE`, else a random sample of that many plus `also` (the
    replicas where the request's class went last)."""
    if len(replicas) <= RANK_SAMPLE:
        return replicas
    sample = rng.sample(replicas, RANK_SAMPLE)
    return sample + [r for r in also if r not in sample]


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
        except RuntimeError:  # no event loop in this thread: report now rather than never,
            self._send(refresh=False)  # and once: nothing could run a later refresh
            return
        if delay <= 0:
            self._send()
        else:
            self._timer, self._due = loop.call_later(delay, self._send), due

    def _send(self, refresh: bool = True) -> None:
        self._timer = None
        self._last_sent = time.monotonic()
        counts = {rid.unique_id: n for rid, n in self._in_flight.items() if n}
        with contextlib.suppress(Exception):  # the hub may be restarting; next report retries
            self.hub.report_routed.remote(self.router_id, counts)  # result never awaited
        if counts and refresh:
            self._schedule(REPORT_REFRESH_S)


class ClassGatheringRouter(RequestRouter):
    """Ray Serve request router for engine replicas (alpha API, ray 2.60)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.in_flight: defaultdict[ReplicaID, int] = defaultdict(int)
        self.in_flight_classes: defaultdict[ReplicaID, Counter[str]] = defaultdict(Counter)
        # Routed and not completed, by (request, replica): a request Serve retried on another
        # replica completes on each, in either order, and each releases its own count.
        self._routed: dict[tuple[str, ReplicaID], str] = {}
        # Chosen, not yet confirmed routed: requests that arrive together (a new wave) must
        # not all see the same counts and pick the same replica. (replica, class, when)
        self._reserved: dict[str, tuple[ReplicaID, str, float]] = {}
        # Completions that came before their routing (see `on_request_completed`), by
        # request: (when, replicas), oldest first.
        self._early: OrderedDict[str, tuple[float, set[ReplicaID]]] = OrderedDict()
        self.recent = RecentByClass()
        self.router_id = uuid.uuid4().hex
        self.reporter = RoutedReporter(self.in_flight, self.router_id)
        self.rng = random.Random()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        payload = _payload(pending_request)
        if payload is not None:  # the replica counts its requests per router (others_in_handler)
            payload["router_id"] = self.router_id
        request_class = _request_class(payload)
        # Only generation is gathered and counted: a health probe (`ready`) is no request of
        # any class, and must not move where a class went last.
        request_id = pending_request.metadata.internal_request_id \
            if pending_request is not None and payload is not None else None
        # A retry chooses afresh; a completion before it was an earlier attempt's (rejected).
        self._reserved.pop(request_id, None)
        self._early.pop(request_id, None)
        reserved, reserved_same = self._reserved_counts(request_class)
        if len(candidate_replicas) > RANK_SAMPLE:
            wanted = set(self.recent.get(request_class))
            recent = [r for r in candidate_replicas if r.replica_id.unique_id in wanted]
            candidate_replicas = sample_candidates(candidate_replicas, self.rng, recent)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = []
        for replica in candidate_replicas:
            stats = replica.routing_stats or {}
            self.reporter.hub = stats.get("hub") or self.reporter.hub
            others, others_same = others_in_handler(self.router_id, request_class, stats)
            own = self.in_flight.get(replica.replica_id, 0) + reserved[replica.replica_id]
            own_same = self.in_flight_classes[replica.replica_id][request_class] + \
                reserved_same[replica.replica_id]
            loads.append(ReplicaLoad(replica.replica_id.unique_id, own + others,
                                     own_same + others_same, stats.get("max_num_seqs")))
        best, *rest = rank_replicas(loads)
        # Serve tries the first rank first: make it one replica.
        pick = pick_warm(best, self.recent.last_class, request_class, self.rng)
        ranks = [[pick], *([[r for r in best if r != pick]] if len(best) > 1 else []), *rest]
        if request_id is not None:
            self._reserved[request_id] = (by_id[pick].replica_id, request_class,
                                          time.monotonic())
            self.recent.record(request_class, pick)
        logger.debug("routing a %s request over %s: %s", request_class, loads, ranks)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def _reserved_counts(self, request_class: str
                         ) -> tuple[Counter[ReplicaID], Counter[ReplicaID]]:
        """Reservations per replica, in all and of `request_class`; one Serve never
        confirmed (the request was cancelled while queued) lapses after `RESERVATION_S`."""
        now = time.monotonic()
        for request_id in [r for r, (_, _, at) in self._reserved.items()
                           if now - at > RESERVATION_S]:
            del self._reserved[request_id]
        return (Counter(replica for replica, _, _ in self._reserved.values()),
                Counter(replica for replica, cls, _ in self._reserved.values()
                        if cls == request_class))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        payload = _payload(pending_request)
        if payload is None:  # not a generation request (see `choose_replicas`)
            return
        request_id = pending_request.metadata.internal_request_id
        request_class = _request_class(payload)
        self._reserved.pop(request_id, None)
        early = self._early.get(request_id)
        if early is not None and replica_id in early[1]:  # it finished already: not in flight
            early[1].discard(replica_id)
            if not early[1]:
                del self._early[request_id]
            return
        self.in_flight[replica_id] += 1
        self.in_flight_classes[replica_id][request_class] += 1
        self._routed[(request_id, replica_id)] = request_class
        self.reporter.changed()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Serve registers the completion callback before it learns that the replica took the
        request, and reports the routing only then: a request that finishes in between
        completes before it is routed. Such a completion is remembered a while, so that the
        routing that follows is not counted (it would never be released)."""
        request_class = self._routed.pop((internal_request_id, replica_id), None)
        if request_class is None:
            self._remember_early(internal_request_id, replica_id)
            return
        self.in_flight[replica_id] = max(0, self.in_flight[replica_id] - 1)
        classes = self.in_flight_classes[replica_id]
        classes[request_class] = max(0, classes[request_class] - 1)
        self.reporter.changed()

    def _remember_early(self, request_id: str, replica_id: ReplicaID) -> None:
        now = time.monotonic()
        self._early.setdefault(request_id, (now, set()))[1].add(replica_id)
        while self._early:  # the oldest first: expired, or beyond the bound
            _, (at, _) = next(iter(self._early.items()))
            if now - at <= EARLY_COMPLETION_S and len(self._early) <= EARLY_COMPLETIONS_MAX:
                break
            self._early.popitem(last=False)


def _request_class(payload: dict[str, Any] | None) -> str:
    return payload.get("request_class", DEFAULT_CLASS) if payload else DEFAULT_CLASS


def _payload(pending_request: PendingRequest | None) -> dict[str, Any] | None:
    """The ingress's request payload (a dict, the call's first argument), if that is what
    is being routed."""
    if pending_request is None or not pending_request.args:
        return None
    payload = pending_request.args[0]
    return payload if isinstance(payload, dict) else None
