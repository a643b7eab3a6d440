"""What a policy sees at each decision: plain values, no Ray, no engine objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepCost:
    """One observed engine step: how long a verify step of `batch` sequences at depth `k` took."""

    batch: int
    k: int
    seconds: float


@dataclass(frozen=True)
class RequestAcceptance:
    """Recent verify outcomes of one running request (oldest first).

    `accepted` holds accepted drafts per verify step (0..k); `drafted` the drafts offered in
    the same steps. Engines that cannot attribute acceptance per request leave this empty.
    """

    request_id: str
    accepted: tuple[int, ...]
    drafted: tuple[int, ...]
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if len(self.accepted) != len(self.drafted):
            raise ValueError(f"request {self.request_id}: {len(self.accepted)} accepted counts "
                             f"for {len(self.drafted)} verify steps")


@dataclass(frozen=True)
class ClusterView:
    """What the telemetry hub knows beyond this replica (absent when the hub is unreachable)."""

    effective_concurrency: int
    """running + waiting + routed-to-this-replica-but-not-admitted."""
    acceptance_prior: tuple[float, ...] = ()
    """Cluster-wide p[k]: share of drafts with more than k accepted, per position k."""

    @classmethod
    def from_hub(cls, view: dict[str, Any], local_load: int) -> ClusterView:
        """From the telemetry hub's answer (`ClusterState.view`). The replica's own count of
        its requests is fresher than the hub's, so the larger of the two counts."""
        return cls(effective_concurrency=max(view["effective_concurrency"], local_load),
                   acceptance_prior=tuple(view["acceptance_prior"]))


@dataclass(frozen=True)
class Signals:
    """Engine activity since the previous decision, plus the replica's cluster view.

    Per-position counts are indexed by draft position (0 = first draft token) and are as long
    as the largest candidate K. `drafted_per_pos[k]` counts drafts that actually reached
    position k, so `accepted_per_pos[k] / drafted_per_pos[k]` is unbiased when K changes.
    """

    candidates: tuple[int, ...]
    current_k: int
    steps: int
    """Engine steps folded into this window."""
    running: int
    waiting: int
    drafts: int = 0
    """Sequence-steps that carried at least one draft token."""
    drafting_sequence_steps: int = 0
    """Sequence-steps run at K > 0, with or without a proposal: prompt-lookup proposes nothing
    where the context has no match, so `drafts` can be far fewer."""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    drafted_per_pos: tuple[int, ...] = ()
    step_costs: tuple[StepCost, ...] = ()
    requests: tuple[RequestAcceptance, ...] = ()
    cluster: ClusterView | None = None
    now_s: float = 0.0
    max_batch: int | None = None
    """The most sequences the engine runs in one step (its max_num_seqs), when known."""
    class_prior: tuple[float, ...] = ()
    """p[k] that the classes of the requests now on the replica showed before (the fleet's
    class statistics, else the replica's own; see `policies.class_acceptance`); empty when no class
    is known. The policy's acceptance prior, and its only hint at K=0, where nothing is
    drafted."""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def local_batch(self) -> int:
        return self.running

    @property
    def effective_concurrency(self) -> int:
        """The cluster view's concurrency when present, else what the engine itself sees."""
        if self.cluster is not None:
            return max(self.cluster.effective_concurrency, self.running)
        return self.running + self.waiting

    def verify_batch(self, concurrency: int) -> int:
        """Sequences a step will verify at this concurrency: demand beyond the engine's batch
        limit waits, and costs no verify work."""
        batch = max(1, concurrency)
        return min(batch, self.max_batch) if self.max_batch else batch

    @property
    def mean_accepted_per_draft(self) -> float | None:
        """Mean accepted drafts per sequence-step (acceptance length - 1); None without drafts."""
        return self.accepted_tokens / self.drafts if self.drafts else None


@dataclass(frozen=True)
class Decision:
    """A policy's answer: the tier to run next and why (for logs, metrics and span events)."""

    k: int
    reason: str = ""
    inputs: dict[str, float] = field(default_factory=dict)
