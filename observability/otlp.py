"""OTLP exporter selection from the standard OpenTelemetry environment variables.

Export is opt-in: nothing is exported unless `OTEL_EXPORTER_OTLP_ENDPOINT` or the signal's own
`OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT` is set (and `OTEL_SDK_DISABLED` is not true).
The protocol comes from `OTEL_EXPORTER_OTLP_[{SIGNAL}_]PROTOCOL`: `http/protobuf` (default) or
`grpc`. The exporters themselves read the endpoint, headers and timeouts from the environment.
`OTEL_SERVICE_NAME` (or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`) names the service in
place of each process's default.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SpanExporter

Signal = Literal["TRACES", "METRICS"]


def otlp_configured(signal: Signal) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def service_resource(default_name: str, **attributes: str) -> Resource:
    """The resource a process's spans and metrics carry: `attributes`, with the service
    named as the user named it (`OTEL_SERVICE_NAME`, else `service.name` in
    `OTEL_RESOURCE_ATTRIBUTES`, as the OTel spec orders them), else `default_name`."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    # Given to `create`, a name would override both variables; the SDK's own default name
    # ("unknown_service:<process>") is what the variables leave when neither names one.
    resource = Resource.create(attributes)
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_name}))
    return resource


def _protocol(signal: Signal) -> str:
    value = (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
             or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    if value not in ("http/protobuf", "grpc"):
        raise ValueError(f"unsupported OTLP protocol {value!r}: use http/protobuf or grpc")
    return value


def span_exporter() -> SpanExporter:
    # Imported lazily: the no-op path never loads exporter code (grpc in particular).
    if _protocol("TRACES") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def metric_exporter() -> MetricExporter:
    if _protocol("METRICS") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    return OTLPMetricExporter()
