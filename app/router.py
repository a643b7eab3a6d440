"""The cluster request router: least effective load first, then the tier that fits the request.

Ranking (`rank_replicas`, pure, also used by the cluster simulation):
1. effective load: the replica's own count (running + waiting + in its handler, from its
   routing stats, pushed every stats period) or this router's requests in flight to it,
   whichever is larger (the router's count is fresh, the stats see other routers' traffic);
2. among replicas within `load_slack` of the least loaded, tier fit: a request whose class
   is expected to accept most drafts goes to the deepest active tier, one expected to accept
   few goes to the shallowest, so each replica's policy sees a more uniform stream.

The request class comes with the request (`payload["request_class"]`, set by the ingress:
`greedy` or `sampled`); its expected acceptance is learned from the replicas' reported
per-class acceptance and falls back to greedy = high, sampled = low.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

HIGH_ACCEPTANCE = 0.5
DEFAULT_CLASS_ACCEPTANCE = {"greedy": 0.8, "sampled": 0.1}


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    load: int
    active_k: int


def expected_acceptance(request_class: str, reports: list[dict[str, float]]) -> float:
    """Mean reported acceptance of the class across replicas, else the default guess."""
    values = [r[request_class] for r in reports if r.get(request_class) is not None]
    if values:
        return sum(values) / len(values)
    return DEFAULT_CLASS_ACCEPTANCE.get(request_class, HIGH_ACCEPTANCE)


def rank_replicas(replicas: list[ReplicaLoad], acceptance: float,
                  load_slack: int = 1) -> list[list[str]]:
    """Ranks of replica ids, best first (see the module docstring)."""
    if not replicas:
        return []
    least = min(r.load for r in replicas)
    near = [r for r in replicas if r.load <= least + load_slack]
    deep_first = acceptance >= HIGH_ACCEPTANCE
    near.sort(key=lambda r: (r.load, -r.active_k if deep_first else r.active_k))
    best_k = near[0].active_k
    best = [r.replica_id for r in near if r.active_k == best_k and r.load == near[0].load]
    rest = sorted((r for r in replicas if r.replica_id not in best), key=lambda r: r.load)
    return [best, [r.replica_id for r in rest]] if rest else [best]


class TierAwareRouter(RequestRouter):
    """Ray Serve request router for engine replicas (alpha API, ray 2.60)."""

    def initialize_state(self, load_slack: int = 1, **kwargs: Any) -> None:
        self.load_slack = load_slack
        self.in_flight: defaultdict[ReplicaID, int] = defaultdict(int)
        self._request_replica: dict[str, ReplicaID] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = []
        reports = []
        for replica in candidate_replicas:
            stats = replica.routing_stats or {}
            own = self.in_flight.get(replica.replica_id, 0)
            loads.append(ReplicaLoad(replica.replica_id.unique_id,
                                     max(int(stats.get("effective", 0)), own),
                                     int(stats.get("active_k", 0))))
            reports.append(stats.get("class_acceptance") or {})
        acceptance = expected_acceptance(_request_class(pending_request), reports)
        ranks = rank_replicas(loads, acceptance, self.load_slack)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self.in_flight[replica_id] += 1
        self._request_replica[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._request_replica.pop(internal_request_id, None) is not None:
            self.in_flight[replica_id] = max(0, self.in_flight[replica_id] - 1)


def _request_class(pending_request: PendingRequest | None) -> str:
    if pending_request is None or not pending_request.args:
        return "greedy"
    payload = pending_request.args[0]
    return payload.get("request_class", "greedy") if isinstance(payload, dict) else "greedy"
