"""specserve metrics: the one table of names, and the recorders replicas and the ingress use.

Every series is recorded through the OpenTelemetry metrics API on a MeterProvider owned by the
recorder (never the global one, so several recorders can share a process and nothing clashes
with vLLM's prometheus_client registry). Each provider has:

- an in-memory pull reader, read by `snapshot()`: a plain, picklable/JSON-able dict that a
  replica hands to the ingress (answering its broadcast on each `/metrics` scrape) and that
  `observability.exposition.render_prometheus` turns into Prometheus text, merged over replicas;
- a periodic OTLP reader, only when `OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT` is set.

Cost: a step is recorded into plain Python integers (about a microsecond), and OpenTelemetry
reads them through observable instruments at collection time. Only the acceptance-length
histogram records per step (one OTel call, ~10 us, per step that drafted), because OTel has no
observable histogram.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricReader,
    PeriodicExportingMetricReader,
)

from observability.otlp import metric_exporter, otlp_configured, service_resource
from observability.per_position import accumulate

if TYPE_CHECKING:  # type-only: observability imports no other specserve package at run time
    from replicas.engines.base import StepRecord
    from replicas.tier_pool import TierSwitch

Kind = Literal["counter", "gauge", "histogram", "info"]

# A snapshot maps a Prometheus family name to its samples. A counter/gauge sample is
# {"labels": {...}, "value": v}; a histogram sample is
# {"labels": {...}, "bounds": [...], "buckets": [cumulative count per bound], "sum": s, "count": n}.
Snapshot = dict[str, list[dict[str, Any]]]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    """The Prometheus family name as exposed (counters end in `_total`)."""
    kind: Kind
    help: str
    labels: tuple[str, ...]
    unit: str = ""
    buckets: tuple[float, ...] = ()

    @property
    def instrument_name(self) -> str:
        # OTel instruments carry no `_total`: Prometheus exporters (ours and the OTel
        # collector's) append it to monotonic sums, so OTLP users see the same names.
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


_R = ("replica",)
_ACCEPT_LEN_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0)
_FAST_S = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5)
_TTFT_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_LAG_STEPS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
_E2E_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

METRICS: tuple[MetricSpec, ...] = (
    # Per replica: every series carries `replica`.
    MetricSpec("specserve_spec_active_tier", "gauge",
               "Speculation depth K in force (0 = plain decoding).", _R),
    MetricSpec("specserve_spec_candidate_tiers_info", "info",
               "Candidate K values of the tier pool, comma-separated in `candidates`; value 1.",
               ("replica", "candidates")),
    MetricSpec("specserve_spec_wasted_draft_ratio", "gauge",
               "Rejected / drafted tokens over the sliding window (absent when nothing was "
               "drafted in the window).", _R, unit="1"),
    MetricSpec("specserve_engine_steps_total", "counter", "Engine steps.", _R),
    MetricSpec("specserve_spec_drafts_total", "counter",
               "Sequence-steps that carried at least one draft token (verify steps).", _R),
    MetricSpec("specserve_spec_draft_tokens_total", "counter", "Draft tokens proposed.", _R),
    MetricSpec("specserve_spec_accepted_tokens_total", "counter",
               "Draft tokens accepted by the target model.", _R),
    MetricSpec("specserve_spec_draft_tokens_per_position_total", "counter",
               "Draft tokens that reached draft position `position` (0 = first).",
               ("replica", "position")),
    MetricSpec("specserve_spec_accepted_tokens_per_position_total", "counter",
               "Draft tokens accepted at draft position `position` (0 = first).",
               ("replica", "position")),
    MetricSpec("specserve_spec_acceptance_length", "histogram",
               "Mean acceptance length (1 + accepted / drafts) of each engine verify step.",
               _R, buckets=_ACCEPT_LEN_BUCKETS),
    MetricSpec("specserve_spec_tier_switches_total", "counter", "Tier switches by old and new K.",
               ("replica", "from_k", "to_k")),
    MetricSpec("specserve_spec_tier_switch_seconds", "histogram",
               "Wall time of one tier switch as seen by the replica.", _R, unit="s",
               buckets=_FAST_S),
    MetricSpec("specserve_spec_tier_switch_lag_steps", "histogram",
               "Engine steps run at the old K after the decision to switch (the steps it saw "
               "excluded), until the first at the new K.", _R, buckets=_LAG_STEPS),
    MetricSpec("specserve_policy_decision_seconds", "histogram",
               "Wall time of one policy decision.", _R, unit="s", buckets=_FAST_S),
    MetricSpec("specserve_generated_tokens_total", "counter",
               "Tokens generated by the replica's engine (goodput = rate of this).", _R),
    MetricSpec("specserve_requests_running", "gauge", "Requests running in the engine now.",
               _R),
    MetricSpec("specserve_requests_waiting", "gauge", "Requests queued in the engine.", _R),
    MetricSpec("specserve_effective_concurrency", "gauge",
               "Running + waiting + routed to this replica but not yet admitted.", _R),
    # Ingress: every series carries `ingress` (the ingress replica) and `model`.
    MetricSpec("specserve_request_ttft_seconds", "histogram", "Time to first token.",
               ("ingress", "model"), unit="s", buckets=_TTFT_S),
    MetricSpec("specserve_request_tpot_seconds", "histogram",
               "Time per output token after the first: (e2e - ttft) / (tokens - 1), one "
               "observation per request.", ("ingress", "model"), unit="s", buckets=_TPOT_S),
    MetricSpec("specserve_request_e2e_seconds", "histogram", "Request latency, end to end.",
               ("ingress", "model"), unit="s", buckets=_E2E_S),
    MetricSpec("specserve_requests_total", "counter",
               "Finished requests by status (ok; cancelled; invalid: refused by the engine as "
               "asked; error: a fault).",
               ("ingress", "model", "status")),
    MetricSpec("specserve_request_prompt_tokens_total", "counter", "Prompt tokens of requests.",
               ("ingress", "model")),
    MetricSpec("specserve_request_generated_tokens_total", "counter",
               "Completion tokens delivered to clients.", ("ingress", "model")),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}
_BY_INSTRUMENT: dict[str, MetricSpec] = {m.instrument_name: m for m in METRICS}


class _Recorder:
    """A private MeterProvider with a pull reader (and OTLP push when configured)."""

    service_name: str
    """The default `service.name` (`OTEL_SERVICE_NAME` overrides it)."""

    def __init__(self, instance_id: str) -> None:
        self._reader = InMemoryMetricReader()
        readers: list[MetricReader] = [self._reader]
        self.exporting = otlp_configured("METRICS")
        if self.exporting:
            # Interval from OTEL_METRIC_EXPORT_INTERVAL (ms, default 60000).
            readers.append(PeriodicExportingMetricReader(metric_exporter()))
        self._provider = MeterProvider(
            metric_readers=readers,
            resource=service_resource(self.service_name, **{"service.instance.id": instance_id}),
            # Exemplars would look up the current span on every histogram record.
            exemplar_filter=AlwaysOffExemplarFilter())
        self._meter = self._provider.get_meter("specserve")
        # Held across a whole pull collection so one snapshot sees one consistent state.
        self._lock = threading.RLock()

    def _histogram(self, name: str) -> Any:
        spec = BY_NAME[name]
        return self._meter.create_histogram(
            spec.instrument_name, unit=spec.unit, description=spec.help,
            explicit_bucket_boundaries_advisory=spec.buckets)

    def _observe(self, name: str, callback: Callable[[], Iterable[Observation]]) -> None:
        spec = BY_NAME[name]

        def read(_options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                return list(callback())

        create = (self._meter.create_observable_counter if spec.kind == "counter"
                  else self._meter.create_observable_gauge)
        create(spec.instrument_name, callbacks=[read], unit=spec.unit, description=spec.help)

    def snapshot(self) -> Snapshot:
        """This process's series as a plain dict (see `Snapshot`), cumulative since start."""
        with self._lock:
            data = self._reader.get_metrics_data()
        out: Snapshot = {}
        if data is None:
            return out
        for resource_metrics in data.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    spec = _BY_INSTRUMENT.get(metric.name)
                    if spec is None:
                        continue
                    samples = out.setdefault(spec.name, [])
                    for point in metric.data.data_points:
                        samples.append(_sample(point))
        return out

    def shutdown(self) -> None:
        """Flush and stop the OTLP exporter's thread, when exporting."""
        self._provider.shutdown()


def _sample(point: Any) -> dict[str, Any]:
    labels = {key: str(value) for key, value in point.attributes.items()}
    if isinstance(point, HistogramDataPoint):
        cumulative, running = [], 0
        for count in point.bucket_counts[:-1]:
            running += count
            cumulative.append(running)
        return {"labels": labels, "bounds": list(point.explicit_bounds), "buckets": cumulative,
                "sum": float(point.sum), "count": int(point.count)}
    return {"labels": labels, "value": float(point.value)}


class ReplicaMetrics(_Recorder):
    """Per-replica speculation and engine series, each labelled `replica=<replica_id>`.

    Feed it `record_steps(engine.drain_steps())` from the control loop, `record_switch` for each
    tier switch, `record_decision_seconds` per policy decision. Writers and collection (also
    from the OTLP export thread) share one lock.

    The wasted-draft ratio covers the steps recorded in the last `window_s` seconds.
    """

    service_name = "specserve-replica"

    def __init__(self, replica_id: str, candidates: Sequence[int] = (), *,
                 window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(str(replica_id))
        self.replica_id = str(replica_id)
        self._attrs = {"replica": self.replica_id}
        self._clock = clock
        self._window_s = window_s
        self._steps = self._drafts = self._draft_tokens = self._accepted = self._generated = 0
        self._drafted_pos: list[int] = []
        self._accepted_pos: list[int] = []
        self._running = self._waiting = 0
        self._effective: int | None = None
        self._active_k: int | None = None
        self._candidates = tuple(int(k) for k in candidates)
        self._switches: dict[tuple[int, int], int] = {}
        # One (time, drafted, accepted) entry per record_steps call, with running sums.
        self._window: deque[tuple[float, int, int]] = deque()
        self._win_drafted = self._win_accepted = 0

        self._acceptance_length = self._histogram("specserve_spec_acceptance_length")
        self._switch_seconds = self._histogram("specserve_spec_tier_switch_seconds")
        self._decision_seconds = self._histogram("specserve_policy_decision_seconds")
        self._switch_lag_steps = self._histogram("specserve_spec_tier_switch_lag_steps")
        attrs = self._attrs
        self._observe("specserve_engine_steps_total", lambda: [Observation(self._steps, attrs)])
        self._observe("specserve_spec_drafts_total", lambda: [Observation(self._drafts, attrs)])
        self._observe("specserve_spec_draft_tokens_total",
                      lambda: [Observation(self._draft_tokens, attrs)])
        self._observe("specserve_spec_accepted_tokens_total",
                      lambda: [Observation(self._accepted, attrs)])
        self._observe("specserve_generated_tokens_total",
                      lambda: [Observation(self._generated, attrs)])
        self._observe("specserve_spec_draft_tokens_per_position_total",
                      lambda: self._per_position(self._drafted_pos))
        self._observe("specserve_spec_accepted_tokens_per_position_total",
                      lambda: self._per_position(self._accepted_pos))
        self._observe("specserve_spec_tier_switches_total", self._switch_observations)
        self._observe("specserve_requests_running", lambda: [Observation(self._running, attrs)])
        self._observe("specserve_requests_waiting", lambda: [Observation(self._waiting, attrs)])
        self._observe("specserve_effective_concurrency", lambda: (
            [] if self._effective is None else [Observation(self._effective, attrs)]))
        self._observe("specserve_spec_active_tier", lambda: (
            [] if self._active_k is None else [Observation(self._active_k, attrs)]))
        self._observe("specserve_spec_candidate_tiers_info", lambda: (
            [Observation(1, {**attrs, "candidates": ",".join(map(str, self._candidates))})]
            if self._candidates else []))
        self._observe("specserve_spec_wasted_draft_ratio", self._wasted_observations)

    # Recording: plain integer arithmetic; OpenTelemetry reads it at collection time.

    def record_steps(self, steps: Iterable[StepRecord]) -> None:
        """Fold engine steps (oldest first) into the counters, gauges and the window."""
        step_means: list[float] = []
        drafted = accepted = 0
        with self._lock:
            for step in steps:
                self._steps += 1
                self._active_k = step.k
                self._generated += step.generated_tokens
                if not step.draft_tokens:
                    continue  # K=0 steps report no spec stats at all
                self._drafts += step.drafts
                drafted += step.draft_tokens
                accepted += step.accepted_tokens
                accumulate(self._accepted_pos, step.accepted_per_pos)
                accumulate(self._drafted_pos, step.drafted_per_pos)
                if step.drafts:
                    step_means.append(1.0 + step.accepted_tokens / step.drafts)
            self._draft_tokens += drafted
            self._accepted += accepted
            now = self._clock()
            if drafted:
                self._window.append((now, drafted, accepted))
                self._win_drafted += drafted
                self._win_accepted += accepted
            self._expire(now)
        for mean in step_means:
            self._acceptance_length.record(mean, self._attrs)

    def record_switch(self, change: TierSwitch) -> None:
        """Count one tier switch (from `TierPool.switch`) and make its K the active tier."""
        with self._lock:
            key = (change.from_k, change.to_k)
            self._switches[key] = self._switches.get(key, 0) + 1
            self._active_k = change.to_k
        self._switch_seconds.record(change.seconds, self._attrs)

    def record_switch_lag_steps(self, steps: int) -> None:
        self._switch_lag_steps.record(steps, self._attrs)

    def record_decision_seconds(self, seconds: float) -> None:
        self._decision_seconds.record(seconds, self._attrs)

    def set_candidates(self, candidates: Sequence[int]) -> None:
        self._candidates = tuple(int(k) for k in candidates)

    def set_effective_concurrency(self, n: int) -> None:
        self._effective = int(n)

    def set_engine_load(self, running: int, waiting: int) -> None:
        """The engine's requests now (a step's batch also holds those it finished)."""
        self._running, self._waiting = int(running), int(waiting)

    def wasted_draft_ratio(self) -> float | None:
        """Rejected / drafted over the window; None when nothing was drafted in it."""
        with self._lock:
            self._expire(self._clock())
            if not self._win_drafted:
                return None
            return 1.0 - self._win_accepted / self._win_drafted

    # Collection helpers (called under the lock by `_Recorder._observe`).

    def _expire(self, now: float) -> None:
        horizon = now - self._window_s
        while self._window and self._window[0][0] < horizon:
            _, drafted, accepted = self._window.popleft()
            self._win_drafted -= drafted
            self._win_accepted -= accepted

    def _wasted_observations(self) -> list[Observation]:
        ratio = self.wasted_draft_ratio()
        return [] if ratio is None else [Observation(ratio, self._attrs)]

    def _per_position(self, counts: list[int]) -> list[Observation]:
        return [Observation(n, {**self._attrs, "position": str(i)}) for i, n in enumerate(counts)]

    def _switch_observations(self) -> list[Observation]:
        return [Observation(n, {**self._attrs, "from_k": str(a), "to_k": str(b)})
                for (a, b), n in self._switches.items()]


class RequestMetrics(_Recorder):
    """Ingress request series, each labelled `ingress=<ingress_id>` and `model`."""

    service_name = "specserve-ingress"

    def __init__(self, ingress_id: str = "ingress") -> None:
        super().__init__(str(ingress_id))
        self.ingress_id = str(ingress_id)
        self._ttft = self._histogram("specserve_request_ttft_seconds")
        self._tpot = self._histogram("specserve_request_tpot_seconds")
        self._e2e = self._histogram("specserve_request_e2e_seconds")
        # (model, status) -> finished requests; model -> [prompt tokens, generated tokens]
        self._requests: dict[tuple[str, str], int] = {}
        self._tokens: dict[str, list[int]] = {}
        self._observe("specserve_requests_total", lambda: [
            Observation(n, self._labels(model, status=status))
            for (model, status), n in self._requests.items()])
        self._observe("specserve_request_prompt_tokens_total", lambda: [
            Observation(t[0], self._labels(model)) for model, t in self._tokens.items()])
        self._observe("specserve_request_generated_tokens_total", lambda: [
            Observation(t[1], self._labels(model)) for model, t in self._tokens.items()])

    def _labels(self, model: str, **extra: str) -> dict[str, str]:
        return {"ingress": self.ingress_id, "model": model, **extra}

    def record_request(self, model: str, *, e2e_s: float, ttft_s: float | None,
                       prompt_tokens: int, completion_tokens: int, status: str = "ok") -> None:
        """One finished request. `ttft_s` is None when no token was produced."""
        with self._lock:
            key = (model, status)
            self._requests[key] = self._requests.get(key, 0) + 1
            tokens = self._tokens.setdefault(model, [0, 0])
            tokens[0] += prompt_tokens
            tokens[1] += completion_tokens
        attrs = self._labels(model)
        self._e2e.record(e2e_s, attrs)
        if ttft_s is not None:
            self._ttft.record(ttft_s, attrs)
            if completion_tokens > 1:
                self._tpot.record((e2e_s - ttft_s) / (completion_tokens - 1), attrs)
