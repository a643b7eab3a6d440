"""Observability overhead: simulated serving with tracing off vs tracing on at sampling 1.0.

A simulated engine serves `--requests` requests at `--concurrency`: each engine step spins for
`--step-ms` (the engine's compute, which observability cannot shorten or lengthen) and produces
1 + accepted tokens per running sequence. Around it the code does what a real request does:
ingress span from an incoming `traceparent`, context injected into a dict, replica child span,
per-step `ReplicaMetrics.record_steps`, a policy decision and a tier switch (span events on
every in-flight span) every `--switch-every` steps, span outcomes, `RequestMetrics`, and a
`/metrics` render every `--scrape-s` seconds (Prometheus scrapes every 15-60 s). Modes,
interleaved over `--repeats` rounds:

- `bare`: no observability calls at all (reference);
- `off`: metrics on, tracing not configured (the default deployment);
- `traced`: metrics on, tracing at sampling 1.0, exported over OTLP/HTTP to an in-process
  receiver (or `--exporter memory`).

Overhead = tokens/s lost against `off` (the issue's 3% budget) and against `bare`. The time spent
inside observability calls is also measured directly, per request and per step.

    python -m bench.observability_overhead            # table, bench/results/*.png and *.md
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from observability import tracing
from observability.exposition import render_prometheus
from observability.metrics import ReplicaMetrics, RequestMetrics
from policies.signals import Decision
from replicas.engines.base import StepRecord
from replicas.tier_pool import TierSwitch

MODES = ("bare", "off", "traced")
RESULTS = Path(__file__).parent / "results"


class _Sink(BaseHTTPRequestHandler):
    """OTLP/HTTP receiver that acknowledges without decoding (a collector is another process)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@dataclass
class RunResult:
    mode: str
    tokens: int
    wall_s: float
    obs_s: float
    steps: int
    requests: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


@dataclass
class _Request:
    rid: str
    remaining: int
    generated: int = 0
    started: float = 0.0
    first_token: float | None = None
    ingress_span: object = None
    replica_span: object = None
    k_start: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(mode: str, args: argparse.Namespace, seed: int) -> RunResult:
    rng = random.Random(seed)
    observe = mode != "bare"
    replica = ReplicaMetrics("r0", candidates=(0, 1, 3)) if observe else None
    ingress = RequestMetrics("i0") if observe else None
    active = tracing.ActiveSpans()
    headers = {"traceparent": f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"}
    k, tokens, steps, obs_s, next_id = 3, 0, 0, 0.0, 0
    pending, running = args.requests, []
    started = last_scrape = time.perf_counter()
    while pending or running:
        while pending and len(running) < args.concurrency:
            now = time.perf_counter()
            request = _Request(f"req-{next_id}", args.max_tokens, started=now, k_start=k)
            next_id += 1
            pending -= 1
            if observe:
                request.ingress_span = tracing.start_ingress_span(
                    "POST /v1/completions", headers, request_id=request.rid, model="demo")
                carrier = tracing.inject_context(request.ingress_span)
                request.replica_span = tracing.start_replica_span(
                    carrier, request_id=request.rid, replica_id="r0", model="demo", k_start=k)
                active.add(request.replica_span)
                obs_s += time.perf_counter() - now
            running.append(request)

        _spin(args.step_ms / 1000)
        steps += 1
        accepted_per_pos = [0] * k
        step_accepted = step_tokens = 0
        for request in running:
            accepted = 0
            while accepted < k and rng.random() < args.acceptance:
                accepted_per_pos[accepted] += 1
                accepted += 1
            step_accepted += accepted
            new = min(request.remaining, accepted + 1)
            request.remaining -= new
            request.generated += new
            request.drafted += k
            request.accepted += accepted
            request.verify_steps += k > 0
            step_tokens += new
        tokens += step_tokens
        now = time.perf_counter()
        for request in running:
            if request.first_token is None:
                request.first_token = now
        if observe:
            batch = len(running)
            # The engine adapter builds the record whether or not anything observes it.
            record = StepRecord(
                running=batch, waiting=pending, k=k, wall_s=args.step_ms / 1000,
                drafts=batch if k else 0, draft_tokens=batch * k, accepted_tokens=step_accepted,
                accepted_per_pos=tuple(accepted_per_pos), drafted_per_pos=(batch,) * k,
                generated_tokens=step_tokens)
            t0 = time.perf_counter()
            replica.record_steps([record])
            if steps % args.switch_every == 0:
                decided = time.perf_counter()
                new_k = 1 if k == 3 else 3
                decision = Decision(k=new_k, reason="bench", inputs={"batch": float(batch)})
                replica.record_decision_seconds(time.perf_counter() - decided)
                change = TierSwitch(k, new_k, 0.0)
                replica.record_switch(change)
                active.record_tier_switch(change, decision)
                k = new_k
            if t0 - last_scrape >= args.scrape_s:
                last_scrape = t0
                render_prometheus(ingress.snapshot(), replica.snapshot())
            obs_s += time.perf_counter() - t0
        elif steps % args.switch_every == 0:
            k = 1 if k == 3 else 3

        done = [r for r in running if r.remaining == 0]
        running = [r for r in running if r.remaining > 0]
        if observe and done:
            t0 = time.perf_counter()
            for request in done:
                active.discard(request.replica_span)
                tracing.finish_span(request.replica_span, prompt_tokens=16,
                                    completion_tokens=request.generated, k_end=k,
                                    draft_tokens=request.drafted,
                                    accepted_tokens=request.accepted,
                                    verify_steps=request.verify_steps)
                tracing.finish_span(request.ingress_span, prompt_tokens=16,
                                    completion_tokens=request.generated)
                ingress.record_request("demo", e2e_s=t0 - request.started,
                                       ttft_s=request.first_token - request.started,
                                       prompt_tokens=16, completion_tokens=request.generated)
            obs_s += time.perf_counter() - t0
    wall = time.perf_counter() - started
    if observe:
        replica.shutdown()
        ingress.shutdown()
    return RunResult(mode, tokens, wall, obs_s, steps, args.requests)


def _configure(mode: str, args: argparse.Namespace, endpoint: str) -> None:
    if mode == "traced":
        if args.exporter == "memory":
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
                InMemorySpanExporter,
            )

            tracing.configure_tracing("bench", 1.0, exporter=InMemorySpanExporter(), force=True)
        else:
            os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint
            tracing.configure_tracing("bench", 1.0, force=True)
            del os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    else:
        tracing.configure_tracing("bench", force=True)  # no endpoint: the no-op path
    assert tracing.tracing_enabled() == (mode == "traced")


def micro(n: int = 20_000) -> dict[str, float]:
    """Microseconds per call of the hot paths, tracing off."""
    metrics = ReplicaMetrics("micro", (0, 3))
    step = StepRecord(running=8, waiting=2, k=3, wall_s=0.01, drafts=8, draft_tokens=24,
                      accepted_tokens=14, accepted_per_pos=(7, 5, 2), drafted_per_pos=(8, 8, 8),
                      generated_tokens=22)
    steps = [step]
    t0 = time.perf_counter()
    for _ in range(n):
        metrics.record_steps(steps)
    record = (time.perf_counter() - t0) / n * 1e6
    zero = StepRecord(running=8, waiting=2, k=0, wall_s=0.01, generated_tokens=8)
    t0 = time.perf_counter()
    for _ in range(n):
        metrics.record_steps([zero])
    record_k0 = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        span = tracing.start_replica_span({"traceparent": "x"}, request_id="r", replica_id="r0")
        tracing.finish_span(span, completion_tokens=3)
    spans_off = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(200):
        metrics.render_prometheus()
    render = (time.perf_counter() - t0) / 200 * 1e6
    metrics.shutdown()
    return {"record_steps, 1 step K=3 (us)": record, "record_steps, 1 step K=0 (us)": record_k0,
            "replica span start+finish, tracing off (us)": spans_off,
            "render_prometheus, one replica (us)": render}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--acceptance", type=float, default=0.6)
    parser.add_argument("--switch-every", type=int, default=20)
    parser.add_argument("--scrape-s", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--exporter", choices=("otlp", "memory"), default="otlp")
    parser.add_argument("--out", type=Path, default=RESULTS / "observability_overhead")
    args = parser.parse_args()
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        os.environ.pop(name, None)  # metrics stay pull-only in every mode

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
    results: dict[str, list[RunResult]] = {mode: [] for mode in MODES}
    try:
        for repeat in range(args.repeats):
            # Rotate the order so drift in machine load does not favour one mode.
            for mode in MODES[repeat % 3:] + MODES[:repeat % 3]:
                _configure(mode, args, endpoint)
                results[mode].append(run(mode, args, seed=repeat))
                tracing.shutdown_tracing()  # flushes the exporter outside the timed run
        tracing.configure_tracing("bench", force=True)
        micro_us = micro()
    finally:
        server.shutdown()
    report = _report(args, results, micro_us)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(report)
    _plot(results, args.out.with_suffix(".png"))


def _report(args: argparse.Namespace, results: dict[str, list[RunResult]],
            micro_us: dict[str, float]) -> str:
    median = {m: statistics.median(r.tokens_per_s for r in rs) for m, rs in results.items()}
    lines = [
        "# Observability overhead",
        "",
        f"{args.requests} requests x {args.max_tokens} tokens at concurrency "
        f"{args.concurrency}, simulated step {args.step_ms} ms, per-draft acceptance "
        f"{args.acceptance}, tier switch every {args.switch_every} steps, "
        f"/metrics render every {args.scrape_s} s, tracing exporter `{args.exporter}`; "
        f"median of {args.repeats} interleaved rounds.",
        "",
        "| mode | tokens/s (median) | min | max | vs off | vs bare | "
        "observability us/request | us/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, runs in results.items():
        tps = [r.tokens_per_s for r in runs]
        per_request = statistics.median(r.obs_s / r.requests for r in runs) * 1e6
        per_step = statistics.median(r.obs_s / r.steps for r in runs) * 1e6
        lines.append(
            f"| {mode} | {median[mode]:.0f} | {min(tps):.0f} | {max(tps):.0f} | "
            f"{(median[mode] / median['off'] - 1) * 100:+.2f}% | "
            f"{(median[mode] / median['bare'] - 1) * 100:+.2f}% | {per_request:.0f} | "
            f"{per_step:.1f} |")
    traced = results["traced"]
    share = statistics.median(r.obs_s / r.wall_s for r in traced) * 100
    lines += ["", f"Time inside observability calls with tracing on: {share:.2f}% of wall time.",
              "", "| hot path (tracing off) | us/call |", "|---|---|"]
    lines += [f"| {name.removesuffix(' (us)')} | {value:.2f} |" for name, value in micro_us.items()]
    return "\n".join(lines) + "\n"


def _plot(results: dict[str, list[RunResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    medians = [statistics.median(r.tokens_per_s for r in results[m]) for m in MODES]
    lows = [m - min(r.tokens_per_s for r in results[mode]) for m, mode in zip(medians, MODES,
                                                                                strict=True)]
    highs = [max(r.tokens_per_s for r in results[mode]) - m for m, mode in zip(medians, MODES,
                                                                                 strict=True)]
    ax.bar(MODES, medians, yerr=[lows, highs], capsize=6, color=["#999", "#4c72b0", "#dd8452"])
    for i, value in enumerate(medians):
        ax.annotate(f"{(value / medians[1] - 1) * 100:+.1f}% vs off", (i, value),
                    ha="center", va="bottom", xytext=(0, 14), textcoords="offset points")
    ax.set_ylim(0, max(medians) * 1.25)  # room for the labels above the error bars
    ax.set_ylabel("tokens/s (median, min-max)")
    ax.set_title("specserve observability overhead (simulated engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
