"""The engine protocol every adapter implements (vLLM, SGLang, simulator)."""

from __future__ import annotations

import contextlib
import operator
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from policies.class_acceptance import DEFAULT_CLASS
from policies.signals import RequestWindows


class EngineInputError(ValueError):
    """The request cannot be served as asked (too long, bad sampling values, ...).

    Raised before anything is generated; the HTTP layer turns it into a 400.
    """


class EngineRequestFailed(RuntimeError):
    """The engine ended a request it had taken without finishing it (vLLM's finish reason
    "error", an internal failure, or "abort" by anyone but the replica, as when the engine
    core shuts down). The HTTP layer answers a 500, or an error event mid-stream: a
    request cut short is not a completion."""


T = TypeVar("T")


async def admitted(stream: AsyncGenerator[T, None], rejections: tuple[type[Exception], ...]
                   ) -> AsyncIterator[T]:
    """`stream`, with an error of a `rejections` type before its first item raised as
    `EngineInputError`. vLLM and SGLang check a request as they admit it, which happens when
    their output stream is first read: failing there, the request itself is at fault; failing
    later, the engine is. Closing this closes `stream` at once (a reader that leaves early:
    the engine's generator aborts its request then, not whenever it is collected)."""
    async with contextlib.aclosing(stream):
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return
        except rejections as error:
            raise EngineInputError(str(error)) from error
        yield first
        async for item in stream:
            yield item


# Sampling controls beyond temperature and top-p, by the names vLLM's `SamplingParams` (and
# OpenAI's API, for the two penalties) gives them: the HTTP layer, the replica and the
# engines hand them on under these names. Each field's default leaves sampling as it is.
SAMPLING_CONTROLS = ("top_k", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "min_tokens")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    request_class: str = DEFAULT_CLASS
    """A label for acceptance statistics (the router and hub keep acceptance per class)."""
    top_k: int = 0
    """The most likely tokens sampled from (0 or -1: all)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    """Tokens generated before an end-of-sequence token or a stop string may end it."""

    def sampling_controls(self) -> dict[str, Any]:
        """The `SAMPLING_CONTROLS` of this request, by name."""
        return {name: getattr(self, name) for name in SAMPLING_CONTROLS}


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, with the most likely tokens at its position
    (as many as the request asked for, most likely first)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class GenerationChunk:
    """New output since the previous chunk of the same request."""

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    completion_tokens: int
    """Total so far, not the delta."""
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One per token of `token_ids`, when the request asked for logprobs."""


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did. The control loop folds these into policy Signals."""

    running: int
    """The requests the step ran, those it finished included: its batch."""
    waiting: int
    k: int
    """The K in force for this step."""
    wall_s: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    drafted_per_pos: tuple[int, ...] = ()
    generated_tokens: int = 0
    prefill_tokens: int = 0
    """Prompt tokens the step prefilled as well: its wall time is not a decode step's."""

    @property
    def times_decoding(self) -> bool:
        """Whether the wall time measures a decode step: timed (the first step after idle is
        not, nor the first steps after a control call: see `StepTimer`) and
        free of prompt prefills, which cost several decode steps each (8 prompts
        at once: 84 ms against 12-25 ms for the decode steps after it, vLLM-CPU, batch 8)."""
        return self.wall_s > 0 and self.running > 0 and self.prefill_tokens == 0

    capped_per_pos: tuple[int, ...] = ()
    """Per draft position k < K, the running requests whose cap closed it (a cap of k or
    less: see `Engine.set_draft_caps`)."""

    @property
    def slots_per_pos(self) -> tuple[int, ...]:
        """Per draft position k < K, the running requests that could have drafted it: all
        of them, less those capped below it."""
        capped = self.capped_per_pos
        return tuple(self.running - (capped[k] if k < len(capped) else 0)
                     for k in range(self.k))

    @property
    def draft_slots(self) -> int:
        """Draft tokens the step could have verified: K per running sequence, less what the
        caps closed."""
        return sum(self.slots_per_pos)

    @property
    def draft_depth(self) -> int:
        """Draft tokens the step verified per running sequence (rounded): what it cost,
        whatever its tier (prompt lookup proposes fewer than K, or none, without a match)."""
        return round(self.draft_tokens / self.running) if self.running else 0


# A gap longer than this between two busy steps is idle time, not a step.
MAX_STEP_GAP_S = 5.0
# Steps after a control call (a tier switch, new draft caps) left untimed, of those that would
# be timed. The first one's wall time carries the call (vLLM: the engine core's utility call
# between two steps; after a switch, over HTTP, it took 9.3 ms on average against 7.8 ms for
# steady steps, 18-25 ms at p90; after new caps 15 ms against 7.4). Timed, a tier
# the policy visits for a few steps (a probe) is priced by its switch: `goodput` priced K=1
# at batch 1 at 5.5-6.7 ms against K=0's 3.8-5.5 ms, where the engine alone measures 3.2-3.5
# against 3.0 ms.
SETTLE_STEPS = 2


class StepTimer:
    """Which step wall times an engine's step log keeps (the rest it records as 0, untimed):
    not an idle gap, and not the first `SETTLE_STEPS` steps after a control call."""

    def __init__(self) -> None:
        self.settling = 0

    def control_call(self) -> None:
        """A tier switch or new draft caps went to the engine between two steps."""
        self.settling = SETTLE_STEPS

    def measured(self, wall_s: float) -> float:
        """`wall_s`, or 0 for a gap that was idle time or a step that carries a call."""
        if wall_s <= 0 or wall_s >= MAX_STEP_GAP_S:
            return 0.0
        if self.settling:
            self.settling -= 1
            return 0.0
        return wall_s


# Finished requests' windows an engine keeps until they are read (`FinishedWindows`).
FINISHED_KEPT = 256


class FinishedWindows:
    """The last verify outcomes of requests that finished, each with its request class,
    until read (`drain`); the last `FINISHED_KEPT` batches of them between two reads. Kept
    only once a reader has read: an engine nobody reads (the cluster simulation's modes
    that learn no classes, 512 replicas at a time) keeps nothing."""

    def __init__(self) -> None:
        self._batches: deque[tuple[RequestWindows, dict[str, str]]] | None = None

    def add(self, windows: RequestWindows, class_of: dict[str, str]) -> None:
        if self._batches is not None and len(windows):
            self._batches.append((windows, class_of))

    def drain(self) -> tuple[RequestWindows, dict[str, str]]:
        """The windows kept since the last call, and request id -> class for their rows."""
        batches, self._batches = self._batches or (), deque(maxlen=FINISHED_KEPT)
        return (RequestWindows.joined([windows for windows, _ in batches]),
                {rid: cls for _, class_of in batches for rid, cls in class_of.items()})


def period_windows(engine: Any, class_of: Mapping[str, str]
                   ) -> tuple[RequestWindows, Mapping[str, str]]:
    """A telemetry period's evidence of per-class acceptance: the running requests' windows
    (their classes from `class_of`) and those of the requests that finished since the last
    period (`Engine.finished_acceptance`, with their classes). Without the finished ones, a
    replica whose requests all finish within a period measures none of them."""
    running = engine.request_acceptance()
    finished, finished_class = engine.finished_acceptance()
    return RequestWindows.joined([running, finished]), {**class_of, **finished_class}


@dataclass
class EngineCounters:
    """Cumulative counters since the engine started (what metrics export)."""

    steps: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    sequence_steps: int = 0
    """Engine steps summed over the sequences in them; generated / sequence_steps is the
    mean acceptance length whatever K was (K=0 steps count as length 1)."""
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    k: int = 0

    def add(self, step: StepRecord) -> None:
        """Fold one engine step into the totals; running, waiting and K become the step's."""
        self.steps += 1
        self.drafts += step.drafts
        self.draft_tokens += step.draft_tokens
        self.accepted_tokens += step.accepted_tokens
        self.generated_tokens += step.generated_tokens
        self.sequence_steps += step.running
        self.running, self.waiting, self.k = step.running, step.waiting, step.k
        add_per_position(self.accepted_per_pos, step.accepted_per_pos)
        add_per_position(self.drafted_per_pos, step.drafted_per_pos)

    def snapshot(self, **live: int) -> EngineCounters:
        """A copy the caller may keep (lists included), with live values (e.g. K) applied."""
        return replace(self, accepted_per_pos=list(self.accepted_per_pos),
                       drafted_per_pos=list(self.drafted_per_pos), **live)


def add_per_position(totals: list[int], counts: Sequence[int]) -> None:
    """Add per-position counts into `totals`, position by position, up to its length."""
    # The sums stop at the shorter of the two, and the slice is no longer than `totals`.
    totals[:len(counts)] = map(operator.add, totals, counts)


class Engine(Protocol):
    """An inference engine with run-time speculation depth.

    `kmax` is the largest K the engine was built for; `set_k` takes any K in [0, kmax] and
    applies it from the next scheduled step on, or, on an engine that prepares its tiers at
    start-up and runs no other (SGLang), any K in its `prepared_tiers`. Stats come two ways:
    `drain_steps()` returns the per-step records since the last call (for the control loop),
    `counters()` the totals.
    An engine that can attribute acceptance to requests also has `request_acceptance()`: each
    running request's last `REQUEST_WINDOW` verify outcomes (`policies.signals`),
    and `finished_acceptance()`: the same of the requests that finished since the last call,
    with request id -> class (`FinishedWindows.drain`).
    One that can cap a request's drafts below K has `applies_draft_caps = True` and
    `async set_draft_caps(caps)`: request id -> most drafts a step, for the running requests
    named; it replaces the previous caps, and the others draft K.
    """

    name: str
    kmax: int
    max_model_len: int
    returns_logprobs: bool
    """Whether `generate` fills `GenerationChunk.logprobs` when a request asks for them."""

    async def start(self) -> None: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]: ...

    async def abort(self, request_id: str) -> None: ...

    async def set_k(self, k: int) -> None: ...

    def drain_steps(self) -> list[StepRecord]: ...

    def counters(self) -> EngineCounters: ...

    async def check_health(self) -> None:
        """Raise if the engine can no longer serve (its core process or loop died)."""
        ...

    async def shutdown(self) -> None: ...
