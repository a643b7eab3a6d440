"""What a policy sees at each decision: plain values, no Ray, no engine objects."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepCost:
    """One observed engine step: how long a verify step of `batch` sequences took with
    `depth` draft tokens per sequence (the tier's K when every sequence proposed K drafts;
    fewer when the drafter proposed fewer, as prompt lookup does without a match)."""

    batch: int
    depth: int
    seconds: float


@dataclass(frozen=True)
class RequestAcceptance:
    """Recent verify outcomes of one running request (oldest first).

    `accepted` holds accepted drafts per verify step (0..k); `drafted` the drafts offered in
    the same steps.
    """

    request_id: str
    accepted: tuple[int, ...]
    drafted: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.accepted) != len(self.drafted):
            raise ValueError(f"request {self.request_id}: {len(self.accepted)} accepted counts "
                             f"for {len(self.drafted)} verify steps")


# Verify outcomes an engine keeps per running request (`Engine.request_acceptance`): the
# widest window a policy can read. DSDE uses 30.
REQUEST_WINDOW = 30


def _no_outcomes() -> np.ndarray:
    return np.zeros((0, 0), np.int64)


@dataclass(frozen=True, eq=False)
class RequestWindows:
    """The requests' recent verify outcomes, one row per request (`request_ids`): the
    engine's running requests, and (`with_new`) empty rows for requests the replica holds
    that have none yet.

    Row i holds the request's last `lengths[i]` outcomes in its last columns, oldest first:
    `accepted[i, j]` of `drafted[i, j]` drafts landed. The columns before them are zeros, a
    step that neither drafted nor landed anything, so counts by position can run over whole
    arrays. Arrays rather than one object per request: a decision reads a whole batch (64 x
    30 outcomes), and the cluster simulation millions of them. Engines that cannot attribute
    acceptance to requests report none (the empty default).
    """

    request_ids: tuple[str, ...] = ()
    accepted: np.ndarray = field(default_factory=_no_outcomes)
    drafted: np.ndarray = field(default_factory=_no_outcomes)
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __post_init__(self) -> None:
        rows = len(self.request_ids)
        # The lengths checked from a list: on these few rows numpy's per-call overhead costs
        # more than the check (the simulator builds windows at every step that finishes one).
        if self.accepted.ndim != 2 or self.accepted.shape != self.drafted.shape or \
                self.accepted.shape[0] != rows or self.lengths.shape != (rows,) or \
                not all(0 <= n <= self.accepted.shape[1] for n in self.lengths.tolist()):
            raise ValueError(f"{rows} requests with accepted {self.accepted.shape}, drafted "
                             f"{self.drafted.shape} and lengths {self.lengths.tolist()}")

    @classmethod
    def of(cls, requests: Sequence[RequestAcceptance]) -> RequestWindows:
        """Rows from per-request outcomes (as an engine that keeps them per request has them)."""
        width = max((len(r.accepted) for r in requests), default=0)
        accepted = np.zeros((len(requests), width), np.int64)
        drafted = np.zeros((len(requests), width), np.int64)
        for row, request in enumerate(requests):
            accepted[row, width - len(request.accepted):] = request.accepted
            drafted[row, width - len(request.drafted):] = request.drafted
        return cls(tuple(r.request_id for r in requests), accepted, drafted,
                   np.array([len(r.accepted) for r in requests], np.int64))

    def with_new(self, request_ids: Iterable[str], limit: int | None = None) -> RequestWindows:
        """These rows plus an empty one for each of `request_ids` not among them, the first
        `limit` of them at most: requests the replica holds that have not run a verify step
        yet (just taken, or waiting). A policy prices such a request by its class until its
        own outcomes arrive."""
        known = set(self.request_ids)
        new = [request_id for request_id in request_ids if request_id not in known][:limit]
        if not new:
            return self
        width = self.accepted.shape[1]
        empty = np.zeros((len(new), width), np.int64)
        return RequestWindows(self.request_ids + tuple(new),
                              np.vstack([self.accepted, empty]),
                              np.vstack([self.drafted, empty]),
                              np.concatenate([self.lengths, np.zeros(len(new), np.int64)]))

    @classmethod
    def joined(cls, parts: Sequence[RequestWindows]) -> RequestWindows:
        """The rows of `parts`, one after another (narrower windows padded on the left with
        steps that neither drafted nor landed)."""
        parts = [part for part in parts if len(part)]
        if len(parts) <= 1:
            return parts[0] if parts else cls()
        width = max(part.accepted.shape[1] for part in parts)

        def padded(rows: np.ndarray) -> np.ndarray:
            # Not np.pad: its generality made a 64-replica cluster simulation take 15% longer.
            if rows.shape[1] == width:
                return rows
            out = np.zeros((rows.shape[0], width), rows.dtype)
            out[:, width - rows.shape[1]:] = rows
            return out

        return cls(tuple(rid for part in parts for rid in part.request_ids),
                   np.vstack([padded(part.accepted) for part in parts]),
                   np.vstack([padded(part.drafted) for part in parts]),
                   np.concatenate([part.lengths for part in parts]))

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self) -> Iterator[RequestAcceptance]:
        """Each request's outcomes on its own (for policies that judge requests one by one)."""
        width = self.accepted.shape[1]
        for row, (request_id, length) in enumerate(zip(self.request_ids, self.lengths.tolist(),
                                                       strict=True)):
            yield RequestAcceptance(request_id, tuple(self.accepted[row, width - length:].tolist()),
                                    tuple(self.drafted[row, width - length:].tolist()))

    def clipped(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(drafted, accepted) with drafts beyond `width` (the deepest position the reader
        counts) left out, and no more accepted than drafted (a step that landed more than
        `width` landed all `width`). A window keeps a request's last `REQUEST_WINDOW` steps,
        which may have run deeper than a policy's widest tier now: before a run-time change
        of candidates lowered it. Position counts (`policies.outcomes`) bin the values
        0..width only; a deeper one would count in the next row's bins."""
        drafted = np.minimum(self.drafted, width)
        return drafted, np.minimum(self.accepted, drafted)


@dataclass(frozen=True)
class ClusterView:
    """What the telemetry hub knows beyond this replica (absent when the hub is unreachable)."""

    in_transit: int = 0
    """Requests the routers had sent to this replica that had not reached it, as of the last
    exchange (on their way, or held back at a full replica)."""
    acceptance_prior: tuple[float, ...] = ()
    """Cluster-wide p[k]: share of drafts with more than k accepted, per position k."""

    @classmethod
    def from_hub(cls, view: dict[str, Any]) -> ClusterView:
        """From the telemetry hub's answer (`ClusterState.view`)."""
        return cls(in_transit=view["in_transit"],
                   acceptance_prior=tuple(view["acceptance_prior"]))


def effective_concurrency(running: int, waiting: int, cluster: ClusterView | None) -> int:
    """running + waiting (as the engine saw them at its last step, and the requests the
    replica took since: see `replicas.control_loop.engine_load`), plus what the cluster view
    says is on its way here. Only the requests in transit come from the view: its counts of
    this replica's own requests are up to a telemetry period old, and copy-like requests
    finish within one (a stale count of 11 priced a batch of 2 as 11, and the next exchange
    undid the switch it made)."""
    return running + waiting + (cluster.in_transit if cluster is not None else 0)


@dataclass(frozen=True)
class Signals:
    """Engine activity since the previous decision, plus the replica's cluster view.

    Per-position counts are indexed by draft position (0 = first draft token) and are as long
    as the largest candidate K. `drafted_per_pos[k]` counts drafts that actually reached
    position k, so `accepted_per_pos[k] / drafted_per_pos[k]` is unbiased when K changes.
    """

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
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    drafted_per_pos: tuple[int, ...] = ()
    slots_per_pos: tuple[int, ...] = ()
    """Per draft position, the sequence-steps that could have drafted it (their step's K
    was deeper, and no cap closed it). `drafted_per_pos[k] / slots_per_pos[k]` is how
    full the drafter kept position k: prompt lookup fills the first positions of a copy
    and fewer of the deep ones, and few of any on text without repeats."""
    step_costs: tuple[StepCost, ...] = ()
    requests: RequestWindows = field(default_factory=RequestWindows, compare=False)
    cluster: ClusterView | None = None
    max_batch: int | None = None
    """The most sequences the engine runs in one step (its max_num_seqs), when known."""
    class_prior: tuple[float, ...] = ()
    """p[k] that the classes of the requests now on the replica showed before (the fleet's
    class statistics, else the replica's own; see `policies.class_acceptance`); empty when no class
    is known. The policy's acceptance prior, and its only hint at K=0, where nothing is
    drafted."""
    class_prior_fresh: int = 0
    """Leading positions of `class_prior` that some replica measured within the last few
    telemetry periods: evidence as fresh as a probe of them here would give."""
    request_priors: tuple[tuple[float, ...], ...] = ()
    """Per row of `requests`, the p[k] its own request class showed before (() where the
    class is unknown or unmeasured; empty when no class is known at all)."""
    draft_caps_apply: bool = False
    """Whether the engine applies per-request draft caps (`Decision.draft_caps`)."""
    new_class: bool = False
    """A request of a class the replica did not hold at the previous decision arrived (the
    control loop then asks at once: see `Policy.decides_on_arrival`)."""

    @property
    def local_batch(self) -> int:
        return self.running

    @property
    def effective_concurrency(self) -> int:
        """See `effective_concurrency` (the function)."""
        return effective_concurrency(self.running, self.waiting, self.cluster)

    def verify_batch(self, concurrency: int) -> int:
        """Sequences a step will verify at this concurrency: demand beyond the engine's batch
        limit waits, and costs no verify work."""
        batch = max(1, concurrency)
        return min(batch, self.max_batch) if self.max_batch else batch


@dataclass(frozen=True)
class Decision:
    """A policy's answer: the tier to run next and why (for logs, metrics and span events)."""

    k: int
    reason: str = ""
    inputs: dict[str, float] = field(default_factory=dict)
    draft_caps: dict[str, int] | None = None
    """Per running request (by id), at most this many drafts a step, whatever K is: a request
    whose drafts fail stops costing the batch verify work while the others draft deep.
    None: no caps (every request drafts K); requests left out are not capped."""
