"""`static`: one fixed K, what every engine does without adaptive speculation."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from policies.signals import Decision, Signals


class StaticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["static"] = "static"
    k: int = Field(3, ge=0)


class StaticPolicy:
    reads_requests = False
    needs_requests = False
    decides_on_arrival = False

    def __init__(self, config: StaticConfig, candidates: tuple[int, ...]):
        # Refused, not rounded to a neighbour: a static policy promises its one K.
        if config.k not in candidates:
            raise ValueError(f"static K={config.k} is not one of the candidate tiers "
                             f"{list(candidates)}; choose one of them, or send new "
                             "candidates with it")
        self.k = config.k

    def decide(self, signals: Signals) -> Decision:
        return Decision(self.k, "static")
