"""Request tracing: an ingress span per HTTP request, a replica child span across the handle call.

Flow: the ingress calls `start_ingress_span(route, request.headers, ...)` (continuing an
incoming W3C `traceparent`), sends `inject_context(span)` (a plain `dict[str, str]`) with the
request through the Ray handle, and the replica calls `start_replica_span(carrier, ...)`.
Both end with `finish_span(span, ...)`. Tier switches land as span events on every in-flight
replica span through `ActiveSpans.record_tier_switch`.

Spans are created explicitly and never made the current context: the ingress span lives across
a streaming response (an async generator), where attaching and detaching a context in
different tasks fails.

Tracing is off unless `configure_tracing` finds an OTLP endpoint in the environment (or is
given an exporter). Off means: every helper returns at its first line, spans are the API's
`INVALID_SPAN` (a no-op), carriers are empty, and no attribute dict is ever built. Our tracer
provider is private to this module; the global one is left alone (Ray Serve may own it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from observability.otlp import otlp_configured, service_resource, span_exporter

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from policies.signals import Decision
    from replicas.tier_pool import TierSwitch

TIER_SWITCH_EVENT = "specserve.tier_switch"
_PROPAGATOR = TraceContextTextMapPropagator()
_PROPAGATION_HEADERS = ("traceparent", "tracestate")


class _State:
    configured = False
    tracer: Tracer | None = None
    provider: TracerProvider | None = None
    record_prompts = False


def configure_tracing(service_name: str, sampling_ratio: float | None = None, *,
                      exporter: SpanExporter | None = None, record_prompts: bool | None = None,
                      force: bool = False) -> bool:
    """Set up tracing for this process once; returns whether spans are recorded.

    `sampling_ratio` defaults to `OTEL_TRACES_SAMPLER_ARG`, else 1.0; the sampler is
    parent-based, so an incoming sampled/unsampled flag is honoured and a replica follows its
    ingress. `exporter` overrides OTLP (tests, benchmarks). Prompt text goes into spans only
    with `record_prompts` (default: env `SPECSERVE_TRACE_PROMPTS=1`). Later calls are no-ops
    unless `force` (which shuts the previous provider down).
    """
    if _State.configured and not force:
        return _State.tracer is not None
    shutdown_tracing()
    _State.configured = True
    if exporter is None:
        if not otlp_configured("TRACES"):
            return False
        exporter = span_exporter()

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if sampling_ratio is None:
        sampling_ratio = float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
    if not 0.0 <= sampling_ratio <= 1.0:
        raise ValueError(f"sampling ratio must be in [0, 1], got {sampling_ratio}")
    if record_prompts is None:
        record_prompts = os.environ.get("SPECSERVE_TRACE_PROMPTS", "") == "1"
    provider = TracerProvider(
        resource=service_resource(service_name),
        sampler=ParentBased(TraceIdRatioBased(sampling_ratio)))
    # Batching keeps export off the request path.
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _State.provider = provider
    _State.tracer = provider.get_tracer("specserve")
    _State.record_prompts = record_prompts
    return True


def tracing_enabled() -> bool:
    return _State.tracer is not None


def force_flush_tracing(timeout_millis: int = 10_000) -> bool:
    return _State.provider.force_flush(timeout_millis) if _State.provider else True


def shutdown_tracing() -> None:
    """Flush and stop the exporter; tracing is off until `configure_tracing(..., force=True)`."""
    if _State.provider is not None:
        _State.provider.shutdown()
    _State.provider = _State.tracer = None


def inject_context(span: Span | None = None) -> dict[str, str]:
    """W3C trace context of `span` (or the current span) as a dict to carry with a request."""
    if _State.tracer is None:
        return {}
    carrier: dict[str, str] = {}
    context = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def extract_context(carrier: Mapping[str, str] | None) -> Context | None:
    """The parent context from `inject_context`'s dict or HTTP headers; None if absent."""
    if _State.tracer is None or not carrier:
        return None
    # HTTP header names are case-insensitive; a plain dict from elsewhere may not be lowercase.
    found = {k.lower(): v for k, v in carrier.items() if k.lower() in _PROPAGATION_HEADERS}
    return _PROPAGATOR.extract(found) if found else None


def records_prompts() -> bool:
    """Whether spans record prompt text (`gen_ai.prompt`): a caller builds the text only then."""
    return _State.tracer is not None and _State.record_prompts


def start_ingress_span(route: str, headers: Mapping[str, str] | None, *, request_id: str,
                       model: str | None = None, prompt: str | None = None) -> Span:
    """The HTTP request's span (kind SERVER), child of an incoming `traceparent` if any."""
    span = _start_server_span(route, headers)
    if span.is_recording():
        _set_common(span, request_id, model, prompt)
    return span


def start_replica_span(carrier: Mapping[str, str] | None, *, request_id: str, replica_id: str,
                       model: str | None = None, k_start: int | None = None) -> Span:
    """The replica's span for one request, child of the ingress span carried in `carrier`
    (the ingress span holds the prompt, when prompts are recorded)."""
    span = _start_server_span("specserve.replica.generate", carrier)
    if span.is_recording():
        _set_common(span, request_id, model, None)
        span.set_attribute("specserve.replica", replica_id)
        if k_start is not None:
            span.set_attribute("specserve.spec.k_start", k_start)
    return span


def _start_server_span(name: str, carrier: Mapping[str, str] | None) -> Span:
    """A SERVER span continuing the context in `carrier`; the no-op span when tracing is off."""
    tracer = _State.tracer
    if tracer is None:
        return INVALID_SPAN
    return tracer.start_span(name, context=extract_context(carrier), kind=SpanKind.SERVER)


def _set_common(span: Span, request_id: str, model: str | None, prompt: str | None) -> None:
    span.set_attribute("specserve.request_id", request_id)
    if model is not None:
        span.set_attribute("gen_ai.request.model", model)
    if prompt is not None and _State.record_prompts:
        span.set_attribute("gen_ai.prompt", prompt)


def set_span_outcome(span: Span, *, prompt_tokens: int | None = None,
                     completion_tokens: int | None = None, k_end: int | None = None,
                     draft_tokens: int | None = None, accepted_tokens: int | None = None,
                     verify_steps: int | None = None) -> None:
    """Request totals. Mean acceptance length = 1 + accepted / verify steps (the request's
    sequence-steps that carried drafts); set only when both are known."""
    if not span.is_recording():
        return
    for key, value in (("gen_ai.usage.input_tokens", prompt_tokens),
                       ("gen_ai.usage.output_tokens", completion_tokens),
                       ("specserve.spec.k_end", k_end),
                       ("specserve.spec.draft_tokens", draft_tokens),
                       ("specserve.spec.accepted_tokens", accepted_tokens)):
        if value is not None:
            span.set_attribute(key, value)
    if accepted_tokens is not None and verify_steps:
        span.set_attribute("specserve.spec.mean_acceptance_length",
                           1.0 + accepted_tokens / verify_steps)


def finish_span(span: Span, *, error: BaseException | None = None,
                prompt_tokens: int | None = None, completion_tokens: int | None = None,
                k_end: int | None = None, draft_tokens: int | None = None,
                accepted_tokens: int | None = None, verify_steps: int | None = None) -> None:
    """`set_span_outcome` with the same arguments, mark `error` if any, and end the span."""
    if span.is_recording():
        set_span_outcome(span, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         k_end=k_end, draft_tokens=draft_tokens,
                         accepted_tokens=accepted_tokens, verify_steps=verify_steps)
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
    span.end()


def _switch_attributes(change: TierSwitch, decision: Decision | None
                       ) -> dict[str, str | int | float]:
    attrs: dict[str, str | int | float] = {
        "specserve.spec.from_k": change.from_k, "specserve.spec.to_k": change.to_k,
        "specserve.spec.switch_seconds": change.seconds}
    if decision is not None:
        attrs["specserve.policy.reason"] = decision.reason
        for key, value in decision.inputs.items():
            attrs[f"specserve.policy.input.{key}"] = float(value)
    return attrs


class ActiveSpans:
    """The replica's in-flight request spans, so a tier switch is recorded on each of them."""

    def __init__(self) -> None:
        self._spans: dict[int, Span] = {}

    def __len__(self) -> int:
        return len(self._spans)

    def add(self, span: Span) -> None:
        if span.is_recording():
            self._spans[id(span)] = span

    def discard(self, span: Span) -> None:
        self._spans.pop(id(span), None)

    def record_tier_switch(self, change: TierSwitch, decision: Decision | None = None) -> None:
        """An event on every in-flight span: old K, new K, and the policy's reason and input
        signals (none without a decision)."""
        if not self._spans:
            return
        attrs = _switch_attributes(change, decision)
        for span in list(self._spans.values()):
            if span.is_recording():
                span.add_event(TIER_SWITCH_EVENT, attrs)
