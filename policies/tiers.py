"""Small helpers every policy shares: mapping a wanted K onto the candidate tiers."""

from __future__ import annotations


def snap_down(k: int, candidates: tuple[int, ...]) -> int:
    """The largest candidate not above `k` (the smallest candidate if all are above)."""
    return max((c for c in candidates if c <= k), default=candidates[0])


def neighbour(k: int, candidates: tuple[int, ...], step: int) -> int:
    """The candidate `step` places above (+) or below (-) `snap_down(k)`, the largest
    candidate not above `k`; clamped to the first and last candidates."""
    index = candidates.index(snap_down(k, candidates))
    return candidates[min(len(candidates) - 1, max(0, index + step))]
