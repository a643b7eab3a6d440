"""The draft model's greedy agreement with the target: what the simulator's draft-model preset
replays is what the shipped models do."""

from __future__ import annotations

import json

import pytest

from bench.greedy_agreement import agreements, report
from replicas.engines.sim_presets import DEMO_DRAFT_AGREEMENT, step_runs


def test_the_shipped_agreement_is_what_the_models_give_and_its_depths_follow_from_it():
    """The first 64 positions of each prompt, measured afresh from the demo models, match the
    agreement the preset replays (all but a rare tie of float arithmetic); and the per-depth
    numbers stored beside each string are its step process's."""
    shipped = json.loads(DEMO_DRAFT_AGREEMENT.read_text())
    fresh = agreements(max_tokens=64)
    assert len(fresh) == len(shipped) == 8
    for now, saved in zip(fresh, shipped, strict=True):
        differing = sum(a != b for a, b in zip(now.agreement, saved["agreement"], strict=False))
        assert len(now.agreement) == 64 and differing <= 1, now.prompt
        for k, tokens in saved["tokens_per_step"].items():
            runs = step_runs(saved["agreement"], int(k))
            assert tokens == pytest.approx(1 + sum(runs) / len(runs))
    table = report(fresh)
    assert table.count("\n| ") == 2 + len(fresh) and "| all (steps pooled) |" in table
