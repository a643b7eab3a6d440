"""`stability`: DSDE-style speculation length from the stability of recent acceptance.

Follows DSDE (arXiv 2509.01083). Per request, over a window of its last N=30 verify steps:
WVIR = weighted variance of the last N/3 signals over the weighted variance of all N
(geometric weights 0.9, newest heaviest; WVIR = 20 when the long variance is below 1e-6);
SF = exp(2 * mean recent signal / T) - 1; the request's length is
ceil((SLmax - SLmin)(1 - WVIR * SF) + SLmin) when WVIR * SF <= 1, else SLmin, where SLmax is
the request's longest accepted run and SLmin = ceil(0.1 SLmax). The batch cap against
stragglers is ceil(mean of the per-request lengths).

Differences, said plainly:
- DSDE's signal is the KL divergence between target and draft distributions; neither vLLM nor
  our simulator exposes draft probabilities, so the signal here is the per-step *rejection
  share* of a request (1 - accepted / drafted): low when drafts land, high when they miss.
- vLLM cannot give each request its own K, so only the batch cap is applied: it becomes the
  replica's K, snapped to the nearest candidate not above it.
- A run at the current depth that accepted every draft is cut off by the depth, not by the
  request: the request might have accepted more. Such a request's SLmax is the next tier up,
  so the policy can climb (with the longest run alone as SLmax, K could only ever fall).
- DSDE never turns speculation off; ours does when the batch's mean acceptance rate over the
  window falls below `off_below` (drafts that rarely land are pure cost). At K=0 nothing is
  measured, so after `probe_interval_steps` there the policy runs the smallest positive tier
  again to see whether drafts land now.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from policies.signals import Decision, RequestAcceptance, Signals
from policies.tiers import neighbour, snap_down


class StabilityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["stability"] = "stability"
    window: int = Field(30, ge=3)
    weight: float = Field(0.9, gt=0, lt=1)
    temperature: float = Field(1.0, gt=0)
    """T in the scale factor (DSDE uses the sampling temperature; 1.0 for greedy traffic)."""
    off_below: float = Field(0.05, ge=0, le=1)
    probe_interval_steps: int = Field(256, ge=1)
    """Engine steps at K=0 before measuring the smallest positive tier again."""


def weighted_variance(values: list[float], weight: float) -> float:
    """Variance with geometric weights, the newest value weighing most."""
    weights = [weight ** (len(values) - 1 - i) for i in range(len(values))]
    total = sum(weights)
    mean = sum(w * v for w, v in zip(weights, values, strict=True)) / total
    return sum(w * (v - mean) ** 2 for w, v in zip(weights, values, strict=True)) / total


def request_length(request: RequestAcceptance, config: StabilityConfig, current: int,
                   next_tier: int) -> int | None:
    """DSDE's per-sequence speculation length, or None without enough history; `next_tier`
    is SLmax for a request whose window holds a run at the `current` depth that accepted
    every draft (cut off by the depth)."""
    pairs = [(a, d) for a, d in zip(request.accepted, request.drafted, strict=True) if d > 0]
    pairs = pairs[-config.window:]
    if len(pairs) < 3:
        return None
    signal = [1 - a / d for a, d in pairs]
    recent = signal[-max(1, config.window // 3):] if len(signal) >= config.window // 3 \
        else signal
    long_var = weighted_variance(signal, config.weight)
    wvir = 20.0 if long_var < 1e-6 else weighted_variance(recent, config.weight) / long_var
    scale = math.exp(2 * (sum(recent) / len(recent)) / config.temperature) - 1
    sl_max = max(1, max(a for a, _ in pairs))
    if any(a >= d == current for a, d in pairs):
        sl_max = max(sl_max, next_tier)
    sl_min = math.ceil(0.1 * sl_max)
    if wvir * scale <= 1:
        return math.ceil((sl_max - sl_min) * (1 - wvir * scale) + sl_min)
    return sl_min


class StabilityPolicy:
    name = "stability"
    reads_requests = True

    def __init__(self, config: StabilityConfig, candidates: tuple[int, ...]):
        self.config = config
        self.candidates = candidates
        self._steps_off = 0  # engine steps at K=0 since the last probe

    def decide(self, signals: Signals) -> Decision:
        current = signals.current_k
        next_tier = neighbour(current, self.candidates, 1)  # current itself at the top
        if current == 0:
            self._steps_off += signals.steps
            if next_tier > 0 and self._steps_off >= self.config.probe_interval_steps:
                self._steps_off = 0
                return Decision(next_tier, "probe: do drafts land again?")
        else:
            self._steps_off = 0
        lengths = [n for r in signals.requests
                   if (n := request_length(r, self.config, current, next_tier))]
        drafted = sum(sum(r.drafted) for r in signals.requests)
        accepted = sum(sum(r.accepted) for r in signals.requests)
        if drafted and accepted / drafted < self.config.off_below:
            return Decision(snap_down(0, self.candidates), "acceptance below the floor",
                            {"acceptance": accepted / drafted})
        if not lengths:
            return Decision(current, "no request history yet")
        cap = math.ceil(sum(lengths) / len(lengths))
        return Decision(snap_down(cap, self.candidates), f"batch cap {cap}",
                        {"cap": float(cap), "requests": float(len(lengths))})
