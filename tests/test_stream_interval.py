"""The streaming benchmark's client side, without a server: the app's own SSE encoder
(`app.openai_format.sse`) makes the event sequences, an `httpx.MockTransport` serves them."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import bench.stream_interval as stream_interval
from app.openai_format import CompletionFormat, error_body, sse
from bench.stream_interval import FAILED, Streamed, read_stream, report, run_load, summarise


def events(tokens: int, fail_after: int | None = None) -> str:
    """What the app streams for a completion of `tokens` one-token chunks (with usage), or,
    with `fail_after`, one whose generation fails after that many chunks."""
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        for n in range(1, tokens + 1):
            if n - 1 == fail_after:
                raise RuntimeError("the engine died")
            yield {"text": "x", "finish_reason": None, "prompt_tokens": 3,
                   "completion_tokens": n}

    async def finish(last: Any, error: Any) -> None:
        pass

    async def collect() -> str:
        return "".join([event async for event in sse(
            chunks(), CompletionFormat("r", "m"), True, finish,
            lambda error: error_body(500, str(error), "server_error"))])

    return asyncio.run(collect())


def timed(body: str, start: float = 10.0, every: float = 0.5) -> list[tuple[float, str]]:
    """The body's lines as they would arrive, one every `every` seconds."""
    return [(start + every * i, line) for i, line in enumerate(body.split("\n"))]


def test_a_complete_stream_gives_its_tokens_first_token_and_gaps() -> None:
    lines = timed(events(3))
    streamed = read_stream(9.0, lines)
    assert not streamed.failed
    assert (streamed.tokens, streamed.events) == (3, 3)
    assert streamed.ttft_s == pytest.approx(1.0)  # the first line came 1 s after the start
    assert streamed.gaps_s == pytest.approx([1.0, 1.0])  # an empty line between events


def test_a_stream_that_fails_midway_or_is_cut_counts_as_failed() -> None:
    """The app reports a failure after the 200 in-band; before, the benchmark read such a
    stream as 0 tokens with a first token at 0.0 s; the `[DONE]` after the error event (as
    vLLM sends) does not make it complete. A stream without `[DONE]` was cut."""
    failing = events(5, fail_after=2)
    assert failing.index('"error"') < failing.index("data: [DONE]")
    assert read_stream(9.0, timed(failing)) == FAILED
    complete = events(3)
    cut = complete[:complete.index("data: [DONE]")]
    assert read_stream(9.0, timed(cut)) == FAILED


def serve(bodies: dict[int, tuple[int, str]]) -> httpx.MockTransport:
    """Request seed -> (status, body); `/v1/models` names one model."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        status, body = bodies[json.loads(request.content)["seed"]]
        return httpx.Response(status, text=body)

    return httpx.MockTransport(handle)


def test_failed_requests_are_counted_and_left_out_of_the_statistics() -> None:
    """An error status no longer ends the run, and no failed request adds tokens, a first
    token or gaps."""
    bodies = {0: (200, events(4)), 1: (500, json.dumps(error_body(500, "no", "x"))),
              2: (200, events(6, fail_after=3)), 3: (200, events(2))}
    row = asyncio.run(run_load("http://127.0.0.1:1", 2, 4, 8, transport=serve(bodies)))
    assert row["errors"] == 2
    assert row["events_per_request"] == 3  # (4 + 2) / 2: the completed ones
    assert row["ttft_s"] > 0
    assert row["throughput"] > 0
    everything_failed = asyncio.run(run_load("http://127.0.0.1:1", 2, 2, 8, transport=serve(
        {0: (503, ""), 1: (200, events(3, fail_after=1))})))
    assert everything_failed["errors"] == 2
    assert everything_failed["ttft_s"] is None and everything_failed["throughput"] == 0
    results = {"rounds": 1, "max_tokens": 8,
               "intervals": {"0": {8: row}, "50": {8: everything_failed}}}
    text = report(results)
    assert next(line for line in text.splitlines() if line.startswith("| 0 ms | 8 |")
                ).endswith("| 2 |")
    assert "| 50 ms | 8 | 0 | n/a | n/a | 0 | 0.00 | 2 |" in text
    assert "| 50 ms / 0 ms | 8 | 0.00x | - | - |" in text


def test_a_rounds_tokens_and_statistics_are_the_completed_requests() -> None:
    done = [Streamed(4, 0.2, 4, [0.1, 0.1, 0.3]), Streamed(2, 0.4, 2, [0.5])]
    row = summarise([done[0], FAILED, done[1], FAILED], seconds=2.0, cpu=3.0)
    assert row == {"throughput": 3.0, "ttft_s": pytest.approx(0.3), "events_per_request": 3,
                   "gap_p99_ms": pytest.approx(500), "cpu_s_per_1k_tokens": 500.0,
                   "errors": 2}


def test_rounds_combine_into_medians_and_summed_errors() -> None:
    rounds = [{"ttft_s": 0.1, "errors": 1}, {"ttft_s": None, "errors": 2},
              {"ttft_s": 0.3, "errors": 0}]
    assert stream_interval.combine_rounds(rounds) == {"ttft_s": pytest.approx(0.2), "errors": 3}


def test_one_app_takes_the_intervals_in_alternating_order_and_warm_up_only_if_asked(
        monkeypatch, tmp_path: Path) -> None:
    """Every interval is set at run time on the same app, forward then backward, each
    followed by its rounds at every concurrency; `--warmup 0` runs no warm-up (a round of no
    requests took a median of nothing and raised)."""
    calls: list[tuple] = []

    async def fake_load(url: str, concurrency: int, requests: int, max_tokens: int
                        ) -> dict[str, float | None]:
        calls.append(("load", concurrency, requests))
        return {"throughput": float(len(calls)), "errors": 0}

    monkeypatch.setattr(stream_interval, "run_load", fake_load)
    monkeypatch.setattr(stream_interval, "set_interval",
                        lambda url, ms: calls.append(("interval", ms)))
    started: list[Path] = []
    monkeypatch.setattr(stream_interval, "serving",
                        lambda config, *args: started.append(config) or
                        contextlib.nullcontext({}))
    args = argparse.Namespace(config=tmp_path / "serve_config.yaml", url="http://127.0.0.1:1",
                              startup_timeout=1, warmup=0, concurrency=[8, 64], requests=16,
                              rounds=2, max_tokens=8)
    results = stream_interval.measure(args, ["0", "50"])
    assert len(started) == 1, "one app for every interval"
    assert calls == [("interval", 0.0), ("load", 8, 16), ("load", 64, 128),
                     ("interval", 50.0), ("load", 8, 16), ("load", 64, 128),
                     ("interval", 50.0), ("load", 8, 16), ("load", 64, 128),
                     ("interval", 0.0), ("load", 8, 16), ("load", 64, 128)]
    assert results["0"][8]["throughput"] == 6.5  # median of the 2nd and 11th calls' rows
    calls.clear()
    stream_interval.measure(argparse.Namespace(**{**vars(args), "warmup": 4}), ["0"])
    assert calls[0] == ("load", 8, 4)


def test_the_interval_is_set_through_the_admin_route() -> None:
    posted: list[tuple[str, dict]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        posted.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"replicas": []})

    stream_interval.set_interval("http://127.0.0.1:1", 20.0, transport=httpx.MockTransport(handle))
    assert posted == [("/admin/policy", {"stream_interval_ms": 20.0})]
