"""The chunks a replica sends its ingress for one request, and how few it can send.

A chunk is {"text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason",
"logprobs"} (or one {"error"}), one per engine output: one per engine step, so one per token
without speculation. Each crosses from the replica to the ingress as a message of Serve's
streaming protocol, and costs both processes far more than the engine spends on the token:
over HTTP on the 2-core dev machine the ingress used more CPU relaying one-token chunks than
both engine cores used computing them. So a replica coalesces them (`coalesce`): the first
chunk goes at once (a bad request, or the time to the first token, shows as it would one per
step), and after it the chunks that arrive within an interval of the last send go as one.
A caller that streams gets a chunk about every interval (Ray Serve LLM's
`stream_batching_interval_ms`, 50 ms by default there and here); a caller that did not ask
to stream reads only the whole text, so the interval is unbounded and it gets two chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator
from typing import Any

Chunk = dict[str, Any]
# The run-time change that sets a replica's stream interval (see `stream_interval_s`).
STREAM_INTERVAL_KEY = "stream_interval_ms"
_END = object()  # what the reader queues after the last chunk
_TICK = object()  # the interval elapsed: send what arrived


def stream_interval_s(interval_ms: Any) -> float:
    """A stream interval given in milliseconds (a deployment's `stream_interval_ms`, or a
    run-time change), in seconds; ValueError unless it is a number of at least 0."""
    if isinstance(interval_ms, bool) or not isinstance(interval_ms, int | float) or \
            not 0 <= interval_ms < math.inf:
        raise ValueError(f"{STREAM_INTERVAL_KEY} must be a number of milliseconds >= 0, "
                         f"got {interval_ms!r}")
    return interval_ms / 1000


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """One chunk that says what `chunks` (in order) said: texts, tokens and logprobs joined;
    counts as of the last; the last finish reason given."""
    last = chunks[-1]
    logprobs = [entry for chunk in chunks for entry in chunk.get("logprobs") or ()]
    return {"text": "".join(chunk["text"] for chunk in chunks),
            "token_ids": [token for chunk in chunks for token in chunk["token_ids"]],
            "prompt_tokens": last["prompt_tokens"],
            "completion_tokens": last["completion_tokens"],
            "finish_reason": next((chunk["finish_reason"] for chunk in reversed(chunks)
                                   if chunk["finish_reason"]), None),
            "logprobs": logprobs or None}


async def coalesce(chunks: AsyncGenerator[Chunk, None], interval_s: float
                   ) -> AsyncGenerator[Chunk, None]:
    """The first chunk as it comes; then, at most once per `interval_s` (from the last send),
    every chunk that arrived since, merged. The last ones go as soon as the stream ends, not
    at the next tick; an error goes after what arrived before it. An interval of 0 passes
    every chunk through as it comes; `math.inf` sends the rest as one chunk at the end.

    A reader task drains `chunks` while this generator waits for its next send, so the
    engine's outputs never wait on the interval. Closing this generator (the caller went
    away) stops the reader and closes `chunks`, and with it the engine's request.
    """
    try:
        try:
            yield await anext(chunks)
        except StopAsyncIteration:
            return
        if interval_s <= 0:
            async for chunk in chunks:
                yield chunk
            return
        if math.isinf(interval_s):  # one chunk at the end: no reader task to wake per step
            rest: list[Chunk] = []
            try:
                async for chunk in chunks:
                    rest.append(chunk)
            except Exception:  # what arrived goes first (a cancel just propagates)
                if rest:
                    yield merge_chunks(rest)
                raise
            if rest:
                yield merge_chunks(rest)
            return
        async with contextlib.aclosing(_merged_per_interval(chunks, interval_s)) as merged:
            async for chunk in merged:
                yield chunk
    finally:
        await chunks.aclose()


async def _merged_per_interval(chunks: AsyncGenerator[Chunk, None], interval_s: float
                               ) -> AsyncGenerator[Chunk, None]:
    """`coalesce` after the first chunk, for a finite interval above 0."""
    arrived: asyncio.Queue[Any] = asyncio.Queue()

    async def read() -> None:
        try:
            async for chunk in chunks:
                arrived.put_nowait(chunk)
        except BaseException as error:  # the consumer raises it (a cancel of ours: unread)
            arrived.put_nowait(error)
            raise
        arrived.put_nowait(_END)

    reader = asyncio.create_task(read())
    loop = asyncio.get_running_loop()
    pending: list[Chunk] = []
    sent_at, due = loop.time(), None  # when the pending chunks go (None: none pending)
    try:
        while True:
            try:
                async with asyncio.timeout_at(due):
                    item = await arrived.get()
            except TimeoutError:
                item = _TICK
            if item is _TICK or item is _END or isinstance(item, BaseException):
                if pending:
                    sent_at = loop.time()
                    yield merge_chunks(pending)
                    pending, due = [], None
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                continue
            if not pending:
                due = sent_at + interval_s  # past already after a quiet spell: goes now
            pending.append(item)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
