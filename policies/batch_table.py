"""`batch_table`: K looked up from concurrency, in vLLM's `num_speculative_tokens_per_batch_size`.

The table is vLLM's list of `[start_bs, end_bs, K]` rows, accepted as is: ranges must not
overlap and the first starts at 1; a gap inherits the previous row's K, and so does everything
beyond the last row. vLLM looks the table up with the number of requests scheduled in a step
(`concurrency_source: local`); our default looks it up with the replica's effective concurrency
(running + waiting + routed-not-admitted), which sees a burst before the engine's batch grows.
The K found is snapped to the nearest candidate tier not above it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policies.signals import Decision, Signals
from policies.tiers import snap_down


class BatchTableConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["batch_table"] = "batch_table"
    concurrency_source: Literal["local", "effective"] = "effective"
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] = Field(
        default_factory=lambda: [(1, 4, 7), (5, 16, 3), (17, 32, 1), (33, 1024, 0)])

    @field_validator("num_speculative_tokens_per_batch_size")
    @classmethod
    def _vllm_rules(cls, rows: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        if not rows:
            raise ValueError("the table needs at least one [start_bs, end_bs, K] row")
        if rows[0][0] != 1:
            raise ValueError("the first range must start at batch size 1")
        previous_end = 0
        for start, end, k in rows:
            if start > end or k < 0:
                raise ValueError(f"bad row {[start, end, k]}: need start <= end and K >= 0")
            if start <= previous_end:
                raise ValueError(f"row {[start, end, k]} overlaps the previous range")
            previous_end = end
        return rows


def lookup(rows: list[tuple[int, int, int]], batch: int) -> int:
    """vLLM's dense-table semantics: the row holding `batch`, else the last row before it."""
    k = rows[0][2]
    for start, _end, row_k in rows:
        if batch < start:
            break
        k = row_k
    return k


class BatchTablePolicy:
    reads_requests = False
    needs_requests = False
    decides_on_arrival = False

    def __init__(self, config: BatchTableConfig, candidates: tuple[int, ...]):
        self.config = config
        self.candidates = candidates

    def decide(self, signals: Signals) -> Decision:
        batch = (signals.effective_concurrency if self.config.concurrency_source == "effective"
                 else signals.local_batch)
        k = snap_down(lookup(self.config.num_speculative_tokens_per_batch_size, max(1, batch)),
                      self.candidates)
        return Decision(k, f"table at batch {batch}", {"batch": float(batch)})
