"""Policy replay: every policy and every static K through the SIMULATOR, in virtual time.

    python -m bench.policy_replay --preset h20-llama8b-ngram --workload transition --json PATH
    python -m bench.policy_replay --preset cpu-demo --workload sweep

The simulator engine (a cost model and synthetic acceptance, not a model) runs each mode over
the same workload: the transition phases low_1, high_1, low_2, high_2 (each `--requests`
requests at `--concurrency`, `--max-tokens` tokens each), or the concurrency sweep
1 -> 16 -> 64 -> 1 with one request class a phase (low, high, low, high): not the HTTP
benchmark's sweep, which mixes both classes in every phase, so here the class changes with
the concurrency (the tables' titles say so). The real control loop, tier pool and policies
decide; time is the sum of simulated step times, so a run takes seconds. Prints
SGLang-benchmark-style tables with an "oracle" row (best static per phase) and saves a plot
of K over time per policy.

`--class-priors` adds what a replica of the app has and the plain replay does not: the request
classes' past acceptance (`policies.class_acceptance`, folded every telemetry period), which
`goodput` uses as a hint at K=0 and to price each request before it has drafted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cli import check_output_dirs, non_negative_number, positive
from bench.report import compare_to_statics, print_table, verdict
from bench.workloads import sweep_shape
from policies.class_acceptance import (
    GREEDY_CLASS,
    SAMPLED_CLASS,
    ClassAcceptance,
    ClassPrior,
    class_counts,
)
from policies.registry import build_policy
from policies.signals import REQUEST_WINDOW, RequestAcceptance, RequestWindows, Signals
from replicas.control_loop import ControlLoop
from replicas.engines.base import GenerationRequest, period_windows
from replicas.engines.sim_engine import SimulatedEngine
from replicas.engines.sim_presets import PRESETS
from replicas.tier_pool import TierPool

CANDIDATES = (0, 1, 3, 7, 15)
# SGLang's published transition run (Llama-3.1-8B-Instruct, NGRAM, one H20; design notes):
# overall tok/s, then low_1, high_1, low_2, high_2.
PUBLISHED_H20 = {"static1": (1093.0, 931.3, 1076.1, 1034.3, 1454.2),
                 "static3": (1640.0, 1306.0, 1276.1, 1913.6, 2728.9),
                 "static7": (1660.0, 1113.9, 1240.2, 2090.0, 4413.2),
                 "static15": (1301.3, 906.9, 865.7, 1578.8, 5458.2)}
# Its mean acceptance lengths (we read them as the mean over the four phases).
PUBLISHED_H20_ACCEPT_LEN = {"static1": 1.73, "static3": 2.88, "static7": 4.46, "static15": 6.36}
# Every candidate tier as a static mode, K=0 too: the adaptive modes run it (the cpu-demo
# presets' low phases), so the best static and the per-phase oracle must offer it.
STATIC = tuple(f"static{k}" for k in CANDIDATES)
ADAPTIVE = ("batch_table", "ema", "goodput", "stability")
# The replay's sweep runs one class a phase: concurrency and class change together.
SWEEP_CLASSES = ("low", "high", "low", "high")
# How often a replica of the app folds its requests' outcomes into its class statistics and
# exchanges them with the hub (the app's `telemetry_period_s` default); the cluster
# simulation's too.
TELEMETRY_PERIOD_S = 0.5


def app_class(phase_class: str) -> str:
    """The class the app's ingress gives a request of this phase: greedy for the high
    phases' prompts (temperature 0), sampled for the low ones' (see `bench.workloads`)."""
    return GREEDY_CLASS if phase_class.startswith("high") else SAMPLED_CLASS


@dataclass(frozen=True)
class Phase:
    name: str
    request_class: str
    concurrency: int
    requests: int


def phases_for(workload: str, requests: int, concurrency: int) -> list[Phase]:
    """The transition's phases as the HTTP benchmark's; the sweep's concurrencies and sizes
    as its too, but each phase one class (low, high, low, high: `SWEEP_CLASSES`) where the
    HTTP sweep mixes both in every phase."""
    if workload == "transition":
        return [Phase(name, name, concurrency, requests)
                for name in ("low_1", "high_1", "low_2", "high_2")]
    return [Phase(name, request_class, c, n) for (name, c, n), request_class
            in zip(sweep_shape(requests), SWEEP_CLASSES, strict=True)]


def policy_config(mode: str, preset: str) -> dict[str, Any]:
    if mode.startswith("static"):
        return {"name": "static", "k": int(mode.removeprefix("static"))}
    if mode == "goodput":  # seeded by a start-up profile of the simulated engine's costs
        costs = PRESETS[preset]
        profile = [(b, k, costs.step_seconds(b, k)) for b in (1, 8, 64) for k in CANDIDATES]
        return {"name": "goodput", "profile": profile}
    return {"name": mode}


@dataclass
class PhaseResult:
    tokens: int = 0
    seconds: float = 0.0
    sequence_steps: int = 0


@dataclass
class ModeResult:
    phases: dict[str, PhaseResult] = field(default_factory=dict)
    timeline: list[tuple[float, int]] = field(default_factory=list)
    switches: int = 0


async def replay(mode: str, preset: str, phases: list[Phase], max_tokens: int,
                 class_priors: bool = False, step_jitter: float = 0.0,
                 step_drift: float = 0.0, seed: int = 0) -> ModeResult:
    engine = SimulatedEngine(PRESETS[preset], kmax=max(CANDIDATES), max_num_seqs=256,
                             seed=seed, step_jitter=step_jitter, step_drift=step_drift)
    pool = TierPool(engine, CANDIDATES, initial_k=3)
    await pool.apply_initial()
    classes, class_of = ClassAcceptance(), {}
    if class_priors:
        engine.finished_acceptance()  # keep finished requests' windows from now on

    def prior() -> ClassPrior:
        return classes.prior(Counter(class_of.values()), class_of)

    loop = ControlLoop(engine, pool, build_policy(policy_config(mode, preset), CANDIDATES),
                       max_batch=engine.max_num_seqs,
                       class_prior=prior if class_priors else None)
    result, clock, serial = ModeResult(), 0.0, 0
    next_period = TELEMETRY_PERIOD_S
    for phase in phases:
        outcome = result.phases.setdefault(phase.name, PhaseResult())
        in_flight: list[Any] = []
        submitted = 0
        while submitted < phase.requests or in_flight:
            while submitted < phase.requests and len(in_flight) < phase.concurrency:
                serial += 1
                in_flight.append(engine.submit(GenerationRequest(
                    request_id=f"{mode}-{serial}", prompt="sim", max_tokens=max_tokens,
                    temperature=0.0, request_class=phase.request_class, seed=serial)))
                if class_priors:
                    class_of[f"{mode}-{serial}"] = app_class(phase.request_class)
                submitted += 1
            engine.admit()
            before = engine.counters()
            seconds = engine.step()
            after = engine.counters()
            clock += seconds
            outcome.seconds += seconds
            outcome.tokens += after.generated_tokens - before.generated_tokens
            outcome.sequence_steps += after.sequence_steps - before.sequence_steps
            if class_priors and clock >= next_period:  # the replica's telemetry period
                next_period = clock + TELEMETRY_PERIOD_S
                # Finished requests come back with their phase's class.
                windows, classes_of = period_windows(engine, class_of)
                classes.observe(class_counts(windows, {
                    rid: class_of.get(rid) or app_class(c) for rid, c in classes_of.items()},
                    engine.kmax))
            for entry in in_flight:
                if entry.done:
                    class_of.pop(entry.request.request_id, None)
            in_flight = [entry for entry in in_flight if not entry.done]
            await loop.tick()
            result.timeline.append((clock, pool.active_k))
    result.switches = pool.switch_count
    return result


def pooled(results: list[ModeResult]) -> ModeResult:
    """Replays of one mode under several seeds as one: each phase's tokens, seconds and
    sequence-steps summed (its tok/s the pooled rate), switches averaged, the first's
    timeline."""
    if len(results) == 1:
        return results[0]
    total = ModeResult(timeline=results[0].timeline,
                       switches=round(sum(r.switches for r in results) / len(results)))
    for result in results:
        for name, phase in result.phases.items():
            into = total.phases.setdefault(name, PhaseResult())
            into.tokens += phase.tokens
            into.seconds += phase.seconds
            into.sequence_steps += phase.sequence_steps
    return total


def decision_time_us(preset: str, mode: str, repeats: int = 2000) -> float:
    """Median wall time of one `decide` call (microseconds) on a typical window: eight
    requests at K=3, each with a full window of verify outcomes (as a vLLM replica has)."""
    policy = build_policy(policy_config(mode, preset), CANDIDATES)
    requests = RequestWindows.of([
        RequestAcceptance(f"r{i}", accepted=tuple((i + j) % 4 for j in range(REQUEST_WINDOW)),
                          drafted=(3,) * REQUEST_WINDOW) for i in range(8)])
    signals = Signals(current_k=3, steps=4, running=8, waiting=0,
                      drafts=32, accepted_tokens=60,
                      drafting_sequence_steps=32,
                      accepted_per_pos=(28, 20, 12) + (0,) * 12,
                      drafted_per_pos=(32, 32, 32) + (0,) * 12,
                      slots_per_pos=(32, 32, 32) + (0,) * 12, requests=requests)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        policy.decide(signals)
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def summarise(results: dict[str, ModeResult], phase_names: list[str]) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode, r in results.items():
        tokens = sum(p.tokens for p in r.phases.values())
        seconds = sum(p.seconds for p in r.phases.values())
        steps = sum(p.sequence_steps for p in r.phases.values())
        modes[mode] = {"throughput": tokens / seconds, "accept_len": tokens / steps,
                       "switches": r.switches,
                       "phases": {n: r.phases[n].tokens / r.phases[n].seconds
                                  for n in phase_names},
                       "phase_accept_len": {n: r.phases[n].tokens / r.phases[n].sequence_steps
                                            for n in phase_names}}
    best = {n: max(modes[m]["phases"][n] for m in STATIC if m in modes) for n in phase_names}
    # Every mode generates the same tokens per phase; the sweep's phases differ in size, so
    # the oracle's overall rate weighs each phase's time by its tokens.
    tokens = {n: next(iter(results.values())).phases[n].tokens for n in phase_names}
    modes["oracle"] = {"throughput": sum(tokens.values()) /
                       sum(tokens[n] / best[n] for n in phase_names),
                       "accept_len": None, "switches": None, "phases": best}
    return modes


def one_class_note(phases: list[Phase]) -> str:
    """The phases' classes for a table title, where the names do not give them (the
    sweep's)."""
    if all(p.name == p.request_class for p in phases):
        return ""
    return "; one class a phase: " + ", ".join(f"{p.name} {p.request_class}" for p in phases)


def report(modes: dict[str, Any], phases: list[Phase], decision_us: dict[str, float],
           compare_published: bool = False) -> str:
    phase_names, note = [p.name for p in phases], one_class_note(phases)
    statics = {m: modes[m]["throughput"] for m in STATIC if m in modes}
    best_static = max(statics, key=statics.get)
    rows = [[m, f"{r['throughput']:.1f}",
             "-" if r["accept_len"] is None else f"{r['accept_len']:.2f}",
             "-" if r["switches"] is None else r["switches"],
             *(f"{r['phases'][n]:.1f}" for n in phase_names)] for m, r in modes.items()]
    parts = [print_table(f"OVERALL AND PER PHASE (tok/s, simulated time{note})",
                         ["mode", "tok/s", "accept len", "switches", *phase_names], rows)]
    comparisons = compare_to_statics({m: r["throughput"] for m, r in modes.items()
                                      if m != "oracle"})
    parts.append(print_table("ADAPTIVE VS STATIC", ["adaptive", "static", "delta", "verdict"],
                             [[a, s, f"{d:+.1%}", verdict(d)] for a, s, d in comparisons]))
    ratio_rows = []
    for mode in (m for m in ADAPTIVE if m in modes):
        ratio_rows.append([mode, f"{modes[mode]['throughput'] / statics[best_static]:.3f}",
                           *(f"{modes[mode]['phases'][n] / modes['oracle']['phases'][n]:.3f}"
                             for n in phase_names), f"{decision_us[mode]:.1f}"])
    parts.append(print_table(
        f"RATIOS (vs best static = {best_static}; per phase vs oracle{note})",
        ["mode", "vs best static", *(f"{n} / oracle" for n in phase_names),
         "decide() median us"], ratio_rows))
    if compare_published and phase_names == ["low_1", "high_1", "low_2", "high_2"]:
        parts.append(print_table(
            "REPLAY / PUBLISHED (H20 static table; within 10% overall, 15% per phase?)",
            ["mode", "overall", *phase_names, "accept len (phase mean) / published"],
            [[m, *(f"{ours / theirs:.3f}" for ours, theirs in zip(
                (modes[m]["throughput"], *(modes[m]["phases"][n] for n in phase_names)),
                published, strict=True)),
              f"{statistics.mean(modes[m]['phase_accept_len'].values()):.2f} / "
              f"{PUBLISHED_H20_ACCEPT_LEN[m]:.2f}"]
             for m, published in PUBLISHED_H20.items()]))
    return "\n\n".join(parts)


def plot(results: dict[str, ModeResult], modes: dict[str, Any], phase_names: list[str],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_k, ax_tp) = plt.subplots(2, 1, figsize=(11, 6.5))
    for mode in ADAPTIVE:
        if mode in results:
            xs, ks = zip(*results[mode].timeline, strict=True)
            ax_k.step(xs, ks, where="post", label=mode)
    ax_k.set(xlabel="simulated time (s)", ylabel="K", title="K over time per policy")
    ax_k.legend(fontsize=8)
    names = [m for m in modes]
    width = 0.8 / len(names)
    for i, mode in enumerate(names):
        ax_tp.bar([j + i * width for j in range(len(phase_names))],
                  [modes[mode]["phases"][n] for n in phase_names], width, label=mode)
    ax_tp.set_xticks([j + 0.4 - width / 2 for j in range(len(phase_names))], phase_names)
    ax_tp.set(ylabel="tok/s", title="throughput per phase")
    ax_tp.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h20-llama8b-ngram")
    parser.add_argument("--workload", choices=["transition", "sweep"], default="transition")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--class-priors", action="store_true",
                        help="price requests by what their class (greedy or sampled, as the "
                             "app's ingress names them) showed before, as a replica of the app "
                             "does; results are saved with a _class_priors suffix")
    parser.add_argument("--step-jitter", type=non_negative_number, default=0.0,
                        help="log sd of each step's time about the cost model's, drawn afresh "
                             "each step (a shared machine's scatter: `bench.step_scatter` reads it "
                             "from a running app's logs; about 0.35 here)")
    parser.add_argument("--step-drift", type=non_negative_number, default=0.0,
                        help="log sd of a slow factor on every step's time (the machine's "
                             "speed; about 0.15 here); with either, results are saved with a "
                             "_scatter suffix")
    parser.add_argument("--seeds", type=positive, default=1,
                        help="replay each mode this many times (seeds 0..N-1) and pool them: "
                             "a scattered machine makes one replay one draw")
    args = parser.parse_args()
    check_output_dirs(parser, args.json, args.plot, args.markdown)
    phases = phases_for(args.workload, args.requests, args.concurrency)
    names = [p.name for p in phases]
    results = {mode: pooled([asyncio.run(replay(
        mode, args.preset, phases, args.max_tokens, args.class_priors, args.step_jitter,
        args.step_drift, seed)) for seed in range(args.seeds)])
        for mode in (*STATIC, *ADAPTIVE)}
    modes = summarise(results, names)
    decision_us = {mode: decision_time_us(args.preset, mode) for mode in ADAPTIVE}
    text = report(modes, phases, decision_us, args.preset == "h20-llama8b-ngram")
    scattered = args.step_jitter or args.step_drift
    print(f"SIMULATOR preset {args.preset}, workload {args.workload}"
          f"{', class priors' if args.class_priors else ''}"
          + (f", step times scattered (jitter {args.step_jitter}, drift {args.step_drift})"
             if scattered else "")
          + (f", {args.seeds} seeds pooled" if args.seeds > 1 else "") + f"\n\n{text}")
    stem = Path("bench/results") / (f"policy_replay_{args.preset}_{args.workload}"
                                    + ("_class_priors" if args.class_priors else "")
                                    + ("_scatter" if scattered else ""))
    json_path, plot_path = args.json or stem.with_suffix(".json"), args.plot or \
        stem.with_suffix(".png")
    json_path.write_text(json.dumps({"preset": args.preset, "workload": args.workload,
                                     "modes": modes, "decision_us": decision_us}, indent=2))
    (args.markdown or stem.with_suffix(".md")).write_text(text + "\n")
    plot(results, modes, names, plot_path)


if __name__ == "__main__":
    main()
