"""End to end: the real application (Ray Serve, two engine replicas, router, hub) over HTTP.

Every test runs twice: on the SIMULATOR engine (fast, no model) and on vLLM with the shipped
demo models. The application is serve_config.yaml's, deployed from its config form as
`serve run` does, with a test-sized engine. Talks to the app with the official `openai`
client; greedy outputs are compared with the same engine built directly by `build_engine`, in
this process, before Ray starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from transformers import AutoTokenizer

from bench.transition import bench as transition_bench
from bench.workloads import COPY_PROMPT, FREE_PROMPTS
from policies.goodput import GoodputConfig
from replicas.engines.base import GenerationRequest
from replicas.engines.factory import build_engine
from replicas.engines.spec import DEMO_TARGET, REPO_ROOT, EngineSpec
from tests.conftest import deploy_config

MAX_TOKENS = 32
PROMPTS = [COPY_PROMPT, FREE_PROMPTS[0], FREE_PROMPTS[3]]
CHAT = [{"role": "user", "content": "def add(a, b):"}]
CHAT_PROMPT = "### user\ndef add(a, b):\n### assistant\n"  # models/target/chat_template.jinja


def chat_ids() -> tuple[int, ...]:
    """CHAT as the replicas render it: the template's token ids, nothing added."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    return tuple(tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True,
                                               return_dict=True)["input_ids"])


# Each engine admits 4 sequences at a time, so routed load beyond that waits in the replica.
ENGINES = {
    # Simulated steps three times the cpu-demo preset's (re-fitted at stop 41 to a faster
    # engine: 2.3 ms a step at batch 1), so the load below lasts as long as on the old fit.
    "sim": {"engine": "sim", "kmax": 15, "max_num_seqs": 4, "sim_time_scale": 3.0},
    "vllm": {"engine": "vllm", "drafter": "ngram", "kmax": 15, "enforce_eager": True,
             "cpu_threads": 1, "max_num_seqs": 4},
}
# Long enough that requests overlap with the hub's 0.5 s exchanges on either engine.
LOAD_TOKENS = {"sim": 400, "vllm": 48}


def app_config(kind: str, **overrides: object) -> dict:
    """serve_config.yaml's application with the test engine (goodput, 2 replicas, K 0..15)."""
    app = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())["applications"][0]
    app["args"]["engine"] = ENGINES[kind]
    return {**app, **overrides}


async def engine_alone(kind: str) -> dict[str, str]:
    """Greedy text per prompt from the engine built directly, as the app builds it."""
    engine = build_engine(EngineSpec(**ENGINES[kind]))
    await engine.start()
    try:
        outputs = {}
        for prompt in [*PROMPTS, CHAT_PROMPT]:
            text = ""
            async for chunk in engine.generate(GenerationRequest(
                    request_id=uuid.uuid4().hex, prompt=None if prompt == CHAT_PROMPT else prompt,
                    prompt_token_ids=chat_ids() if prompt == CHAT_PROMPT else None,
                    max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)):
                text += chunk.text
            outputs[prompt] = text
        return outputs
    finally:
        await engine.shutdown()


@pytest.fixture(scope="module", params=["sim", "vllm"])
def kind(request) -> str:
    if request.param == "vllm" and not (Path(DEMO_TARGET) / "config.json").exists():
        pytest.skip("the demo models are not trained yet (models/target missing): "
                    "run `make models`")
    return request.param


@pytest.fixture(scope="module")
def reference(kind) -> dict[str, str]:
    saved = dict(os.environ)  # the vLLM adapter sets per-rank core binding in os.environ
    try:
        return asyncio.run(engine_alone(kind))
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def app_url(kind, reference, serve_url) -> Iterator[str]:
    deploy_config(app_config(kind))
    yield serve_url


@pytest.fixture(scope="module")
def client(app_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0)


def replicas(app_url: str) -> list[dict]:
    return httpx.get(f"{app_url}/admin/replicas", timeout=30).json()["replicas"]


def set_policy(app_url: str, policy: dict) -> None:
    """Every replica on `policy`, through the admin route."""
    httpx.post(f"{app_url}/admin/policy", json={"policy": policy}, timeout=30).raise_for_status()


def in_threads(count: int, call: Callable[[int], None]) -> list[threading.Thread]:
    threads = [threading.Thread(target=call, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_completions_match_the_engine_alone(client, reference):
    for prompt in PROMPTS:
        result = client.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert result.choices[0].text == reference[prompt]
        assert result.usage.completion_tokens == MAX_TOKENS
        assert result.choices[0].finish_reason == "length"
    stream = client.completions.create(
        model="target", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[PROMPTS[1]]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_the_demo_chat_template_writes_one_bos_as_the_models_were_trained():
    """Chat prompts are tokenized without adding special tokens (as vLLM's server does), so
    the template writes the BOS: exactly the ids of the plain prompt encoded as text."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    ids = chat_ids()
    assert list(ids) == tokenizer.encode(CHAT_PROMPT)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_chat_applies_the_template_streaming_and_not(client, reference):
    whole = client.chat.completions.create(model="target", messages=CHAT,
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == reference[CHAT_PROMPT]
    chunks = list(client.chat.completions.create(
        model="target", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        reference[CHAT_PROMPT]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == MAX_TOKENS
    # OpenAI's content parts: the same text in one part is the same prompt.
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    in_parts = client.chat.completions.create(model="target", messages=parts,
                                              max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert in_parts.choices[0].message.content == reference[CHAT_PROMPT]


def test_chat_without_a_limit_runs_to_the_end_of_the_context(client, kind):
    """As OpenAI's and vLLM's chat: no `max_tokens` means up to the context, not the legacy
    completions' 16 tokens."""
    reply = client.chat.completions.create(model="target", messages=CHAT, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == \
        EngineSpec(**ENGINES[kind]).max_model_len
    # Messages that fill the context leave nothing: a 400 about them (no max_tokens was sent).
    too_long = [{"role": "user", "content": "x " * EngineSpec(**ENGINES[kind]).max_model_len}]
    with pytest.raises(openai.BadRequestError, match="the messages take"):
        client.chat.completions.create(model="target", messages=too_long)
    # Text no context of its tokens could hold is refused before the template runs.
    with pytest.raises(openai.BadRequestError, match="characters, more than"):
        client.chat.completions.create(
            model="target", messages=[{"role": "user", "content": "x" * 400_000}])


def test_logprobs_come_from_vllm_and_the_simulator_says_it_has_none(client, kind):
    """vLLM's: one entry per token in OpenAI's forms, greedy's token heading its own list.
    The simulator has no distribution to report: a clear 400, not a silent null."""
    if kind == "sim":
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=8,
                                      logprobs=2)
        return
    text = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=8,
                                     temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True}).choices[0]
    assert len(text.logprobs.tokens) == 8 and "".join(text.logprobs.tokens) == text.text
    assert all(len(top) == 2 for top in text.logprobs.top_logprobs)
    chat = client.chat.completions.create(model="target", messages=CHAT, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True}).choices[0]
    content = chat.logprobs.content
    assert "".join(c.token for c in content) == chat.message.content and len(content) == 8
    assert all(c.top_logprobs[0].token == c.token for c in content)


def test_models_and_health(app_url, client):
    assert [m.id for m in client.models.list()] == ["target"]
    assert client.models.retrieve("target").id == "target"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert httpx.get(f"{app_url}/health", timeout=30).json() == {"status": "ok"}
    assert httpx.head(f"{app_url}/health", timeout=30).status_code == 200


def test_traffic_reaches_both_replicas_and_policies_see_effective_concurrency(
        client, app_url, kind):
    before = {r["replica_id"]: r["counters"]["generated_tokens"] for r in replicas(app_url)}

    def one(i: int) -> None:
        client.completions.create(model="target", prompt=PROMPTS[i % len(PROMPTS)],
                                  max_tokens=LOAD_TOKENS[kind], temperature=0)

    for thread in in_threads(16, one):
        thread.join()
    after = replicas(app_url)
    assert len(after) == 2
    assert all(r["counters"]["generated_tokens"] > before.get(r["replica_id"], 0)
               for r in after), "both replicas must serve traffic"
    # The engine batch stops at 4; the policy's effective concurrency also counts what was
    # routed to the replica and is still waiting, and the hub heard of it from the router.
    assert all(r["max_local_batch"] <= 4 for r in after)
    assert any(r["max_effective_concurrency"] > r["max_local_batch"] for r in after)
    assert all(r["max_routed"] > 0 for r in after), "router reports reach every replica"
    # What each replica's goodput policy learned is a profile a deployment can start from.
    for stats in after:
        GoodputConfig(profile=stats["learned_profile"])
        # The simulator's load is long enough for a point's steps to pile up (vLLM's here
        # is not) and its steps cost what no shipped profile says: the rows move.
        if kind == "sim":
            assert stats["learned_profile"] != stats["policy"]["profile"], \
                "each replica reports the step costs it measured"
    if kind == "vllm":  # per-request verify outcomes: only vLLM reports them
        # Each replica's per-class acceptance went to the hub, and the fleet's came back. The
        # load above may have finished between two telemetry periods on both replicas: a
        # replica also measures the requests that finished since its last period.
        deadline = time.monotonic() + 20
        while not all(r["fleet_class_acceptance"].get("greedy") for r in after) and \
                time.monotonic() < deadline:
            time.sleep(0.25)
            after = replicas(app_url)
        for stats in after:
            fleet = stats["fleet_class_acceptance"]["greedy"]
            assert fleet and all(0 <= rate <= 1 for rate in fleet)


@pytest.mark.parametrize(("body", "status"), [
    ({"model": "nope", "prompt": "x"}, 404),
    ({"model": "target", "prompt": "x", "max_tokens": 0}, 400),
    # Strict types, as OpenAI's API: not 5 tokens, not a stream.
    ({"model": "target", "prompt": "x", "max_tokens": "5"}, 400),
    ({"model": "target", "prompt": "x", "stream": "yes"}, 400),
    ({"model": "target", "prompt": "x", "temperature": -1}, 400),
    ({"model": "target", "prompt": "x", "n": 2}, 400),
    ({"model": "target", "prompt": ""}, 400),
    ({"model": "target", "prompt": "x", "max_tokens": 5000}, 400),
    # JSON escapes that decode to half a surrogate pair: no tokenizer can encode them.
    ({"model": "target", "prompt": "ab\ud800c"}, 400),
    ({"model": "target", "prompt": ["\udfff"]}, 400),
    ({"model": "target", "prompt": "x", "stop": ["ok", "\ud83d"]}, 400),
    ({"model": "target", "messages": [{"role": "user", "content": "hi \udc00"}]}, 400),
    # vLLM seeds a torch.Generator: 64-bit signed only.
    ({"model": "target", "prompt": "x", "seed": 1 << 63}, 400),
    ({"model": "target", "prompt": "x", "seed": -(1 << 63) - 1}, 400),
    ({"model": "target", "prompt": "x", "presence_penalty": 2.5}, 400),
    ({"model": "target", "prompt": "x", "repetition_penalty": 0}, 400),
    ({"model": "target", "prompt": "x", "top_k": -2}, 400),
    ({"model": "target", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400),
    ({"model": "target", "prompt": "x", "min_p": 0.1}, 400),
    ({"model": "target", "prompt": "x", "stream_options": {"include_usage": True}}, 400),
    ({"model": "target", "messages": CHAT, "top_logprobs": 2}, 400),
    # Fields that would change the output but that no engine here applies.
    ({"model": "target", "prompt": "x", "logit_bias": {"13": 100}}, 400),
    ({"model": "target", "prompt": "x", "echo": True}, 400),
    ({"model": "target", "messages": CHAT, "response_format": {"type": "json_object"}}, 400),
    ({"model": "target", "messages": CHAT, "tools": [{"type": "function",
                                                      "function": {"name": "f"}}]}, 400),
    ({"model": "target", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400),
])
def test_bad_input_gets_an_openai_error_and_harms_nothing(app_url, client, body, status):
    route = "chat/completions" if "messages" in body else "completions"
    # json.dumps escapes the lone surrogates as a client's JSON encoder would.
    response = httpx.post(f"{app_url}/v1/{route}", content=json.dumps(body),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and "param" in error and "code" in error
    ok = client.completions.create(model="target", prompt="def f():", max_tokens=4,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 4


def test_sampling_controls_reach_vllm_and_keep_greedy_identical_across_tiers(app_url, client,
                                                                            kind):
    """Penalties and top-k pass through the app to vLLM: the copy prompt, penalised, stops
    repeating itself, and decodes the same with speculation off and deep; top_k=1 makes a
    sampled request (temperature 1) decode as a greedy one."""
    if kind != "vllm":
        pytest.skip("the simulator's made-up tokens do not depend on sampling controls")
    penalties = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.3}

    def complete(temperature: float = 0, **extra: object) -> str:
        return client.completions.create(
            model="target", prompt=COPY_PROMPT, max_tokens=24, temperature=temperature,
            seed=3, extra_body={"ignore_eos": True, **extra}).choices[0].text

    plain = complete()
    outputs = []
    try:
        for k in (0, 7):
            set_policy(app_url, {"name": "static", "k": k})
            outputs.append(complete(**penalties))
        assert complete(temperature=1.0, top_k=1, **penalties) == outputs[-1]
    finally:
        set_policy(app_url, app_config(kind)["args"]["policy"])
    assert outputs[0] == outputs[1] != plain


def test_seeds_at_the_64_bit_bounds_are_served(client):
    for seed in (-(1 << 63), (1 << 63) - 1):
        result = client.completions.create(model="target", prompt="def f():", max_tokens=4,
                                           temperature=0.8, seed=seed,
                                           extra_body={"ignore_eos": True})
        assert result.usage.completion_tokens == 4


def test_malformed_json_and_unknown_route(app_url):
    response = httpx.post(f"{app_url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = httpx.get(f"{app_url}/v1/nothing", timeout=30)
    assert response.status_code == 404 and response.json()["error"]["type"]


def test_redeployed_user_config_reaches_every_replica_within_2s(client, app_url, kind):
    """Redeploy with only the replicas' user_config changed: the same replicas reconfigured,
    no request failing."""
    ids = {r["replica_id"] for r in replicas(app_url)}
    failures: list[BaseException] = []

    def one(i: int) -> None:
        try:
            result = client.completions.create(model="target", prompt=COPY_PROMPT,
                                               max_tokens=LOAD_TOKENS[kind], temperature=0,
                                               extra_body={"ignore_eos": True})
            assert result.usage.completion_tokens == LOAD_TOKENS[kind]
        except BaseException as error:  # any failure fails the test
            failures.append(error)

    threads = in_threads(6, one)
    time.sleep(0.5)  # the requests are in flight
    started = time.perf_counter()
    candidates = app_config(kind)["args"]["candidates"]
    deploy_config(app_config(kind, deployments=[{"name": "EngineReplica", "user_config": {
        "policy": {"name": "static", "k": 3}, "candidates": candidates}}]))
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
    assert {r["replica_id"] for r in state} == ids, "reconfigured, not replaced"


def test_a_benchmark_run_leaves_the_app_on_the_policy_it_found(app_url, kind):
    """`bench.transition` switches the running app from mode to mode; afterwards the deployed
    policy is back, so the next run (the suite's sweep after its transition) reads the
    deployed config, step-cost profile and all, not the last mode's."""
    if kind != "sim":
        pytest.skip("the benchmark's reconfiguration does not depend on the engine")
    deployed = app_config(kind)["args"]["policy"]  # goodput with its step-cost profile
    set_policy(app_url, deployed)
    before = [r["policy"] for r in replicas(app_url)]
    assert before[0]["name"] == "goodput" and before[0]["profile"]
    args = argparse.Namespace(
        url=app_url, model=None, max_tokens=8, api_key=None, workload="sweep", requests=2,
        concurrency=1, phases=["c1"], modes=["goodput", "static3"], defined={},
        aa_control=None, rounds=1, warmup=1, app_config=None)
    results = asyncio.run(transition_bench(args))
    assert results["policies"]["goodput"] == before[0]
    assert results["modes"]["static3"]["errors"] == 0
    assert [r["policy"] for r in replicas(app_url)] == before


def test_the_stream_interval_in_force_is_read_back_per_replica(app_url):
    before = {r["stream_interval_ms"] for r in replicas(app_url)}
    response = httpx.post(f"{app_url}/admin/policy", json={"stream_interval_ms": 20},
                          timeout=30)
    response.raise_for_status()
    assert {r["stream_interval_ms"] for r in response.json()["replicas"]} == {20.0}
    (interval,) = before
    httpx.post(f"{app_url}/admin/policy", json={"stream_interval_ms": interval},
               timeout=30).raise_for_status()


def test_run_time_candidates_are_checked_and_the_policy_chooses_among_them(app_url):
    """A bad candidate list, or a policy that is not a config object, gets a 400 and changes
    no replica; a good list alone (no policy) rebuilds the running policy over the new
    tiers, so its choice holds at once."""
    def tiers() -> list[tuple[list[int], int]]:
        return sorted((r["candidates"], r["active_k"]) for r in replicas(app_url))

    admin = f"{app_url}/admin/policy"
    set_policy(app_url, {"name": "static", "k": 7})
    before = tiers()
    for bad in ({"candidates": [0, 99]}, {"candidates": "abc"}, {"candidates": 5},
                {"candidates": [3, 1]}, {"candidates": []},
                {"candidates": [0, 1], "initial_k": 3},
                {"policy": "goodput", "candidates": [0, 2, 5]}, {"policy": None}):
        response = httpx.post(admin, json=bad, timeout=30)
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert tiers() == before
    # Tiers without the static K in force, or a static K outside the tiers: every replica
    # refuses it (a 400 with its reason) and stays as it was.
    for bad in ({"candidates": [0, 2, 5]}, {"policy": {"name": "static", "k": 5}}):
        response = httpx.post(admin, json=bad, timeout=30)
        assert response.status_code == 400, (bad, response.text)
        assert "is not one of the candidate tiers" in response.json()["error"]["message"]
    assert tiers() == before
    response = httpx.post(admin, json={"policy": {"name": "static", "k": 5},
                                       "candidates": [0, 2, 5], "initial_k": 2}, timeout=30)
    response.raise_for_status()
    assert sorted((r["candidates"], r["active_k"]) for r in response.json()["replicas"]) == \
        [([0, 2, 5], 5)] * 2
