"""Per-request verify outcomes as arrays, counted by draft position.

Both readers of `RequestAcceptance` windows count the same thing, per group of steps (a
request, a request class): at each draft position k, the steps that drafted it and the steps
that landed it. A decision or a telemetry period reads a whole batch's windows (64 x 30
outcomes), and the cluster simulation reads millions of them, so the counting is vectorised.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from policies.signals import RequestAcceptance


def flatten(windows: Sequence[RequestAcceptance], width: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(owner, depth, accepted) per step of all `windows`: the window's index, the drafts it
    offered (at most `width`) and those accepted (at most the depth)."""
    owner = np.repeat(np.arange(len(windows)), [len(w.accepted) for w in windows])
    depth = np.minimum(np.fromiter(chain.from_iterable(w.drafted for w in windows), np.int64,
                                   len(owner)), width)
    accepted = np.minimum(np.fromiter(chain.from_iterable(w.accepted for w in windows),
                                      np.int64, len(owner)), depth)
    return owner, depth, accepted


def reaching(groups: np.ndarray, values: np.ndarray, count: int, width: int) -> np.ndarray:
    """[group, k] for k < width: how many of a group's steps have a value of at least k + 1
    (with drafts offered: steps that drafted position k; with drafts accepted: that landed it)."""
    counts = np.bincount(groups * (width + 1) + values, minlength=count * (width + 1))
    return np.cumsum(counts.reshape(-1, width + 1)[:, :0:-1], axis=1)[:, ::-1]
