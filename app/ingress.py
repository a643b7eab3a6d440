"""OpenAI-compatible HTTP ingress: validation, streaming, errors, metrics and admin routes.

The request and response bodies are written here rather than imported from vLLM's protocol
module on purpose: the ingress serves every engine (vLLM, SGLang, the simulator), and importing
vLLM would cost each ingress replica ~0.5 GB and seconds of start-up for schemas alone. The
shapes follow OpenAI's API (and vLLM's `ignore_eos` extension).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.openai_format import (
    ChatFormat,
    CompletionFormat,
    EventStream,
    error_body,
    json_body,
    sse,
    usage,
)
from observability import tracing
from observability.exposition import CONTENT_TYPE, render_prometheus
from observability.metrics import RequestMetrics
from policies.class_acceptance import GREEDY_CLASS, SAMPLED_CLASS
from replicas.engines.base import SAMPLING_CONTROLS
from replicas.runtime_change import parse_change

API_KEY_ENV = "SPECSERVE_API_KEY"
MAX_BODY_BYTES = 1 << 20
HEALTH_TIMEOUT_S = 5.0
BROADCAST_TIMEOUT_S = 10.0  # /metrics, /admin: every replica answers within this
GREEDY_BELOW = 1e-5  # temperature under which sampling is argmax (vLLM's threshold)
# vLLM seeds a torch.Generator per request, which takes a 64-bit signed integer.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
# vLLM checks every stop string of a request after each of its steps, on the replica's event
# loop that every other stream shares: a body of a megabyte could hold a quarter of a million
# of them. OpenAI takes 4; vLLM sets no bound.
MAX_STOP_STRINGS = 64
logger = logging.getLogger("ray.serve")


# Request bodies validate strictly, as OpenAI's API does: "5" or true is not a max_tokens,
# "yes" not a stream (pydantic's default would coerce them).
STRICT = ConfigDict(strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    """vLLM's: with `include_usage`, every chunk carries the counts so far."""


# Fields OpenAI's API (or vLLM's) lets a client send as null for "the default".
NULL_MEANS_DEFAULT = ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "top_k", "min_p", "min_tokens", "ignore_eos",
                      "stream", "logprobs", "echo")


# vLLM builds neither a min-p nor a logit-bias processor when speculative decoding is
# configured, as it is on every replica here (K=0 included) but the `drafter: none`
# baseline's, which refuses them too: one app, one set of fields for its clients.
UNAPPLIED_FIELDS = {
    "min_p": "vLLM does not apply it with speculative decoding",
    "logit_bias": "vLLM does not apply it with speculative decoding",
    "response_format": "structured output is not enabled here; only {\"type\": \"text\"}",
    "tools": "tool calling is not enabled here",
    "functions": "function calling is not enabled here",
    "echo": "the prompt is not echoed here",
    "suffix": "text insertion (a prompt with a suffix) is not enabled here",
    "best_of": "only best_of=1 is supported",
    # vLLM's own request fields, which its clients send.
    "stop_token_ids": "only stop strings are applied here",
    "include_stop_str_in_output": "the stop string is never included here",
    "skip_special_tokens": "special tokens are always skipped here",
    "spaces_between_special_tokens": "special tokens are always skipped here",
    "bad_words": "token restrictions are not applied here",
    "allowed_token_ids": "token restrictions are not applied here",
    "prompt_logprobs": "prompt logprobs are not returned here",
    "truncate_prompt_tokens": "prompts are never truncated here: a prompt over the context "
                              "is refused",
    "structured_outputs": "structured output is not enabled here",
    "guided_json": "structured output is not enabled here",
    "guided_regex": "structured output is not enabled here",
    "guided_choice": "structured output is not enabled here",
    "guided_grammar": "structured output is not enabled here",
}
# The values of each field that ask for nothing: its default and the like.
ASKS_FOR_NOTHING: dict[str, tuple[Any, ...]] = {
    "response_format": (None, {}, {"type": "text"}), "best_of": (None, 1),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    # vLLM acts on any value but None: 0 prompt logprobs is the chosen token's, {} any JSON.
    "prompt_logprobs": (None,), "guided_json": (None,)}
NOTHING = (None, False, 0, "", [], {})


def refuse_unapplied(value: Any, info: ValidationInfo) -> Any:
    """A field validator for `UNAPPLIED_FIELDS`: their defaults (and values that ask for
    nothing, such as `best_of: 1`) pass; anything else is refused with the reason."""
    if value not in ASKS_FOR_NOTHING.get(info.field_name, NOTHING):
        raise ValueError(f"{info.field_name} is not supported: "
                         f"{UNAPPLIED_FIELDS[info.field_name]}")
    return value


class SamplingFields(BaseModel):
    # NaN and infinity are refused by name (JSON parsers take NaN), not by a range check.
    model_config = ConfigDict(**STRICT, extra="ignore", allow_inf_nan=False)

    model: str | None = None
    """None (or left out) asks for the served model, as vLLM's server takes it."""
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False
    user: str | None = None
    # OpenAI's two penalties, and vLLM's extensions its clients send (see SAMPLING_CONTROLS).
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)  # SGLang's range; vLLM takes any > 0
    top_k: int = Field(0, ge=-1, le=2**31 - 1)
    min_tokens: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items()
                    if value is not None or key not in NULL_MEANS_DEFAULT}
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    # Fields of OpenAI's API (or vLLM's) that would change the output but that no engine here
    # applies: a request that sets one is refused with the reason rather than answered as if
    # it had not (unknown fields are ignored, as vLLM ignores them).
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    functions: list[dict[str, Any]] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # Every field `UNAPPLIED_FIELDS` names, read from it so the two cannot drift; some are
    # fields of completions only (`echo`, `suffix`, `best_of`), hence `check_fields=False`.
    _unapplied = field_validator(*UNAPPLIED_FIELDS, check_fields=False)(refuse_unapplied)

    @model_validator(mode="after")
    def _min_within_limit(self) -> SamplingFields:
        limit = self.limit()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({limit})")
        return self

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> SamplingFields:
        # Refused rather than ignored, as vLLM and OpenAI refuse it.
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    def limit(self) -> int | None:
        """The request's token limit; None (chat only) lets the replica fill the context."""
        return self.max_completion_tokens or self.max_tokens or self.default_limit

    default_limit: ClassVar[int | None] = 16  # OpenAI's legacy completions default

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text_prompt(cls, prompt: Any) -> Any:
        """A list of one prompt is that prompt; one type left, so an error's `param` is
        `prompt` (a union would name its branch too: `prompt.str`)."""
        if not isinstance(prompt, list):
            return prompt
        if any(isinstance(p, int | list) and not isinstance(p, bool) for p in prompt):
            raise ValueError("prompts of token ids are not supported here; send text")
        if len(prompt) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return prompt[0]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str) -> str:
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _joined_text_parts(cls, content: Any) -> Any:
        """OpenAI's list of content parts, joined by newlines as vLLM joins them. The demo
        models read text only, so an image or audio part is refused, named."""
        if not isinstance(content, list):
            return content
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"only text content parts are supported; part {index} is "
                                 f"{kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"text part {index} needs a string 'text'")
        return "\n".join(part["text"] for part in content)


# `apply_chat_template`'s own parameters and the name it passes the messages on by
# (transformers 5; a test holds the list to it): a template variable of the same name would
# set the call's option instead (tokenize=False, say, and the replica would get text where it
# reads token ids) or collide with it.
TEMPLATE_CALL_OPTIONS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


class ChatRequest(SamplingFields):
    # Without a limit a chat reply runs to its end or the context's, as OpenAI's and vLLM's.
    default_limit: ClassVar[int | None] = None

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: variables for the model's chat template (Qwen3's `enable_thinking`, say)."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        # These would reach the tokenizer's own options, not the template.
        if kwargs and (taken := sorted(TEMPLATE_CALL_OPTIONS & kwargs.keys())):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: "
                             f"options of the tokenizer's call, not template variables")
        return kwargs

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        # Refused rather than ignored, as vLLM refuses it.
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs can only be set when logprobs is true")
        return self


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.kind, self.param, self.code)


def request_status(error: BaseException | None) -> str:
    """A finished request's status label: ok, cancelled (the client went away: its task was
    cancelled, or its response stream closed), invalid (the engine refused the request as
    asked: a 4xx, the client's mistake, kept out of `error` so an alert on it means a fault)
    or error."""
    if error is None:
        return "ok"
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    return "invalid" if isinstance(error, APIError) and error.status < 500 else "error"


def generation_failed(request_id: str, error: BaseException) -> APIError:
    """A request cut off after it started (its replica died, say): logged with the cause,
    answered without it, since a Ray error's text is the replica's traceback."""
    logger.error("request %s: generation failed: %r", request_id, error)
    return APIError(500, f"generation failed (request id {request_id})", "server_error")


def lone_surrogate_at(node: Any) -> str | None:
    """The path of a string in a JSON value that is not valid Unicode, if any.

    JSON's escapes can spell half of a UTF-16 surrogate pair ("\\ud800"); Python decodes it
    into a str that no tokenizer can encode, so it is refused at the door rather than failing
    deep in the engine. Walked with a stack of its own, not by recursion: a body nested
    nearly as deep as the JSON parser allows would exhaust the interpreter's. Each entry links
    to its parent's, and the path is spelled only for the string found: spelling every
    child's path would copy a long key or a deep path once per child, gigabytes for a body of
    a megabyte."""
    # Each entry: a node and its trail, (its key, the parent's trail); None at the root.
    pending: list[tuple[Any, tuple[Any, Any] | None]] = [(node, None)]
    while pending:
        node, trail = pending.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                keys = []
                while trail is not None:
                    key, trail = trail
                    keys.append(str(key))
                return ".".join(reversed(keys)) or "body"
            continue
        children = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, list) else ()
        # Reversed onto the stack, so the first such string in document order is named.
        pending.extend(reversed([(value, (key, trail)) for key, value in children]))
    return None


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


# Nothing could take the request (replicas dead or restarting, the queue full): the client
# may send it again. Any other failure before the first chunk would fail it again: a 500.
REPLICAS_UNAVAILABLE = (RayActorError, BackPressureError, DeploymentUnavailableError,
                        ReplicaUnavailableError)


async def first_chunk(engine: DeploymentHandle, payload: dict[str, Any]
                      ) -> tuple[Any, dict[str, Any]]:
    """The request's response stream and its first chunk (an empty final one if none). A
    stream that fails before it is cancelled: a replica unavailable for a moment may still
    be generating for it, for nobody, while the request is sent again."""
    stream = engine.options(stream=True).generate.remote(payload)
    try:
        return stream, await stream.__anext__()
    except StopAsyncIteration:
        return stream, {"text": "", "token_ids": [], "prompt_tokens": 0,
                        "completion_tokens": 0, "finish_reason": "stop", "logprobs": None}
    except BaseException:
        with contextlib.suppress(Exception):
            stream.cancel()
        raise


async def open_stream(engine: DeploymentHandle, payload: dict[str, Any]
                      ) -> tuple[Any, dict[str, Any]]:
    """Start generation and wait for its first chunk, so errors surface before any byte is
    sent. A replica that dies before answering gets the request sent once more: nothing has
    reached the client yet."""
    try:
        return await first_chunk(engine, payload)
    except RayActorError:
        return await first_chunk(engine, payload)


def start_failed(request_id: str, error: Exception) -> APIError:
    """The answer to a request that failed before its first chunk: a 503 (with Retry-After)
    when no replica could take it, else a 500; the cause (a Ray error carries the replica's
    traceback) goes to the log, not the client."""
    if not isinstance(error, REPLICAS_UNAVAILABLE):
        return generation_failed(request_id, error)
    logger.error("request %s: no engine replica could serve it: %r", request_id, error)
    return APIError(503, f"no engine replica could serve the request (request id "
                         f"{request_id})", "server_error")


fastapi_app = FastAPI(title="specserve", version="0.1.0")


@fastapi_app.exception_handler(APIError)
async def _api_error(_: Request, error: APIError) -> JSONResponse:
    return error_response(error)


@fastapi_app.exception_handler(Exception)
async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, "internal server error", "server_error"))


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return error_response(APIError(error.status_code, str(error.detail), kind))


@serve.ingress(fastapi_app)
class Ingress:
    def __init__(self, engine: DeploymentHandle, model_name: str, kmax: int,
                 api_key: str | None = None):
        self.engine = engine
        self.model_name = model_name
        self.kmax = kmax
        """The engine's deepest tier: run-time candidate lists are checked against it."""
        self.broadcast_timeout_s = BROADCAST_TIMEOUT_S
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        tracing.configure_tracing("specserve-ingress")
        self.metrics = RequestMetrics(f"ingress-{uuid.uuid4().hex[:8]}")

    # ---- guards ---------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        supplied = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if not hmac.compare_digest(supplied.encode(), self.api_key.encode()):
            raise APIError(401, "missing or invalid API key", "authentication_error",
                           code="invalid_api_key")

    async def _json(self, request: Request) -> Any:
        """The request body's JSON value, refused with a 4xx if too large, not JSON, nested
        deeper than the parser goes, or holding text that is not valid Unicode."""
        raw = bytearray()  # read no further than the limit: a huge body is refused, not held
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
        try:
            data = json.loads(raw)
        except ValueError as error:  # malformed, not UTF-8, or an integer of over 4300 digits
            raise APIError(400, f"request body is not valid JSON: {error}") from error
        except RecursionError as error:  # the parser recurses per level of nesting
            raise APIError(400, "request body is not valid JSON here: nested too deeply"
                           ) from error
        if (where := lone_surrogate_at(data)) is not None:
            raise APIError(400, "text must be valid Unicode: the request holds a lone UTF-16 "
                                "surrogate escape (such as \\ud800)",
                           # a key may hold one too, and the error body must encode
                           param=where.encode("utf-8", "backslashreplace").decode())
        return data

    async def _body(self, request: Request, model: type[BaseModel]) -> Any:
        self._authorize(request)
        data = await self._json(request)
        try:
            body = model.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            raise APIError(400, first["msg"], param=".".join(map(str, first["loc"])) or None
                           ) from error
        if body.model is not None:  # else the served model, as vLLM's server takes it
            self._check_model(body.model)
        return body

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this endpoint serves "
                                f"{self.model_name!r}", "not_found_error", param="model",
                           code="model_not_found")

    # ---- OpenAI routes ------------------------------------------------------------------------

    @fastapi_app.api_route("/health", methods=["GET", "HEAD"])  # some balancers probe HEAD
    async def health(self) -> dict[str, str]:
        """Ready when an engine replica answers (no API key: load balancers probe it)."""
        try:
            await asyncio.wait_for(self.engine.ready.remote(), HEALTH_TIMEOUT_S)
        except Exception as error:  # no replica, a dead engine, or none answered in time
            logger.warning("health: no engine replica is ready: %r", error)
            raise APIError(503, "no engine replica is ready", "server_error",
                           code="not_ready") from error
        return {"status": "ok"}

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [self._model_card()]}

    @fastapi_app.get("/v1/models/{model:path}")  # a model id may hold slashes (org/name)
    async def model(self, request: Request, model: str) -> dict[str, Any]:
        self._authorize(request)
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0,
                "owned_by": "specserve"}

    @fastapi_app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(self, request: Request) -> Any:
        body: CompletionRequest = await self._body(request, CompletionRequest)
        payload = self._payload(body, prompt=body.prompt, logprobs=body.logprobs)
        return await self._respond(request, body, payload, chat=False)

    @fastapi_app.post("/v1/chat/completions", openapi_extra=json_body(ChatRequest))
    async def chat_completions(self, request: Request) -> Any:
        body: ChatRequest = await self._body(request, ChatRequest)
        messages = [m.model_dump() for m in body.messages]
        payload = self._payload(body, messages=messages,
                                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                chat_template_kwargs=body.chat_template_kwargs)
        return await self._respond(request, body, payload, chat=True)

    def _payload(self, body: SamplingFields, **extra: Any) -> dict[str, Any]:
        return {"request_id": uuid.uuid4().hex, "max_tokens": body.limit(),
                "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
                "stop": body.stops(), "ignore_eos": body.ignore_eos,
                **{name: getattr(body, name) for name in SAMPLING_CONTROLS},
                "request_class": GREEDY_CLASS if body.temperature < GREEDY_BELOW
                else SAMPLED_CLASS,
                "stream": body.stream, **extra}

    async def _respond(self, request: Request, body: SamplingFields, payload: dict[str, Any],
                       chat: bool) -> Any:
        route = "/v1/chat/completions" if chat else "/v1/completions"
        prompt = None
        if tracing.records_prompts():  # a chat's messages as sent, a completion's prompt text
            prompt = payload["prompt"] if "prompt" in payload else json.dumps(payload["messages"])
        span = tracing.start_ingress_span(f"POST {route}", request.headers,
                                          request_id=payload["request_id"], model=self.model_name,
                                          prompt=prompt)
        payload["trace_context"] = tracing.inject_context(span)
        started = time.perf_counter()
        ttft: float | None = None  # until the first chunk

        finished: str | None = None  # the request's status once it has ended

        async def finish(last: dict[str, Any] | None, error: BaseException | None) -> None:
            """Every request ends here exactly once: its span closed, its metrics recorded
            (a second call, a stream's response making sure, does nothing)."""
            nonlocal finished
            if finished:
                return
            finished = request_status(error)
            tokens = usage(last)
            tracing.finish_span(span, error=error, prompt_tokens=tokens["prompt_tokens"],
                                completion_tokens=tokens["completion_tokens"])
            self.metrics.record_request(
                self.model_name, e2e_s=time.perf_counter() - started, ttft_s=ttft,
                prompt_tokens=tokens["prompt_tokens"],
                completion_tokens=tokens["completion_tokens"], status=finished)

        try:
            stream, first = await open_stream(self.engine, payload)
        except BaseException as error:  # no replica served it, or the client left meanwhile
            await finish(None, error)
            if isinstance(error, Exception):
                raise start_failed(payload["request_id"], error) from error
            raise
        if "error" in first:
            refused = APIError(400, first["error"]["message"])
            await finish(None, refused)
            raise refused
        ttft = time.perf_counter() - started
        formatter = ChatFormat(payload["request_id"], self.model_name) if chat else \
            CompletionFormat(payload["request_id"], self.model_name)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            yield first
            async for chunk in stream:
                yield chunk

        if body.stream:
            options = body.stream_options or StreamOptions()

            def failure_body(error: BaseException) -> dict[str, Any]:
                return generation_failed(payload["request_id"], error).body()

            async def abandon() -> None:
                if finished != "ok":  # the client left: the replica stops generating
                    stream.cancel()
                await finish(None, asyncio.CancelledError())  # left before the first event

            return EventStream(
                sse(chunks(), formatter, bool(options.include_usage), finish, failure_body,
                    continuous_usage=bool(options.continuous_usage_stats)), abandon)
        last: dict[str, Any] | None = None
        text: list[str] = []
        logprobs: list[dict[str, Any]] = []
        finish_reason = None
        try:
            async for chunk in chunks():
                last = chunk
                text.append(chunk["text"])
                logprobs.extend(chunk.get("logprobs") or [])
                finish_reason = chunk["finish_reason"] or finish_reason
        except BaseException as error:  # the replica failed, or the client went away
            await finish(last, error)
            if isinstance(error, Exception):
                raise generation_failed(payload["request_id"], error) from error
            raise
        await finish(last, None)
        return formatter.full("".join(text), finish_reason, last, logprobs or None)

    # ---- operations ---------------------------------------------------------------------------

    async def _broadcast(self, method: str, *args: Any) -> list[Any]:
        """Every live replica's answer, or its exception; one replica too slow to answer
        within `broadcast_timeout_s` is a 503, not a request that never ends."""
        try:
            return await self.engine.broadcast(method, *args).results_async(
                timeout_s=self.broadcast_timeout_s, return_exceptions=True)
        except TimeoutError as error:
            raise APIError(503, f"engine replicas did not answer {method} within "
                                f"{self.broadcast_timeout_s:.0f} s", "server_error") from error

    async def _from_every_replica(self, method: str) -> list[Any]:
        """The answers of the replicas that gave one: a replica that fails (it is dying, say)
        is logged and left out rather than failing the scrape or the view of the others."""
        results = await self._broadcast(method)
        for failure in (r for r in results if isinstance(r, BaseException)):
            logger.warning("a replica failed %s: %r", method, failure)
        return [r for r in results if not isinstance(r, BaseException)]

    @fastapi_app.get("/metrics")
    async def prometheus(self, request: Request) -> PlainTextResponse:
        self._authorize(request)
        snapshots = await self._from_every_replica("metrics_snapshot")
        return PlainTextResponse(render_prometheus(self.metrics.snapshot(), *snapshots),
                                 media_type=CONTENT_TYPE)

    @fastapi_app.get("/admin/replicas")
    async def replicas(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"replicas": await self._from_every_replica("stats")}

    @fastapi_app.post("/admin/policy")
    async def set_policy(self, request: Request) -> dict[str, Any]:
        """Fleet-wide run-time change on every replica: {"policy": {...}, "candidates": [...],
        "stream_interval_ms": ...}, any of them."""
        self._authorize(request)
        user_config = await self._json(request)
        try:
            parse_change(user_config, self.kmax)  # as every replica will parse it
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error)) from error
        user_config["issued_at"] = time.time()  # orders run-time changes fleet-wide
        results = await self._broadcast("reconfigure", user_config)
        failed = [result for result in results if isinstance(result, BaseException)]
        if failed and len(failed) == len(results) and \
                all(isinstance(result, ValueError) for result in failed):
            # Every replica refused it as invalid for its state (a static K outside its
            # tiers, a policy its engine cannot serve), each leaving itself as it was.
            cause = getattr(failed[0], "cause", None) or failed[0]  # a Ray error wraps it
            raise APIError(400, str(cause))
        if failed:  # a valid change the replica could not apply: a server fault
            logger.error("reconfiguration failed on %d of %d replicas: %r", len(failed),
                         len(results), failed)
            raise APIError(500, f"the change failed on {len(failed)} of {len(results)} "
                                "replicas (the others applied it); see the replica logs",
                           "server_error")
        return {"replicas": await self._from_every_replica("stats")}
