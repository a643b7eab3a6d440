"""A replica coalesces the chunks of one request: the first at once, then what arrived within
an interval of the last send as one chunk, saying what the chunks one per step would have
said; a caller that did not ask to stream gets two."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import pytest

from replicas.chunks import Chunk, coalesce, merge_chunks

# As a replica sends a token's logprobs: the sampled token's and the most likely.
LP2 = {"token": " ", "logprob": -0.1, "top": [[" ", -0.1]]}
LP3 = {"token": "f", "logprob": -0.2, "top": [["f", -0.2]]}


def chunk(text: str, tokens: list[int], completion: int, finish: str | None = None,
          logprobs: list[dict[str, float]] | None = None) -> Chunk:
    return {"text": text, "token_ids": tokens, "prompt_tokens": 5,
            "completion_tokens": completion, "finish_reason": finish, "logprobs": logprobs}


STEPS = [chunk("def", [1], 1), chunk(" f", [2, 3], 3, logprobs=[LP2, LP3]),
         chunk("():", [4], 4), chunk("", [], 4, finish="length")]


async def stream(chunks: list[Chunk]) -> AsyncIterator[Chunk]:
    for item in chunks:
        await asyncio.sleep(0)
        yield item


async def collect(chunks: AsyncIterator[Chunk], interval_s: float) -> list[Chunk]:
    return [item async for item in coalesce(chunks, interval_s)]


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_not_streaming_the_first_chunk_comes_alone_and_the_rest_merge():
    first, rest = run(collect(stream(STEPS), math.inf))
    assert first == STEPS[0]
    assert rest == {"text": " f():", "token_ids": [2, 3, 4], "prompt_tokens": 5,
                    "completion_tokens": 4, "finish_reason": "length",
                    "logprobs": [LP2, LP3]}
    # What the ingress builds from them is what it builds from the chunks one per step.
    assert merge_chunks([first, rest]) == merge_chunks(STEPS)


def test_the_end_sends_what_is_pending_at_once():
    # An interval far longer than the test's timeout: only the end can send the rest.
    assert run(collect(stream(STEPS), 3600.0)) == [STEPS[0], merge_chunks(STEPS[1:])]


def test_an_interval_of_zero_passes_every_chunk():
    assert run(collect(stream(STEPS), 0.0)) == STEPS


def test_short_streams_pass_through():
    for interval in (0.0, 0.05, math.inf):
        assert run(collect(stream([]), interval)) == []
        only = [{"error": {"message": "bad", "type": "invalid_request_error", "code": 400}}]
        assert run(collect(stream(only), interval)) == only
        one = [chunk("x", [7], 1, finish="stop")]
        assert run(collect(stream(one), interval)) == one


def test_chunks_within_an_interval_go_as_one_and_a_later_one_goes_on_its_own():
    later = asyncio.Event()

    async def source() -> AsyncIterator[Chunk]:
        yield STEPS[0]
        yield STEPS[1]
        yield STEPS[2]
        await later.wait()  # quiet until the merged chunk was sent
        yield STEPS[3]

    async def consume() -> list[Chunk]:
        received = []
        async for item in coalesce(source(), 0.2):
            received.append(item)
            if len(received) == 2:
                later.set()
        return received

    assert run(consume()) == [STEPS[0], merge_chunks(STEPS[1:3]), STEPS[3]]


@pytest.mark.parametrize("interval", [0.0, 0.05, math.inf])
def test_an_error_after_the_first_chunk_reaches_the_caller_after_what_came_before_it(interval):
    async def failing() -> AsyncIterator[Chunk]:
        yield STEPS[0]
        yield STEPS[1]
        raise RuntimeError("engine died")

    async def consume(received: list[Chunk]) -> None:
        async for item in coalesce(failing(), interval):
            received.append(item)

    received: list[Chunk] = []
    with pytest.raises(RuntimeError, match="engine died"):
        run(consume(received))
    assert received == [STEPS[0], STEPS[1]]


@pytest.mark.parametrize(("interval", "taken"), [(0.0, 1), (0.0, 2), (0.01, 1), (0.01, 2),
                                                (math.inf, 1)])
def test_closing_the_stream_stops_reading_the_engine(interval, taken):
    stopped = asyncio.Event()

    async def endless() -> AsyncIterator[Chunk]:
        try:
            yield STEPS[0]
            yield STEPS[1]
            await asyncio.Event().wait()  # an engine request that never ends by itself
        finally:
            stopped.set()  # vLLM aborts the request here

    async def consume() -> None:
        chunks = coalesce(endless(), interval)
        for expected in STEPS[:taken]:
            assert await anext(chunks) == expected
        await chunks.aclose()  # the caller went away
        assert stopped.is_set()  # at once, not when the garbage collector gets to it

    run(consume())
