"""End to end: the real application (Ray Serve, two vLLM replicas, router, hub) over HTTP.

Talks to it with the official `openai` client. Greedy outputs are compared with the vLLM
engine run alone (no Ray, no speculation) in this process before the app starts.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid

import httpx
import openai
import pytest
import ray
from ray import serve

from app.builder import build_app
from bench.workloads import COPY_PROMPT, FREE_PROMPTS
from replicas.engines.base import GenerationRequest
from replicas.engines.spec import EngineSpec
from replicas.engines.vllm_engine import VllmEngine

MAX_TOKENS = 32
PROMPTS = [COPY_PROMPT, FREE_PROMPTS[0], FREE_PROMPTS[3]]
ENGINE = {"engine": "vllm", "drafter": "ngram", "kmax": 15, "enforce_eager": True,
          "cpu_threads": 1, "max_num_seqs": 4}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def reference_outputs() -> dict[str, str]:
    """Greedy text from the engine alone, speculation off."""
    engine = VllmEngine(EngineSpec(**{**ENGINE, "drafter": "none", "cpu_threads": 2}))
    await engine.start()
    try:
        outputs = {}
        for prompt in PROMPTS:
            text = ""
            async for chunk in engine.generate(GenerationRequest(
                    request_id=uuid.uuid4().hex, prompt=prompt, max_tokens=MAX_TOKENS,
                    temperature=0.0, ignore_eos=True)):
                text += chunk.text
            outputs[prompt] = text
        return outputs
    finally:
        await engine.shutdown()


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return asyncio.run(reference_outputs())


@pytest.fixture(scope="module")
def app_url(reference):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False,
             log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"engine": ENGINE, "num_replicas": 2, "policy": {"name": "goodput"},
                         "telemetry_period_s": 0.5}), name="specserve", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(app_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0)


def replicas(app_url: str) -> list[dict]:
    return httpx.get(f"{app_url}/admin/replicas", timeout=30).json()["replicas"]


def test_completions_match_the_engine_alone(client, reference):
    for prompt, expected in reference.items():
        result = client.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert result.choices[0].text == expected
        assert result.usage.completion_tokens == MAX_TOKENS
        assert result.choices[0].finish_reason == "length"


def test_streamed_completion_equals_the_whole(client, reference):
    stream = client.completions.create(
        model="target", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[PROMPTS[1]]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_streaming_and_not_agree(client):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model="target", messages=messages, max_tokens=24,
                                           temperature=0)
    stream = client.chat.completions.create(
        model="target", messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_traffic_reaches_both_replicas_and_policies_see_effective_concurrency(client, app_url):
    before = {r["replica_id"]: r["counters"]["generated_tokens"] for r in replicas(app_url)}

    def one(i: int) -> None:
        client.completions.create(model="target", prompt=PROMPTS[i % len(PROMPTS)],
                                  max_tokens=48, temperature=0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = replicas(app_url)
    assert len(after) == 2
    assert all(r["counters"]["generated_tokens"] > before.get(r["replica_id"], 0)
               for r in after), "both replicas must serve traffic"
    # Each engine admits 4 sequences at a time; the policy's effective concurrency also counts
    # the requests routed to the replica and still waiting, which the engine batch does not.
    assert all(r["max_local_batch"] <= 4 for r in after)
    assert any(r["max_effective_concurrency"] > r["max_local_batch"] for r in after)


def test_reconfigure_to_static_3_reaches_every_replica_within_2s(client, app_url):
    failures: list[BaseException] = []

    def one() -> None:
        try:
            client.completions.create(model="target", prompt=COPY_PROMPT, max_tokens=64,
                                      temperature=0)
        except Exception as error:  # any failure fails the test
            failures.append(error)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    started = time.perf_counter()
    response = httpx.post(f"{app_url}/admin/policy",
                          json={"policy": {"name": "static", "k": 3}}, timeout=30)
    assert response.status_code == 200
    while True:
        state = replicas(app_url)
        if all(r["active_k"] == 3 and r["policy"]["name"] == "static" for r in state):
            break
        assert time.perf_counter() - started < 2.0, state
        time.sleep(0.05)
    assert time.perf_counter() - started < 2.0
    for thread in threads:
        thread.join()
    assert not failures


@pytest.mark.parametrize(("body", "status"), [
    ({"model": "nope", "prompt": "x"}, 404),
    ({"model": "target", "prompt": "x", "max_tokens": 0}, 400),
    ({"model": "target", "prompt": "x", "temperature": -1}, 400),
    ({"model": "target", "prompt": "x", "n": 2}, 400),
    ({"model": "target", "prompt": ""}, 400),
    ({"model": "target", "prompt": "x " * 4000, "max_tokens": 8}, 400),
    ({"model": "target", "prompt": "x", "max_tokens": 5000}, 400),
])
def test_bad_input_gets_an_openai_error_and_harms_nothing(app_url, client, body, status):
    response = httpx.post(f"{app_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    ok = client.completions.create(model="target", prompt="def f():", max_tokens=4)
    assert ok.usage.completion_tokens == 4


def test_malformed_json_and_unknown_route(app_url):
    response = httpx.post(f"{app_url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    assert httpx.get(f"{app_url}/v1/nothing", timeout=30).status_code == 404
