"""Table helpers shared by the benchmarks: markdown tables, adaptive-vs-static verdicts, and
the confidence interval of a ratio measured round by round."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Within this relative difference two modes are "on par" when a single measurement is all
# there is (one round, or a deterministic simulation).
PAR_BAND = 0.03
# Student's t, two-sided 95%, by degrees of freedom 1-30: a handful of rounds gives far less
# certainty than the normal's 1.96 would claim (2.57 for six rounds).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile by nearest rank (the smallest value with at least q% of them at or
    below it), None when there are none: the benchmarks' p99 latencies and gaps."""
    if not values:
        return None
    ordered = sorted(values)
    # Rank ceil(q% of n), 1-based; q * n first, so a whole rank is not pushed up by rounding.
    rank = math.ceil(q * len(ordered) / 100)
    return ordered[min(len(ordered), max(1, rank)) - 1]


def quotient(value: float, base: float) -> float:
    """`value / base`, nan where the base is 0 (a mode that made nothing, or none that met
    the SLO), so one such mode cannot lose the others' results."""
    return value / base if base else math.nan


def ratio(value: float, base: float) -> str:
    """`value / base` to three places; "n/a" where the base made nothing."""
    return number(quotient(value, base), 3)


def number(value: float | None, places: int = 2) -> str:
    """`value` to `places` places; "n/a" for None (not measured) and nan (no base)."""
    return "n/a" if value is None or math.isnan(value) else f"{value:.{places}f}"


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A titled markdown table (returned, so callers can print it and save it)."""
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def is_static(mode: str) -> bool:
    return mode.startswith("static")


def compare_to_statics(throughputs: dict[str, float]) -> list[tuple[str, str, float]]:
    """(adaptive mode, static mode, relative delta) for every adaptive/static pair."""
    statics = {m: t for m, t in throughputs.items() if is_static(m)}
    return [(mode, static, value / base - 1)
            for mode, value in throughputs.items() if not is_static(mode)
            for static, base in statics.items() if base > 0]


def verdict(delta: float) -> str:
    """From a single measurement of `a / b - 1` (see `PAR_BAND`)."""
    if delta > PAR_BAND:
        return "better"
    if delta < -PAR_BAND:
        return "worse"
    return "on par"


def t_975(degrees_of_freedom: int) -> float:
    if degrees_of_freedom < 1:
        raise ValueError("an interval needs at least two samples")
    if degrees_of_freedom <= len(T_975):
        return T_975[degrees_of_freedom - 1]
    # The Cornish-Fisher expansion of t about the normal's z = 1.959964, to 1/df^3: the
    # coefficients (z^3 + z)/4, (5z^5 + 16z^3 + 3z)/96, (3z^7 + 19z^5 + 17z^3 - 15z)/384.
    # 2.03951 at 31 (the true value 2.03951); within 2e-6 of it from there on.
    df = degrees_of_freedom
    return 1.959964 + 2.372271 / df + 2.822499 / df ** 2 + 2.555850 / df ** 3


@dataclass(frozen=True)
class RatioInterval:
    """The geometric mean of paired ratios and its 95% confidence interval, a t interval on
    the ratios' logs. Logs, because a ratio of 0.8 and one of 1.25 are the same distance from
    parity. The pairs are rounds in the HTTP benchmarks (a mode over another in the same
    round) and burst patterns in the cluster simulation."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, ratios: Sequence[float]) -> RatioInterval | None:
        """None for fewer than two ratios, or where a mode made nothing in some round (a
        ratio of 0 has no log, nor one of nan, from a base of 0; the report's medians show
        that round)."""
        if len(ratios) < 2 or not all(r > 0 for r in ratios):  # nan too
            return None
        return cls._of_logs([math.log(r) for r in ratios])

    @classmethod
    def over_groups(cls, groups: Sequence[Sequence[float]]) -> RatioInterval | None:
        """The same with each group's geometric mean as one sample, whatever its size: for
        groups whose ratios may share a level (the rounds of one app start, on one machine),
        which `of` would count as independent. With two groups the t quantile is 12.7, so
        such an interval resolves little. None for fewer than two groups, an empty group, or
        a ratio `of` refuses."""
        if len(groups) < 2 or not all(groups) or \
                not all(r > 0 for group in groups for r in group):
            return None
        return cls._of_logs([statistics.fmean(math.log(r) for r in group) for group in groups])

    @classmethod
    def _of_logs(cls, logs: list[float]) -> RatioInterval:
        centre = statistics.fmean(logs)
        half = t_975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        return cls(math.exp(centre), math.exp(centre - half), math.exp(centre + half))

    def against(self, bar: float) -> str:
        """Whether the rounds show the mean ratio above `bar`, below it, or neither."""
        if self.low > bar:
            return "above"
        if self.high < bar:
            return "below"
        return "not resolved"

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}-{self.high:.3f}]"


def interval_verdict(interval: RatioInterval) -> str:
    """`verdict` from rounds: better or worse only where the 95% interval of the paired
    ratio excludes parity, on par where it holds it."""
    return {"above": "better", "below": "worse", "not resolved": "on par"}[interval.against(1.0)]
