"""The HTTP benchmark's results (`bench.transition`): a mode's rounds combined, the report's
tables, and the plot. Medians across rounds, and the ratios that decide something also round by
round with a 95% interval (`bench.report.RatioInterval`): the modes of a round run back to
back, so a slow spell of the machine cancels out of a round's ratio."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench.foreign_cpu import ForeignCpuReport
from bench.report import (
    RatioInterval,
    compare_to_statics,
    interval_verdict,
    is_static,
    number,
    print_table,
    quotient,
    ratio,
    verdict,
)

# What `bench.transition` records of a run's load and deployment (absent from older runs).
RUN_SHAPE = ("requests", "concurrency", "warmup", "model", "replicas", "candidates",
             "app_config")

# Policy options a committed run recorded that the code no longer has, each with the value that
# did what the code does now: a run that recorded that value ran today's policy, one that
# recorded another ran a variant. (Stop 49's draft-model run recorded `request_class_priors`,
# an experiment's switch whose default, true, was the committed behaviour; the experiment was
# not kept.)
RETIRED_POLICY_OPTIONS: dict[str, dict[str, Any]] = {
    "goodput": {"request_class_priors": True}}


def current_policy_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """A recorded policy config as the code now spells it: retired options that held the
    behaviour the code kept are dropped; any other value of one stays, so it compares as
    different."""
    if config is None:
        return None
    retired = RETIRED_POLICY_OPTIONS.get(config.get("name", ""), {})
    return {key: value for key, value in config.items()
            if key not in retired or retired[key] != value}


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode over its rounds: medians of throughput (overall and per phase), latency,
    acceptance length and switches; errors summed; every round's tier timeline; and each
    round's own numbers under "rounds"."""
    def median_of(key: str) -> float | None:
        # None: no request finished; absent: a run recorded before the key existed
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    per_round = [{k: v for k, v in r.items() if k not in ("timeline", "started_s")}
                 for r in runs]  # each keeps its phase start times
    return {
        "throughput": median_of("throughput"), "latency_s": median_of("latency_s"),
        "latency_p99_s": median_of("latency_p99_s"),
        "accept_len": median_of("accept_len"), "switches": median_of("switches"),
        "errors": sum(r["errors"] for r in runs),
        "phases": {p: statistics.median(r["phases"][p] for r in runs) for p in runs[0]["phases"]},
        "phase_tokens": {p: statistics.median(r["phase_tokens"][p] for r in runs)
                         for p in runs[0]["phase_tokens"]},
        "phase_accept_len": {p: statistics.median(r["phase_accept_len"][p] for r in runs)
                             for p in runs[0]["phase_accept_len"]},
        "timeline": [point for r in runs for point in r["timeline"]],
        "started_s": [r["started_s"] for r in runs],
        "rounds": per_round,
    }


def report(results: dict[str, Any]) -> str:
    modes, phase_names = results["modes"], results["phases"]
    rounds = results["rounds"]
    of = f", median of {rounds} rounds" if rounds > 1 else ""
    lines = []
    if stopped := results.get("stopped_early"):
        lines.append(f"STOPPED EARLY: {rounds} of {stopped['rounds_asked']} rounds finished "
                     f"for every mode ({stopped['error']})")
    if "foreign_cpu" in results:  # `bench.http_suite` records it
        machine = ForeignCpuReport.from_dict(results["foreign_cpu"])
        lines.append(f"{'MACHINE SHARED' if machine.shared else 'MACHINE'}: {machine}")
    lines += [print_table(
        f"SUMMARY{f' (median of {rounds} rounds; errors summed)' if rounds > 1 else ''}",
        ["mode", "tok/s", "avg latency s", "p99 latency s", "accept len", "switches",
         "errors"],
        [[m, f"{r['throughput']:.1f}", number(r["latency_s"]), number(r.get("latency_p99_s")),
          f"{r['accept_len']:.2f}", f"{r['switches']:g}", r["errors"]]
         for m, r in modes.items()])]
    lines.append(print_table(
        f"PER-PHASE THROUGHPUT (tok/s{of}) [accept len]", ["mode", *phase_names],
        [[m, *(f"{r['phases'][p]:.1f} [{r['phase_accept_len'][p]:.2f}]" for p in phase_names)]
         for m, r in modes.items()]))
    if (contrast := acceptance_contrast(modes, phase_names)) is not None:
        lines.append(contrast)
    statics = [m for m in modes if is_static(m)]
    adaptive = [m for m in modes if not is_static(m)]
    if statics and adaptive:  # the bar: >= best static overall, >= 0.9x per phase
        best_overall = max(modes[s]["throughput"] for s in statics)
        lines.append(print_table(
            "ADAPTIVE VS BEST STATIC (overall; per phase vs that phase's best static)",
            ["mode", "overall", *phase_names],
            [[m, *(number(over_best_static(modes, m, p)[1], 3) for p in (None, *phase_names))]
             for m in adaptive]))
        lines.append(ceiling_table(modes, statics, adaptive, phase_names, best_overall))
    if statics and adaptive and rounds > 1:
        lines.append(paired_table(modes, statics, adaptive, phase_names))
        lines.append(interval_table(modes, statics, adaptive, phase_names))
    if "aa_control" in results:
        lines.append(aa_table(modes, results["aa_control"], phase_names))
    comparisons = compare_to_statics({m: r["throughput"] for m, r in modes.items()})
    if comparisons:
        lines.append(versus_statics_table(modes, comparisons))
    return "\n\n".join(lines)


def versus_statics_table(modes: dict[str, Any], comparisons: list[tuple[str, str, float]]
                         ) -> str:
    """Each adaptive mode against each static: the delta of their medians, and, with
    rounds, the round-by-round ratio's 95% interval, which sets the verdict (better or worse
    only where it excludes parity); with one round the delta's band does."""
    rows = []
    for adaptive, static, delta in comparisons:
        interval = RatioInterval.of(paired_ratios(modes, [static], adaptive))
        rows.append([adaptive, static, f"{delta:+.1%}", str(interval or "n/a"),
                     interval_verdict(interval) if interval else verdict(delta)])
    return print_table(
        "ADAPTIVE VS STATIC (delta of the medians; round by round: geometric mean [95% "
        "interval] of the adaptive mode over the static in the same round, which sets the "
        "verdict where there are rounds)",
        ["adaptive", "static", "delta", "round by round", "verdict"], rows)


def acceptance_contrast(modes: dict[str, Any], phase_names: list[str]) -> str | None:
    """The transition workload's premise, printed: under static7 the high phases' mean
    acceptance length is at least twice the low phases' (None without static7 or both
    kinds of phase)."""
    high = [p for p in phase_names if p.startswith("high")]
    low = [p for p in phase_names if p.startswith("low")]
    if "static7" not in modes or not high or not low:
        return None
    accept = modes["static7"]["phase_accept_len"]
    high_len = statistics.mean(accept[p] for p in high)
    low_len = statistics.mean(accept[p] for p in low)
    contrast = high_len / low_len if low_len else math.inf
    return print_table(
        "ACCEPTANCE LENGTH UNDER static7, HIGH PHASES VS LOW (the workload asks for 2x)",
        ["high phases", "low phases", "ratio", "at least 2x"],
        [[f"{high_len:.2f}", f"{low_len:.2f}", f"{contrast:.2f}",
          "yes" if contrast >= 2 else "NO"]])


def ceiling_table(modes: dict[str, Any], statics: list[str], adaptive: list[str],
                  phase_names: list[str], best_overall: float) -> str:
    """The run each phase's best static would make if one mode could be it in every phase:
    the most a choice among these tiers makes without beating a static inside a phase (and
    without the moves between them). Each phase counts with that static's tokens and time."""
    tokens = seconds = 0.0
    for phase in phase_names:
        best = best_static(modes, statics, phase)
        if not modes[best]["phases"][phase]:  # no static made a token here: no ceiling
            tokens, seconds = 0.0, 0.0
            break
        tokens += modes[best]["phase_tokens"][phase]
        seconds += modes[best]["phase_tokens"][phase] / modes[best]["phases"][phase]
    ceiling = tokens / seconds if seconds else 0.0
    return print_table(
        "THE BEST STATIC OF EACH PHASE, COMBINED (the ceiling of a choice among these tiers "
        "per phase)",
        ["run", "tok/s", "/ best static", "/ that ceiling"],
        [["each phase's best static", f"{ceiling:.1f}", ratio(ceiling, best_overall),
          ratio(ceiling, ceiling)],
         *([m, f"{modes[m]['throughput']:.1f}", ratio(modes[m]["throughput"], best_overall),
            ratio(modes[m]["throughput"], ceiling)] for m in adaptive)])


def throughput_of(run: dict[str, Any], phase: str | None = None) -> float:
    """A mode's (or one round's) tok/s, overall or in `phase`."""
    return run["throughput"] if phase is None else run["phases"][phase]


def best_static(modes: dict[str, Any], statics: list[str], phase: str | None = None) -> str:
    """The static mode with the most tok/s by medians, overall or in `phase`."""
    return max(statics, key=lambda static: throughput_of(modes[static], phase))


def over_best_static(modes: dict[str, Any], mode: str, phase: str | None = None
                     ) -> tuple[str, float]:
    """The run's best static by medians (overall or in `phase`), and `mode` over it (nan
    where the static made nothing)."""
    best = best_static(modes, [m for m in modes if is_static(m)], phase)
    return best, quotient(throughput_of(modes[mode], phase), throughput_of(modes[best], phase))


def paired_ratios(modes: dict[str, Any], against: list[str], mode: str,
                  phase: str | None = None) -> list[float]:
    """Per round, `mode` over the best of `against` in the same round (overall, or in
    `phase`). The modes of a round run back to back, so a slow spell of the machine that
    lowers a whole round cancels out, which it does not between medians taken over the
    rounds. A round where none of `against` made a token has no ratio."""
    pairs = [(throughput_of(run, phase),
              max(throughput_of(modes[other]["rounds"][i], phase) for other in against))
             for i, run in enumerate(modes[mode]["rounds"])]
    return [value / base for value, base in pairs if base]


def spread(ratios: list[float]) -> str:
    """Median [min-max] of per-round ratios."""
    if not ratios:
        return "n/a"
    return f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"


def paired_table(modes: dict[str, Any], statics: list[str], adaptive: list[str],
                 phase_names: list[str]) -> str:
    def cell(ratios: list[float], bar: float) -> str:
        return f"{spread(ratios)} {sum(r >= bar for r in ratios)}/{len(ratios)}"

    return print_table(
        "ADAPTIVE VS THE BEST STATIC OF THE SAME ROUND (median [min-max] of the rounds' "
        "ratios; rounds at the bar: 1.0 overall, 0.9 per phase)",
        ["mode", "overall", *phase_names],
        [[m, cell(paired_ratios(modes, statics, m), 1.0),
          *(cell(paired_ratios(modes, statics, m, p), 0.9) for p in phase_names)]
         for m in adaptive])


def interval_table(modes: dict[str, Any], statics: list[str], adaptive: list[str],
                   phase_names: list[str]) -> str:
    """The bars with their noise: each adaptive mode over the best static by medians (the
    bar's static; in each phase that phase's), round by round, as a geometric mean with its
    95% interval, and whether the rounds put it above the bar, below it, or do not resolve
    it. Against one static throughout, not each round's best, which a slow spell of one
    static's turn would lower in that round only."""
    def cell(mode: str, phase: str | None, bar: float) -> str:
        interval = RatioInterval.of(paired_ratios(
            modes, [best_static(modes, statics, phase)], mode, phase))
        return f"{interval} {interval.against(bar)}" if interval else "n/a"

    return print_table(
        "ADAPTIVE VS BEST STATIC, ROUND BY ROUND WITH 95% INTERVALS (geometric mean [interval] "
        "of each round's ratio to the best static by medians; the interval above the bar, "
        "below it, or not resolved: 1.0 overall, 0.9 per phase)",
        ["mode", "overall", *phase_names],
        [[m, cell(m, None, 1.0), *(cell(m, p, 0.9) for p in phase_names)] for m in adaptive])


def aa_table(modes: dict[str, Any], control: dict[str, Any], phase_names: list[str]) -> str:
    """One mode run twice in every round (`--aa-control`): the second run over the first, by
    medians and round by round. Both ran the same configuration, so how far they land apart
    is the noise in every ratio of this run (an A/A test)."""
    first, second = modes[control["mode"]], control["again"]
    pair = {"first": first, "second": second}
    return print_table(
        f"A/A CONTROL: {control['mode']} RUN TWICE IN EVERY ROUND (the second over the first; "
        "both ran the same configuration, so this is the noise in every ratio above)",
        ["measure", "overall", *phase_names],
        [["medians", ratio(second["throughput"], first["throughput"]),
          *(ratio(second["phases"][p], first["phases"][p]) for p in phase_names)],
         ["round by round: median [min-max]", spread(paired_ratios(pair, ["first"], "second")),
          *(spread(paired_ratios(pair, ["first"], "second", p)) for p in phase_names)]])


def typical_round(runs: list[dict[str, Any]]) -> int:
    """Index of the round whose throughput is the median (the lower one for an even count)."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["throughput"])
    return order[(len(order) - 1) // 2]


def plot(results: dict[str, Any], path: Path) -> None:
    """K over time per replica for each adaptive mode (its typical round, from the round's
    start, phases marked; a static mode holds its K), and throughput per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes, phase_names = results["modes"], results["phases"]
    adaptive = [m for m in modes if not is_static(m)]
    fig, axes = plt.subplots(len(adaptive) + 1, 1, figsize=(11, 2.6 * len(adaptive) + 3.2),
                             squeeze=False)
    for ax_k, mode in zip(axes[:, 0], adaptive, strict=False):
        r = modes[mode]
        chosen = typical_round(r["rounds"])
        start = r["started_s"][chosen]
        end = r["started_s"][chosen + 1] if chosen + 1 < len(r["started_s"]) else math.inf
        points = [p for p in r["timeline"] if start <= p["t"] < end]
        replicas = sorted({p["replica"] for p in points})
        for i, replica in enumerate(replicas):
            own = [p for p in points if p["replica"] == replica]
            # Apart by a fraction of a tier, so replicas on the same K do not hide each other.
            offset = 0.15 * (i - (len(replicas) - 1) / 2)
            ax_k.step([p["t"] - start for p in own], [p["k"] + offset for p in own],
                      where="post", label=f"replica {replica}")
        for name, began in zip(phase_names, r["rounds"][chosen]["phase_started_s"],
                               strict=True):
            ax_k.axvline(began - start, color="grey", lw=0.6)
            ax_k.annotate(name, (began - start, 1.0), xycoords=("data", "axes fraction"),
                          xytext=(2, -10), textcoords="offset points", fontsize=7)
        if points:  # room on the right for the last phase's name
            ax_k.set_xlim(0, 1.08 * (points[-1]["t"] - start))
        if results.get("candidates"):
            ax_k.set_yticks(results["candidates"])
        sampled = f"K sampled every {results['tier_sample_s']} s, " \
            if "tier_sample_s" in results else ""
        ax_k.set(xlabel="s since the round began", ylabel="active K",
                 title=f"{mode}: K over time per replica (round {chosen + 1} of "
                       f"{len(r['rounds'])}, the median throughput; {sampled}"
                       f"{r['rounds'][chosen]['switches']} switches in all)")
        ax_k.legend(fontsize=7, loc="center right")
    ax_tp = axes[-1, 0]
    width = 0.8 / max(1, len(modes))
    for i, (mode, r) in enumerate(modes.items()):
        xs = [j + i * width for j in range(len(phase_names))]
        ax_tp.bar(xs, [r["phases"][p] for p in phase_names], width, label=mode)
    ax_tp.set_xticks([j + 0.4 - width / 2 for j in range(len(phase_names))], phase_names)
    ax_tp.set(ylabel="tok/s", title="throughput per phase (median of rounds)")
    # The legend in a band above the tallest bar: placed where matplotlib finds room, it hid
    # the high phases' bars.
    tallest = max((r["phases"][p] for r in modes.values() for p in phase_names), default=0)
    ax_tp.set_ylim(0, 1.2 * tallest or 1)
    ax_tp.legend(fontsize=7, ncol=len(modes), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' results (`--json` files) as one run of all their rounds: more rounds
    narrow the intervals that one run leaves unresolved. Each round keeps its pairing (its
    modes ran back to back); the tier timelines are not pooled. Runs of different workloads,
    phases, token budgets, loads (requests and concurrency per phase, warm-up), models,
    deployments (replicas, tiers, the app's config) or policy configs are refused (a retired
    option compares as the code now behaves: `RETIRED_POLICY_OPTIONS`); runs recorded before a
    field existed are not compared on it. The modes are those every run has
    (the others are named under "pooled"), and the A/A control only if every run had it.
    The interval then treats every round alike, though rounds of one app start may share a
    level: the report names each run's own ratio beside it, and the interval over the runs
    (see `main`)."""
    first = runs[0]
    for key in ("workload", "phases", "max_tokens"):
        if any(run.get(key) != first.get(key) for run in runs):
            raise ValueError(f"the runs differ in {key}: not one benchmark")
    for key in RUN_SHAPE:
        if len({json.dumps(run[key]) for run in runs if key in run}) > 1:
            raise ValueError(f"the runs differ in {key}: not one benchmark")
    names = [m for m in first["modes"] if all(m in run["modes"] for run in runs)]
    for mode in names:
        configs = {json.dumps(current_policy_config(run.get("policies", {}).get(mode)),
                              sort_keys=True) for run in runs}
        if len(configs) > 1:
            raise ValueError(f"the runs ran {mode} with different policy configs")

    def rounds_of(mode: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**r, "timeline": [], "started_s": None} for r in mode["rounds"]]

    left_out = sorted({m for run in runs for m in run["modes"]} - set(names))
    pooled: dict[str, Any] = {
        "workload": first.get("workload"), "phases": first["phases"],
        "rounds": sum(run["rounds"] for run in runs),
        "modes": {m: combine([r for run in runs for r in rounds_of(run["modes"][m])])
                  for m in names},
        "pooled": {"runs": len(runs), "modes_left_out": left_out,
                   "aa_control_left_out": False}}
    controls = [run["aa_control"] for run in runs if "aa_control" in run]
    if len(controls) == len(runs) and len({c["mode"] for c in controls}) == 1:
        pooled["aa_control"] = {"mode": controls[0]["mode"], "again": combine(
            [r for c in controls for r in rounds_of(c["again"])])}
    elif controls:
        pooled["pooled"]["aa_control_left_out"] = True
    return pooled


def run_ratios(runs: list[dict[str, Any]], mode: str) -> list[str]:
    """Each run's own overall ratio of `mode` to its best static by medians, as
    "0.948x (static7)": how far apart the pooled runs landed."""
    ratios = []
    for run in runs:
        if mode in run["modes"] and any(map(is_static, run["modes"])):
            best, value = over_best_static(run["modes"], mode)
            ratios.append(f"{number(value, 3)}x ({best})")
    return ratios


def over_runs(runs: list[dict[str, Any]], pooled: dict[str, Any], mode: str) -> str:
    """`mode` over the pooled medians' best static, as a geometric mean over the runs with
    its 95% interval: the rounds of one app start may share a level, so the round-by-round
    interval below can read narrower than the runs allow. (The must-shows table judges
    against each run's best static instead: `bench.must_shows.judge`.)"""
    statics = [m for m in pooled["modes"] if is_static(m)]
    if not statics:
        return "n/a (no static mode in every run)"
    best = best_static(pooled["modes"], statics)
    interval = RatioInterval.over_groups([paired_ratios(run["modes"], [best], mode)
                                          for run in runs])
    return f"{interval or 'n/a'} of {best}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Re-render HTTP benchmark results, one run or several pooled")
    parser.add_argument("json", type=Path, nargs="+",
                        help="`bench.transition --json` files; several are pooled (`pool`)")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None,
                        help="draw the run's plot again (one run: pooled rounds keep no "
                             "tier timelines)")
    args = parser.parse_args()
    if args.plot and len(args.json) > 1:
        parser.error("--plot takes one run")
    runs = [json.loads(path.read_text()) for path in args.json]
    if len(runs) == 1:
        text = report(runs[0])
    else:
        pooled = pool(runs)
        notes = [f"POOLED: {len(runs)} runs ({', '.join(p.name for p in args.json)})"]
        for mode in (m for m in pooled["modes"] if not is_static(m)):
            notes.append(f"each run alone, {mode} / its best static: "
                         f"{', '.join(run_ratios(runs, mode))}")
            notes.append(f"{mode} over the runs (each run's rounds one sample): "
                         f"{over_runs(runs, pooled, mode)}")
        if left_out := pooled["pooled"]["modes_left_out"]:
            notes.append(f"left out (not in every run): {', '.join(left_out)}")
        if pooled["pooled"]["aa_control_left_out"]:
            notes.append("A/A control left out (not in every run)")
        unmeasured = [p.name for p, run in zip(args.json, runs, strict=True)
                      if "foreign_cpu" not in run]
        if unmeasured:
            notes.append("other processes' CPU not measured in: " + ", ".join(unmeasured))
        text = "\n".join(notes) + "\n\n" + report(pooled)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.plot:
        plot(runs[0], args.plot)


if __name__ == "__main__":
    main()
