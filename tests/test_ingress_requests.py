"""The ingress's request path over a stand-in engine handle (no Ray, no Serve): every request
closes its span and is counted once, whatever ends it; a failure before the first chunk is a
503 only when no replica could take the request; a body nested too deeply is a 400."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from typing import Any

import pytest
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from app.ingress import APIError, error_response, lone_surrogate_at
from observability import tracing
from tests.conftest import bare_ingress, http_request

WAIT = "wait"  # the replica never answers (the request queues, or its prompt is prefilled)
CHUNK = {"text": "hi", "token_ids": [1], "prompt_tokens": 2, "completion_tokens": 1,
         "finish_reason": "length", "logprobs": None}


class Stream:
    """A response stream that raises, waits forever or yields its chunks."""

    def __init__(self, outcome: BaseException | str | list[dict[str, Any]]):
        self.outcome = outcome
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        if self.outcome == WAIT:
            await asyncio.Event().wait()
        if not self.outcome:
            raise StopAsyncIteration
        return self.outcome.pop(0)


class Engine:
    """Stands in for the engine deployment's handle: one outcome per request sent."""

    def __init__(self, *outcomes: BaseException | str | list[dict[str, Any]]):
        self.outcomes, self.sent = list(outcomes), 0
        self.streams: list[Stream] = []

    def options(self, stream: bool) -> Engine:
        return self

    @property
    def generate(self) -> Engine:
        return self

    def remote(self, payload: dict[str, Any]) -> Stream:
        self.sent += 1
        self.stream = Stream(self.outcomes.pop(0))
        self.streams.append(self.stream)
        return self.stream


class Recorded:
    """Stands in for the ingress's RequestMetrics: the status of each recorded request."""

    def __init__(self) -> None:
        self.statuses: list[str] = []

    def record_request(self, model: str, **fields: Any) -> None:
        self.statuses.append(fields["status"])


@pytest.fixture
def spans_finished(monkeypatch: pytest.MonkeyPatch) -> list[BaseException | None]:
    """The error each finished span was closed with."""
    finished: list[BaseException | None] = []
    monkeypatch.setattr(tracing, "finish_span",
                        lambda span, error=None, **_: finished.append(error))
    return finished


def completion(engine: Engine, recorded: Recorded) -> Any:
    front = bare_ingress(engine, metrics=recorded)
    return front.completions(http_request({"model": "target", "prompt": "x"}))


def test_a_client_that_leaves_while_its_request_waits_is_counted_cancelled(spans_finished):
    recorded = Recorded()

    async def scenario() -> None:
        task = asyncio.create_task(completion(Engine(WAIT), recorded))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert recorded.statuses == ["cancelled"]
    assert len(spans_finished) == 1


@pytest.mark.parametrize(("outcomes", "status", "sent"), [
    ((RayActorError(), RayActorError()), 503, 2),  # died twice before answering
    ((BackPressureError(num_queued_requests=3, max_queued_requests=2),), 503, 1),
    # An engine fault fails the same input every time: no retry, no Retry-After.
    ((ValueError("engine bug: secret detail"),), 500, 1),
])
def test_a_failure_before_the_first_chunk_is_answered_counted_and_closed_once(
        spans_finished, outcomes, status, sent):
    engine, recorded = Engine(*outcomes), Recorded()
    with pytest.raises(APIError) as raised:
        asyncio.run(completion(engine, recorded))
    response = error_response(raised.value)
    assert response.status_code == status
    assert ("retry-after" in response.headers) == (status == 503)
    assert "secret" not in raised.value.message, "the cause goes to the log, not the client"
    assert engine.sent == sent
    assert recorded.statuses == ["error"]
    assert len(spans_finished) == 1 and spans_finished[0] is not None


def test_a_request_the_engine_refuses_is_a_400_counted_invalid_not_error(spans_finished):
    """A prompt too long for the context is found by the engine: the client's mistake, so a
    dashboard's error rate does not count it."""
    refusal = {"error": {"message": "the prompt exceeds the context",
                         "type": "invalid_request_error", "code": 400}}
    engine, recorded = Engine([refusal]), Recorded()
    with pytest.raises(APIError) as raised:
        asyncio.run(completion(engine, recorded))
    assert raised.value.status == 400 and "exceeds the context" in raised.value.message
    assert recorded.statuses == ["invalid"] and len(spans_finished) == 1


def test_a_replica_that_died_before_answering_gets_the_request_once_more(spans_finished):
    """The first attempt is cancelled: a replica unavailable for a moment may still run it."""
    engine, recorded = Engine(RayActorError(), [dict(CHUNK)]), Recorded()
    body = asyncio.run(completion(engine, recorded))
    assert [stream.cancelled for stream in engine.streams] == [True, False]
    assert body["choices"][0]["text"] == "hi" and engine.sent == 2
    assert recorded.statuses == ["ok"] and spans_finished == [None]


def test_the_prompt_is_on_the_ingress_span_only_when_prompts_are_recorded():
    """`SPECSERVE_TRACE_PROMPTS=1` (here `record_prompts`): a completion's prompt and a chat's
    messages go on the request's span as `gen_ai.prompt`; otherwise no span carries them."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    def prompts(record: bool) -> list[str | None]:
        exporter = InMemorySpanExporter()
        tracing.configure_tracing("test", exporter=exporter, record_prompts=record, force=True)
        try:
            front = bare_ingress(Engine([dict(CHUNK)], [dict(CHUNK)]), metrics=Recorded())
            asyncio.run(front.completions(http_request({"model": "target", "prompt": "x y"})))
            asyncio.run(front.chat_completions(http_request(
                {"model": "target", "messages": [{"role": "user", "content": "hi"}]})))
            tracing.force_flush_tracing()
            return [span.attributes.get("gen_ai.prompt")
                    for span in exporter.get_finished_spans()]
        finally:
            tracing.shutdown_tracing()

    recorded = prompts(True)
    assert recorded[0] == "x y" and json.loads(recorded[1])[0]["content"] == "hi"
    assert prompts(False) == [None, None]


def nested(depth: int, inner: str = "[]") -> str:
    return "[" * depth + inner + "]" * depth


@pytest.mark.parametrize("route", ["completions", "chat_completions", "set_policy"])
def test_a_body_nested_deeper_than_the_parser_goes_is_a_400(route):
    front = bare_ingress(Engine())
    with pytest.raises(APIError) as raised:
        asyncio.run(getattr(front, route)(http_request(nested(1200).encode())))
    assert raised.value.status == 400 and "nested too deeply" in raised.value.message


def test_a_lone_surrogate_is_found_at_any_depth_without_recursion():
    deep: Any = "\ud800"
    for _ in range(5000):  # deeper than the interpreter's recursion limit
        deep = [deep]
    assert lone_surrogate_at({"model": "target", "stop": ["ok", "\udfff"], "x": deep}) == \
        "stop.1"
    assert lone_surrogate_at({"x": deep}) == "x" + ".0" * 5000
    assert lone_surrogate_at(json.loads(nested(900, '"ok"'))) is None


def test_a_body_of_long_keys_over_many_values_is_walked_in_its_own_size():
    """A path per child would copy a 200,000-character key once for each of 100,000
    values (20 GB); the walk holds a link per child and spells only the path it names."""
    key = "k" * 200_000
    tracemalloc.start()
    try:
        assert lone_surrogate_at({key: [0] * 100_000}) is None
        assert lone_surrogate_at({key: [0] * 99_999 + ["\ud800"]}) == f"{key}.99999"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20


@pytest.mark.parametrize("route", ["completions", "chat_completions"])
def test_an_integer_past_pythons_digit_limit_is_a_400(route: str):
    front = bare_ingress(Engine())
    body = b'{"model": "target", "prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}"
    with pytest.raises(APIError) as raised:
        asyncio.run(getattr(front, route)(http_request(body)))
    assert raised.value.status == 400 and "not valid JSON" in raised.value.message


@pytest.mark.parametrize("model", [None, "left out"])
def test_a_request_without_a_model_asks_for_the_served_one(model):
    """As vLLM's server takes it: `model` null or left out is the model it serves."""
    front = bare_ingress(Engine([dict(CHUNK)], [dict(CHUNK)]), metrics=Recorded())
    fields = {} if model == "left out" else {"model": model}
    answer = asyncio.run(front.completions(http_request({"prompt": "x", **fields})))
    assert answer["model"] == "target"
    chat = asyncio.run(front.chat_completions(http_request(
        {"messages": [{"role": "user", "content": "hi"}], **fields})))
    assert chat["model"] == "target"


@pytest.mark.parametrize("asgi", ["2.3", "2.4"])
@pytest.mark.parametrize(("sends_before_leaving", "status", "cancelled"), [
    (0, "cancelled", True),  # gone before the first event: the events never started
    (2, "cancelled", True),  # gone mid-stream: the events wait at a yield
    (None, "ok", False),  # read to the end
])
def test_a_streamed_request_is_finished_once_however_the_client_leaves(
        spans_finished, asgi, sends_before_leaving, status, cancelled):
    """Counted and its span closed once; a replica whose client left stops generating.
    ASGI 2.4 servers report a gone client by failing a send, older ones (uvicorn's 2.3) by a
    disconnect message, which Starlette listens for beside the stream."""
    engine, recorded = Engine([dict(CHUNK), dict(CHUNK), dict(CHUNK)]), Recorded()
    front = bare_ingress(engine, metrics=recorded)
    sent: list[dict[str, Any]] = []

    def gone() -> bool:
        return len(sent) == sends_before_leaving

    async def send(message: dict[str, Any]) -> None:
        if asgi == "2.4" and gone():
            raise OSError("the client closed the connection")
        sent.append(message)
        await asyncio.sleep(0)  # the server writes: the disconnect listener may run

    async def receive() -> dict[str, Any]:
        while not (asgi == "2.3" and gone()):
            await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    async def scenario() -> None:
        response = await front.completions(http_request(
            {"model": "target", "prompt": "x", "stream": True}))
        scope = {"type": "http", "asgi": {"spec_version": asgi}}
        try:
            await response(scope, receive, send)
        except Exception:  # the disconnect, as Starlette reports it
            assert sends_before_leaving is not None

    asyncio.run(scenario())
    assert recorded.statuses == [status] and len(spans_finished) == 1
    assert engine.stream.cancelled is cancelled
