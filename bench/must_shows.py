"""The README's must-shows table, made from the saved runs: each bar the benchmarks must
show, the numbers that decide it, and a verdict by fixed rules, so that no verdict outlives
the results it was read from.

    python -m bench.must_shows          # write bench/results/must_shows.md
    python -m bench.must_shows --check  # exit 1 if it is out of date

`bench/results/must_shows.json` names the saved runs each HTTP bar pools (`pooled`) and its
latest run (`last`, the file the suite writes); the latest joins the pool unless it is one
of the saved runs already, so a new suite run counts at once. The rules:

- HTTP, overall: an adaptive mode over the best static, round by round over every pooled
  round, as a geometric mean with its 95% interval (`RatioInterval`): met where the interval
  lies above 1.0, missed where it lies below, else not resolved (and then the last run's
  medians say which side it fell on). "The best static" is each static that was the best of
  some pooled run, and the one the mode does worst against is taken: pooled medians mix
  machines of different speeds, so the pool's own best static is no safer a choice.
- HTTP, per phase: the same against 0.9, in every phase (against each phase's best statics).
- Cluster simulation: the ratios of its saved run (`bench.cluster_sim`), met at a fleet size
  where they reach the bar, as the median over the burst patterns where several ran; wall
  time as that run measured it, on the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import RatioInterval, is_static, print_table, ratio
from bench.transition_report import best_static, paired_ratios, pool

RESULTS = Path("bench/results")
MANIFEST = "must_shows.json"
OUTPUT = "must_shows.md"
OVERALL_BAR = 1.0
PHASE_BAR = 0.9
CLUSTER_GAIN_BAR = 1.1  # cluster-aware goodput over the best local-only policy
SWITCH_BAR = 5.0  # `ema`'s switches over the cluster-aware mode's
WALL_BAR_S = 60.0  # the largest fleet, each mode
OUTCOME = {"above": "met", "below": "missed", "not resolved": "not resolved"}


@dataclass(frozen=True)
class Against:
    """A mode's round-by-round ratio to the static it does worst against (see the module)."""

    static: str
    interval: RatioInterval

    def __str__(self) -> str:
        return f"{self.interval} of {self.static}"


def runs_of(bar: dict[str, Any], results: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The bar's saved runs, with its latest run unless it is one of them; and the latest."""
    runs = [json.loads((results / name).read_text()) for name in bar["pooled"]]
    last = json.loads((results / bar["last"]).read_text())
    return (runs if last in runs else [*runs, last]), last


def hardest(runs: list[dict[str, Any]], pooled: dict[str, Any], mode: str,
            phase: str | None = None) -> Against | None:
    """`mode`'s pooled rounds against each static that was the best of some run (overall or
    in `phase`, among the statics every run has), the lowest ratio; None with too few
    rounds for an interval."""
    statics = [m for m in pooled["modes"] if is_static(m)]
    bests = {best_static(run["modes"], statics, phase) for run in runs}
    found = [Against(static, interval) for static in sorted(bests)
             if (interval := RatioInterval.of(
                 paired_ratios(pooled["modes"], [static], mode, phase)))]
    return min(found, key=lambda against: against.interval.mean, default=None)


def last_run_cell(run: dict[str, Any], mode: str) -> str:
    """The latest run alone: `mode` over its best static by medians, overall and in its
    worst phase, and overall round by round."""
    modes = run["modes"]
    statics = [m for m in modes if is_static(m)]
    best = best_static(modes, statics)
    phases = {phase: modes[mode]["phases"][phase] /
              modes[best_static(modes, statics, phase)]["phases"][phase]
              for phase in run["phases"]}
    worst = min(phases, key=phases.__getitem__)
    cell = (f"{ratio(modes[mode]['throughput'], modes[best]['throughput'])}x {best}, "
            f"worst phase {phases[worst]:.3f}x ({worst}), {run['rounds']} rounds")
    interval = RatioInterval.of(paired_ratios(modes, [best], mode))
    return cell + (f"; round by round {interval}" if interval else "")


def http_rows(bar: dict[str, Any], results: Path) -> list[list[str]]:
    """One row per adaptive mode every run of the bar has."""
    runs, last = runs_of(bar, results)
    pooled = pool(runs) if len(runs) > 1 else last
    rows = []
    for mode in (m for m in pooled["modes"] if not is_static(m)):
        overall = hardest(runs, pooled, mode)
        phases = {phase: hardest(runs, pooled, mode, phase) for phase in pooled["phases"]}
        rows.append([f"{bar['bar']}: `{mode}`", last_run_cell(last, mode),
                     pooled_cell(runs, pooled, overall, phases),
                     http_verdict(last, mode, overall, phases)])
    return rows


def pooled_cell(runs: list[dict[str, Any]], pooled: dict[str, Any], overall: Against | None,
                phases: dict[str, Against | None]) -> str:
    if overall is None:
        return "too few rounds for an interval"
    cell = f"{len(runs)} run{'s' if len(runs) > 1 else ''}, {pooled['rounds']} rounds: {overall}"
    measured = {phase: against for phase, against in phases.items() if against}
    if not measured:
        return cell
    worst = min(measured, key=lambda phase: measured[phase].interval.low)
    return f"{cell}; lowest phase {worst}, {measured[worst]}"


def http_verdict(last: dict[str, Any], mode: str, overall: Against | None,
                 phases: dict[str, Against | None]) -> str:
    if overall is None:
        return "not resolved (too few rounds)"
    verdict = f"overall **{OUTCOME[overall.interval.against(OVERALL_BAR)]}**"
    if overall.interval.against(OVERALL_BAR) == "not resolved":
        modes = last["modes"]
        best = best_static(modes, [m for m in modes if is_static(m)])
        side = "met" if modes[mode]["throughput"] >= modes[best]["throughput"] else "missed"
        verdict += f" ({side} by medians in the last run)"
    return verdict + f"; per phase **{phase_outcome(phases)}**"


def phase_outcome(phases: dict[str, Against | None]) -> str:
    """Met when every phase's interval lies above the bar; missed, naming the phases, when
    some lie below it; else not resolved, naming the phases whose intervals cross it."""
    sides = {phase: against.interval.against(PHASE_BAR) if against else "not resolved"
             for phase, against in phases.items()}
    for side in ("below", "not resolved"):
        if named := [phase for phase, s in sides.items() if s == side]:
            return f"{OUTCOME[side]} ({', '.join(named)})"
    return "met"


def by_fleet(runs: dict[str, Any], value: str, places: int = 3) -> str:
    """A verdict value of each fleet size's run, as "1.628x / 1.025x at 8 / 64 replicas"."""
    return " / ".join(f"{run['verdicts'][value]:.{places}f}x" for run in runs.values()) + \
        f" at {' / '.join(runs)} replicas"


def decisive(run: dict[str, Any], value: str) -> float:
    """A fleet size's verdict value: the median over its burst patterns where several ran
    (one pattern's gain can be far from the typical one's), else its one run's."""
    seeds = [verdicts[value] for verdicts in run.get("seed_verdicts", ())]
    return statistics.median(seeds) if len(seeds) > 1 else run["verdicts"][value]


def met_where(runs: dict[str, Any], value: str, bar: float) -> str:
    """The fleet sizes that reach `bar` (see `decisive`), and those that do not."""
    met = [size for size, run in runs.items() if decisive(run, value) >= bar]
    missed = [size for size in runs if size not in met]
    return ", ".join(f"**{outcome}** at {', '.join(sizes)} replicas"
                     for outcome, sizes in (("met", met), ("missed", missed)) if sizes)


def burst_patterns(runs: dict[str, Any]) -> list[str]:
    """The cluster-aware gain over other burst patterns (seeds), where the run has them."""
    cells = []
    for size, run in runs.items():
        for label, part in (("", run), (" over the longer run", run.get("longer", {}))):
            values = [v["cluster_vs_best_local"] for v in part.get("seed_verdicts", ())]
            if len(values) > 1:
                cells.append(f"{len(values)} burst patterns at {size}{label}: median "
                             f"{statistics.median(values):.3f}x "
                             f"({min(values):.3f}-{max(values):.3f})")
    return cells


def cluster_rows(saved: dict[str, Any]) -> list[list[str]]:
    runs = saved["runs"]
    longer = {size: run["longer"] for size, run in runs.items() if "longer" in run}
    gain = "cluster_vs_best_local"
    more, gain_verdict = burst_patterns(runs), f"{met_where(runs, gain, CLUSTER_GAIN_BAR)} " \
        "in the default runs"
    if longer:
        seconds = "/".join(sorted({f"{run['duration_s']:.0f}" for run in longer.values()}))
        more.insert(0, f"{seconds} s of arrivals: {by_fleet(longer, gain)}")
        gain_verdict += f"; over {seconds} s {met_where(longer, gain, CLUSTER_GAIN_BAR)}"
    largest = max(runs, key=int)
    walls = {mode: result["wall_s"] for mode, result in runs[largest]["modes"].items()}
    slowest = max(walls, key=walls.__getitem__)
    under = sum(wall < WALL_BAR_S for wall in walls.values())
    # Simulations share the machine when the run gave each core one (absent from older runs).
    at_once = f", {saved['jobs']} at a time" if "jobs" in saved else ""
    return [
        [f"cluster simulation: cluster-aware goodput >= {CLUSTER_GAIN_BAR}x the best "
         "local-only policy", by_fleet(runs, gain), "; ".join(more) or "-", gain_verdict],
        [f"cluster simulation: `ema` switches >= {SWITCH_BAR:.0f}x the cluster-aware mode's",
         by_fleet(runs, "ema_switches_vs_cluster", 1),
         f"steady window: {by_fleet(runs, 'ema_steady_switches_vs_cluster', 1)}",
         met_where(runs, "ema_switches_vs_cluster", SWITCH_BAR)],
        [f"cluster simulation: {largest} replicas in under a minute of wall time, each mode",
         f"{min(walls.values()):.1f}-{walls[slowest]:.1f} s a mode ({slowest} the slowest)"
         f"{at_once}, on the machine that made the tables", "-",
         f"**{'met' if under == len(walls) else 'missed'}** there "
         f"({under} of {len(walls)} modes under {WALL_BAR_S:.0f} s)"],
    ]


def render(results: Path = RESULTS) -> str:
    manifest = json.loads((results / MANIFEST).read_text())
    rows = [row for bar in manifest["http"] for row in http_rows(bar, results)]
    rows += cluster_rows(json.loads((results / manifest["cluster"]).read_text()))
    return print_table(
        "THE MUST-SHOWS (made by `python -m bench.must_shows` from the saved runs; the rules "
        "in its docstring)",
        ["bar", "the last run", "pooled, round by round", "verdict"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 if {RESULTS / OUTPUT} is not what the saved runs give")
    args = parser.parse_args()
    text = render() + "\n"
    output = RESULTS / OUTPUT
    if args.check:
        sys.exit(0 if output.exists() and output.read_text() == text else 1)
    output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
