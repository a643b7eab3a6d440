"""Per-request verify outcomes counted by draft position.

Both readers of `RequestWindows` count the same thing, per group of requests (a request, a
request class): at each draft position k, the steps that drafted it and the steps that landed
it. A decision or a telemetry period reads a whole batch's windows (64 x 30 outcomes), and the
cluster simulation reads millions of them, so the counting is vectorised.
"""

from __future__ import annotations

import numpy as np


def position_counts(drafted: np.ndarray, landed: np.ndarray, group: np.ndarray, groups: int,
                    width: int) -> tuple[np.ndarray, np.ndarray]:
    """([group, k], [group, k]) for k < `width`: the steps of each group's requests that
    drafted position k, and those that landed it, from `RequestWindows.clipped(width)` rows
    (`group`: each row's group, < `groups`)."""
    # One histogram of values 0..width per group, drafted counts first, then landed ones.
    bins = np.repeat(group * (width + 1), drafted.shape[1])  # rows are contiguous in a ravel
    histogram = np.bincount(
        np.concatenate((bins + drafted.ravel(), bins + landed.ravel() + groups * (width + 1))),
        minlength=2 * groups * (width + 1)).reshape(2, groups, width + 1)
    counts = reaching(histogram)
    return counts[0], counts[1]


def survival_counts(drafted: np.ndarray, landed: np.ndarray, width: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """([row, k], [row, k]) for k < `width`, one row per request: the steps that drafted
    position k having landed every position before it (at risk at k), and those that landed
    position k. Their ratio is the conditional rate at k, the evidence a step gives about
    each position: a step that landed nothing says nothing about position 3, and one that
    landed all of its k drafts says nothing about position k."""
    rows = drafted.shape[0]
    reach, beyond = position_counts(drafted, landed, np.arange(rows), rows, width)
    # Steps that landed all of exactly v drafts, per row and v (v = 0: no draft at all).
    bins = np.arange(rows)[:, None] * (width + 1) + drafted
    whole = np.bincount(bins[landed == drafted], minlength=rows * (width + 1)
                        ).reshape(rows, width + 1)
    at_risk = reach.copy()
    at_risk[:, 1:] = beyond[:, :-1] - whole[:, 1:width]
    return at_risk, beyond


def reaching(histogram: np.ndarray) -> np.ndarray:
    """From counts of values 0..width along the last axis, how many values are at least k + 1
    for k < width (of drafts offered: steps that drafted position k; of drafts accepted:
    steps that landed it)."""
    # np.add.accumulate, not the cumsum method: the same sums, with less call overhead (the
    # simulator engine counts two small histograms a step).
    return np.add.accumulate(histogram[..., :0:-1], axis=-1)[..., ::-1]
