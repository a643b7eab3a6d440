"""SGLang engine adapter: `sglang.Engine` with its adaptive tier pool driven by our policy.

SGLang's adaptive speculative decoding (EAGLE/EAGLE3, topk=1, sglang 0.5.23) prepares one
runtime state per candidate step count at start-up; `sglang_hooks` hands the choice of state to
specserve. Per-step verify results arrive from the scheduler process over ZeroMQ.

GPU only: written against the same `Engine` protocol as the vLLM adapter, not run on the CPU
machines this project is developed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from replicas.engines.base import (
    EngineCounters,
    EngineInputError,
    GenerationChunk,
    GenerationRequest,
    StepRecord,
    StepTimer,
    admitted,
)
from replicas.engines.sglang_hooks import SET_K_RPC, STEP_SOCKET_ENV
from replicas.engines.spec import SGLANG_ALGORITHMS, EngineSpec


def sampling_params(request: GenerationRequest) -> dict[str, Any]:
    """The request's sampling as SGLang's `sampling_params` names it (its top-k "all" is -1,
    its `min_tokens` is `min_new_tokens`, and its seed is `sampling_seed`)."""
    params = {"max_new_tokens": request.max_tokens, "temperature": request.temperature,
              "top_p": request.top_p, "stop": list(request.stop) or None,
              "ignore_eos": request.ignore_eos,
              "top_k": request.top_k if request.top_k > 0 else -1,
              "presence_penalty": request.presence_penalty,
              "frequency_penalty": request.frequency_penalty,
              "repetition_penalty": request.repetition_penalty,
              "min_new_tokens": request.min_tokens}
    if request.seed is not None:
        params["sampling_seed"] = request.seed
    return params


def step_from_verify(record: dict[str, Any], kmax: int, timer: StepTimer) -> StepRecord:
    """One SGLang verify step (per-request accepted drafts) as our StepRecord, its wall time
    kept as `timer` says."""
    k, accepted = record["k"], record["accepted"]
    drafts = len(accepted) if k else 0
    return StepRecord(
        running=record["running"], waiting=0, k=k, wall_s=timer.measured(record["wall_s"]),
        drafts=drafts, draft_tokens=drafts * k, accepted_tokens=sum(accepted) if k else 0,
        accepted_per_pos=tuple(sum(1 for a in accepted if a > pos) if k else 0
                               for pos in range(kmax)),
        drafted_per_pos=tuple(drafts if pos < k else 0 for pos in range(kmax)),
        generated_tokens=sum(a + 1 for a in accepted))


class SglangEngine:
    name = "sglang"
    returns_logprobs = False  # not wired through the adapter yet

    def __init__(self, spec: EngineSpec, replica_rank: int = 0):
        self.spec = spec
        self.kmax = spec.kmax
        # SGLang builds a state (backends, CUDA graphs) per tier at start-up and runs no other.
        self.prepared_tiers = tuple(sorted({*spec.tiers, spec.kmax}))
        self.max_model_len = spec.max_model_len
        self._engine: Any = None
        self._records: list[StepRecord] = []
        self._totals = EngineCounters(accepted_per_pos=[0] * spec.kmax,
                                      drafted_per_pos=[0] * spec.kmax)
        self._k = spec.kmax
        self._timer = StepTimer()
        self._receiver: asyncio.Task | None = None
        self._socket: Any = None

    async def start(self) -> None:
        import sglang
        import zmq.asyncio

        address = f"ipc://{tempfile.gettempdir()}/specserve-steps-{uuid.uuid4().hex}"
        self._socket = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._socket.bind(address)
        os.environ[STEP_SOCKET_ENV] = address
        config = Path(tempfile.mkdtemp()) / "adaptive.json"
        config.write_text(json.dumps({"1": {"candidate_steps": list(self.prepared_tiers)}}))
        self._engine = sglang.Engine(
            model_path=self.spec.model, dtype=self.spec.dtype, random_seed=self.spec.seed,
            context_length=self.spec.max_model_len,
            max_running_requests=self.spec.max_num_seqs, tp_size=self.spec.tensor_parallel_size,
            mem_fraction_static=self.spec.gpu_memory_utilization,
            speculative_algorithm=SGLANG_ALGORITHMS[self.spec.drafter],
            speculative_draft_model_path=self.spec.drafter_checkpoint(),
            speculative_num_steps=self.kmax, speculative_eagle_topk=1,
            speculative_num_draft_tokens=self.kmax + 1,
            speculative_adaptive=True, speculative_adaptive_config=str(config))
        self._receiver = asyncio.create_task(self._receive_steps())

    async def _receive_steps(self) -> None:
        while True:
            record = json.loads(await self._socket.recv())
            step = step_from_verify(record, self.kmax, self._timer)
            self._records.append(step)
            self._totals.add(step)

    async def set_k(self, k: int) -> None:
        if k not in self.prepared_tiers:
            raise ValueError(f"K={k} is not a tier prepared at start-up {self.prepared_tiers}")
        # collective_rpc blocks until the scheduler has run the call between two batches.
        await asyncio.to_thread(self._engine.collective_rpc, SET_K_RPC, k=k)
        self._k = k
        self._timer.control_call()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        params = sampling_params(request)
        prompt_args: dict[str, Any] = (
            {"prompt": request.prompt} if request.prompt_token_ids is None
            else {"input_ids": list(request.prompt_token_ids)})
        try:
            stream = await self._engine.async_generate(
                **prompt_args, sampling_params=params, stream=True, rid=request.request_id)
        except ValueError as error:
            raise EngineInputError(str(error)) from error
        text_so_far, ids_so_far = "", 0
        # A streamed request is checked (its length against the context, ...) when its stream
        # is first read, not by the call that returned it.
        async for output in admitted(stream, (ValueError,)):
            meta = output["meta_info"]
            ids = output.get("output_ids") or []
            text = output["text"]
            finish = meta.get("finish_reason")
            yield GenerationChunk(
                token_ids=tuple(ids[ids_so_far:]), text=text[len(text_so_far):],
                prompt_tokens=meta["prompt_tokens"], completion_tokens=meta["completion_tokens"],
                finish_reason=finish.get("type") if finish else None)
            text_so_far, ids_so_far = text, len(ids)

    async def abort(self, request_id: str) -> None:
        self._engine.tokenizer_manager.abort_request(request_id)

    def drain_steps(self) -> list[StepRecord]:
        records, self._records = self._records, []
        return records

    def counters(self) -> EngineCounters:
        return self._totals.snapshot(k=self._k)

    async def check_health(self) -> None:
        if self._engine is None or (self._receiver is not None and self._receiver.done()):
            raise RuntimeError("the SGLang engine or its verify-record receiver stopped")

    async def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
