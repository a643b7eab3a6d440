"""OTLP export: a local OTLP/HTTP receiver gets real protobuf spans and metrics."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from observability import tracing
from observability.metrics import ReplicaMetrics
from policies.signals import Decision
from replicas.engines.base import StepRecord
from replicas.tier_pool import TierSwitch
from tests.otlp_receiver import Receiver


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SDK_DISABLED",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                 "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    yield server
    tracing.shutdown_tracing()
    server.shutdown()
    server.server_close()


def test_spans_reach_the_otlp_receiver(receiver: Receiver) -> None:
    assert tracing.configure_tracing("specserve-test", sampling_ratio=1.0, force=True)
    ingress = tracing.start_ingress_span("POST /v1/completions", None, request_id="req-9")
    replica = tracing.start_replica_span(tracing.inject_context(ingress), request_id="req-9",
                                         replica_id="r0", k_start=3)
    active = tracing.ActiveSpans()
    active.add(replica)
    active.record_tier_switch(TierSwitch(3, 0, 0.001),
                              Decision(k=0, reason="batch", inputs={"batch": 40.0}))
    tracing.finish_span(replica, completion_tokens=5)
    tracing.finish_span(ingress, completion_tokens=5)
    assert tracing.force_flush_tracing()

    spans = {span.name: span for request in receiver.traces
             for resource_spans in request.resource_spans
             for scope_spans in resource_spans.scope_spans for span in scope_spans.spans}
    ingress_pb, replica_pb = spans["POST /v1/completions"], spans["specserve.replica.generate"]
    assert replica_pb.trace_id == ingress_pb.trace_id
    assert replica_pb.parent_span_id == ingress_pb.span_id
    (event,) = replica_pb.events
    attributes = {a.key: a.value for a in event.attributes}
    assert attributes["specserve.spec.from_k"].int_value == 3
    assert attributes["specserve.spec.to_k"].int_value == 0
    assert attributes["specserve.policy.input.batch"].double_value == 40.0
    service = {a.key: a.value.string_value
               for a in receiver.traces[0].resource_spans[0].resource.attributes}
    assert service["service.name"] == "specserve-test"


@pytest.mark.parametrize("variable", ["OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"])
def test_the_users_service_name_names_the_traced_service(
        receiver: Receiver, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "shop-llm" if variable == "OTEL_SERVICE_NAME"
                       else "deployment.environment=prod,service.name=shop-llm")
    assert tracing.configure_tracing("specserve-ingress", force=True)
    tracing.finish_span(tracing.start_ingress_span("POST /v1/completions", None,
                                                   request_id="req-1"))
    assert tracing.force_flush_tracing()
    service = {a.key: a.value.string_value
               for a in receiver.traces[0].resource_spans[0].resource.attributes}
    assert service["service.name"] == "shop-llm"


@pytest.mark.parametrize("service_name", [None, "shop-llm"])
def test_metrics_reach_the_otlp_receiver(receiver: Receiver, monkeypatch: pytest.MonkeyPatch,
                                          service_name: str | None) -> None:
    """Each replica's series carry its instance id, under `specserve-replica` unless the
    user names the service with `OTEL_SERVICE_NAME`, as every OTel SDK lets them."""
    if service_name:
        monkeypatch.setenv("OTEL_SERVICE_NAME", service_name)
    metrics = ReplicaMetrics("r7", candidates=(0, 3))
    try:
        assert metrics.exporting
        metrics.record_steps([StepRecord(running=1, waiting=0, k=3, wall_s=0.01, drafts=1,
                                         draft_tokens=3, accepted_tokens=2,
                                         accepted_per_pos=(1, 1, 0), drafted_per_pos=(1, 1, 1),
                                         generated_tokens=3)])
    finally:
        metrics.shutdown()  # flushes the exporter first
    points = {}
    for request in receiver.metrics:
        for resource_metrics in request.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    kind = metric.WhichOneof("data")
                    points[metric.name] = list(getattr(metric, kind).data_points)
    (drafted,) = points["specserve_spec_draft_tokens"]
    assert drafted.as_int == 3 or drafted.as_double == 3
    assert {a.key: a.value.string_value for a in drafted.attributes} == {"replica": "r7"}
    (hist,) = points["specserve_spec_acceptance_length"]
    assert hist.count == 1 and hist.sum == pytest.approx(3.0)
    assert len(points["specserve_spec_accepted_tokens_per_position"]) == 3
    resource = {a.key: a.value.string_value
                for a in receiver.metrics[0].resource_metrics[0].resource.attributes}
    assert resource["service.name"] == (service_name or "specserve-replica")
    assert resource["service.instance.id"] == "r7"


def test_protocol_selects_the_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    from observability.otlp import metric_exporter, span_exporter

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert "grpc" in type(span_exporter()).__module__
    assert "grpc" in type(metric_exporter()).__module__
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert "http" in type(span_exporter()).__module__
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="unsupported OTLP protocol"):
        metric_exporter()
