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
- The batch cap becomes the replica's K, snapped to the nearest candidate not above it. Where
  the engine caps drafts per request (vLLM's synchronous scheduler, the simulator), each
  request whose own length is below that K is capped at it, as in DSDE; elsewhere (vLLM's
  async scheduler) one K serves every request. An engine that reports no per-request
  outcomes (SGLang) gives the policy nothing to judge: the control loop refuses it there.
- A run at the request's depth (K, or its cap) that accepted every draft is cut off by the
  depth, not by the request: it might have accepted more. Such a request's SLmax is the next
  tier up (twice its cap, at most that tier, for a capped one), so the policy can climb
  (with the longest run alone as SLmax, K could only ever fall).
- DSDE never turns speculation off; ours does when the batch's mean acceptance rate over the
  window falls below `off_below` (drafts that rarely land are pure cost). At K=0 nothing is
  measured, so after `probe_interval_steps` there the policy runs the smallest positive tier
  again to see whether drafts land now, at every interval however many probes found nothing:
  this probe is the policy's only way to see a phase change (`goodput` also has its request
  classes' past acceptance), and `goodput`'s backoff, tried here, held it at K=0 through the
  high phases of the cpu-demo transition replay with its stop-40 preset (867.7 -> 645.8
  tok/s).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from policies.signals import REQUEST_WINDOW, Decision, RequestWindows, Signals
from policies.tiers import neighbour, snap_down


class StabilityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["stability"] = "stability"
    window: int = Field(30, ge=3, le=REQUEST_WINDOW)
    """N, the verify steps a request's length is judged over: at most what an engine keeps
    per request (a longer one would silently be that)."""
    weight: float = Field(0.9, gt=0, lt=1)
    temperature: float = Field(1.0, gt=0)
    """T in the scale factor (DSDE uses the sampling temperature; 1.0 for greedy traffic)."""
    off_below: float = Field(0.05, ge=0, le=1)
    probe_interval_steps: int = Field(256, ge=1)
    """Engine steps at K=0 before measuring the smallest positive tier again."""
    draft_caps: bool = True
    """Cap each request below the batch's K at its own length, where the engine can
    (`Signals.draft_caps_apply`); off: the batch cap alone, one K for every request."""


def request_lengths(windows: RequestWindows, config: StabilityConfig, width: int,
                    current: int | np.ndarray, next_tier: int | np.ndarray) -> np.ndarray:
    """DSDE's speculation length per request, 0 for a request with fewer than three drafting
    steps; `next_tier` is SLmax for a request whose window holds a run at the `current` depth
    that accepted every draft (cut off by the depth); each is one depth for every request or
    one per request. A step counts up to `width` drafts, the widest tier
    (`RequestWindows.clipped`). Vectorised over requests: a row holds a request's steps that
    drafted, the last `config.window` of them, right-aligned, so one set of geometric weights
    (newest 1) serves every row."""
    drafted, accepted = windows.clipped(width)
    columns = drafted.shape[1]
    column = np.arange(columns)
    drafting = drafted > 0
    drafting_steps = drafting.sum(axis=1)
    if not (drafting == (column >= columns - drafting_steps[:, None])).all():
        # Move each row's drafting steps to its end, in order (K=0 steps carry no signal).
        order = np.argsort(np.where(drafting, column, -1), axis=1, kind="stable")
        accepted = np.take_along_axis(accepted, order, axis=1)
        drafted = np.take_along_axis(drafted, order, axis=1)
    steps = np.minimum(drafting_steps, config.window)
    recent_steps = np.minimum(steps, config.window // 3)  # the last N/3 (all when fewer)
    kept = column >= columns - steps[:, None]
    recent = column >= columns - recent_steps[:, None]
    signal = 1 - accepted / np.maximum(drafted, 1)  # read only through the masks above
    weights = _newest_heaviest(config.weight, columns)
    long_var, recent_var = _weighted_variance(signal, np.stack((kept, recent)) * weights)
    flat = long_var < 1e-6
    wvir = np.divide(recent_var, long_var, out=np.full_like(long_var, 20.0), where=~flat)
    scale = np.exp(2 * signal.sum(axis=1, where=recent) / np.maximum(recent_steps, 1)
                   / config.temperature) - 1
    sl_max = np.maximum(1, np.max(accepted, axis=1, where=kept, initial=0))
    depth = np.broadcast_to(current, (len(windows),))[:, None]
    cut_off = (kept & (accepted >= drafted) & (drafted == depth)).any(axis=1)
    sl_max = np.where(cut_off, np.maximum(sl_max, next_tier), sl_max)
    sl_min = np.ceil(0.1 * sl_max)
    unstable = wvir * scale
    lengths = np.where(unstable <= 1, np.ceil((sl_max - sl_min) * (1 - unstable) + sl_min),
                       sl_min)
    return np.where(steps >= 3, lengths, 0).astype(np.int64)


@functools.lru_cache(maxsize=16)
def _newest_heaviest(weight: float, columns: int) -> np.ndarray:
    """Geometric weights over right-aligned columns, the newest (last) 1; shared between
    calls, so read-only."""
    weights = weight ** np.arange(columns - 1, -1, -1, dtype=np.float64)
    weights.flags.writeable = False
    return weights


def _weighted_variance(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Along the last axis, the variance of `values` under `weights` (which may stack several
    sets of weights in front); 0 where there is no weight."""
    total = np.maximum(weights.sum(axis=-1), 1e-300)
    mean = (weights * values).sum(axis=-1) / total
    return (weights * (values - mean[..., None]) ** 2).sum(axis=-1) / total


class StabilityPolicy:
    reads_requests = True
    needs_requests = True
    decides_on_arrival = False

    def __init__(self, config: StabilityConfig, candidates: tuple[int, ...]):
        self.config = config
        self.candidates = candidates
        self._steps_off = 0  # engine steps at K=0 since the last probe
        self._caps: dict[str, int] = {}  # the per-request caps the last decision asked for

    def decide(self, signals: Signals) -> Decision:
        decision = self._decide(signals)
        self._caps = decision.draft_caps or {}
        return decision

    def _decide(self, signals: Signals) -> Decision:
        current = signals.current_k
        next_tier = neighbour(current, self.candidates, 1)  # current itself at the top
        if current == 0:
            self._steps_off += signals.steps
            if next_tier > 0 and self._steps_off >= self.config.probe_interval_steps:
                self._steps_off = 0
                return Decision(next_tier, "probe: do drafts land again?")
        else:
            self._steps_off = 0
        requests = signals.requests
        depths = np.array([min(current, self._caps.get(request_id, current))
                           for request_id in requests.request_ids], dtype=np.int64)
        next_depths = np.where(depths < current, np.minimum(2 * depths, next_tier), next_tier)
        lengths = request_lengths(requests, self.config, self.candidates[-1], depths,
                                  next_depths)
        drafted, accepted = (int(counts.sum())
                             for counts in requests.clipped(self.candidates[-1]))
        if drafted and accepted / drafted < self.config.off_below:
            return Decision(snap_down(0, self.candidates), "acceptance below the floor",
                            {"acceptance": accepted / drafted})
        measured = lengths > 0
        if not measured.any():
            return Decision(current, "no request history yet")
        cap = math.ceil(lengths[measured].mean())
        k = snap_down(cap, self.candidates)
        inputs = {"cap": float(cap), "requests": float(measured.sum())}
        if not (signals.draft_caps_apply and self.config.draft_caps):
            return Decision(k, f"batch cap {cap}", inputs)
        caps = {request_id: int(length)
                for request_id, length in zip(requests.request_ids, lengths.tolist(),
                                              strict=True)
                if 0 < length < k}
        inputs["capped_requests"] = float(len(caps))
        return Decision(k, f"batch cap {cap}", inputs, draft_caps=caps)
