"""A bounded load test: a fixed number of requests, a time limit, loopback only.

    python -m bench.load --url http://127.0.0.1:8000 --requests 200 --concurrency 16 \\
        --time-limit 300 --kill-replica-at 0.5 --json out.json

Reports requests sent, accepted (the server answered with a status, or took the request and
then failed to answer), completed (200 with a full body), failed by status (with the error
messages clients read), and lost:
accepted but never answered before the per-request deadline, or cut off without an answer.
Lost must be 0. With `--kill-replica-at F` one engine replica is killed through Ray once a
share F of the requests has finished (the app must then be on this machine's Ray cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

PROMPTS = ("import os\nimport os\nimport os\n", "def parse(line):", "class Node:\n    def")


@dataclass
class LoadReport:
    sent: int = 0
    accepted: int = 0
    completed: int = 0
    failed_by_status: dict[str, int] = field(default_factory=dict)
    error_messages: list[str] = field(default_factory=list)
    """The distinct error messages of failed answers (what a client reads)."""
    lost: int = 0
    killed_replica: str | None = None
    seconds: float = 0.0


def kill_one_engine_replica() -> str:
    """Kill one Serve engine-replica actor (Serve starts a new one)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", log_to_driver=False)
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("SERVE_REPLICA::") and "EngineReplica" in a["name"])
    if not names:
        raise RuntimeError("no engine replica actor found on this Ray cluster")
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def is_loopback(url: str) -> bool:
    """Whether `url` is plain HTTP to this machine: the benchmarks load no other. By host
    name, so "http://localhost.example.com" is not taken for it."""
    parts = urlsplit(url)
    return parts.scheme == "http" and parts.hostname in ("127.0.0.1", "localhost")


def error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text


async def run_load(url: str, requests: int, concurrency: int, time_limit_s: float,
                   request_timeout_s: float = 60.0, api_key: str | None = None,
                   kill_at: float | None = None,
                   kill: Callable[[], str] = kill_one_engine_replica) -> LoadReport:
    if not is_loopback(url):
        raise ValueError("the load test talks to loopback only")
    report, statuses = LoadReport(), Counter()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.monotonic()
    finished = 0
    kill_started = False
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(0)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal finished, kill_started
        body = {"model": "target", "prompt": PROMPTS[i % len(PROMPTS)],
                "max_tokens": rng.randint(16, 64), "temperature": 0.0 if i % 2 else 0.8}
        async with gate:
            if time.monotonic() - started > time_limit_s:
                return  # past the time limit: not sent
            report.sent += 1
            try:
                response = await client.post(f"{url}/v1/completions", json=body,
                                             headers=headers, timeout=request_timeout_s)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                statuses["connect_error"] += 1  # never reached the server: not accepted
            except httpx.HTTPError:
                report.accepted += 1
                report.lost += 1  # taken, then no answer in time or the connection cut
            else:
                report.accepted += 1
                if response.status_code == 200 and response.json().get("choices"):
                    report.completed += 1
                else:
                    statuses[str(response.status_code)] += 1
                    message = error_message(response)
                    if message not in report.error_messages:
                        report.error_messages.append(message)
            finished += 1
            if kill_at is not None and not kill_started and finished >= kill_at * requests:
                kill_started = True  # once, though several requests cross the mark together
                report.killed_replica = await asyncio.to_thread(kill)

    # A connection for every request in flight: past httpx's default pool (100), a request
    # waiting for one would time out unsent and count as accepted and lost.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(one(client, i) for i in range(requests)))
    report.failed_by_status = dict(statuses)
    report.seconds = time.monotonic() - started
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--time-limit", type=float, default=300)
    parser.add_argument("--request-timeout", type=float, default=60)
    parser.add_argument("--kill-replica-at", type=float, default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report = asyncio.run(run_load(args.url, args.requests, args.concurrency, args.time_limit,
                                  args.request_timeout, args.api_key, args.kill_replica_at))
    print(json.dumps(asdict(report), indent=2))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    if report.lost:
        raise SystemExit(f"{report.lost} accepted requests were never answered")


if __name__ == "__main__":
    main()
