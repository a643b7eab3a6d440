"""How much a serving machine's step times scatter, read from the engine replicas' decision
logs: the `--step-jitter` and `--step-drift` to replay the policies with on the simulator.

    python -m bench.step_scatter /tmp/ray/session_latest/logs/serve/replica_*EngineReplica*.log

The replicas must log their decisions at DEBUG (the README's "Why a replica chose its K")
while `goodput` serves a steady load, e.g. `python -m bench.transition --modes goodput
--rounds 2`. Each decision logs its window's mean step time (`step_ms_measured`, over about
`decide_every_steps` steps) beside the policy's prediction for the tier in force
(`step_ms_current`). Per replica, tier and batch, the log ratio of the two scatters; from
its variance and its correlation between consecutive windows of the same tier and batch,
the scatter splits into a part drawn afresh each step (`jitter`) and a slow part that
carries over from step to step as the simulator's drift does (`DRIFT_CORRELATION` a step):

    var(window) = drift^2 + jitter^2 / steps
    corr(one window, the next) = DRIFT_CORRELATION^steps * drift^2 / var(window)
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from bench.cli import positive
from bench.report import print_table
from replicas.engines.sim_engine import DRIFT_CORRELATION

DECISION = re.compile(r"-- decision K=(\d+) -> \d+: ")
# The decision's inputs this reads, each a plain number in the logged dict.
FIELDS = {name: re.compile(rf"'{name}': ([-+0-9.eE]+)")
          for name in ("batch", "step_ms_measured", "step_ms_current")}
# A tier and batch with fewer windows than this says little about its scatter.
MIN_WINDOWS = 20


@dataclass
class Windows:
    """One replica's decision windows at one tier and batch size."""

    ratios: list[float] = field(default_factory=list)
    """log(measured / predicted) per window, in order."""
    pairs: list[tuple[float, float]] = field(default_factory=list)
    """(window, the next decision's window) where the next was at the same tier and batch."""


def read_windows(sources: dict[str, Iterable[str]]) -> dict[tuple[str, int, int], Windows]:
    """Per (source, K, batch), the decision windows that measured their step time."""
    groups: dict[tuple[str, int, int], Windows] = {}
    for source, lines in sources.items():
        previous: tuple[tuple[str, int, int], float] | None = None
        for line in lines:
            match = DECISION.search(line)
            if match is None:
                continue
            inputs = {name: float(found.group(1)) for name, field_re in FIELDS.items()
                      if (found := field_re.search(line, match.end()))}
            if len(inputs) < len(FIELDS):
                previous = None  # a window without timed steps breaks the sequence
                continue
            key = (source, int(match.group(1)), int(inputs["batch"]))
            ratio = math.log(inputs["step_ms_measured"] / inputs["step_ms_current"])
            group = groups.setdefault(key, Windows())
            group.ratios.append(ratio)
            if previous is not None and previous[0] == key:
                group.pairs.append((previous[1], ratio))
            previous = key, ratio
    return groups


def split(variance: float, correlation: float, steps: int) -> tuple[float, float]:
    """(jitter, drift): the per-step log sds whose `steps`-step windows have this variance
    and this correlation from one window to the next (see the module docstring)."""
    drift_var = min(variance, max(0.0, correlation * variance / DRIFT_CORRELATION ** steps))
    return math.sqrt(steps * (variance - drift_var)), math.sqrt(drift_var)


def summarise(groups: dict[tuple[str, int, int], Windows], steps: int
              ) -> tuple[list[list[str]], tuple[float, float] | None]:
    """Table rows per (source, K, batch) with enough windows, and the (jitter, drift) of all
    of them pooled (window-weighted variance and correlation); None without any."""
    rows, weights, variances, correlations = [], [], [], []
    for (source, k, batch), group in sorted(groups.items()):
        if len(group.ratios) < MIN_WINDOWS or len(group.pairs) < 2:
            continue
        variance = statistics.variance(group.ratios)
        first, second = zip(*group.pairs, strict=True)
        correlation = statistics.correlation(first, second) \
            if len(set(first)) > 1 and len(set(second)) > 1 else 0.0
        jitter, drift = split(variance, correlation, steps)
        rows.append([source, str(k), str(batch), str(len(group.ratios)),
                     f"{math.sqrt(variance):.3f}", f"{correlation:.2f}", f"{jitter:.2f}",
                     f"{drift:.2f}"])
        weights.append(len(group.ratios))
        variances.append(variance)
        correlations.append(correlation)
    if not weights:
        return rows, None
    total = sum(weights)
    pooled_variance = sum(w * v for w, v in zip(weights, variances, strict=True)) / total
    pooled_correlation = sum(w * c for w, c in zip(weights, correlations, strict=True)) / total
    return rows, split(pooled_variance, pooled_correlation, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path, help="engine replicas' log files")
    parser.add_argument("--steps", type=positive, default=4,
                        help="steps a decision window holds (the app's decide_every_steps)")
    args = parser.parse_args()
    missing = [str(path) for path in args.logs if not path.is_file()]
    if missing:
        parser.error(f"no such log file: {', '.join(missing)}")
    groups = read_windows({path.name: path.read_text().splitlines() for path in args.logs})
    rows, pooled = summarise(groups, args.steps)
    if pooled is None:
        parser.error(f"no tier and batch with {MIN_WINDOWS} timed decision windows in these "
                     "logs: are the replicas logging at DEBUG, and did goodput serve?")
    print(print_table("STEP-TIME SCATTER PER REPLICA, TIER AND BATCH (log ratio of a decision "
                      "window's mean step time to the policy's prediction)",
                      ["log", "K", "batch", "windows", "log sd", "corr next", "jitter",
                       "drift"], rows))
    jitter, drift = pooled
    print(f"\npooled: --step-jitter {jitter:.2f} --step-drift {drift:.2f}")


if __name__ == "__main__":
    main()
