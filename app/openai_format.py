"""OpenAI response bodies and server-sent-event framing for the ingress."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def error_body(status: int, message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": code if code is not None else status}}


class CompletionFormat:
    def __init__(self, request_id: str, model: str):
        self.id, self.model, self.created = f"cmpl-{request_id}", model, int(time.time())
        self._text_offset = 0
        """Where the next token's text starts in the completion (legacy `text_offset`)."""

    def _logprobs(self, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """OpenAI's legacy completion logprobs: each token, its logprob, the most likely
        tokens at its position with the sampled one always among them (so up to
        `logprobs` + 1, as OpenAI and vLLM give them) and where its text starts. Entries
        are the replica's: {"token", "logprob", "top": [[token, logprob], ...]}."""
        if not entries:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self._text_offset)
            self._text_offset += len(entry["token"])
        return {"tokens": [entry["token"] for entry in entries],
                "token_logprobs": [entry["logprob"] for entry in entries],
                "top_logprobs": [{**dict(entry["top"]), entry["token"]: entry["logprob"]}
                                 for entry in entries],
                "text_offset": offsets}

    def _base(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model}

    def delta(self, chunk: dict[str, Any], first: bool) -> dict[str, Any]:
        return {**self._base(), "choices": [{"index": 0, "text": chunk["text"],
                                             "logprobs": self._logprobs(chunk.get("logprobs")),
                                             "finish_reason": chunk["finish_reason"]}]}

    def full(self, text: str, finish_reason: str | None, last: dict[str, Any] | None,
             logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {**self._base(), "choices": [{"index": 0, "text": text,
                                             "logprobs": self._logprobs(logprobs),
                                             "finish_reason": finish_reason}],
                "usage": usage(last)}

    def usage_chunk(self, last: dict[str, Any] | None) -> dict[str, Any]:
        return {**self._base(), "choices": [], "usage": usage(last)}


class ChatFormat(CompletionFormat):
    def __init__(self, request_id: str, model: str):
        super().__init__(request_id, model)
        self.id = f"chatcmpl-{request_id}"

    def _logprobs(self, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """OpenAI's chat logprobs: per token its text, logprob and UTF-8 bytes, and the
        `top_logprobs` most likely tokens at its position in the same form."""
        if not entries:
            return None
        return {"content": [{**_chat_token(entry["token"], entry["logprob"]),
                             "top_logprobs": [_chat_token(token, logprob)
                                              for token, logprob in entry["top"]]}
                            for entry in entries]}

    def _base(self, final: bool = False) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion" if final else
                "chat.completion.chunk", "created": self.created, "model": self.model}

    def delta(self, chunk: dict[str, Any], first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": chunk["text"]}
        if first:
            delta["role"] = "assistant"
        return {**self._base(), "choices": [{
            "index": 0, "delta": delta, "logprobs": self._logprobs(chunk.get("logprobs")),
            "finish_reason": chunk["finish_reason"]}]}

    def full(self, text: str, finish_reason: str | None, last: dict[str, Any] | None,
             logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {**self._base(final=True), "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}],
            "usage": usage(last)}


def usage(last: dict[str, Any] | None) -> dict[str, int]:
    prompt = last["prompt_tokens"] if last else 0
    completion = last["completion_tokens"] if last else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


async def sse(chunks: AsyncIterator[dict[str, Any]], formatter: CompletionFormat,
              include_usage: bool,
              finish: Callable[[dict[str, Any] | None, BaseException | None], Awaitable[None]],
              failure_body: Callable[[BaseException], dict[str, Any]], *,
              continuous_usage: bool = False) -> AsyncGenerator[str, None]:
    """Server-sent events as OpenAI sends them: with `include_usage`, `"usage": null` on
    every chunk (the counts so far with `continuous_usage`, vLLM's `continuous_usage_stats`)
    and the usage in a last chunk of its own; `data: [DONE]` at the end, also after an error
    reported in-band (as vLLM does)."""
    last: dict[str, Any] | None = None
    error: BaseException | None = None
    try:
        first = True
        async for chunk in chunks:
            last = chunk
            event = formatter.delta(chunk, first)
            if include_usage:
                event["usage"] = usage(chunk) if continuous_usage else None
            yield f"data: {json.dumps(event)}\n\n"
            first = False
        if include_usage:
            yield f"data: {json.dumps(formatter.usage_chunk(last))}\n\n"
    except Exception as failure:  # mid-stream: the status line is gone, report in-band
        error = failure
        yield f"data: {json.dumps(failure_body(failure))}\n\n"
    except BaseException as gone:  # the client disconnected: nobody to tell
        error = gone
        raise
    finally:
        await finish(last, error)
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """`sse`'s events as a response whose request is finished however the client leaves.

    A client that leaves mid-stream leaves the events suspended at a yield, finished only
    when the garbage collector closes them; one that leaves before the first event leaves
    them unstarted, and closing an unstarted generator runs none of its code, `sse`'s
    `finally` included. So the response closes its events itself, then calls `abandon`,
    which must finish the request unless `sse` already did."""

    def __init__(self, events: AsyncGenerator[str, None],
                 abandon: Callable[[], Awaitable[None]]):
        super().__init__(events, media_type="text/event-stream")
        self._events, self._abandon = events, abandon

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            await self._abandon()


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI `requestBody` for a route that parses its body itself (for size limits and
    OpenAI-style errors), so clients and schema-driven fuzzers see the fields."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": inline(schema)}}}}
