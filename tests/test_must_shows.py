"""The README's must-shows table (`bench.must_shows`): the committed table is what the saved
runs give, and its verdicts follow the rules: the pooled interval decides a bar, against the
hardest of the statics, and a latest run joins the pool once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import must_shows
from bench.transition_report import combine

ROOT = Path(__file__).resolve().parent.parent
PHASES = ["low", "high"]


def a_round(throughput: float, phases: dict[str, float] | None = None) -> dict:
    phases = phases or {phase: throughput for phase in PHASES}
    return {"throughput": throughput, "latency_s": 1.0, "accept_len": 1.5, "switches": 0,
            "errors": 0, "phases": phases, "phase_tokens": {p: 1000 for p in PHASES},
            "phase_accept_len": {p: 1.5 for p in PHASES}, "timeline": [], "started_s": 0.0}


def a_run(rounds: dict[str, list[dict]]) -> dict:
    """A saved `bench.transition` run of these modes' rounds."""
    return {"workload": "transition", "phases": PHASES, "max_tokens": 256,
            "rounds": len(next(iter(rounds.values()))),
            "modes": {mode: combine(each) for mode, each in rounds.items()}}


def steady(base: float, ratios: list[float]) -> dict[str, list[dict]]:
    """static1 at `base` tok/s every round, goodput at each ratio of it."""
    return {"static1": [a_round(base) for _ in ratios],
            "goodput": [a_round(base * r) for r in ratios]}


def table_of(tmp_path: Path, runs: dict[str, dict], pooled: list[str], last: str,
             current: dict | None = None) -> str:
    for name, run in runs.items():
        (tmp_path / name).write_text(json.dumps(run))
    bar = {"bar": "transition", "last": last, "pooled": pooled}
    (tmp_path / "must_shows.json").write_text(json.dumps(
        {"http": [{**bar, "current": current} if current else bar], "cluster": "cluster.json"}))
    (tmp_path / "cluster.json").write_text(json.dumps(a_cluster_run()))
    return must_shows.render(tmp_path)


def a_cluster_run() -> dict:
    def fleet(gain: float, switches: float, wall_s: float) -> dict:
        verdicts = {"cluster_vs_best_local": gain, "ema_switches_vs_cluster": switches,
                    "ema_steady_switches_vs_cluster": switches}
        return {"duration_s": 10.0, "verdicts": verdicts,
                "modes": {"static3": {"wall_s": wall_s / 2}, "goodput_routed": {"wall_s": wall_s}}}

    # At 64 the first burst pattern gains 30%, the typical one (the median) nothing.
    patterns = fleet(1.3, 6.0, 5.0)
    patterns["seed_verdicts"] = [patterns["verdicts"]] + [
        {**patterns["verdicts"], "cluster_vs_best_local": gain} for gain in (1.0, 1.01, 0.99)]
    return {"runs": {"8": fleet(1.5, 6.0, 2.0), "64": patterns, "512": fleet(1.02, 1.3, 75.0)}}


def verdict_row(table: str, starts: str) -> list[str]:
    row = next(line for line in table.splitlines() if line.startswith(f"| {starts}"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_the_committed_tables_are_what_the_saved_runs_give(monkeypatch):
    monkeypatch.chdir(ROOT)
    committed = (must_shows.RESULTS / must_shows.OUTPUT).read_text()
    assert must_shows.render() + "\n" == committed, "run `python -m bench.must_shows`"
    runs = (must_shows.RESULTS / must_shows.RUNS_OUTPUT).read_text()
    assert must_shows.render_runs() + "\n" == runs, "run `python -m bench.must_shows`"


@pytest.mark.parametrize(("ratios", "verdict"), [
    ([1.08, 1.12, 1.10, 1.09, 1.11, 1.10], "overall **met**"),
    ([0.85, 0.88, 0.86, 0.87, 0.84, 0.86], "overall **missed**"),
    ([0.90, 1.12, 0.95, 1.08, 0.92, 1.10], "overall **not resolved**"),
])
def test_the_pooled_interval_decides_the_overall_bar(tmp_path, ratios, verdict):
    runs = {"a.json": a_run(steady(100.0, ratios[:3])), "b.json": a_run(steady(200.0, ratios[3:]))}
    row = verdict_row(table_of(tmp_path, runs, ["a.json"], "b.json"), "transition: `goodput`")
    assert row[3].startswith(verdict)
    assert "2 runs, 6 rounds" in row[2]


def test_runs_that_disagree_leave_a_bar_unresolved_that_their_rounds_alone_would_meet(
        tmp_path):
    """Each run's rounds agree closely, the runs do not: counted as 18 independent rounds
    the ratio lies above 1.0, but over the three runs (each its own level) it does not."""
    runs = {name: a_run(steady(100.0, ratios)) for name, ratios in (
        ("a.json", [1.10, 1.105, 1.095] * 2), ("b.json", [1.04, 1.045, 1.035] * 2),
        ("c.json", [0.99, 0.995, 0.985] * 2))}
    row = verdict_row(table_of(tmp_path, runs, ["a.json", "b.json"], "c.json"),
                      "transition: `goodput`")
    assert "3 runs, 18 rounds: 1.042 [1.020-1.066] (by runs [0.914-1.188]) of static1" in row[2]
    assert row[3].startswith("overall **not resolved**")


def test_a_phase_below_the_bar_is_named(tmp_path):
    def rounds(base: float) -> dict[str, list[dict]]:
        return {"static1": [a_round(base) for _ in range(3)],
                "goodput": [a_round(base, {"low": base * r, "high": base * 1.2})
                            for r in (0.70, 0.72, 0.71)]}

    runs = {"a.json": a_run(rounds(100.0)), "b.json": a_run(rounds(120.0))}
    row = verdict_row(table_of(tmp_path, runs, ["a.json", "b.json"], "b.json"),
                      "transition: `goodput`")
    assert row[3].endswith("per phase **missed (low)**")


def test_a_bar_is_met_only_against_every_static(tmp_path):
    # static1 is the best of run a and of the pooled medians: goodput makes 1.2x it in every
    # round. Run b's best is static3, which goodput only ties there: against static3 the
    # pooled rounds do not resolve the bar, so neither does the verdict.
    def rounds(static3: float) -> dict[str, list[dict]]:
        return {"static1": [a_round(100.0) for _ in range(3)],
                "static3": [a_round(static3 * f) for f in (0.98, 1.0, 1.02)],
                "goodput": [a_round(120.0) for _ in range(3)]}

    runs = {"a.json": a_run(rounds(80.0)), "b.json": a_run(rounds(120.0))}
    row = verdict_row(table_of(tmp_path, runs, ["a.json", "b.json"], "b.json"),
                      "transition: `goodput`")
    assert "of static3" in row[2]
    assert row[3].startswith("overall **not resolved** (above static3 by medians")


def test_a_static_behind_by_medians_and_ahead_by_the_rounds_keeps_a_bar_open(tmp_path):
    """static1 is the run's best by medians and goodput beats it in every round; static3,
    slower by medians, has two fast rounds that put it ahead of goodput on the rounds'
    mean. Which static is best is measured too: the bar is held against both."""
    runs = {"a.json": a_run({
        "static1": [a_round(t) for t in (103, 104, 105, 104, 103, 105)],
        "static3": [a_round(t) for t in (100, 100, 100, 100, 130, 130)],
        "goodput": [a_round(t) for t in (106, 105, 107, 106, 106, 105)]})}
    row = verdict_row(table_of(tmp_path, runs, [], "a.json"), "transition: `goodput`")
    assert "1.019x static1" in row[1]  # by medians: 106 over 104
    assert "of static3" in row[2]
    assert row[3].startswith("overall **not resolved** (above static1 by medians")


def test_a_run_without_rounds_against_a_static_leaves_the_other_runs_interval(tmp_path):
    """Runs a and b put goodput's low phase at 0.96x and 0.93x of static1: above 0.9 round
    by round, not resolved over the two runs. In run c static1 made nothing in that phase,
    so c has no ratio there; the two runs' interval still decides."""
    def rounds(low: float, static_low: float = 100.0) -> dict[str, list[dict]]:
        jitter = (0.995, 1.0, 1.005) * 2
        return {"static1": [a_round(100.0, {"low": static_low, "high": 100.0})
                            for _ in jitter],
                "goodput": [a_round(110.0, {"low": 100.0 * low * j, "high": 120.0})
                            for j in jitter]}

    runs = {"a.json": a_run(rounds(0.96)), "b.json": a_run(rounds(0.93)),
            "c.json": a_run(rounds(0.5, static_low=0.0))}
    row = verdict_row(table_of(tmp_path, runs, ["a.json", "b.json"], "c.json"),
                      "transition: `goodput`")
    assert row[3] == "overall **met**; per phase **not resolved (low)**"


def test_every_phase_above_the_bar_meets_it(tmp_path):
    runs = {"a.json": a_run(steady(100.0, [1.0, 0.98, 1.02, 1.01]))}
    row = verdict_row(table_of(tmp_path, runs, [], "a.json"), "transition: `goodput`")
    assert row[3].endswith("per phase **met**")


def test_a_static_without_tokens_in_a_phase_gives_no_ratio_and_no_crash(tmp_path):
    run = steady(100.0, [1.0, 1.1, 0.9])
    run["static1"] = [a_round(100.0, {"low": 0.0, "high": 100.0}) for _ in range(3)]
    row = verdict_row(table_of(tmp_path, {"a.json": a_run(run)}, [], "a.json"),
                      "transition: `goodput`")
    assert "worst phase 1.000x (high)" in row[1]  # a phase without a ratio is not the worst
    assert "no interval: low" in row[3]


def test_a_mode_some_run_lacks_is_named_and_not_judged(tmp_path):
    """A mode the latest run has and an older one lacks is named; a variant that only an
    older run ran is no bar of today's suite and gets no row."""
    with_ema = steady(100.0, [1.0, 1.1, 0.9])
    with_ema["ema"] = [a_round(95.0) for _ in range(3)]
    with_variant = steady(100.0, [1.0, 1.1, 0.9])
    with_variant["goodput_variant"] = [a_round(97.0) for _ in range(3)]
    runs = {"old.json": a_run(with_variant), "latest.json": a_run(with_ema)}
    table = table_of(tmp_path, runs, ["old.json"], "latest.json")
    assert verdict_row(table, "transition: `ema`")[3] == "not judged: not in every run"
    assert verdict_row(table, "transition: `goodput`")[2].startswith("2 runs, 6 rounds")
    assert "goodput_variant" not in table


def test_the_current_codes_runs_are_judged_apart_from_the_older_ones(tmp_path):
    """Rounds of an older policy pull the pool below the bar; the rows since the change
    judge only the runs named as the current code's, with the latest among them."""
    runs = {"old.json": a_run(steady(100.0, [0.85, 0.86, 0.84])),
            "new.json": a_run(steady(100.0, [1.10, 1.12, 1.11])),
            "latest.json": a_run(steady(120.0, [1.09, 1.13, 1.10]))}
    table = table_of(tmp_path, runs, ["old.json", "new.json"], "latest.json",
                     current={"since": "the fix", "pooled": ["new.json"]})
    every_run = verdict_row(table, "transition: `goodput`")
    current = verdict_row(table, "transition, since the fix: `goodput`")
    assert every_run[2].startswith("3 runs, 9 rounds")
    assert every_run[3].startswith("overall **not resolved**")
    assert current[2].startswith("2 runs, 6 rounds")
    assert current[3].startswith("overall **met**")


def test_the_latest_run_joins_the_pool_once(tmp_path):
    run = a_run(steady(100.0, [1.0, 1.1, 0.95]))
    table = table_of(tmp_path, {"saved.json": run, "latest.json": run}, ["saved.json"],
                     "latest.json")
    assert "1 run, 3 rounds" in verdict_row(table, "transition: `goodput`")[2]


def test_each_run_of_a_bar_gets_a_row_of_its_own_numbers_and_the_latest_one_row(tmp_path):
    """The runs table: each pooled run alone, by its own best static; the latest run once,
    though it is saved under a second name too; a run without the A/A control says so."""
    first = a_run(steady(100.0, [1.2, 1.0, 1.1]))  # goodput 1.1x by medians
    first["aa_control"] = {"mode": "goodput", "again": {
        **first["modes"]["goodput"], "throughput": 0.9 * first["modes"]["goodput"]["throughput"]}}
    second = a_run({"static1": [a_round(200.0, {"low": 200.0, "high": 200.0})] * 2,
                    "goodput": [a_round(180.0, {"low": 150.0, "high": 210.0})] * 2})
    # No static made a token in c's first phase: no ratio there, and not its worst phase.
    third = a_run({"static1": [a_round(100.0, {"low": 0.0, "high": 200.0})] * 2,
                   "goodput": [a_round(125.0, {"low": 100.0, "high": 150.0})] * 2})
    table_of(tmp_path, {"a.json": first, "b.json": second, "c.json": third,
                        "latest.json": second}, ["a.json", "b.json", "c.json"], "latest.json")
    rows = must_shows.render_runs(tmp_path).splitlines()
    assert [row.split("|")[1].strip() for row in rows if row.startswith("| ")][1:] \
        == ["a.json", "b.json", "c.json"]
    a, b, c = (verdict_row("\n".join(rows), name) for name in ("a.json", "b.json", "c.json"))
    assert a[1:4] == ["3", "-", "static1 100.0"]
    assert a[4] == "1.100x (low 1.100x)" and a[6:] == ["0.900x", "-"]  # a tie: the first
    assert b[3] == "static1 200.0" and b[4] == "0.900x (low 0.750x)" and b[6] == "-"
    assert c[4] == "1.250x (high 0.750x)"


def test_the_cluster_bars_are_met_where_a_fleet_typically_reaches_them(tmp_path):
    table = table_of(tmp_path, {"a.json": a_run(steady(100.0, [1.0, 1.1]))}, [], "a.json")
    gain = verdict_row(table, "cluster simulation: cluster-aware goodput")
    assert gain[3] == "**met** at 8 replicas, **missed** at 64, 512 replicas in the default runs"
    assert "4 burst patterns at 64: median 1.005x (0.990x-1.300x)" in gain[2]
    switches = verdict_row(table, "cluster simulation: `ema` switches")
    assert switches[3] == "**met** at 8, 64 replicas, **missed** at 512 replicas"
    wall = verdict_row(table, "cluster simulation: 512 replicas")
    assert wall[3] == "**missed** there (1 of 2 modes under 60 s)"
