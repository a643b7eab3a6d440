"""`ema`: SGLang's adaptive speculative decoding policy, same semantics and defaults.

Follows sglang 0.5.23 (`speculative/adaptive_spec_params.py`): batch-size slots (the integer
keys of the config are batch-size lower bounds), each with its candidate steps and its own EMA
of accepted drafts per request (acceptance length - 1). The EMA is seeded at steps - 1, is not
updated while the slot runs 0 steps, and is not reset on a switch. After `warmup_batches`,
every `update_interval` batches: step down while ema <= (previous step - 0.5, or 0.5 when the
previous step is 0) + down_hysteresis, possibly several tiers; otherwise step up while
ema > current - 0.5 + up_hysteresis; from 0 always probe the next tier. An SGLang
`--speculative-adaptive-config` JSON is accepted as is.

Differences: SGLang updates once per verified batch with per-request counts; specserve's
control loop hands over a window of `signals.steps` engine steps with their totals, so the slot
takes `steps` updates with the window's mean (identical when acceptance is steady within a
window of a few steps). As in SGLang, a batch's outcome feeds the slot that set its depth: the
window's steps go to the slot of the previous decision, whose K they ran at, even when the
batch has since moved to another slot. The mean is over every sequence-step run at K > 0,
as SGLang's is over every request of the verified batch: a prompt-lookup sequence without a
match accepts no drafts. The slot is chosen by the engine batch (`concurrency_source: local`,
SGLang's semantics) or by the effective concurrency (ours, the default). Candidates not in the
tier pool are snapped to the nearest tier below.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.signals import Decision, Signals
from policies.tiers import snap_down

# The limits of the settings a slot may override, shared by the global settings and the
# slots' overrides: an override outside them fails as the global setting would (an interval
# of 0 divided by zero at the slot's first update).
EmaAlpha = Annotated[float, Field(gt=0, le=1)]
Batches = Annotated[int, Field(ge=0)]
Interval = Annotated[int, Field(ge=1)]
CeilingCoeff = Annotated[float, Field(ge=0)]


class EmaSlotConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    candidate_steps: list[int] = Field(min_length=1)
    ema_alpha: EmaAlpha | None = None
    warmup_batches: Batches | None = None
    update_interval: Interval | None = None
    down_hysteresis: float | None = None
    up_hysteresis: float | None = None
    ceiling_coeff: CeilingCoeff | None = None


def _sglang_default_slots() -> dict[int, EmaSlotConfig]:
    """SGLang 0.5.23's DEFAULT_ADAPTIVE_CONFIG (larger batches: fewer steps, no hysteresis)."""
    flat = {"up_hysteresis": 0.0, "down_hysteresis": 0.0}
    return {1: EmaSlotConfig(candidate_steps=[1, 3, 5, 7], up_hysteresis=0.0,
                             down_hysteresis=-0.25),
            8: EmaSlotConfig(candidate_steps=[0, 1, 3], **flat),
            32: EmaSlotConfig(candidate_steps=[0, 1], **flat),
            64: EmaSlotConfig(candidate_steps=[0], **flat)}


class EmaConfig(BaseModel):
    """Global settings plus batch-size slots; SGLang's JSON form (digit keys) is accepted."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["ema"] = "ema"
    concurrency_source: Literal["local", "effective"] = "effective"
    ema_alpha: EmaAlpha = 0.2
    warmup_batches: Batches = 10
    update_interval: Interval = 5
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    ceiling_coeff: CeilingCoeff = 0.0
    slots: dict[int, EmaSlotConfig] = Field(default_factory=_sglang_default_slots, min_length=1)
    """Batch-size lower bound -> slot; at least one (every batch size needs a slot)."""

    @model_validator(mode="before")
    @classmethod
    def _from_sglang_json(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        slots = {key: value for key, value in data.items() if str(key).isdigit()}
        if not slots:
            return data
        rest = {key: value for key, value in data.items() if not str(key).isdigit()}
        rest["slots"] = {int(key): ({"candidate_steps": value} if isinstance(value, list)
                                    else value) for key, value in slots.items()}
        return rest


class EmaSlot:
    """One batch-size slot: SGLang's AdaptiveStepSlot."""

    def __init__(self, candidates: list[int], initial_k: int, settings: dict[str, float]):
        self.candidates = candidates
        self.alpha = settings["ema_alpha"]
        self.warmup = int(settings["warmup_batches"])
        self.interval = int(settings["update_interval"])
        self.down = settings["down_hysteresis"]
        self.up = settings["up_hysteresis"]
        self.ceiling_coeff = settings["ceiling_coeff"]
        self.current = (initial_k if initial_k in candidates
                        else candidates[len(candidates) // 2])
        self.ema = float(self.current - 1)
        self.batches = 0

    def update(self, accepted_per_request: float) -> None:
        if self.current > 0:
            self.ema = (1 - self.alpha) * self.ema + self.alpha * accepted_per_request
        self.batches += 1
        if self.batches > self.warmup and (self.batches - self.warmup) % self.interval == 0:
            self.current = self._target()

    def _target(self) -> int:
        index = self.candidates.index(self.current)
        if self.current == 0:  # probe the next tier after a plain-decoding interval
            index = min(index + 1, len(self.candidates) - 1)
            if self.candidates[index] > 0 and self.ema < 0:
                self.ema = float(self.candidates[index] - 1)
            return self.candidates[index]
        start = index
        while index > 0:
            previous = self.candidates[index - 1]
            threshold = (0.5 if previous == 0 else previous - 0.5) + self.down
            if self.ema > threshold:
                break
            index -= 1
        if index == start:
            while (index < len(self.candidates) - 1
                   and self.ema > self.candidates[index] - 0.5 + self.up):
                index += 1
        target = self.candidates[index]
        if self.ceiling_coeff > 0:  # caps only moves that are not step-ups
            ceiling = max(1, math.ceil(self.ema * self.ceiling_coeff))
            if ceiling < target <= self.current:
                while index > 0 and self.candidates[index] > ceiling:
                    index -= 1
                target = self.candidates[index]
        return target


class EmaPolicy:
    reads_requests = False
    needs_requests = False
    decides_on_arrival = False

    def __init__(self, config: EmaConfig, candidates: tuple[int, ...]):
        self.config = config
        globals_ = config.model_dump(exclude={"name", "concurrency_source", "slots"})
        self.bounds = sorted(config.slots)
        self.slots = {}
        for bound, slot in config.slots.items():
            overrides = slot.model_dump(exclude={"candidate_steps"}, exclude_none=True)
            steps = sorted({snap_down(k, candidates) for k in slot.candidate_steps})
            self.slots[bound] = EmaSlot(steps, candidates[-1], {**globals_, **overrides})
        self._ran: EmaSlot | None = None
        """The slot of the last decision: the engine ran its K since."""

    def slot_for(self, batch: int) -> EmaSlot:
        return self.slots[self._bound_for(batch)]

    def _bound_for(self, batch: int) -> int:
        """The batch-size lower bound of the slot that serves `batch`."""
        return max((b for b in self.bounds if b <= batch), default=self.bounds[0])

    def decide(self, signals: Signals) -> Decision:
        batch = max(1, signals.effective_concurrency if self.config.concurrency_source ==
                    "effective" else signals.local_batch)
        bound = self._bound_for(batch)
        slot = self.slots[bound]
        ran = self._ran or slot
        if signals.running:
            mean = (signals.accepted_tokens / signals.drafting_sequence_steps
                    if signals.drafting_sequence_steps else 0.0)
            for _ in range(signals.steps):
                ran.update(mean)
        self._ran = slot
        return Decision(slot.current, f"ema {slot.ema:.2f} in slot {bound} (batch {batch})",
                        {"ema": slot.ema, "batch": float(batch)})
