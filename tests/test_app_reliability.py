"""Reliability and security against the running app (simulator engine, so it runs in seconds):
readiness, the API key on every route, overload, and a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, settings

from bench.load import run_load
from tests.conftest import REPO_ROOT, deploy_config

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_ONGOING, MAX_QUEUED, REPLICAS = 2, 2, 2
# Sampled text on the simulator: about one token per step, so these take seconds.
FUZZ_EXAMPLES = 25  # per route
SLOW = {"model": "target", "prompt": "def slow():", "max_tokens": 400, "temperature": 0.8}


@pytest.fixture(scope="module")
def app_url(serve_url) -> Iterator[str]:
    app = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())["applications"][0]
    app["args"].update(engine={"engine": "sim", "kmax": 15, "max_num_seqs": 4},
                       api_key=KEY, num_replicas=REPLICAS, max_ongoing_requests=MAX_ONGOING,
                       max_queued_requests=MAX_QUEUED)
    deploy_config(app)
    yield serve_url


def running(app_url: str) -> int:
    replicas = httpx.get(f"{app_url}/admin/replicas", headers=AUTH, timeout=30).json()
    return sum(r["counters"]["running"] + r["counters"]["waiting"]
               for r in replicas["replicas"])


def test_health_needs_no_key_and_reports_a_ready_engine(app_url):
    response = httpx.get(f"{app_url}/health", timeout=30)
    assert response.status_code == 200 and response.json() == {"status": "ok"}


@pytest.mark.parametrize(("method", "route"), [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("GET", "/metrics"), ("GET", "/admin/replicas"), ("POST", "/admin/policy")])
@pytest.mark.parametrize("header", [{}, {"Authorization": "Bearer wrong"},
                                    {"Authorization": KEY}])
def test_every_route_but_health_needs_the_key(app_url, method, route, header):
    response = httpx.request(method, f"{app_url}{route}", headers=header, timeout=30,
                             json={"name": "static", "k": 1} if route == "/admin/policy"
                             else {"model": "target", "prompt": "x", "max_tokens": 1})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_reconfiguration_is_unreachable_without_the_key(app_url):
    before = httpx.get(f"{app_url}/admin/replicas", headers=AUTH, timeout=30).json()
    httpx.post(f"{app_url}/admin/policy", json={"name": "static", "k": 1}, timeout=30)
    after = httpx.get(f"{app_url}/admin/replicas", headers=AUTH, timeout=30).json()
    assert [r["policy"] for r in after["replicas"]] == [r["policy"] for r in before["replicas"]]


def test_overload_gets_a_fast_503_with_retry_after_and_accepted_requests_finish(app_url):
    capacity = REPLICAS * MAX_ONGOING + MAX_QUEUED
    results: list[tuple[int, float, str | None]] = []
    lock = threading.Lock()

    def one() -> None:
        started = time.monotonic()
        response = httpx.post(f"{app_url}/v1/completions", json=SLOW, headers=AUTH,
                              timeout=120)
        with lock:
            results.append((response.status_code, time.monotonic() - started,
                            response.headers.get("retry-after")))

    threads = [threading.Thread(target=one) for _ in range(capacity + 6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert len(results) == len(threads), "a request hung"
    rejected = [r for r in results if r[0] in (429, 503)]
    served = [r for r in results if r[0] == 200]
    print(f"overload: {len(served)} served, {len(rejected)} rejected in at most "
          f"{max(r[1] for r in rejected):.2f} s")  # shown with pytest -s
    assert rejected and len(served) + len(rejected) == len(results)
    assert all(seconds < 2.0 and retry_after for _, seconds, retry_after in rejected)
    assert served  # and every request the app took was served in full (200 with its tokens)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(app_url):
    assert running(app_url) == 0
    finished: list[int] = []

    def steady() -> None:  # another stream that must complete untouched
        body = {**SLOW, "max_tokens": 120, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{app_url}/v1/completions", json=body, headers=AUTH,
                          timeout=120) as response:
            events = [json.loads(line.removeprefix("data: "))
                      for line in response.iter_lines() if line.startswith("data: {")]
        finished.append(events[-1]["usage"]["completion_tokens"])

    other = threading.Thread(target=steady)
    other.start()
    with httpx.stream("POST", f"{app_url}/v1/completions", json={**SLOW, "stream": True},
                      headers=AUTH, timeout=120) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert running(app_url) >= 1
    # The connection is closed: the engine's running count returns to the baseline.
    other.join(timeout=120)
    deadline = time.monotonic() + 10
    while running(app_url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(app_url) == 0
    assert finished == [120]  # every token of the other stream arrived


@pytest.fixture(scope="module")
def served_schema(app_url):
    return schemathesis.openapi.from_url(f"{app_url}/openapi.json")


fuzzed = schemathesis.pytest.from_fixture("served_schema")


@fuzzed.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzing_the_openapi_schema_finds_no_5xx(case, app_url):
    """Bounded schema-driven fuzzing of every route (with the key), simulator engine. The
    served model's name is kept so that generated sampling fields reach the engine (an
    unknown model is its own bad-input row)."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "target"
    response = case.call(base_url=app_url, headers=AUTH, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)


def test_serving_continues_on_local_signals_while_the_hub_is_killed(app_url):
    import ray

    hub = next(a for a in ray.util.list_named_actors(all_namespaces=True)
               if "telemetry_hub" in a["name"])
    ray.kill(ray.get_actor(hub["name"], namespace=hub["namespace"]), no_restart=False)
    for _ in range(4):
        response = httpx.post(f"{app_url}/v1/completions", headers=AUTH, timeout=60,
                              json={**SLOW, "max_tokens": 40})
        assert response.status_code == 200
    # Ray restarts the hub actor; the replicas find it again and get their view back.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{app_url}/admin/replicas", headers=AUTH, timeout=30).json()
        if all(r["cluster_view"] for r in replicas["replicas"]):
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the replicas did not get a cluster view back")


def test_load_with_a_replica_killed_midway_loses_nothing(app_url):
    """Runs last in this module: it kills an engine replica (Serve starts a new one)."""
    before = {r["replica_id"] for r in httpx.get(
        f"{app_url}/admin/replicas", headers=AUTH, timeout=30).json()["replicas"]}
    report = asyncio.run(run_load(app_url, requests=60, concurrency=REPLICAS * MAX_ONGOING,
                                  time_limit_s=120, request_timeout_s=60, api_key=KEY,
                                  kill_at=0.3))
    print(f"load with a replica killed: {report}")  # shown with pytest -s
    assert report.killed_replica is not None
    assert report.sent == 60 and report.lost == 0
    assert report.completed + sum(report.failed_by_status.values()) == report.sent
    assert all(status.startswith("5") for status in report.failed_by_status), \
        report.failed_by_status  # a clear 5xx, never a hang or a 4xx
    # ... that names the request and leaks no replica traceback or exception text.
    assert all(re.fullmatch(r"(generation failed|no engine replica could serve the request) "
                            r"\(request id [0-9a-f]{32}\)", message)
               for message in report.error_messages), report.error_messages
    assert report.completed >= 30
    # Serve brings the replica back; the new one serves and has its cluster view.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{app_url}/admin/replicas", headers=AUTH, timeout=30).json()
        ids = {r["replica_id"] for r in replicas["replicas"]}
        if len(ids) == REPLICAS and ids != before and all(
                r["cluster_view"] for r in replicas["replicas"]):
            break
        time.sleep(1)
    else:
        raise AssertionError(f"no restarted replica with a cluster view: {replicas}")
    assert httpx.get(f"{app_url}/health", timeout=30).status_code == 200
