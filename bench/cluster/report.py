"""The cluster simulation's verdicts, tables and plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from bench.cluster.fleet import CLUSTER, LOCAL, MODES, ORACLE, PRESET, STATIC, mixed_tokens_per_s
from bench.cluster.runs import CAPACITY_RESOLUTION
from bench.policy_replay import CANDIDATES
from bench.report import RatioInterval, number, print_table, quotient, ratio
from policies.goodput import GoodputConfig
from replicas.engines.sim_presets import PRESETS, SimPreset


def verdicts(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    best_static = max(STATIC, key=lambda m: modes[m]["goodput"])
    best_local = max(LOCAL, key=lambda m: modes[m]["goodput"])
    best_cluster = max(CLUSTER, key=lambda m: modes[m]["goodput"])
    # nan where the base met the SLO with nothing (a strict --slo-tpot): no ratio to give
    return {"best_static": best_static, "best_local": best_local, "best_cluster": best_cluster,
            "cluster_vs_best_local": quotient(modes[best_cluster]["goodput"],
                                              modes[best_local]["goodput"]),
            "cluster_vs_best_static": quotient(modes[best_cluster]["goodput"],
                                               modes[best_static]["goodput"]),
            "ema_switches_vs_cluster": switch_ratio(modes["ema"], modes[best_cluster]),
            "ema_steady_switches_vs_cluster": switch_ratio(modes["ema"], modes[best_cluster],
                                                           "steady_"),
            "oracle_vs_best_local": quotient(modes[ORACLE]["goodput"],
                                             modes[best_local]["goodput"])}


def switch_ratio(ema: dict[str, Any], other: dict[str, Any], window: str = "") -> float:
    """How many times as often `ema` switches as `other` (`window`: "" for the whole run,
    "steady_" for the steady window); inf when `other` never switches."""
    key = f"{window}switches_per_replica_hour"
    return ema[key] / other[key] if other[key] else float("inf")


def gathering_bound(preset: SimPreset, shares: dict[str, float], batch: int
                    ) -> tuple[float, float]:
    """Tokens/s of one replica at `batch` for this class mix (token shares): every replica
    serving the mix at its best single K, against replicas that each serve one class at that
    class's best K (as many replicas per class as its work needs). It bounds what gathering
    similar requests can give in this cost model."""
    mixed = max(mixed_tokens_per_s(preset, shares, batch, k) for k in CANDIDATES)
    gathered = 1 / sum(share / max(mixed_tokens_per_s(preset, {c: 1.0}, batch, k)
                                   for k in CANDIDATES) for c, share in shares.items())
    return mixed, gathered


def report(runs: dict[int, dict[str, Any]]) -> str:
    parts = []
    for replicas, run in runs.items():
        modes = run["modes"]
        rows = [[m, f"{r['goodput']:.0f}", f"{r['slo_attainment']:.1%}",
                 f"{r['throughput']:.0f}", f"{r['p50_s']:.2f}",
                 f"{r['p99_s']:.2f}", f"{r['switches_per_replica_hour']:.0f}",
                 f"{r['steady_switches_per_replica_hour']:.0f}",
                 f"{r['gathered']:.2f}", r["requests"], f"{r['wall_s']:.1f}"]
                for m, r in modes.items()]
        parts.append(print_table(
            f"{replicas} REPLICAS (SIMULATOR, {run['arrivals']} requests, "
            f"{run['duration_s']:.0f} s of arrivals, offered "
            f"{run['offered_tok_s_per_replica']:.0f} tok/s per replica)",
            ["mode", "goodput tok/s", "SLO met", "throughput tok/s", "p50 s", "p99 s",
             "switches / replica-hour", "steady switches / replica-hour", "gathered",
             "requests", "wall s"], rows))
    verdict_columns = ["best static", "best local", "best cluster-aware",
                       "cluster / best local", "cluster / best static",
                       "ema switches / cluster's", "the same, steady window",
                       "oracle K / best local"]

    def verdict_cells(modes: dict[str, dict[str, Any]], v: dict[str, Any]) -> list[str]:
        return [*(f"{v[key]} ({modes[v[key]]['slo_attainment']:.1%} SLO)"
                  for key in ("best_static", "best_local", "best_cluster")),
                number(v["cluster_vs_best_local"], 3), number(v["cluster_vs_best_static"], 3),
                f"{v['ema_switches_vs_cluster']:.1f}x",
                f"{v['ema_steady_switches_vs_cluster']:.1f}x",
                number(v["oracle_vs_best_local"], 3)]

    parts.append(print_table(
        "CLUSTER-AWARE VS LOCAL-ONLY (goodput ratios)", ["replicas", *verdict_columns],
        [[n, *verdict_cells(run["modes"], run["verdicts"])] for n, run in runs.items()]))
    longer = {n: r["longer"] for n, r in runs.items() if "longer" in r}
    if longer:
        parts.append(print_table(
            "THE SAME OVER A LONGER RUN (first seed; the default run ends before the overload "
            "shows)", ["replicas", "s of arrivals", *verdict_columns],
            [[n, f"{run['duration_s']:.0f}", *verdict_cells(run["modes"], run["verdicts"])]
             for n, run in longer.items()]))
    spread = [(n, r["duration_s"], r["seed_verdicts"])
              for n, r in [*runs.items(), *longer.items()] if "seed_verdicts" in r]
    if spread:
        def summary(values: list[float]) -> str:
            if any(math.isnan(v) for v in values):  # a seed had no ratio to give
                return "n/a"
            return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

        def mean_interval(values: list[float]) -> str:
            return str(RatioInterval.of(values) or "n/a")

        parts.append(print_table(
            "THE SAME ACROSS BURST PATTERNS (seeds; median, min-max; and the geometric mean "
            "over the patterns with its 95% interval)",
            ["replicas", "s of arrivals", "seeds", "cluster / best local",
             "the same, geometric mean [95% interval]",
             "cluster / best static", "ema switches / cluster's", "the same, steady window",
             "oracle K / best local"],
            [[n, f"{duration:.0f}", len(vs), summary([v["cluster_vs_best_local"] for v in vs]),
              mean_interval([v["cluster_vs_best_local"] for v in vs]),
              summary([v["cluster_vs_best_static"] for v in vs]),
              summary([v["ema_switches_vs_cluster"] for v in vs]),
              summary([v["ema_steady_switches_vs_cluster"] for v in vs]),
              summary([v["oracle_vs_best_local"] for v in vs])] for n, duration, vs in spread]))
    margins = {n: r for n, r in runs.items() if "margins" in r}
    if margins:
        default = GoodputConfig.model_fields["switch_margin"].default
        rows = []
        for n, run in margins.items():
            base, ema = run["modes"]["goodput_routed"], run["modes"]["ema"]
            for margin, r in {f"{default} (default)": base, **run["margins"]}.items():
                rows.append([n, margin, ratio(r["goodput"], base["goodput"]),
                             ratio(r["throughput"], base["throughput"]),
                             f"{r['slo_attainment']:.1%}",
                             f"{r['switches_per_replica_hour']:.0f}",
                             f"{r['steady_switches_per_replica_hour']:.0f}",
                             f"{switch_ratio(ema, r):.1f}x",
                             f"{switch_ratio(ema, r, 'steady_'):.1f}x"])
        parts.append(print_table(
            "FEWER SWITCHES FOR A LARGER SWITCH MARGIN (goodput_routed, first seed)",
            ["replicas", "switch margin", "goodput / default's", "throughput / default's",
             "SLO met", "switches / replica-hour", "steady switches / replica-hour",
             "ema switches / these", "the same, steady window"], rows))
    bounded = {n: r for n, r in runs.items() if "tpot_bound" in r}
    if bounded:
        rows = []
        for n, run in bounded.items():
            best_local = run["verdicts"]["best_local"]
            for mode, r in run["tpot_bound"].items():
                base = run["modes"][mode]
                rows.append([n, mode, ratio(r["goodput"], base["goodput"]),
                             ratio(r["throughput"], base["throughput"]),
                             f"{base['slo_attainment']:.1%} -> {r['slo_attainment']:.1%}",
                             f"{base['tpot_missed']:.1%} -> {r['tpot_missed']:.1%}",
                             f"{base['switches_per_replica_hour']:.0f} -> "
                             f"{r['switches_per_replica_hour']:.0f}",
                             f"{base['steady_switches_per_replica_hour']:.0f} -> "
                             f"{r['steady_switches_per_replica_hour']:.0f}",
                             ratio(r["goodput"], run["modes"][best_local]["goodput"])])
        parts.append(print_table(
            "WITH THE SLO'S BOUND ON TIME PER TOKEN (`tpot_slo_ms`; first seed; vs the same "
            "mode without)",
            ["replicas", "mode", "goodput / without", "throughput / without", "SLO met",
             "over the TPOT bound",
             "switches / replica-hour", "steady switches / replica-hour",
             "goodput / best local-only without"], rows))
    for n, run in runs.items():
        if "capacity" in run:
            parts.append(capacity_table(n, run["capacity"]))
    shares = next(iter(runs.values()))["token_shares"]
    bounds = {b: gathering_bound(PRESETS[PRESET], shares, b) for b in (16, 32, 64)}
    parts.append(print_table(
        "WHAT GATHERING CLASSES CAN GIVE AT MOST (cost model, tok/s per replica; token shares "
        + ", ".join(f"{c} {s:.0%}" for c, s in shares.items()) + ")",
        ["batch", "mixed, best single K", "one class per replica, its best K", "ratio"],
        [[b, f"{mixed:.0f}", f"{gathered:.0f}", f"{gathered / mixed:.3f}"]
         for b, (mixed, gathered) in bounds.items()]))
    return "\n\n".join(parts)


def capacity_table(replicas: int, capacity: dict[str, Any]) -> str:
    modes = capacity["modes"]
    best_static = max(modes[m]["rate_per_replica"] for m in STATIC)
    best_local = max(modes[m]["rate_per_replica"] for m in LOCAL)
    rows = [[m, f"{r['rate_per_replica']:.2f}", f"{r['offered_tok_s_per_replica']:.0f}",
             f"{r['slo_attainment']:.1%}", ratio(r["rate_per_replica"], best_local),
             ratio(r["rate_per_replica"], best_static), r["simulations"]]
            for m, r in modes.items()]
    return print_table(
        f"CAPACITY AT THE SLO ({replicas} replicas, {capacity['duration_s']:.0f} s of "
        f"arrivals, first seed: the most requests/s per replica, this burst pattern scaled, "
        f"at which {capacity['attainment']:.0%} of requests meet the SLO; to "
        f"{CAPACITY_RESOLUTION} requests/s)",
        ["mode", "requests/s per replica", "offered tok/s per replica", "SLO met there",
         "/ best local-only", "/ best static", "simulations"], rows)


def plot(runs: dict[int, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capacity = next(((n, r["capacity"]) for n, r in runs.items() if "capacity" in r), None)
    fig, axes = plt.subplots(1, 3 if capacity else 2, figsize=(18 if capacity else 12, 4.5))
    ax_g, ax_s = axes[:2]
    scales = list(runs)
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        xs = [j + i * width for j in range(len(scales))]
        ax_g.bar(xs, [runs[n]["modes"][mode]["goodput"] / n for n in scales], width, label=mode)
        ax_s.bar(xs, [runs[n]["modes"][mode]["steady_switches_per_replica_hour"]
                      for n in scales],
                 width, label=mode)
    for ax, title in ((ax_g, "goodput per replica (tok/s, SLO met)"),
                      (ax_s, "tier switches per replica-hour (steady window)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(scales))],
                      [f"{n} replicas" for n in scales])
        ax.set_title(title)
    ax_s.set_yscale("symlog")
    if capacity:
        n, found = capacity
        for i, mode in enumerate(MODES):
            axes[2].bar(i, found["modes"][mode]["rate_per_replica"], color=f"C{i}")
        axes[2].set_xticks([])
        axes[2].set_title(f"capacity at the SLO, {n} replicas (requests/s per replica at "
                          f"which {found['attainment']:.0%} meet it)", fontsize=9)
    handles, labels = ax_g.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(MODES), fontsize=7)
    fig.suptitle("Cluster simulation (SIMULATOR engines, real router ranking and hub logic)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
