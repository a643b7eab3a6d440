"""The chunks a replica sends its ingress for one request, and how few it can send.

A chunk is {"text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason",
"logprobs"} (or one {"error"}), one per engine output: one per engine step, so one per token
without speculation. Each crosses from the replica to the ingress as a message of Serve's
streaming protocol, and costs both processes far more than the engine spends on the token:
over HTTP on the 2-core dev machine the ingress used more CPU relaying one-token chunks than
both engine cores used computing them. A caller that did not ask to stream reads only the
whole text, so it gets two chunks: the first at once (a bad request, or the time to the
first token, shows as it would streamed), and the rest merged when the request finishes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

Chunk = dict[str, Any]


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


async def first_then_rest(chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    """The first chunk as it comes, then everything after it as one chunk at the end."""
    iterator = aiter(chunks)
    try:
        yield await anext(iterator)
    except StopAsyncIteration:
        return
    rest = [chunk async for chunk in iterator]
    if rest:
        yield merge_chunks(rest)
