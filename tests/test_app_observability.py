"""Traces and metrics through the running application (Ray Serve, two replicas).

The engine is the SIMULATOR (the tracing and metrics code paths do not depend on the engine);
spans go over real OTLP/HTTP to a receiver in this test, and /metrics is scraped and checked
against the replicas' own engine counters.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from app.builder import build_app
from tests.otlp_receiver import Receiver


@pytest.fixture(scope="module")
def receiver():
    server = Receiver()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def otel_env(receiver):
    """Set before the cluster starts: the builder passes OTEL_* on to the replicas."""
    saved = dict(os.environ)
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}",
                       "OTEL_BSP_SCHEDULE_DELAY": "200"})
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def app_url(otel_env, serve_url):
    serve.run(build_app({"engine": {"engine": "sim", "kmax": 15, "sim_time_scale": 1.0},
                         "num_replicas": 2, "policy": {"name": "static", "k": 3}}),
              name="specserve", route_prefix="/")
    yield serve_url


def spans_of(receiver: Receiver, trace_id: bytes) -> list:
    return [span for request in list(receiver.traces) for resource in request.resource_spans
            for scope in resource.scope_spans for span in scope.spans
            if span.trace_id == trace_id]


def attributes(span) -> dict:
    return {a.key: next(iter(a.value.ListFields()))[1] for a in span.attributes}


def test_one_request_is_one_connected_trace_with_a_tier_switch_event(app_url, receiver):
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    done: dict = {}

    def long_request() -> None:
        done["response"] = httpx.post(
            f"{app_url}/v1/completions", timeout=60,
            headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
            # Sampled: the simulator accepts few drafts, so 600 tokens take ~5 s of steps.
            json={"model": "target", "prompt": "a b c", "max_tokens": 600, "temperature": 0.8})

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)  # the request is decoding: switch every replica's tier under it
    httpx.post(f"{app_url}/admin/policy", json={"policy": {"name": "static", "k": 7}},
               timeout=30).raise_for_status()
    thread.join()
    assert done["response"].status_code == 200
    deadline = time.time() + 15
    while time.time() < deadline and len(spans_of(receiver, bytes.fromhex(trace_id))) < 2:
        time.sleep(0.2)
    spans = spans_of(receiver, bytes.fromhex(trace_id))
    ingress = next(s for s in spans if s.name.startswith("POST"))
    replica = next(s for s in spans if s.name == "specserve.replica.generate")
    assert ingress.parent_span_id == bytes.fromhex(parent_id), "continues the traceparent"
    assert replica.parent_span_id == ingress.span_id, "replica span is the ingress's child"
    attrs = attributes(replica)
    assert attrs["specserve.spec.k_start"] == 3 and attrs["specserve.spec.k_end"] == 7
    assert attrs["gen_ai.usage.output_tokens"] == 600
    assert attrs["specserve.spec.accepted_tokens"] <= attrs["specserve.spec.draft_tokens"]
    assert attrs["specserve.spec.mean_acceptance_length"] >= 1
    assert attrs["specserve.request_id"]
    assert "gen_ai.prompt" not in attrs, "no prompt text unless enabled"
    events = [e for e in replica.events if e.name == "specserve.tier_switch"]
    assert [(attributes(e)["specserve.spec.from_k"], attributes(e)["specserve.spec.to_k"])
            for e in events] == [(3, 7)]


def test_scraped_counters_agree_with_each_replicas_engine(app_url):
    for i in range(8):
        httpx.post(f"{app_url}/v1/completions", timeout=60, json={
            "model": "target", "prompt": f"p{i}", "max_tokens": 64, "temperature": 0.8})
    time.sleep(1.5)  # every control loop has drained its steps
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{app_url}/metrics", timeout=30).text)}
    replicas = httpx.get(f"{app_url}/admin/replicas", timeout=30).json()["replicas"]

    def value(name: str, replica: str, **labels: str) -> float:
        return sum(s.value for s in families[name].samples
                   if s.labels.get("replica") == replica and s.name.endswith("_total")
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    for replica in replicas:
        rid, engine = replica["replica_id"], replica["counters"]
        drafted = value("specserve_spec_draft_tokens", rid)
        accepted = value("specserve_spec_accepted_tokens", rid)
        assert drafted == engine["draft_tokens"] and accepted == engine["accepted_tokens"]
        assert accepted <= drafted
        assert value("specserve_spec_tier_switches", rid) == replica["switch_count"]
        wasted = [s.value for s in families["specserve_spec_wasted_draft_ratio"].samples
                  if s.labels["replica"] == rid]
        if drafted:
            assert wasted and 0 <= wasted[0] <= 1
        for family in families.values():
            if family.name.startswith("specserve_spec_"):
                assert all("replica" in s.labels for s in family.samples), family.name


@pytest.mark.parametrize(("content", "status"), [
    (b'{"model": "target", "prompt": "\xff\xfe"}', 400),            # invalid UTF-8
    (b'{"model": "target", "prompt": "x", "max_tokens": "ten"}', 400),  # wrong type
    (b'{"model": "target", "prompt": "x", "top_p": 1.5}', 400),
    (b'{"model": "target"}', 400),                                   # missing field
    (b'{"model": "target", "prompt": "' + b"x" * (2 << 20) + b'"}', 413),
])
def test_more_bad_input(app_url, content, status):
    response = httpx.post(f"{app_url}/v1/completions", content=content, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    assert response.json()["error"]["type"]
