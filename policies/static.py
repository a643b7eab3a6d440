"""`static`: one fixed K, what every engine does without adaptive speculation."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from policies.signals import Decision, Signals
from policies.tiers import snap_down


class StaticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["static"] = "static"
    k: int = Field(3, ge=0)


class StaticPolicy:
    reads_requests = False
    needs_requests = False
    decides_on_arrival = False

    def __init__(self, config: StaticConfig, candidates: tuple[int, ...]):
        self.k = snap_down(config.k, candidates)

    def decide(self, signals: Signals) -> Decision:
        return Decision(self.k, "static")
