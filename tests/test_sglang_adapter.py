"""The SGLang adapter's engine-independent part (SGLang itself needs a GPU: not run here)."""

from types import SimpleNamespace

import pytest

from replicas.engines.base import MAX_STEP_GAP_S, SETTLE_STEPS, GenerationRequest, StepTimer
from replicas.engines.sglang_engine import sampling_params, step_from_verify
from replicas.engines.sglang_hooks import STEP_SOCKET_ENV, ExternalTierPolicy, _scheduler_set_k


def scheduler(tp_rank: int) -> SimpleNamespace:
    """What the K setter reads of SGLang's `Scheduler` (started with --speculative-adaptive)."""
    controller = SimpleNamespace(params=None, candidate_steps=[1, 3, 7])
    return SimpleNamespace(tp_rank=tp_rank, draft_worker=SimpleNamespace(
        adaptive_controller=controller, speculative_num_steps=7))


def test_the_k_setter_takes_the_rpc_parameters_as_sglang_passes_them(monkeypatch):
    """SGLang's scheduler calls an RPC method with one dict of the call's keyword arguments
    (`collective_rpc("specserve_set_k", k=3)` -> `method({"k": 3})`), on every rank; only
    rank 0 publishes the verify records, or each step would count once per rank."""
    monkeypatch.setenv(STEP_SOCKET_ENV, "tcp://127.0.0.1:9")  # connecting needs no listener
    first, other = scheduler(tp_rank=0), scheduler(tp_rank=1)
    for rank in (first, other):
        _scheduler_set_k(rank, {"k": 3})
        policy = rank.draft_worker.adaptive_controller.params
        assert isinstance(policy, ExternalTierPolicy) and policy.get_steps_for_batch(8) == 3
    assert first.draft_worker.adaptive_controller.params._publisher._socket is not None
    assert other.draft_worker.adaptive_controller.params._publisher._socket is None
    with pytest.raises(ValueError, match="not a prepared SGLang tier"):
        _scheduler_set_k(first, {"k": 5})


def test_every_sampling_control_reaches_sglang_under_its_name():
    request = GenerationRequest("r", prompt="x", max_tokens=9, temperature=0.7, top_p=0.9,
                                seed=5, stop=("\n",), top_k=40,
                                presence_penalty=0.5, frequency_penalty=-0.5,
                                repetition_penalty=1.2, min_tokens=3)
    assert sampling_params(request) == {
        "max_new_tokens": 9, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"],
        "ignore_eos": False, "top_k": 40, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_new_tokens": 3,
        "sampling_seed": 5}
    for off in (0, -1):  # vLLM's and OpenAI clients' "all"; SGLang's is -1
        assert sampling_params(GenerationRequest("r", top_k=off))["top_k"] == -1


def test_verify_record_becomes_unbiased_step_record():
    step = step_from_verify({"running": 3, "k": 3, "wall_s": 0.02, "accepted": [3, 0, 1]},
                            kmax=7, timer=StepTimer())
    assert (step.drafts, step.draft_tokens, step.accepted_tokens) == (3, 9, 4)
    assert step.accepted_per_pos == (2, 1, 1, 0, 0, 0, 0)
    assert step.drafted_per_pos == (3, 3, 3, 0, 0, 0, 0)
    assert step.generated_tokens == 7


def test_plain_decoding_step_drafts_nothing():
    step = step_from_verify({"running": 2, "k": 0, "wall_s": 0.01, "accepted": [0, 0]}, kmax=3,
                            timer=StepTimer())
    assert (step.drafts, step.draft_tokens, step.accepted_tokens) == (0, 0, 0)
    assert step.generated_tokens == 2


def test_idle_gaps_and_the_steps_after_a_switch_are_not_timed():
    """SGLang's hook times a verify from the one before it: a gap that was idle time is not a
    step, and the first steps after a tier switch carry the switch, as on vLLM."""
    timer = StepTimer()

    def wall(seconds: float) -> float:
        record = {"running": 2, "k": 3, "wall_s": seconds, "accepted": [1, 2]}
        return step_from_verify(record, kmax=7, timer=timer).wall_s

    assert wall(0.02) == 0.02
    assert wall(MAX_STEP_GAP_S + 1) == 0.0
    timer.control_call()
    assert [wall(0.02) for _ in range(SETTLE_STEPS + 1)] == [0.0] * SETTLE_STEPS + [0.02]


def test_a_request_refused_on_admission_is_the_requests_fault_and_a_later_error_is_not():
    """SGLang (and vLLM) check a streamed request when its stream is first read: an error
    there is `EngineInputError` (a 400), one after the first chunk stays the engine's."""
    import asyncio

    from replicas.engines.base import EngineInputError, admitted

    async def stream(fail_at: int):
        for n in range(3):
            if n == fail_at:
                raise ValueError("the prompt and max_new_tokens exceed the context")
            yield n

    async def read(fail_at: int) -> list[int]:
        return [n async for n in admitted(stream(fail_at), (ValueError,))]

    with pytest.raises(EngineInputError, match="exceed the context"):
        asyncio.run(read(0))
    with pytest.raises(ValueError) as later:
        asyncio.run(read(2))
    assert type(later.value) is ValueError
    assert asyncio.run(read(-1)) == [0, 1, 2]


def test_a_reader_that_leaves_early_closes_the_engine_stream_at_once():
    """The engines abort a request when their output generator closes: a reader that stops
    after the first chunk must close it then, not leave it to the garbage collector."""
    import asyncio

    from replicas.engines.base import admitted

    closed: list[int] = []

    async def stream():
        try:
            for n in range(100):
                yield n
        finally:
            closed.append(n)

    async def first_only() -> None:
        engine_stream = stream()
        reader = admitted(engine_stream, (ValueError,))
        assert await anext(reader) == 0
        await reader.aclose()
        assert closed == [0]  # before this coroutine ends, while `engine_stream` is alive

    asyncio.run(first_only())


def test_a_verify_is_timed_from_its_rounds_start_not_from_the_verify_before(monkeypatch):
    """Between two verifies SGLang may sit idle or run prefill batches: a step's time starts
    when the controller asks for the round's steps (when it asks), else at the last verify."""
    import replicas.engines.sglang_hooks as hooks

    clock = iter([0.0, 5.0, 5.25, 6.0]).__next__
    monkeypatch.setattr(hooks.time, "perf_counter", clock)
    published: list[dict] = []
    policy = ExternalTierPolicy([1, 3], 3, SimpleNamespace(publish=published.append))  # at 0
    policy.get_steps_for_batch(4)  # at 5.0: the round starts after 5 s idle
    policy.on_verify_complete([1, 2, 0, 3], 4)  # at 5.25
    policy.on_verify_complete([1, 2, 0, 3], 4)  # at 6.0: no round start seen, from the verify
    assert [record["wall_s"] for record in published] == [0.25, 0.75]
