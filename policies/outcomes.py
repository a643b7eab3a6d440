"""Per-request verify outcomes counted by draft position.

Both readers of `RequestWindows` count the same thing, per group of requests (a request, a
request class): at each draft position k, the steps that drafted it and the steps that landed
it. A decision or a telemetry period reads a whole batch's windows (64 x 30 outcomes), and the
cluster simulation reads millions of them, so the counting is vectorised.
"""

from __future__ import annotations

import numpy as np

from policies.signals import RequestWindows


def position_counts(windows: RequestWindows, group: np.ndarray, groups: int, width: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """([group, k], [group, k]) for k < `width`: the steps of each group's requests that
    drafted position k, and those that landed it (`group`: each request's group, < `groups`).
    Drafts beyond `width` are not counted."""
    depth = np.minimum(windows.drafted, width)
    landed = np.minimum(windows.accepted, depth)
    owner = np.repeat(group, depth.shape[1])  # rows are contiguous in a C-order ravel
    return (reaching(owner, depth.ravel(), groups, width),
            reaching(owner, landed.ravel(), groups, width))


def reaching(groups: np.ndarray, values: np.ndarray, count: int, width: int) -> np.ndarray:
    """[group, k] for k < width: how many of a group's steps have a value of at least k + 1
    (with drafts offered: steps that drafted position k; with drafts accepted: that landed it)."""
    counts = np.bincount(groups * (width + 1) + values, minlength=count * (width + 1))
    return np.cumsum(counts.reshape(-1, width + 1)[:, :0:-1], axis=1)[:, ::-1]
