"""Tracing: ingress span -> dict carrier -> replica span is one trace; switches are span events."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, StatusCode

from observability import tracing
from policies.signals import Decision
from replicas.tier_pool import TierSwitch

INCOMING_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
INCOMING = {"Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    monkeypatch.delenv("SPECSERVE_TRACE_PROMPTS", raising=False)
    exporter = InMemorySpanExporter()
    assert tracing.configure_tracing("test", sampling_ratio=1.0, exporter=exporter, force=True)
    yield exporter
    tracing.shutdown_tracing()


def _simulate_request(error: BaseException | None = None) -> None:
    """What the ingress and replica do for one request, across a (simulated) handle call."""
    ingress = tracing.start_ingress_span("POST /v1/completions", INCOMING, request_id="req-1",
                                         model="demo", prompt="secret prompt")
    carrier = tracing.inject_context(ingress)
    assert set(carrier) == {"traceparent"}
    active = tracing.ActiveSpans()
    replica = tracing.start_replica_span(dict(carrier), request_id="req-1", replica_id="r0",
                                         model="demo", k_start=3)
    active.add(replica)
    active.record_tier_switch(
        TierSwitch(from_k=3, to_k=1, seconds=0.002),
        Decision(k=1, reason="goodput", inputs={"batch": 12.0, "p0": 0.41}))
    active.discard(replica)
    outcome = {"prompt_tokens": 7, "completion_tokens": 20, "k_end": 1, "draft_tokens": 30,
               "accepted_tokens": 12, "verify_steps": 8}
    tracing.finish_span(replica, error=error, **outcome)
    tracing.finish_span(ingress, error=error, prompt_tokens=7, completion_tokens=20)


def test_ingress_and_replica_spans_form_one_trace(spans: InMemorySpanExporter) -> None:
    _simulate_request()
    assert tracing.force_flush_tracing()
    by_name = {span.name: span for span in spans.get_finished_spans()}
    ingress, replica = by_name["POST /v1/completions"], by_name["specserve.replica.generate"]

    # The incoming traceparent is continued, and the replica span is the ingress span's child.
    assert ingress.context.trace_id == INCOMING_TRACE_ID
    assert ingress.parent is not None and ingress.parent.span_id == 0xB7AD6B7169203331
    assert replica.context.trace_id == INCOMING_TRACE_ID
    assert replica.parent is not None and replica.parent.span_id == ingress.context.span_id

    assert replica.attributes["specserve.request_id"] == "req-1"
    assert replica.attributes["gen_ai.request.model"] == "demo"
    assert replica.attributes["specserve.replica"] == "r0"
    assert replica.attributes["gen_ai.usage.input_tokens"] == 7
    assert replica.attributes["gen_ai.usage.output_tokens"] == 20
    assert replica.attributes["specserve.spec.k_start"] == 3
    assert replica.attributes["specserve.spec.k_end"] == 1
    assert replica.attributes["specserve.spec.draft_tokens"] == 30
    assert replica.attributes["specserve.spec.accepted_tokens"] == 12
    assert replica.attributes["specserve.spec.mean_acceptance_length"] == pytest.approx(2.5)
    assert ingress.attributes["specserve.request_id"] == "req-1"
    assert ingress.attributes["gen_ai.usage.output_tokens"] == 20
    # Prompt text stays out of spans unless enabled.
    assert "gen_ai.prompt" not in ingress.attributes
    assert "gen_ai.prompt" not in replica.attributes


def test_tier_switch_is_a_span_event_with_its_signals(spans: InMemorySpanExporter) -> None:
    _simulate_request()
    tracing.force_flush_tracing()
    replica = next(s for s in spans.get_finished_spans() if s.name.startswith("specserve."))
    (event,) = [e for e in replica.events if e.name == tracing.TIER_SWITCH_EVENT]
    assert event.attributes["specserve.spec.from_k"] == 3
    assert event.attributes["specserve.spec.to_k"] == 1
    assert event.attributes["specserve.policy.reason"] == "goodput"
    assert event.attributes["specserve.policy.input.batch"] == 12.0
    assert event.attributes["specserve.policy.input.p0"] == pytest.approx(0.41)


def test_a_switch_without_a_decision_records_the_tiers_only(spans: InMemorySpanExporter
                                                            ) -> None:
    active = tracing.ActiveSpans()
    span = tracing.start_replica_span({}, request_id="r", replica_id="r1", k_start=7)
    active.add(span)
    active.record_tier_switch(TierSwitch(7, 0, 0.001))
    tracing.finish_span(span)
    tracing.force_flush_tracing()
    (finished,) = spans.get_finished_spans()
    assert finished.parent is None  # no carrier: a root span
    (event,) = finished.events
    assert (event.attributes["specserve.spec.from_k"], event.attributes["specserve.spec.to_k"]) \
        == (7, 0)
    assert "specserve.policy.reason" not in event.attributes


def test_errors_mark_both_spans(spans: InMemorySpanExporter) -> None:
    _simulate_request(error=RuntimeError("engine died"))
    tracing.force_flush_tracing()
    finished = spans.get_finished_spans()
    assert len(finished) == 2
    assert all(s.status.status_code is StatusCode.ERROR for s in finished)
    assert all(any(e.name == "exception" for e in s.events) for s in finished)


def test_prompt_recorded_only_when_enabled() -> None:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("test", exporter=exporter, record_prompts=True, force=True)
    try:
        tracing.finish_span(tracing.start_ingress_span("POST /x", None, request_id="r",
                                                       prompt="hello"))
        tracing.force_flush_tracing()
        (span,) = exporter.get_finished_spans()
        assert span.attributes["gen_ai.prompt"] == "hello"
    finally:
        tracing.shutdown_tracing()


def test_sampling_ratio_zero_records_nothing_and_replica_follows_parent() -> None:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("test", sampling_ratio=0.0, exporter=exporter, force=True)
    try:
        ingress = tracing.start_ingress_span("POST /x", None, request_id="r")
        carrier = tracing.inject_context(ingress)
        # The unsampled flag travels to the replica.
        assert int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 0x01 == 0
        replica = tracing.start_replica_span(carrier, request_id="r", replica_id="r0")
        assert not ingress.is_recording() and not replica.is_recording()
        tracing.finish_span(replica, completion_tokens=3)
        tracing.finish_span(ingress)
        tracing.force_flush_tracing()
        assert exporter.get_finished_spans() == ()
    finally:
        tracing.shutdown_tracing()


def test_not_configured_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.configure_tracing("test", force=True) is False
    assert not tracing.tracing_enabled()
    span = tracing.start_ingress_span("POST /x", INCOMING, request_id="r")
    assert span is INVALID_SPAN
    assert tracing.inject_context(span) == {}
    assert tracing.extract_context(INCOMING) is None
    assert tracing.start_replica_span({"traceparent": "x"}, request_id="r",
                                      replica_id="r0") is INVALID_SPAN
    active = tracing.ActiveSpans()
    active.add(span)
    assert len(active) == 0
    tracing.finish_span(span, completion_tokens=1)  # no error, nothing recorded
    # Idempotent: a second call without force keeps the first outcome.
    assert tracing.configure_tracing("other") is False

