"""A caller that did not ask to stream gets two chunks from its replica: the first, then the
rest merged, saying what the chunks one per step would have said."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from replicas.chunks import Chunk, first_then_rest, merge_chunks


def chunk(text: str, tokens: list[int], completion: int, finish: str | None = None,
          logprobs: list[dict[str, float]] | None = None) -> Chunk:
    return {"text": text, "token_ids": tokens, "prompt_tokens": 5,
            "completion_tokens": completion, "finish_reason": finish, "logprobs": logprobs}


async def stream(chunks: list[Chunk]) -> AsyncIterator[Chunk]:
    for item in chunks:
        await asyncio.sleep(0)
        yield item


async def collect(chunks: list[Chunk]) -> list[Chunk]:
    return [item async for item in first_then_rest(stream(chunks))]


def test_the_first_chunk_comes_alone_and_the_rest_merge():
    steps = [chunk("def", [1], 1), chunk(" f", [2, 3], 3, logprobs=[{"2": -0.1}, {"3": -0.2}]),
             chunk("():", [4], 4), chunk("", [], 4, finish="length")]
    first, rest = asyncio.run(collect(steps))
    assert first == steps[0]
    assert rest == {"text": " f():", "token_ids": [2, 3, 4], "prompt_tokens": 5,
                    "completion_tokens": 4, "finish_reason": "length",
                    "logprobs": [{"2": -0.1}, {"3": -0.2}]}
    # What the ingress builds from them is what it builds from the chunks one per step.
    assert "".join(c["text"] for c in (first, rest)) == "".join(c["text"] for c in steps)
    assert merge_chunks([first, rest]) == merge_chunks(steps)


def test_short_streams_pass_through():
    assert asyncio.run(collect([])) == []
    only = [{"error": {"message": "bad", "type": "invalid_request_error", "code": 400}}]
    assert asyncio.run(collect(only)) == only
    one = [chunk("x", [7], 1, finish="stop")]
    assert asyncio.run(collect(one)) == one
