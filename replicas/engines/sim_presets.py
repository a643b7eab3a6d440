"""Calibration presets for the SIMULATOR engine (cost model and acceptance per class)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from replicas.engines.base import GenerationRequest


@dataclass(frozen=True)
class Acceptance:
    """How one request class's drafts fare, step by step.

    Prompt-lookup and draft models alike see two regimes: stretches where the continuation is
    already in context (a "copy" step: nearly every draft position is accepted) and free text
    (each next position accepted with `free_rate`). A step is a copy step with probability
    `copy_share`; drafts are accepted position by position until the first miss. One geometric
    rate alone cannot reproduce published acceptance lengths that keep growing up to K=15.
    """

    free_rate: float
    copy_share: float = 0.0
    copy_rate: float = 0.999

    def __post_init__(self) -> None:
        for rate in (self.free_rate, self.copy_rate):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"acceptance rate {rate} outside [0, 1]")

    def mean_run(self, k: int) -> float:
        """Expected drafts accepted per step at depth k: sum over j <= k of P(run >= j)."""
        return sum(self.copy_share * self.copy_rate ** j +
                   (1 - self.copy_share) * self.free_rate ** j for j in range(1, k + 1))


class AcceptanceTable:
    """Request classes' acceptance as arrays, to draw a whole batch's accepted runs at once
    (a Python call per sequence-step would make the draw the simulator's main cost: a cluster
    run draws ~10^7 runs)."""

    def __init__(self, classes: Iterable[Acceptance]):
        self.classes = list(dict.fromkeys(classes))
        self.index = {acceptance: i for i, acceptance in enumerate(self.classes)}
        self._copy_share = np.array([a.copy_share for a in self.classes])
        self._inv_log_copy = np.array([_inverse_log(a.copy_rate) for a in self.classes])
        self._inv_log_free = np.array([_inverse_log(a.free_rate) for a in self.classes])

    def draw(self, rng: np.random.Generator, k: int, classes: np.ndarray) -> np.ndarray:
        """Drafts accepted before the first miss, out of k, for one sequence-step of each
        class index in `classes`: one draw picks the regime, one more the run, by inverting
        P(run >= j) = rate^j."""
        if k == 0:
            return np.zeros(len(classes), np.int64)
        draws = rng.random((2, len(classes)))
        inv_log = np.where(draws[0] < self._copy_share[classes], self._inv_log_copy[classes],
                           self._inv_log_free[classes])
        # 1 - draw lies in (0, 1]; a rate of 1 never misses (a NaN from 0 * -inf too: fmin
        # drops it for k).
        return np.fmin(np.log1p(-draws[1]) * inv_log, k).astype(np.int64)


def _inverse_log(rate: float) -> float:
    """1 / ln(rate): 0 for rate 0 (every run 0), -inf for rate 1 (no run ever misses)."""
    if rate <= 0.0:
        return -0.0
    return 1.0 / math.log(rate) if rate < 1.0 else -math.inf


@dataclass(frozen=True)
class SimPreset:
    """Step time = base + per_seq*B + per_draft*K + per_token*max(0, drafts - knee) (seconds),
    where drafts = B*K unless per-request caps verified fewer.

    `knee` is the number of extra verify tokens the hardware absorbs for free (memory-bound
    regime); beyond it verify cost grows with batch x K (compute-bound regime).
    """

    name: str
    base_s: float
    per_seq_s: float
    per_draft_s: float
    per_token_s: float
    knee_tokens: int = 0
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    """Per request class."""

    def step_seconds(self, batch: int, k: float, drafts: int | None = None) -> float:
        """`drafts`: draft tokens verified, when per-request caps left fewer than B x K (the
        drafter still ran K deep)."""
        if batch == 0:
            return self.base_s
        extra = max(0, (batch * k if drafts is None else drafts) - self.knee_tokens)
        return self.base_s + self.per_seq_s * batch + self.per_draft_s * k + \
            self.per_token_s * extra

    def acceptance_for(self, request: GenerationRequest) -> Acceptance:
        name = request.request_class
        if name not in self.acceptance:  # "low_2" -> "low"
            name = name.split("_")[0]
        if name not in self.acceptance:  # unlabelled: greedy repeats well, sampling does not
            name = "high" if request.temperature <= 0.1 else "low"
        return self.acceptance[name]


PRESETS = {
    # Demo target on vLLM-CPU (ngram, 2 cores): least squares over the median
    # step times by draft tokens per sequence in bench/results/engine_bench.md (batch 1, 8)
    # and engine_bench_ngram_depth.md (batch 8, 32), every point within 14%; acceptance per
    # draft slot from their copy and sampled-free-text workloads (on sampled text prompt
    # lookup fills 7-11% of the slots and 14% of its drafts land).
    "cpu-demo": SimPreset("cpu-demo", base_s=2.26e-3, per_seq_s=2.67e-4, per_draft_s=1.3e-5,
                          per_token_s=7.41e-5, acceptance={"high": Acceptance(0.97),
                                                           "low": Acceptance(0.02)}),
    # H20 / Llama-3.1-8B / NGRAM, least-squares fit to the published static-K transition table
    # (design notes: the 16 per-phase throughputs and the 4 mean acceptance lengths, taken as
    # the mean over phases): verify cost flat up to a knee of 35 extra tokens, then linear;
    # per phase a share of copy steps and a free-text rate (that table's phases differ more
    # than low/high; high_2 copies throughout).
    "h20-llama8b-ngram": SimPreset(
        "h20-llama8b-ngram", base_s=10.73e-3, per_seq_s=0.15e-3, per_draft_s=0.0,
        per_token_s=0.1335e-3, knee_tokens=35,
        acceptance={"low_1": Acceptance(0.434, copy_share=0.059),
                    "high_1": Acceptance(0.515, copy_share=0.033),
                    "low_2": Acceptance(0.739, copy_share=0.067),
                    "high_2": Acceptance(0.999),
                    "low": Acceptance(0.434, copy_share=0.059),
                    "high": Acceptance(0.999)}),
}
