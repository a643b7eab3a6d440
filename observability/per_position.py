"""Per-position counts (entry k: draft position k), summed position by position.

Here because it is the lowest package every user may import: the replicas' metrics, and the
telemetry hub's fleet sums. (The engines' `add_per_position` differs on purpose: it adds only
up to the length of its totals, which are sized to the tiers in use.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

N = TypeVar("N", int, float)


def accumulate(totals: list[N], values: Sequence[N], sign: int = 1) -> None:
    """totals += sign * values, position by position, growing `totals` as needed."""
    totals.extend([0] * (len(values) - len(totals)))
    for i, value in enumerate(values):
        totals[i] += sign * value
