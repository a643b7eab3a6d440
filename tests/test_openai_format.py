"""OpenAI response bodies built from a replica's chunks: logprobs in the legacy completion
form and the chat form, the same whether the chunks stream or arrive as one."""

from __future__ import annotations

import asyncio
import json

from app.ingress import request_status
from app.openai_format import ChatFormat, CompletionFormat, sse

# As a replica sends them: the sampled token, its logprob, the most likely at its position.
ENTRIES = [{"token": "def", "logprob": -0.1, "top": [["def", -0.1], ["class", -2.5]]},
           {"token": " f", "logprob": -0.7, "top": [[" g", -0.5], [" f", -0.7]]},
           {"token": "é", "logprob": -1.0, "top": [["é", -1.0], ["e", -1.2]]}]


def chunk(entries: list[dict], finish: str | None = None) -> dict:
    return {"text": "".join(e["token"] for e in entries), "token_ids": [1] * len(entries),
            "prompt_tokens": 3, "completion_tokens": 3, "finish_reason": finish,
            "logprobs": entries}


def test_completion_logprobs_name_the_sampled_tokens_not_the_most_likely():
    body = CompletionFormat("r", "target").full("def fé", "length", chunk(ENTRIES), ENTRIES)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs == {"tokens": ["def", " f", "é"], "token_logprobs": [-0.1, -0.7, -1.0],
                        "top_logprobs": [{"def": -0.1, "class": -2.5}, {" g": -0.5, " f": -0.7},
                                         {"é": -1.0, "e": -1.2}],
                        "text_offset": [0, 3, 5]}


def test_completion_top_logprobs_always_hold_the_sampled_token():
    """A sampled token outside the most likely ones joins them: up to logprobs + 1."""
    entry = {"token": "x", "logprob": -4.0, "top": [["def", -0.1], ["class", -2.5]]}
    body = CompletionFormat("r", "target").full("x", "length", chunk([entry]), [entry])
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [
        {"def": -0.1, "class": -2.5, "x": -4.0}]


def test_streamed_completion_logprobs_continue_the_text_offsets():
    formatter = CompletionFormat("r", "target")
    first = formatter.delta(chunk(ENTRIES[:1]), first=True)["choices"][0]["logprobs"]
    rest = formatter.delta(chunk(ENTRIES[1:]), first=False)["choices"][0]["logprobs"]
    assert first["text_offset"] + rest["text_offset"] == [0, 3, 5]
    assert first["tokens"] + rest["tokens"] == ["def", " f", "é"]


def test_chat_logprobs_carry_bytes_and_top_logprobs_streamed_or_not():
    whole = ChatFormat("r", "target").full("def fé", "stop", chunk(ENTRIES), ENTRIES)
    content = whole["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [("def", -0.1), (" f", -0.7),
                                                             ("é", -1.0)]
    assert content[2]["bytes"] == [0xC3, 0xA9]
    assert content[1]["top_logprobs"] == [{"token": " g", "logprob": -0.5, "bytes": [32, 103]},
                                          {"token": " f", "logprob": -0.7,
                                           "bytes": [32, 102]}]
    formatter = ChatFormat("r", "target")
    streamed = [formatter.delta(chunk([entry]), first=i == 0)["choices"][0]["logprobs"]
                ["content"][0] for i, entry in enumerate(ENTRIES)]
    assert streamed == content


def test_no_logprobs_asked_none_given():
    assert CompletionFormat("r", "t").full("x", "stop", None, None)["choices"][0][
        "logprobs"] is None
    assert ChatFormat("r", "t").delta(chunk([]), first=True)["choices"][0]["logprobs"] is None


def test_a_stream_the_client_left_finishes_as_cancelled_not_ok():
    """A client that disconnects mid-stream closes the response's generator: the request is
    finished once, with the error that says so, and counted as cancelled."""
    finished: list = []

    async def chunks():
        for entry in ENTRIES:
            yield chunk([entry])

    async def finish(last, error):
        finished.append((last, error))

    async def scenario() -> None:
        events = sse(chunks(), CompletionFormat("r", "t"), False, finish, lambda e: {})
        await anext(events)
        await events.aclose()

    asyncio.run(scenario())
    assert len(finished) == 1
    assert request_status(finished[0][1]) == "cancelled"
    assert [request_status(e) for e in (None, RuntimeError("engine died"),
                                        asyncio.CancelledError())] == ["ok", "error",
                                                                      "cancelled"]


def streamed(chunks: list[dict | Exception], include_usage: bool,
             continuous_usage: bool = False) -> list[str]:
    """The events `sse` sends for these chunks (an exception: the replica failed there)."""
    async def source():
        for item in chunks:
            if isinstance(item, Exception):
                raise item
            yield item

    async def finish(last, error):
        pass

    async def scenario() -> list[str]:
        return [event async for event in sse(source(), ChatFormat("r", "t"), include_usage,
                                             finish, lambda e: {"error": {"message": "x"}},
                                             continuous_usage=continuous_usage)]

    return [event.removeprefix("data: ").strip() for event in asyncio.run(scenario())]


def test_with_include_usage_every_chunk_carries_null_usage_and_the_last_the_counts():
    *events, done = streamed([chunk(ENTRIES[:1]), chunk(ENTRIES[1:], "stop")], True)
    bodies = [json.loads(event) for event in events]
    assert done == "[DONE]"
    assert [body["usage"] for body in bodies[:-1]] == [None, None]
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["total_tokens"] == 6
    assert all("usage" not in json.loads(event) for event in streamed([chunk(ENTRIES)],
                                                                       False)[:-1])


def test_with_continuous_usage_stats_every_chunk_carries_the_counts_so_far():
    """vLLM's `stream_options.continuous_usage_stats`; without `include_usage` it adds
    nothing, as in vLLM."""
    first, second = chunk(ENTRIES[:1]), chunk(ENTRIES[1:], "stop")
    first["completion_tokens"] = 1
    *events, done = streamed([first, second], True, continuous_usage=True)
    assert done == "[DONE]"
    counts = [json.loads(event)["usage"]["completion_tokens"] for event in events]
    assert counts == [1, second["completion_tokens"], second["completion_tokens"]]
    assert all("usage" not in json.loads(event)
               for event in streamed([first, second], False, continuous_usage=True)[:-1])


def test_a_stream_that_fails_midway_reports_the_error_then_ends_with_done():
    events = streamed([chunk(ENTRIES[:1]), RuntimeError("replica died")], True)
    assert json.loads(events[1]) == {"error": {"message": "x"}}
    assert events[2:] == ["[DONE]"]
