"""SIMULATOR engine: the Engine protocol over a cost model and synthetic acceptance.

Not a model. It exists for policy studies, cluster-scale runs and fast application tests, and
it says so: its name is "sim" and its output text is made-up tokens (" t123"). Each step runs
every admitted request at the active K:

- step time  t(B, K) from the preset's cost model (`SimPreset.step_seconds`), counting the
  drafts each request verified (K, or less under a per-request cap: `set_draft_caps`)
- acceptance: each request belongs to a class (`sim_presets.Acceptance`): per step, a copy or
  a free-text regime, then drafts accepted position by position until the first miss.

Token ids depend only on the prompt and the position, so outputs are identical at every K,
like greedy decoding on a real engine; sampling controls (temperature aside, which picks the
acceptance class) change nothing in them. Randomness (acceptance) is seeded per engine (`seed`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import chain, islice

import numpy as np

from policies.outcomes import reaching
from policies.signals import REQUEST_WINDOW, RequestWindows
from replicas.engines.base import (
    EngineCounters,
    EngineInputError,
    FinishedWindows,
    GenerationChunk,
    GenerationRequest,
    StepRecord,
)
from replicas.engines.sim_presets import (
    PRESETS,
    Acceptance,
    AcceptanceTable,
    SimPreset,
)
from replicas.engines.spec import EngineSpec

logger = logging.getLogger(__name__)

# Put in a reader's queue when the step loop ends: no chunk will follow.
LOOP_STOPPED = object()
# Put in a reader's queue when its request is aborted: its stream ends, as vLLM's does, with
# a last chunk whose finish reason is "abort".
ABORTED = object()

VOCAB = 4096
# Appended to the engine's seed for its step-time jitter's random stream.
JITTER_STREAM = 1
# Per step, how much of the machine's slow speed factor carries over (`step_drift`): about 20
# steps' memory. Over HTTP on this machine, 4-step windows of one tier and batch scattered by
# 0.15-0.27 (log sd) about the policy's prediction, with a correlation of 0.1-0.6 from one
# window to the next: a fresh part of about 0.35 and a slow one of about 0.15 a step
# (`bench.step_scatter`).
DRIFT_CORRELATION = 0.95


def token_at(prompt: str, position: int) -> int:
    digest = hashlib.blake2b(f"{prompt}\x00{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB


@dataclass(slots=True)
class _SimRequest:
    request: GenerationRequest
    acceptance: Acceptance
    generated: int = 0
    """Tokens so far: kept current for streamed requests, set when it finishes for the others
    (virtual-time harnesses read it then)."""
    queue: asyncio.Queue | None = None
    """Where `generate` streams from: chunks, then `ABORTED` if the request is aborted, or
    `LOOP_STOPPED` if the step loop ends."""
    done: bool = False
    aborted: bool = False
    slot: int = -1
    """Its row in the engine's batch arrays while running."""


class SimulatedEngine:
    """A simulator engine (see module docstring); `time_scale` stretches simulated time."""

    name = "sim"
    returns_logprobs = False  # a simulator has no distribution

    def __init__(self, preset: SimPreset, kmax: int = 15, max_num_seqs: int = 64,
                 max_model_len: int = 1024, time_scale: float = 1.0,
                 seed: int | tuple[int, ...] = 0, step_jitter: float = 0.0,
                 step_drift: float = 0.0):
        self.preset = preset
        # A shared machine's steps are not all alike. Each step's time is the model's times a
        # mean-one log-normal factor: `step_jitter`, the sigma of a part drawn afresh each
        # step, and `step_drift`, that of a slow part (the machine's speed: its log follows
        # an AR(1) with `DRIFT_CORRELATION` a step). Drawn from a stream of their own, so the
        # acceptance draws do not change with them.
        self.step_jitter, self.step_drift = step_jitter, step_drift
        self._drift = 0.0
        self._jitter_rng = np.random.default_rng(
            (*(seed if isinstance(seed, tuple) else (seed,)), JITTER_STREAM))
        # As the app's adapter for the engine the preset models (`SimPreset.draft_caps`).
        self.applies_draft_caps = preset.draft_caps
        self._rng = np.random.default_rng(seed)
        self.kmax = kmax
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.time_scale = time_scale
        self.k = kmax
        self._waiting: deque[_SimRequest] = deque()
        self._running: dict[str, _SimRequest] = {}
        # The batch as arrays, one row per slot, so a step is a few vector operations.
        self._table = AcceptanceTable(preset.all_acceptance())
        self._slots: list[_SimRequest | None] = [None] * max_num_seqs
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._active = np.zeros(max_num_seqs, bool)
        self._left = np.zeros(max_num_seqs, np.int64)  # tokens still to generate
        self._made = np.zeros(max_num_seqs, np.int64)  # tokens generated (a replay's position)
        # Per slot, its request's acceptance (a column of `AcceptanceTable.params`).
        self._slot_params = np.zeros((self._table.params.shape[0], max_num_seqs))
        self._slot_request = np.full(max_num_seqs, "", object)  # request id
        # Most drafts a step: kmax unless capped (set_draft_caps); 0 in a free slot, so a step
        # drafts, lands and makes nothing there.
        self._cap = np.zeros(max_num_seqs, np.int64)
        self._streams: dict[int, _SimRequest] = {}  # by slot
        self._stopped: BaseException | None = None  # why the step loop ended, once it has
        # Each slot's last REQUEST_WINDOW verify outcomes, a ring: step n (counted in
        # `_totals.steps`) writes column n % REQUEST_WINDOW. `_window_len`: steps run by the
        # request now in the slot (the window holds the last REQUEST_WINDOW of them). A slot's
        # ring is emptied when a request takes it, so the columns it has not written are zeros.
        self._window = np.zeros((2, max_num_seqs, REQUEST_WINDOW), np.int64)  # accepted, drafted
        self._window_len = np.zeros(max_num_seqs, np.int64)
        # Row n % REQUEST_WINDOW: the ring's columns oldest first once n steps have written.
        self._oldest_first = (np.arange(REQUEST_WINDOW)[:, None] +
                              np.arange(REQUEST_WINDOW)) % REQUEST_WINDOW
        self._records: list[StepRecord] = []
        self._totals = EngineCounters(accepted_per_pos=[0] * kmax, drafted_per_pos=[0] * kmax)
        self._loop: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.just_finished: list[_SimRequest] = []
        self._finished = FinishedWindows()

    @classmethod
    def from_spec(cls, spec: EngineSpec, replica_rank: int = 0) -> SimulatedEngine:
        """Seeded by the spec's seed and the replica's rank: each replica of an app draws its
        own acceptance, and a run with the same seed draws the same again."""
        return cls(PRESETS[spec.sim_preset], kmax=spec.kmax, max_num_seqs=spec.max_num_seqs,
                   max_model_len=spec.max_model_len, time_scale=spec.sim_time_scale,
                   seed=(spec.seed, replica_rank))

    async def start(self) -> None:
        self._loop = asyncio.create_task(self._run())

    async def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            self._loop = None

    async def check_health(self) -> None:
        if self._loop is None or self._loop.done():
            raise self._ended()

    async def set_k(self, k: int) -> None:
        if not 0 <= k <= self.kmax:
            raise ValueError(f"K={k} outside [0, {self.kmax}]")
        self.k = k

    async def set_draft_caps(self, caps: dict[str, int]) -> None:
        self._cap[:] = np.where(self._active, self.kmax, 0)
        for request_id, cap in caps.items():
            entry = self._running.get(request_id)
            if entry is not None:
                self._cap[entry.slot] = max(0, cap)

    async def abort(self, request_id: str) -> None:
        entry = self._running.get(request_id) or next(
            (r for r in self._waiting if r.request.request_id == request_id), None)
        if entry is not None:
            entry.aborted = True
            if entry.slot >= 0:
                self._release(entry)
            elif entry in self._waiting:
                self._waiting.remove(entry)
            if entry.queue is not None:
                entry.queue.put_nowait(ABORTED)

    def drain_steps(self) -> list[StepRecord]:
        records, self._records = self._records, []
        return records

    def counters(self) -> EngineCounters:
        return self._totals.snapshot(k=self.k, running=len(self._running),
                                     waiting=len(self._waiting))

    def _validate(self, request: GenerationRequest) -> str:
        prompt = request.prompt if request.prompt is not None else " ".join(
            map(str, request.prompt_token_ids or ()))
        if len(prompt.split()) + request.max_tokens > self.max_model_len:
            raise EngineInputError(
                f"prompt ({len(prompt.split())} tokens) plus max_tokens ({request.max_tokens}) "
                f"exceeds the context of {self.max_model_len} tokens")
        return prompt

    def submit(self, request: GenerationRequest, stream: bool = False) -> _SimRequest:
        """Queue a request; without `stream`, nothing is queued for a reader (virtual-time
        harnesses watch `just_finished`)."""
        self._validate(request)
        entry = _SimRequest(request, self.preset.acceptance_for(request),
                            queue=asyncio.Queue() if stream else None)
        self._waiting.append(entry)
        self._wake.set()
        return entry

    def admit(self) -> list[_SimRequest]:
        """Move waiting requests into the batch while it has room; returns those admitted
        (their first token comes with the next step)."""
        admitted = []
        while self._waiting and len(self._running) < self.max_num_seqs:
            entry = self._waiting.popleft()
            self._running[entry.request.request_id] = entry
            entry.slot = slot = self._free_slots.pop()
            self._slots[slot] = entry
            self._active[slot] = True
            self._left[slot] = entry.request.max_tokens
            self._made[slot] = 0
            self._cap[slot] = self.kmax
            self._slot_params[:, slot] = self._table.params[:, self._table.index[entry.acceptance]]
            self._slot_request[slot] = entry.request.request_id
            self._window[:, slot] = 0
            if entry.queue is not None:
                self._streams[slot] = entry
            admitted.append(entry)
        return admitted

    def _release(self, entry: _SimRequest) -> None:
        """Take a running request out of the batch and free its slot."""
        del self._running[entry.request.request_id]
        slot, entry.slot = entry.slot, -1
        self._slots[slot] = None
        self._active[slot] = False
        self._left[slot] = 0
        self._window_len[slot] = 0
        self._cap[slot] = 0
        self._streams.pop(slot, None)
        self._free_slots.append(slot)

    def request_acceptance(self) -> RequestWindows:
        """Each running request's recent verify outcomes, as vLLM's engine reports them."""
        return self._windows_of(self._window_len.nonzero()[0], self._totals.steps)

    def finished_acceptance(self) -> tuple[RequestWindows, dict[str, str]]:
        """The last outcomes of the requests that finished since the last call, and their
        classes."""
        return self._finished.drain()

    def _windows_of(self, slots: np.ndarray, steps: int) -> RequestWindows:
        """The outcomes of the requests in `slots`, oldest first, once `steps` steps have
        written theirs."""
        accepted, drafted = self._window.take(slots, axis=1).take(
            self._oldest_first[steps % REQUEST_WINDOW], axis=2)
        return RequestWindows(tuple(self._slot_request[slots].tolist()), accepted, drafted,
                              np.minimum(self._window_len[slots], REQUEST_WINDOW))

    def next_batch_acceptance(self) -> Counter[Acceptance]:
        """The acceptance models of the requests the next step will run (how many of each).
        Only a simulator knows this: `bench.cluster_sim`'s exact-information reference uses it."""
        queued = islice(self._waiting, max(0, self.max_num_seqs - len(self._running)))
        return Counter(entry.acceptance for entry in chain(self._running.values(), queued))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        prompt = self._validate(request)
        await self.check_health()
        entry = self.submit(request, stream=True)
        prompt_tokens = len(prompt.split())
        try:
            while True:
                item = await entry.queue.get()
                if item is LOOP_STOPPED:
                    raise self._ended()
                if item is ABORTED:
                    yield GenerationChunk(token_ids=(), text="", prompt_tokens=prompt_tokens,
                                          completion_tokens=entry.generated,
                                          finish_reason="abort")
                    return
                first, count, finished = item
                ids = tuple(token_at(prompt, first + i) for i in range(count))
                yield GenerationChunk(
                    token_ids=ids, text="".join(f" t{t}" for t in ids),
                    prompt_tokens=prompt_tokens, completion_tokens=first + count,
                    finish_reason="length" if finished else None)
                if finished:
                    return
        finally:
            # A reader that leaves early takes its request out, running or still queued.
            if not entry.done and not entry.aborted:
                await self.abort(request.request_id)

    async def _run(self) -> None:
        try:
            while True:
                if not self._running and not self._waiting:
                    self._wake.clear()
                    await self._wake.wait()
                self.admit()
                seconds = self.step()
                await asyncio.sleep(seconds * self.time_scale)
        except BaseException as error:  # a failed step, or shutdown: no reader waits forever
            self._stopped = error
            for entry in chain(self._running.values(), self._waiting):
                if entry.queue is not None:
                    entry.queue.put_nowait(LOOP_STOPPED)
            if not isinstance(error, Exception):  # cancelled by `shutdown`
                raise
            logger.exception("the simulator's step loop failed")

    def _ended(self) -> RuntimeError:
        """The error a reader gets once the step loop has ended, chained to its cause."""
        error = RuntimeError("the simulator's step loop is not running" + (
            f" ({self._stopped!r})" if self._stopped else ""))
        error.__cause__ = self._stopped
        return error

    def step(self) -> float:
        """One engine step over the running requests; returns its simulated seconds. The
        requests it finished are in `just_finished` until the next step."""
        k, size, active = self.k, len(self._running), self._active
        depth = np.minimum(k, self._cap)  # each request's drafts: K, or its cap
        drafted_pos = self._per_position(depth, k)
        draft_tokens = sum(drafted_pos)
        seconds = self.preset.step_seconds(size, k, draft_tokens)
        if self.step_jitter or self.step_drift:
            seconds *= self._machine_factor()
        runs = self._table.draw_runs(self._rng, k, self._slot_params, depth, self._made)
        tokens = np.minimum(runs + 1, self._left)  # free slots have nothing left: 0
        self._left -= tokens
        self._made += tokens
        finished = active & (self._left == 0)
        column = self._totals.steps % REQUEST_WINDOW  # this step's, counted at its end
        self._window[0, :, column], self._window[1, :, column] = runs, depth
        self._window_len += active
        accepted_pos = self._per_position(runs, k)
        for slot, entry in self._streams.items():
            # (first position, tokens, finished): a reader that falls behind still names
            # each chunk's own positions.
            entry.queue.put_nowait((entry.generated, int(tokens[slot]), bool(finished[slot])))
            entry.generated += int(tokens[slot])
        self.just_finished = []
        slots = finished.nonzero()[0]
        if slots.size:
            self._finished.add(self._windows_of(slots, self._totals.steps + 1), {
                self._slot_request[slot]: self._slots[slot].request.request_class
                for slot in slots.tolist()})
        for slot in slots.tolist():
            entry = self._slots[slot]
            entry.generated = entry.request.max_tokens
            entry.done = True
            self._release(entry)
            self.just_finished.append(entry)
        record = StepRecord(running=size, waiting=len(self._waiting), k=k, wall_s=seconds,
                            drafts=drafted_pos[0] if k else 0, draft_tokens=draft_tokens,
                            # It drafts every open slot: the ones it left are capped.
                            capped_per_pos=tuple(size - drafted for drafted in drafted_pos[:k]),
                            accepted_tokens=sum(accepted_pos), accepted_per_pos=tuple(accepted_pos),
                            drafted_per_pos=tuple(drafted_pos),
                            # From a list: numpy's sum costs more on a batch's few slots.
                            generated_tokens=sum(tokens.tolist()))
        self._records.append(record)
        self._totals.add(record)
        return seconds

    def _machine_factor(self) -> float:
        """This step's factor on the modelled time (see `step_jitter`, `step_drift`)."""
        fresh, slow = self._jitter_rng.standard_normal(2)
        self._drift = DRIFT_CORRELATION * self._drift + \
            math.sqrt(1 - DRIFT_CORRELATION ** 2) * self.step_drift * slow
        variance = self.step_jitter ** 2 + self.step_drift ** 2
        return math.exp(self._drift + self.step_jitter * fresh - variance / 2)

    def _per_position(self, counts: np.ndarray, k: int) -> list[int]:
        """Per draft position p (as many as kmax), the slots whose count (drafts, or drafts
        landed: at most K, 0 in a free slot) reached p + 1."""
        positions = [0] * self.kmax
        if k:
            positions[:k] = reaching(np.bincount(counts, minlength=k + 1)).tolist()
        return positions
