"""The adaptive tier pool: candidate K values prepared at start-up, switched between steps.

A tier is one candidate K together with the engine state prepared for it. The engine is built
once for the largest candidate (`kmax`): on vLLM that sizes the drafter and the verify buffers
for every K up to kmax, so moving between candidates is a change of one scheduler value between
two steps, never a rebuild or a re-allocation.

On GPUs, vLLM captures CUDA graphs only for the verify lengths its dynamic-SD table names at
start-up. The engine spec's `tiers` carries the candidate list into that table (one row per
candidate, see `vllm_engine.start_up_schedule`), so every tier has its graphs before the first
request; vLLM's V1 runner uses piecewise graphs under dynamic SD, which cover any K.
"""

from __future__ import annotations

import asyncio
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass

from policies.tiers import snap_down
from replicas.engines.base import Engine


def validate_candidates(candidates: Sequence[int], kmax: int, initial_k: int | None = None
                        ) -> tuple[int, ...]:
    """Candidates must be a list of integers, sorted, unique, >= 0 and <= the engine's kmax;
    `initial_k`, when given, one of them. Nothing is coerced: the admin route hands on a
    client's JSON, where "0137" or [0, 1.9, "3"] is a mistake, not a tier list."""
    if not isinstance(candidates, list | tuple) or not all(map(_is_integer, candidates)):
        raise ValueError(f"candidate K values must be a list of integers, got {candidates!r}")
    if initial_k is not None and not _is_integer(initial_k):
        raise ValueError(f"initial_k must be an integer, got {initial_k!r}")
    values = tuple(int(k) for k in candidates)
    if not values:
        raise ValueError("candidate K list is empty")
    if any(k < 0 for k in values):
        raise ValueError(f"candidate K values must be >= 0, got {list(values)}")
    if list(values) != sorted(set(values)):
        raise ValueError(f"candidate K values must be sorted and unique, got {list(values)}")
    if values[-1] > kmax:
        raise ValueError(
            f"candidate K {values[-1]} exceeds the engine's kmax {kmax}; "
            "raise num_speculative_tokens or drop the candidate")
    if initial_k is not None and initial_k not in values:
        raise ValueError(f"initial_k {initial_k} is not one of {list(values)}")
    return values


def _is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class TierSwitch:
    from_k: int
    to_k: int
    seconds: float
    """Wall time of the swap as seen by the replica (one engine utility call on vLLM)."""


class TierPool:
    def __init__(self, engine: Engine, candidates: Sequence[int], initial_k: int | None = None):
        self._engine = engine
        self.candidates = self._runnable(validate_candidates(candidates, engine.kmax))
        self.active_k = self.candidates[-1] if initial_k is None else self._checked(initial_k)
        self.switch_count = 0
        # The control loop and a run-time reconfiguration both switch: one at a time, so
        # `active_k` is always the tier the engine was last set to.
        self._lock = asyncio.Lock()

    def _runnable(self, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """`candidates`, if the engine can run each: one that prepares its tiers at start-up
        (`Engine.prepared_tiers`) runs no other."""
        prepared = getattr(self._engine, "prepared_tiers", None)
        unprepared = [k for k in candidates if prepared is not None and k not in prepared]
        if unprepared:
            raise ValueError(f"candidate K {unprepared} was not prepared when the "
                             f"{self._engine.name} engine started, which runs only "
                             f"{list(prepared)}; restart it with them among the candidates")
        return candidates

    def _checked(self, k: int) -> int:
        if k not in self.candidates:
            raise ValueError(f"K={k} is not a candidate tier {list(self.candidates)}")
        return k

    async def apply_initial(self) -> None:
        """Put the engine on the active tier (once, after the engine started)."""
        await self._engine.set_k(self.active_k)

    async def switch(self, k: int) -> TierSwitch | None:
        """Make `k` the active tier from the next engine step on; None when already active."""
        async with self._lock:
            return await self._switch(k)

    async def _switch(self, k: int) -> TierSwitch | None:
        k = self._checked(k)
        if k == self.active_k:
            return None
        started = time.perf_counter()
        await self._engine.set_k(k)
        seconds = time.perf_counter() - started
        change = TierSwitch(self.active_k, k, seconds)
        self.active_k = k
        self.switch_count += 1
        return change

    async def set_candidates(self, candidates: Sequence[int], initial_k: int | None = None
                             ) -> TierSwitch | None:
        """Replace the candidate list at run time (within the engine's kmax, so no rebuild).
        Checked in full before anything changes: a bad list leaves the pool as it was."""
        candidates = self._runnable(validate_candidates(candidates, self._engine.kmax,
                                                        initial_k))
        async with self._lock:
            if initial_k is not None:
                target = initial_k
            elif self.active_k in candidates:
                target = self.active_k
            else:  # the nearest candidate not above the old K, else the smallest
                target = snap_down(self.active_k, candidates)
            previous, self.candidates = self.candidates, candidates
            try:
                return await self._switch(target)
            except BaseException:  # the engine refused the tier: the pool stays as it was
                self.candidates = previous
                raise
