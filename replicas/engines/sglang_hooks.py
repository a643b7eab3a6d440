"""The run-time K hook into SGLang. Runs inside SGLang's scheduler process.

SGLang (0.5.23) already keeps a tier pool for EAGLE/EAGLE3 with `--speculative-adaptive`: one
runtime state (attention backends, CUDA graphs) per candidate step count, switched by reference
between batches by its `AdaptiveController`, which asks a policy object for the steps to use.
We replace that policy object with `ExternalTierPolicy`, whose K is set from outside:
`Engine.collective_rpc("specserve_set_k", k=...)` reaches `Scheduler.specserve_set_k`
between scheduler iterations. Every verify step's per-request accepted counts are pushed to the
replica over a ZeroMQ socket (`SPECSERVE_STEP_SOCKET`), non-blocking: a full queue drops
records rather than stall the scheduler.

Loaded in every SGLang process through the `sglang.srt.plugins` entry point declared in
pyproject.toml (the GPU install does `pip install -e .`). Written against sglang 0.5.23
internals; not run on the CPU machines this project is developed on.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

STEP_SOCKET_ENV = "SPECSERVE_STEP_SOCKET"
SET_K_RPC = "specserve_set_k"


class ExternalTierPolicy:
    """SGLang's `AdaptiveSpecPolicy` protocol, with the step count chosen by specserve."""

    def __init__(self, candidates: list[int], initial_steps: int, publisher: Any):
        self._candidates = sorted(set(candidates))
        self.k = initial_steps
        self._announced = initial_steps
        self._cuda_graph_bs: list[int] | None = None
        self._publisher = publisher
        self._last_verify = time.perf_counter()
        self._round_started: float | None = None  # this decode round's steps were asked for

    @property
    def candidate_steps(self) -> list[int]:
        return self._candidates

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = cuda_graph_bs

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        return self._cuda_graph_bs

    def get_steps_for_batch(self, batch_size: int) -> int:
        self._round_started = time.perf_counter()
        return self.k

    def request(self, k: int) -> None:
        if k not in self._candidates:
            raise ValueError(f"K={k} is not a prepared SGLang tier {self._candidates}")
        self.k = k

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int
                           ) -> int | None:
        now = time.perf_counter()
        # The round's own time when the controller asked for its steps since the last verify
        # (reset at each verify): the gap from that verify would also hold idle time and
        # prefill batches.
        started = self._last_verify if self._round_started is None else self._round_started
        self._publisher.publish({
            "running": batch_size, "k": self._announced,
            "wall_s": now - started, "accepted": list(num_correct_drafts_per_req)})
        self._last_verify, self._round_started = now, None
        if self.k != self._announced:
            self._announced = self.k
            return self.k
        return None


class _StepPublisher:
    def __init__(self, address: str | None):
        self._socket = None
        if address:
            import zmq

            self._socket = zmq.Context.instance().socket(zmq.PUSH)
            self._socket.setsockopt(zmq.SNDHWM, 10_000)
            self._socket.connect(address)

    def publish(self, record: dict[str, Any]) -> None:
        if self._socket is None:
            return
        import zmq

        # When the replica is behind, drop a record rather than stall a step.
        with contextlib.suppress(zmq.Again):
            self._socket.send(json.dumps(record).encode(), flags=zmq.NOBLOCK)


def _scheduler_set_k(self: Any, parameters: dict[str, Any]) -> None:
    """`Scheduler.specserve_set_k`: SGLang's scheduler calls an RPC method with the call's
    keyword arguments as one dict (`collective_rpc(SET_K_RPC, k=3)` -> {"k": 3}), on every
    tensor-parallel rank."""
    controller = getattr(self.draft_worker, "adaptive_controller", None)
    if controller is None:
        raise RuntimeError("SGLang was started without --speculative-adaptive")
    if not isinstance(controller.params, ExternalTierPolicy):
        # Every rank verifies the same batch: one publishes it, or each step counts tp times.
        address = os.environ.get(STEP_SOCKET_ENV) if getattr(self, "tp_rank", 0) == 0 else None
        controller.params = ExternalTierPolicy(
            controller.candidate_steps, self.draft_worker.speculative_num_steps,
            _StepPublisher(address))
    controller.params.request(int(parameters["k"]))


def register() -> None:
    """SGLang general-plugin entry point: add the K setter to the scheduler."""
    from sglang.srt.managers.scheduler import Scheduler

    setattr(Scheduler, SET_K_RPC, _scheduler_set_k)
