"""The README's must-shows table, made from the saved runs: each bar the benchmarks must
show, the numbers that decide it, and a verdict by fixed rules, so that no verdict outlives
the results it was read from.

    python -m bench.must_shows          # write bench/results/must_shows{,_runs}.md
    python -m bench.must_shows --check  # exit 1 if either is out of date

`bench/results/must_shows.json` names the saved runs each HTTP bar pools (`pooled`) and its
latest run (`last`, the file the suite writes); the latest joins the pool unless it is one
of the saved runs already, so a new suite run counts at once. A bar may also name the runs
of the code as it stands (`current`: `since`, what changed, and its `pooled` runs; the
latest joins them too): older runs measured an older policy, so those rounds get rows of
their own, judged by the same rules, next to the rows of every run. `must_shows_runs.md`
has each HTTP bar's runs one row each, as each run alone measured them. The rules:

- HTTP, overall: an adaptive mode over the best static, round by round over every pooled
  round, as a geometric mean with its 95% interval (`RatioInterval`), and run by run (each
  run's geometric mean one sample: the rounds of one app start on one machine may share a
  level, which the rounds' interval would count as independent evidence), against every
  static the runs have: which one is best is itself measured with noise (pooled medians
  mix machines of different speeds, and a static best by medians need not be best by the
  rounds' ratios), and the bar holds only where it holds against each (an
  intersection-union test, so no correction for the several comparisons). Above the bar
  against a static where both intervals lie above it (the rounds' alone where there is no
  interval by runs: a single run, or a single run with rounds against it, a round where
  the static made nothing having no ratio), below it where both lie below (two runs give
  an interval by runs that resolves little: its t quantile is 12.7); met where above
  against every static, missed where below against any, else not resolved (and then the
  last run's medians say on which side it fell).
- HTTP, per phase: the same against 0.9 in every phase.
- Cluster simulation: the ratios of its saved run (`bench.cluster_sim`), met at a fleet size
  where they reach the bar, as the median over the burst patterns where several ran; wall
  time as that run measured it, on the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import RatioInterval, is_static, number, print_table, quotient
from bench.transition_report import best_static, over_best_static, paired_ratios, pool

RESULTS = Path("bench/results")
MANIFEST = "must_shows.json"
OUTPUT = "must_shows.md"
RUNS_OUTPUT = "must_shows_runs.md"
# The suite's adaptive modes, the runs table's columns: a variant some older run ran beside
# them (`goodput_classless`, say) is no bar.
SUITE_ADAPTIVE = ("goodput", "ema")
OVERALL_BAR = 1.0
PHASE_BAR = 0.9
CLUSTER_GAIN_BAR = 1.1  # cluster-aware goodput over the best local-only policy
SWITCH_BAR = 5.0  # `ema`'s switches over the cluster-aware mode's
WALL_FLEET = "512"  # the fleet that must run each mode in under WALL_BAR_S of wall time
WALL_BAR_S = 60.0
OUTCOME = {"above": "met", "below": "missed", "not resolved": "not resolved"}


@dataclass(frozen=True)
class Judged:
    """A mode's pooled rounds against every static (see `judge`): the outcome at `bar`, and
    the static that decides it with its round-by-round interval and its run-by-run one
    (None for a single run with rounds against it)."""

    outcome: str
    """"above", "below" or "not resolved"; "no interval" with fewer than two rounds with a
    ratio (a round where the static made nothing has none) or a round in which the mode
    made nothing."""
    static: str
    interval: RatioInterval | None
    by_runs: RatioInterval | None = None

    def __str__(self) -> str:
        runs = f" (by runs [{self.by_runs.low:.3f}-{self.by_runs.high:.3f}])" \
            if self.by_runs else ""
        return f"{self.interval or 'n/a'}{runs} of {self.static}"


def with_latest(runs: list[dict[str, Any]], last: dict[str, Any]) -> list[dict[str, Any]]:
    """The saved runs with the latest unless it equals one of them (the suite rewrites the
    latest; a copy saved under another name is the same run)."""
    return runs if last in runs else [*runs, last]


def judge(runs: list[dict[str, Any]], pooled: dict[str, Any], mode: str, bar: float,
          phase: str | None = None) -> Judged:
    """`mode`'s pooled rounds (overall, or in `phase`) against every static every run has, by
    rounds and by runs: above `bar` only if above it against every one, below it if below
    against any, else not resolved. The static shown decides: one it lies below (the
    lowest), else one it is not above, else any; among those, the one it leads least (by
    the rounds' mean: an interval by few runs can be wide against a static far behind). A
    static that made nothing in every pooled round is no contender and is passed over."""
    statics = sorted(m for m in pooled["modes"] if is_static(m))
    judged = {}
    for static in statics:
        # Each run's rounds, in pool order: together they are the pooled rounds. A run
        # without a round against the static (it made nothing in each) adds no sample by
        # runs, and does not take the other runs' interval away.
        groups = [group for run in runs
                  if (group := paired_ratios(run["modes"], [static], mode, phase))]
        if not groups:
            continue
        interval = RatioInterval.of([ratio for group in groups for ratio in group])
        if interval is None:
            return Judged("no interval", static, None)
        by_runs = RatioInterval.over_groups(groups) if len(groups) > 1 else None
        sides = {interval.against(bar), *([by_runs.against(bar)] if by_runs else ())}
        judged[static] = Judged(sides.pop() if len(sides) == 1 else "not resolved", static,
                                interval, by_runs)
    if not judged:
        return Judged("no interval", statics[0], None)
    below = [j for j in judged.values() if j.outcome == "below"]
    if below:
        return min(below, key=lambda j: j.interval.high)
    deciding = [j for j in judged.values() if j.outcome != "above"] or list(judged.values())
    return min(deciding, key=lambda j: j.interval.mean)


@dataclass(frozen=True)
class RunAlone:
    """One run's `mode` by itself: over the run's best static by medians, overall and in its
    worst phase (against that phase's best static; a phase where no static made a token
    comes last), and overall round by round."""

    best: str
    overall: float
    worst_phase: str
    worst: float
    interval: RatioInterval | None

    @classmethod
    def of(cls, run: dict[str, Any], mode: str) -> RunAlone:
        modes = run["modes"]
        best, overall = over_best_static(modes, mode)
        phases = {phase: over_best_static(modes, mode, phase)[1] for phase in run["phases"]}
        worst = min(phases, key=lambda phase: (math.isnan(phases[phase]), phases[phase]))
        return cls(best, overall, worst, phases[worst],
                   RatioInterval.of(paired_ratios(modes, [best], mode)))


def last_run_cell(run: dict[str, Any], mode: str) -> str:
    alone = RunAlone.of(run, mode)
    cell = (f"{as_ratio(alone.overall)} {alone.best}, worst phase {as_ratio(alone.worst)} "
            f"({alone.worst_phase}), {run['rounds']} rounds")
    return cell + (f"; round by round {alone.interval}" if alone.interval else "")


def http_rows(bar: dict[str, Any], results: Path) -> list[list[str]]:
    """The bar's rows over every run it pools, then over the current code's runs where it
    names them."""
    current = bar.get("current")
    names = {*bar["pooled"], *(current["pooled"] if current else ()), bar["last"]}
    saved = {name: json.loads((results / name).read_text()) for name in names}
    last = saved[bar["last"]]
    rows = judged_rows(bar["bar"], with_latest([saved[n] for n in bar["pooled"]], last), last)
    if current:
        rows += judged_rows(f"{bar['bar']}, since {current['since']}",
                            with_latest([saved[n] for n in current["pooled"]], last), last)
    return rows


def judged_rows(label: str, runs: list[dict[str, Any]],
                last: dict[str, Any]) -> list[list[str]]:
    """One row per adaptive mode of these runs; a mode the latest run has and some other
    run lacks is named and not judged (its rounds would not pair with every run's statics).
    A mode only older runs have was a variant the suite no longer runs: not a bar."""
    try:
        pooled = pool(runs) if len(runs) > 1 else last
    except ValueError as error:
        raise ValueError(f"{label}: {error}") from error
    left_out = pooled.get("pooled", {}).get("modes_left_out", [])
    rows = []
    for mode in (m for m in pooled["modes"] if not is_static(m)):
        overall = judge(runs, pooled, mode, OVERALL_BAR)
        phases = {phase: judge(runs, pooled, mode, PHASE_BAR, phase)
                  for phase in pooled["phases"]}
        rows.append([f"{label}: `{mode}`", last_run_cell(last, mode),
                     pooled_cell(runs, pooled, overall, phases, left_out),
                     http_verdict(last, mode, overall, phases)])
    rows += [[f"{label}: `{mode}`", "-", "-", "not judged: not in every run"]
             for mode in left_out if not is_static(mode) and mode in last["modes"]]
    return rows


def pooled_cell(runs: list[dict[str, Any]], pooled: dict[str, Any], overall: Judged,
                phases: dict[str, Judged], left_out: list[str]) -> str:
    cell = f"{len(runs)} run{'s' if len(runs) > 1 else ''}, {pooled['rounds']} rounds: {overall}"
    measured = {phase: judged for phase, judged in phases.items() if judged.interval}
    if measured:
        worst = min(measured, key=lambda phase: measured[phase].interval.low)
        cell += f"; lowest phase {worst}, {measured[worst]}"
    if statics := [mode for mode in left_out if is_static(mode)]:
        cell += f"; not in every run, so not compared: {', '.join(statics)}"
    return cell


def http_verdict(last: dict[str, Any], mode: str, overall: Judged,
                 phases: dict[str, Judged]) -> str:
    if overall.outcome == "no interval":
        return "not judged (too few rounds, or a round without tokens)"
    verdict = f"overall **{OUTCOME[overall.outcome]}**"
    if overall.outcome == "not resolved":
        best, value = over_best_static(last["modes"], mode)
        side = "above" if value >= OVERALL_BAR else "below"
        verdict += f" ({side} {best} by medians in the last run)"
    return verdict + f"; per phase **{phase_outcome(phases)}**"


def phase_outcome(phases: dict[str, Judged]) -> str:
    """Met when every phase's pooled rounds lie above the bar; else missed (naming the
    phases below it) or not resolved, naming the phases the rounds do not resolve."""
    named = {outcome: [phase for phase, judged in phases.items() if judged.outcome == outcome]
             for outcome in ("below", "not resolved", "no interval")}
    if not any(named.values()):
        return "met"
    parts = [", ".join(named["below"])] if named["below"] else []
    prefix = {"not resolved": "not resolved: " if named["below"] else "",
              "no interval": "no interval: "}
    parts += [prefix[outcome] + ", ".join(named[outcome])
              for outcome in ("not resolved", "no interval") if named[outcome]]
    return f"{'missed' if named['below'] else 'not resolved'} ({'; '.join(parts)})"


def as_ratio(value: float, places: int = 3) -> str:
    """A ratio as "1.025x"; "n/a" for nan, where the base made nothing (no tokens, or no
    request within the SLO); "infx" where the cluster-aware mode never switched."""
    return "n/a" if math.isnan(value) else f"{value:.{places}f}x"


def by_fleet(runs: dict[str, Any], value: str, places: int = 3) -> str:
    """A verdict value of each fleet size's run, as "1.628x / 1.025x at 8 / 64 replicas"."""
    return " / ".join(as_ratio(run["verdicts"][value], places) for run in runs.values()) + \
        f" at {' / '.join(runs)} replicas"


def decisive(run: dict[str, Any], value: str) -> float:
    """A fleet size's verdict value: the median over its burst patterns where several ran
    (one pattern's gain can be far from the typical one's), else its one run's; nan where
    any is nan (a median over nan is not defined)."""
    values = [verdicts[value] for verdicts in run.get("seed_verdicts", ())] or \
        [run["verdicts"][value]]
    return math.nan if any(map(math.isnan, values)) else statistics.median(values)


def met_where(runs: dict[str, Any], value: str, bar: float) -> str:
    """The fleet sizes that reach `bar` (see `decisive`), those that do not, and those
    without a value."""
    sizes: dict[str, list[str]] = {"met": [], "missed": [], "n/a": []}
    for size, run in runs.items():
        found = decisive(run, value)
        sizes["n/a" if math.isnan(found) else "met" if found >= bar else "missed"].append(size)
    return ", ".join(f"**{outcome}** at {', '.join(named)} replicas"
                     for outcome, named in sizes.items() if named)


def burst_patterns(runs: dict[str, Any], value: str) -> list[str]:
    """`value` over other burst patterns (seeds), where a run has them."""
    cells = []
    for size, run in runs.items():
        for label, part in (("", run), (" over the longer run", run.get("longer", {}))):
            values = [v[value] for v in part.get("seed_verdicts", ())]
            if len(values) > 1:
                cells.append(f"{len(values)} burst patterns at {size}{label}: median "
                             f"{as_ratio(decisive(part, value))} "
                             f"({as_ratio(min(values))}-{as_ratio(max(values))})")
    return cells


def gain_row(runs: dict[str, Any]) -> list[str]:
    gain = "cluster_vs_best_local"
    more = burst_patterns(runs, gain)
    verdict = f"{met_where(runs, gain, CLUSTER_GAIN_BAR)} in the default runs"
    longer = {size: run["longer"] for size, run in runs.items() if "longer" in run}
    if longer:
        seconds = "/".join(sorted({f"{run['duration_s']:.0f}" for run in longer.values()}))
        more.insert(0, f"{seconds} s of arrivals: {by_fleet(longer, gain)}")
        verdict += f"; over {seconds} s {met_where(longer, gain, CLUSTER_GAIN_BAR)}"
    return [f"cluster simulation: cluster-aware goodput >= {CLUSTER_GAIN_BAR}x the best "
            "local-only policy", by_fleet(runs, gain), "; ".join(more) or "-", verdict]


def switch_row(runs: dict[str, Any]) -> list[str]:
    return [f"cluster simulation: `ema` switches >= {SWITCH_BAR:.0f}x the cluster-aware mode's",
            by_fleet(runs, "ema_switches_vs_cluster", 1),
            f"steady window: {by_fleet(runs, 'ema_steady_switches_vs_cluster', 1)}",
            met_where(runs, "ema_switches_vs_cluster", SWITCH_BAR)]


def wall_row(saved: dict[str, Any]) -> list[str]:
    bar = f"cluster simulation: {WALL_FLEET} replicas in under a minute of wall time, each mode"
    if WALL_FLEET not in saved["runs"]:
        return [bar, "-", "-", "**missed** (not run)"]
    walls = {mode: result["wall_s"] for mode, result in saved["runs"][WALL_FLEET]["modes"].items()}
    slowest = max(walls, key=walls.__getitem__)
    under = sum(wall < WALL_BAR_S for wall in walls.values())
    # Simulations share the machine when the run gave each core one (absent from older runs).
    at_once = f", {saved['jobs']} at a time" if "jobs" in saved else ""
    return [bar, f"{min(walls.values()):.1f}-{walls[slowest]:.1f} s a mode ({slowest} the "
            f"slowest){at_once}, on the machine that made the tables", "-",
            f"**{'met' if under == len(walls) else 'missed'}** there "
            f"({under} of {len(walls)} modes under {WALL_BAR_S:.0f} s)"]


def cluster_rows(saved: dict[str, Any]) -> list[list[str]]:
    return [gain_row(saved["runs"]), switch_row(saved["runs"]), wall_row(saved)]


def run_row(name: str, run: dict[str, Any], adaptive: tuple[str, ...]) -> list[str]:
    """One saved run alone: its machine's speed (static0, where it ran), its best static,
    each adaptive mode by itself (`RunAlone`), the A/A control's second run over its first,
    and the CPU other processes took meanwhile."""
    modes = run["modes"]
    best = best_static(modes, [m for m in modes if is_static(m)])
    cells = [name, str(run["rounds"]),
             number(modes["static0"]["throughput"], 1) if "static0" in modes else "-",
             f"{best} {number(modes[best]['throughput'], 1)}"]
    for mode in adaptive:
        if mode not in modes:
            cells += ["-", "-"]
            continue
        alone = RunAlone.of(run, mode)
        cells += [f"{as_ratio(alone.overall)} ({alone.worst_phase} {as_ratio(alone.worst)})",
                  str(alone.interval or "-")]
    control = run.get("aa_control")
    cells.append(as_ratio(quotient(control["again"]["throughput"],
                                   modes[control["mode"]]["throughput"])) if control else "-")
    foreign = run.get("foreign_cpu")
    cells.append(f"{100 * foreign['share_of_a_core']:.1f}%" if foreign else "-")
    return cells


def render_runs(results: Path = RESULTS) -> str:
    """Each HTTP bar's runs (those it pools, and the latest unless saved among them under
    another name), one row each (see `run_row`), in the manifest's order."""
    manifest = json.loads((results / MANIFEST).read_text())
    tables = []
    for bar in manifest["http"]:
        saved = {name: json.loads((results / name).read_text()) for name in bar["pooled"]}
        runs = with_latest(list(saved.values()), json.loads((results / bar["last"]).read_text()))
        names = [*saved, *([bar["last"]] if len(runs) > len(saved) else [])]
        adaptive = tuple(m for m in SUITE_ADAPTIVE if any(m in run["modes"] for run in runs))
        header = ["run", "rounds", "static0 tok/s", "best static, tok/s"]
        for mode in adaptive:
            header += [f"`{mode}` / best static by medians (worst phase, against its best)",
                       f"`{mode}` round by round"]
        tables.append(print_table(
            f"RUNS: {bar['bar']} (each run alone)",
            [*header, "A/A by medians", "other processes' CPU"],
            [run_row(name, run, adaptive) for name, run in zip(names, runs, strict=True)]))
    return "\n\n".join(tables)


def render(results: Path = RESULTS) -> str:
    manifest = json.loads((results / MANIFEST).read_text())
    rows = [row for bar in manifest["http"] for row in http_rows(bar, results)]
    rows += cluster_rows(json.loads((results / manifest["cluster"]).read_text()))
    return print_table(
        "THE MUST-SHOWS (made by `python -m bench.must_shows` from the saved runs; the rules "
        "in its docstring)",
        ["bar", "the last run", "pooled: round by round (by runs)", "verdict"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 if {RESULTS / OUTPUT} or {RESULTS / RUNS_OUTPUT} is "
                             "not what the saved runs give")
    args = parser.parse_args()
    outputs = {RESULTS / OUTPUT: render() + "\n", RESULTS / RUNS_OUTPUT: render_runs() + "\n"}
    if args.check:
        sys.exit(0 if all(path.exists() and path.read_text() == text
                          for path, text in outputs.items()) else 1)
    for path, text in outputs.items():
        path.write_text(text)
    print(outputs[RESULTS / OUTPUT])


if __name__ == "__main__":
    main()
