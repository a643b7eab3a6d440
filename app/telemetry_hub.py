"""The telemetry hub: every replica's latest stats, and the cluster view handed back to each.

`ClusterState` is the logic (pure, used as is by the cluster simulation); `TelemetryHub` is the
deployment-scoped Ray actor around it, created, health-checked and restarted by the Serve
controller. Replicas push their stats every telemetry period and read their view in the same
call; routers report how many requests they have in flight to each replica (fire-and-forget).
Nothing on the request path waits on the hub, and a replica that cannot reach it keeps
deciding on local signals.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from observability.per_position import accumulate
from policies.class_acceptance import Rates, fleet_average, fleet_fresh, rates_from_counts

# A replica that has not pushed for this long is dropped from the view (dead or restarting).
STALE_AFTER_S = 3.0
# Per-position counts from the replicas decay with this factor per push, a sliding window.
PRIOR_DECAY = 0.8
# Fleet-wide summaries (per-class acceptance) and expiry are refreshed at most this
# often: they move slowly, and a large fleet pushes often (512 replicas: 1000 pushes a second).
SUMMARY_REFRESH_S = 0.25


class ClusterState:
    """Cluster view assembled from replica pushes (see `push` for the stats schema).

    A push costs O(K), not O(replicas): the acceptance prior is kept as running fleet totals
    of the replicas' decayed per-position counts, and fleet-wide summaries are refreshed at
    most every `SUMMARY_REFRESH_S`."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S):
        self.stale_after_s = stale_after_s
        self.replicas: dict[str, dict[str, Any]] = {}
        self._seen_at: dict[str, float] = {}
        # Per replica, decayed (accepted, drafted) per position; and their fleet sums.
        self._counts: dict[str, tuple[list[float], list[float]]] = {}
        self._total_accepted: list[float] = []
        self._total_drafted: list[float] = []
        self.policy_override: dict[str, Any] | None = None
        self._override_changed_at = 0.0
        # router id -> (when reported, {replica id: requests in flight from that router})
        self._routed: dict[str, tuple[float, dict[str, int]]] = {}
        self._class_acceptance: dict[str, Rates] = {}
        self._class_fresh: dict[str, int] = {}
        self._refreshed_at = float("-inf")

    def report_routed(self, router_id: str, in_flight: dict[str, int],
                      now: float | None = None) -> None:
        """One router's requests in flight per replica (its latest report replaces the last)."""
        now = time.monotonic() if now is None else now
        self._routed[router_id] = (now, dict(in_flight))

    def routed(self, replica_id: str) -> int:
        """Requests all routers have sent to the replica and not yet seen completed."""
        return sum(counts.get(replica_id, 0) for _, counts in self._routed.values())

    def push(self, replica_id: str, stats: dict[str, Any], now: float | None = None
             ) -> dict[str, Any]:
        """Record one replica's stats and return its cluster view.

        `stats` holds at least: running, waiting, ongoing, active_k, and per-position
        `window_accepted` / `window_drafted` counts since its previous push; optionally
        `class_acceptance` (class -> p[k]) and `class_fresh` (class -> leading positions
        measured in its last periods), see `policies.class_acceptance`.
        """
        now = time.monotonic() if now is None else now
        self.replicas[replica_id] = stats
        self._seen_at[replica_id] = now
        self._decay_into(replica_id, stats.get("window_accepted", ()),
                         stats.get("window_drafted", ()))
        self.refresh(now)
        return self.view(replica_id)

    def _decay_into(self, replica_id: str, accepted: Any, drafted: Any) -> None:
        """The replica's counts decay and take its new window; the fleet sums follow."""
        old_accepted, old_drafted = self._counts.get(replica_id, ([], []))
        new_accepted = _decayed_plus(old_accepted, accepted)
        new_drafted = _decayed_plus(old_drafted, drafted)
        self._counts[replica_id] = (new_accepted, new_drafted)
        for total, new, old in ((self._total_accepted, new_accepted, old_accepted),
                                (self._total_drafted, new_drafted, old_drafted)):
            accumulate(total, new)
            accumulate(total, old, sign=-1)

    def refresh(self, now: float) -> None:
        """Expire silent replicas and routers, and recompute the fleet-wide summaries (at
        most every `SUMMARY_REFRESH_S`)."""
        if now - self._refreshed_at < SUMMARY_REFRESH_S:
            return
        self._refreshed_at = now
        self.expire(now)
        self._class_acceptance = fleet_average(stats.get("class_acceptance") or {}
                                               for stats in self.replicas.values())
        self._class_fresh = fleet_fresh(stats.get("class_fresh") or {}
                                        for stats in self.replicas.values())

    def expire(self, now: float) -> list[str]:
        gone = [rid for rid, seen in self._seen_at.items() if now - seen > self.stale_after_s]
        for rid in gone:
            for table in (self.replicas, self._seen_at):
                table.pop(rid, None)
            accepted, drafted = self._counts.pop(rid, ([], []))
            accumulate(self._total_accepted, accepted, sign=-1)
            accumulate(self._total_drafted, drafted, sign=-1)
        # A router that stopped reporting (its ingress went away) no longer counts.
        for router_id in [r for r, (at, _) in self._routed.items()
                          if now - at > self.stale_after_s]:
            del self._routed[router_id]
        return gone

    def acceptance_prior(self) -> tuple[float, ...]:
        """Cluster-wide p[k] (share of drafts with more than k accepted), per position."""
        return rates_from_counts(self._total_accepted, self._total_drafted)

    def view(self, replica_id: str) -> dict[str, Any]:
        ongoing = self.replicas.get(replica_id, {}).get("ongoing", 0)
        # Routed but not in the replica's handler yet: in transit, or held back at a full
        # replica. The replica counts the rest itself, fresher than this view.
        routed = self.routed(replica_id)
        return {
            "in_transit": max(0, routed - ongoing),
            "routed": routed,
            "acceptance_prior": self.acceptance_prior(),
            "class_acceptance": self._class_acceptance,
            "class_fresh": self._class_fresh,
            "policy_override": self.policy_override,
        }

    def set_override(self, user_config: dict[str, Any] | None, at: float) -> None:
        """Newest wins: every replica reports the same change, in any order (a late report of
        an older one is dropped). Changes merge, so a replica started later applies the policy
        of one and the tiers or stream interval of the next; new candidates drop an earlier
        `initial_k`, which was for the old ones. None (a redeploy) forgets them all."""
        if at < self._override_changed_at:
            return
        self._override_changed_at = at
        if user_config is None:
            self.policy_override = None
            return
        merged = dict(self.policy_override or {})
        if "candidates" in user_config:
            merged.pop("initial_k", None)
        self.policy_override = {**merged, **user_config}


@ray.remote(num_cpus=0)
class TelemetryHub:
    """The deployment-scoped actor. Every method is cheap and never blocks."""

    def __init__(self) -> None:
        self.state = ClusterState()

    def push(self, replica_id: str, stats: dict[str, Any]) -> dict[str, Any]:
        return self.state.push(replica_id, stats)

    def report_routed(self, router_id: str, in_flight: dict[str, int]) -> None:
        self.state.report_routed(router_id, in_flight)

    def set_policy_override(self, user_config: dict[str, Any]) -> None:
        """Remember a fleet-wide reconfiguration so replicas started later apply it too."""
        self.state.set_override(user_config, user_config["issued_at"])

    def clear_policy_override(self, at: float) -> None:
        """A redeployed user_config supersedes earlier run-time changes."""
        self.state.set_override(None, at)


def _decayed_plus(old: list[float], window: Any) -> list[float]:
    decayed = [PRIOR_DECAY * value for value in old]
    accumulate(decayed, window)
    return decayed
