"""Metrics: counters from known StepRecords, Prometheus text, merged replicas, no-export path."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from observability.exposition import render_prometheus
from observability.metrics import METRICS, ReplicaMetrics, RequestMetrics
from observability.per_position import accumulate
from replicas.engines.base import StepRecord
from replicas.tier_pool import TierSwitch

STEPS = [
    # K=3, two sequences: one accepted 2 drafts, the other 0.
    StepRecord(running=2, waiting=1, k=3, wall_s=0.01, drafts=2, draft_tokens=6,
               accepted_tokens=2, accepted_per_pos=(1, 1, 0), drafted_per_pos=(2, 2, 2),
               generated_tokens=4),
    StepRecord(running=2, waiting=0, k=3, wall_s=0.01, drafts=2, draft_tokens=6,
               accepted_tokens=5, accepted_per_pos=(2, 2, 1), drafted_per_pos=(2, 2, 2),
               generated_tokens=7),
    # K=0: no spec stats.
    StepRecord(running=3, waiting=0, k=0, wall_s=0.01, generated_tokens=3),
    # K=1
    StepRecord(running=1, waiting=0, k=1, wall_s=0.01, drafts=1, draft_tokens=1,
               accepted_tokens=1, accepted_per_pos=(1,), drafted_per_pos=(1,),
               generated_tokens=2),
]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _families(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} over every family of a Prometheus text."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _value(samples: dict[tuple, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def replica() -> Iterator[ReplicaMetrics]:
    metrics = ReplicaMetrics("r0", candidates=(0, 1, 3), window_s=30.0, clock=FakeClock())
    yield metrics
    metrics.shutdown()


def test_counters_agree_with_the_steps(replica: ReplicaMetrics) -> None:
    replica.record_steps(STEPS)
    replica.set_effective_concurrency(5)
    replica.set_engine_load(running=4, waiting=2)  # not the last step's 1 and 0
    fam = _families(render_prometheus(replica.snapshot()))

    drafted = _value(fam, "specserve_spec_draft_tokens_total", replica="r0")
    accepted = _value(fam, "specserve_spec_accepted_tokens_total", replica="r0")
    assert (drafted, accepted) == (13, 8)
    assert accepted <= drafted
    assert _value(fam, "specserve_spec_drafts_total", replica="r0") == 5
    assert _value(fam, "specserve_engine_steps_total", replica="r0") == 4
    assert _value(fam, "specserve_generated_tokens_total", replica="r0") == 16
    for pos, (d, a) in enumerate([(5, 4), (4, 3), (4, 1)]):
        assert _value(fam, "specserve_spec_draft_tokens_per_position_total",
                      replica="r0", position=str(pos)) == d
        assert _value(fam, "specserve_spec_accepted_tokens_per_position_total",
                      replica="r0", position=str(pos)) == a
    assert _value(fam, "specserve_spec_wasted_draft_ratio", replica="r0") \
        == pytest.approx(1 - 8 / 13)
    # The tier gauge follows the latest step; the load gauges, the engine's counts now.
    assert _value(fam, "specserve_spec_active_tier", replica="r0") == 1
    assert _value(fam, "specserve_requests_running", replica="r0") == 4
    assert _value(fam, "specserve_requests_waiting", replica="r0") == 2
    assert _value(fam, "specserve_effective_concurrency", replica="r0") == 5
    assert _value(fam, "specserve_spec_candidate_tiers_info", replica="r0",
                  candidates="0,1,3") == 1
    # One acceptance-length observation per drafting step: means 2.0, 3.5, 2.0.
    hist = "specserve_spec_acceptance_length"
    assert _value(fam, f"{hist}_count", replica="r0") == 3
    assert _value(fam, f"{hist}_sum", replica="r0") == pytest.approx(7.5)
    assert _value(fam, f"{hist}_bucket", replica="r0", le="2.0") == 2


def test_every_replica_series_carries_the_replica_label(replica: ReplicaMetrics) -> None:
    replica.record_steps(STEPS)
    replica.record_switch(TierSwitch(3, 1, 0.001))
    replica.record_switch_lag_steps(2)
    replica.record_decision_seconds(0.0002)
    replica.set_effective_concurrency(3)
    text = render_prometheus(replica.snapshot())
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        for sample in family.samples:
            assert sample.labels.get("replica") == "r0", sample
    # Every replica-scoped series of the table is present once fed.
    expected = {m.name.removesuffix("_total") for m in METRICS if m.labels[0] == "replica"}
    assert names == expected


def test_switches_counted_once_per_switch(replica: ReplicaMetrics) -> None:
    replica.record_switch(TierSwitch(3, 1, 0.001))
    replica.record_switch(TierSwitch(1, 3, 0.001))
    replica.record_switch(TierSwitch(3, 1, 0.002))
    fam = _families(render_prometheus(replica.snapshot()))
    # Reading twice must not count again (collection is not recording).
    fam = _families(render_prometheus(replica.snapshot()))
    name = "specserve_spec_tier_switches_total"
    assert _value(fam, name, replica="r0", from_k="3", to_k="1") == 2
    assert _value(fam, name, replica="r0", from_k="1", to_k="3") == 1
    assert _value(fam, "specserve_spec_tier_switch_seconds_count", replica="r0") == 3
    assert _value(fam, "specserve_spec_active_tier", replica="r0") == 1


def test_wasted_ratio_window_slides() -> None:
    clock = FakeClock()
    metrics = ReplicaMetrics("r0", window_s=10.0, clock=clock)
    try:
        assert metrics.wasted_draft_ratio() is None
        metrics.record_steps([STEPS[0]])  # 2 of 6 accepted
        clock.now += 6
        metrics.record_steps([STEPS[1]])  # 5 of 6 accepted
        assert metrics.wasted_draft_ratio() == pytest.approx(1 - 7 / 12)
        clock.now += 6  # the first entry leaves the window
        assert metrics.wasted_draft_ratio() == pytest.approx(1 - 5 / 6)
        clock.now += 6
        assert metrics.wasted_draft_ratio() is None
        assert "specserve_spec_wasted_draft_ratio" not in metrics.snapshot()
        # Lifetime counters are unaffected by the window.
        fam = _families(render_prometheus(metrics.snapshot()))
        assert _value(fam, "specserve_spec_draft_tokens_total", replica="r0") == 12
    finally:
        metrics.shutdown()


def test_merged_exposition_keeps_both_replicas_and_the_ingress() -> None:
    a, b = ReplicaMetrics("a", (0, 3)), ReplicaMetrics("b", (0, 1, 3))
    ingress = RequestMetrics("i0")
    try:
        a.record_steps(STEPS[:2])
        b.record_steps(STEPS[3:])
        ingress.record_request("demo", e2e_s=1.0, ttft_s=0.2, prompt_tokens=5,
                               completion_tokens=9)
        ingress.record_request("demo", e2e_s=0.5, ttft_s=None, prompt_tokens=3,
                               completion_tokens=0, status="error")
        # Snapshots travel between processes: they must survive a JSON round trip.
        snapshots = [json.loads(json.dumps(s.snapshot())) for s in (ingress, a, b)]
        fam = _families(render_prometheus(*snapshots))
    finally:
        for m in (a, b, ingress):
            m.shutdown()
    assert _value(fam, "specserve_spec_draft_tokens_total", replica="a") == 12
    assert _value(fam, "specserve_spec_draft_tokens_total", replica="b") == 1
    assert _value(fam, "specserve_spec_candidate_tiers_info", replica="b", candidates="0,1,3") == 1
    assert _value(fam, "specserve_requests_total", ingress="i0", model="demo", status="ok") == 1
    assert _value(fam, "specserve_requests_total", ingress="i0", model="demo", status="error") \
        == 1
    assert _value(fam, "specserve_request_generated_tokens_total", ingress="i0", model="demo") \
        == 9
    assert _value(fam, "specserve_request_prompt_tokens_total", ingress="i0", model="demo") == 8
    assert _value(fam, "specserve_request_e2e_seconds_count", ingress="i0", model="demo") == 2
    assert _value(fam, "specserve_request_ttft_seconds_count", ingress="i0", model="demo") == 1
    assert _value(fam, "specserve_request_tpot_seconds_sum", ingress="i0", model="demo") \
        == pytest.approx(0.1)


def test_metric_table_follows_prometheus_naming() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert m.name.startswith("specserve_")
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert (m.unit == "s") == m.name.endswith("_seconds"), m.name
        assert m.labels[0] in ("replica", "ingress")
        assert (m.kind == "info") == m.name.endswith("_info")


def test_no_otlp_export_without_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    metrics = ReplicaMetrics("r0")
    try:
        assert metrics.exporting is False
    finally:
        metrics.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    metrics = ReplicaMetrics("r0")
    try:
        assert metrics.exporting is False
    finally:
        metrics.shutdown()


def test_dashboard_queries_name_only_known_series() -> None:
    path = Path(__file__).parents[1] / "observability" / "grafana_dashboard.json"
    dashboard = json.loads(path.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    known = {m.name for m in METRICS}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
    for expr in exprs:
        for name in re.findall(r"specserve_\w+", expr):
            assert re.sub(r"_(bucket|sum|count)$", "", name) in known, name
    referenced = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs
                  for n in re.findall(r"specserve_\w+", e)}
    for must in ("specserve_spec_active_tier", "specserve_spec_wasted_draft_ratio",
                 "specserve_spec_acceptance_length", "specserve_generated_tokens_total",
                 "specserve_request_ttft_seconds", "specserve_request_tpot_seconds"):
        assert must in referenced


def test_per_position_counts_add_and_subtract_growing_to_the_longer():
    totals = [1, 2]
    accumulate(totals, [10, 20, 30])
    assert totals == [11, 22, 30]
    accumulate(totals, [1, 2, 3, 4], sign=-1)
    assert totals == [10, 20, 27, -4]
    accumulate(totals, [])
    assert totals == [10, 20, 27, -4]
