"""Table helpers shared by the benchmarks: markdown tables and adaptive-vs-static verdicts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Within this relative difference two modes are "on par": run-to-run noise on this machine.
PAR_BAND = 0.03


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
    if delta > PAR_BAND:
        return "better"
    if delta < -PAR_BAND:
        return "worse"
    return "on par"
