"""The SGLang adapter's engine-independent part (SGLang itself needs a GPU: not run here)."""

from replicas.engines.sglang_engine import step_from_verify


def test_verify_record_becomes_unbiased_step_record():
    step = step_from_verify({"running": 3, "k": 3, "wall_s": 0.02, "accepted": [3, 0, 1]},
                            kmax=7)
    assert (step.drafts, step.draft_tokens, step.accepted_tokens) == (3, 9, 4)
    assert step.accepted_per_pos == (2, 1, 1, 0, 0, 0, 0)
    assert step.drafted_per_pos == (3, 3, 3, 0, 0, 0, 0)
    assert step.generated_tokens == 7


def test_plain_decoding_step_drafts_nothing():
    step = step_from_verify({"running": 2, "k": 0, "wall_s": 0.01, "accepted": [0, 0]}, kmax=3)
    assert (step.drafts, step.draft_tokens, step.accepted_tokens) == (0, 0, 0)
    assert step.generated_tokens == 2
