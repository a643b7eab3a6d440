"""Cluster simulation: SIMULATOR engines behind the real router ranking and telemetry-hub logic.

    python -m bench.cluster_sim                      # 8, 64 and 512 replicas, every mode
    python -m bench.cluster_sim --replicas 64 --duration 20 --json out.json
    python -m bench.cluster_sim --replicas 64 --duration 30 --rate 10 --burst-factor 1 \
        --seeds 1 --margins "" --json s.json --markdown s.md --plot s.png   # stationary load
    python -m bench.cluster_sim --replicas 8 64 --modes ema,ema_tiers,goodput_routed \
        --define 'ema_tiers={"name": "ema", "concurrency_source": "local", "1": [1, 3, 7, 15]}' \
        --json t.json    # a policy config of your own beside the table's modes

Each replica is a `SimulatedEngine` (cost model and synthetic acceptance, not a model) with the
real `TierPool`, `ControlLoop` and policy. The router ranks with `app.router.rank_replicas`
(class gathering) from its in-flight counts per class, as the Serve router does; the hub is
`app.telemetry_hub.ClusterState`, exchanged with every replica each telemetry period. A
discrete-event loop in virtual time drives them all, so no Ray or HTTP is needed and a run
takes seconds.

The load is bursty and skewed: tenants with Zipf popularity, each sending one request class
(copy-heavy, code-like or chat-like acceptance); every few seconds a burst multiplies the rate
and comes mostly from one tenant. Modes:

| mode | policy | concurrency seen | cluster prior | routing |
|---|---|---|---|---|
| static0..static15 | static K | - | no | power of two choices (Ray Serve's default) |
| batch_table | vLLM's table | local batch | no | power of two choices |
| ema | SGLang's EMA | local batch | no | power of two choices |
| goodput_local | goodput | local batch | no | power of two choices |
| goodput_cluster | goodput | effective (cluster) | yes | power of two choices |
| goodput_routed | goodput | effective (cluster) | yes | class-gathering (`rank_replicas`) |
| oracle_k | best K from exact acceptance (a reference) | exact | - | power of two choices |

A mode `--define`d with a policy config (as in `bench.transition`) runs that config: under a
new name as a local mode (Ray Serve's routing, no hub); under a mode's name in place of that
mode's policy, keeping its routing and hub (so the verdict tables judge against it).

`oracle_k` is a SIMULATOR-only reference: each decision it knows every queued request's true
acceptance model and the true step cost, which no engine knows, and scores K as `goodput` does
(the batch's steady state), without margin or dwell. It is not a strict bound (it decides per
step, blind to the queue's future), but it shows what exact acceptance adds to the choice of K
under this load with Ray Serve's routing: about what a cluster view could add to it (routing
can add more: see the gathering bound).

Reported per mode: goodput (tokens of the requests that met the latency SLO, per second of
arrivals; the run drains, so a request counts wherever it finishes), the share of requests that
met the SLO, throughput while arrivals last, p50/p99 request latency, and tier switches per
replica-hour: over the whole run, and in the steady window (after `WARMUP_S`, until arrivals
end). The whole run's count is mostly two one-off transients a fleet in service does not repeat
each hour: every replica's first moves from its starting tier, and the walk back up the tiers
as the queues drain after the last arrival. The steady window is what a long-running fleet
would see. At the smaller fleets the goodput modes run again told the SLO's bound on time per
output token (`tpot_slo_ms`), against themselves without it.

Goodput at one offered load separates the modes only where some of them miss the SLO, and
near overload a small difference in throughput becomes a large one in goodput. So at one
fleet size (`--capacity-at`) each mode's capacity at the SLO is also found: the most
requests a second per replica, the burst pattern scaled, at which 90% of requests meet it
(DistServe's definition of goodput; `slo_capacity`).

The parts are in `bench/cluster/`: `load` (the arrivals), `fleet` (one mode's fleet in virtual
time), `runs` (a simulation as a value for a worker, the capacity search) and `report` (the
verdicts, tables and plot). This module queues a table's simulations and writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.cli import check_output_dirs, defined_mode, defined_modes, positive, positive_seconds
from bench.cluster.fleet import MODES, ORACLE, PRESET
from bench.cluster.load import LoadShape, offered_tok_s_per_replica, token_shares, workload
from bench.cluster.report import plot, report, verdicts
from bench.cluster.runs import Run, run_one, slo_capacity


def submit(pool: Executor, args: argparse.Namespace, shape: LoadShape, replicas: int,
           modes: list[str], seed: int, duration_s: float,
           switch_margin: float | None = None, tpot_bound: bool = False
           ) -> dict[str, Future]:
    """Queue one simulation per mode; their summaries come back as the futures complete."""
    return {mode: pool.submit(run_one, Run(mode, replicas, duration_s, shape, seed,
                                           args.slo_ttft, args.slo_tpot, switch_margin,
                                           tpot_bound, args.defined.get(mode)))
            for mode in modes}


def run_all(pool: Executor, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Every table's simulations, fleet by fleet; a fleet's all go to the pool at once (its
    modes, the other seeds, the longer run and the margins)."""
    modes = args.modes.split(",")
    shape = LoadShape(rate_per_replica=args.rate, burst_factor=args.burst_factor)
    runs: dict[int, dict[str, Any]] = {}
    for replicas in args.replicas:
        duration = args.duration or max(10.0, 480 / replicas)
        every_mode = set(MODES) <= set(modes)  # the verdict tables need them all
        with_extras = every_mode and replicas <= args.seeds_up_to
        run_longer = every_mode and args.longer > duration
        other_seeds = range(args.seed + 1, args.seed + args.seeds) if with_extras else ()
        default = submit(pool, args, shape, replicas, modes, args.seed, duration)
        seeds = [submit(pool, args, shape, replicas, modes, seed, duration) for seed in other_seeds]
        longer, longer_seeds = {}, []
        if run_longer:
            longer = submit(pool, args, shape, replicas, modes, args.seed, args.longer)
            longer_seeds = [submit(pool, args, shape, replicas, modes, seed, args.longer)
                            for seed in other_seeds]
        margins = {}
        if with_extras and args.margins:
            margins = {margin: submit(pool, args, shape, replicas, ["goodput_routed"], args.seed,
                                      duration, float(margin))
                       for margin in args.margins.split(",")}
        capacity = {mode: pool.submit(slo_capacity, Run(
            mode, replicas, args.capacity_duration, shape, args.seed, args.slo_ttft,
            args.slo_tpot, policy=args.defined.get(mode)), args.capacity_attainment)
            for mode in MODES} if every_mode and replicas == args.capacity_at else {}
        # The goodput modes again, told the SLO's bound on time per token (`tpot_slo_ms`).
        bounded = submit(pool, args, shape, replicas, [m for m in MODES if m.startswith(
            "goodput")], args.seed, duration, tpot_bound=True) if with_extras else {}
        results = {}
        for mode, future in default.items():
            results[mode] = result = future.result()
            print(f"{replicas:4d} replicas {mode:16s} goodput {result['goodput']:9.0f} "
                  f"tok/s  wall {result['wall_s']:5.1f} s", flush=True)
        arrivals = workload(replicas, duration, shape, args.seed)
        runs[replicas] = run = {
            "arrivals": len(arrivals), "duration_s": duration,
            "offered_tok_s_per_replica": offered_tok_s_per_replica(arrivals, duration,
                                                                   replicas),
            "token_shares": token_shares(arrivals), "modes": results}
        if not every_mode:
            continue
        run["verdicts"] = verdicts(results)
        if seeds:
            run["seed_verdicts"] = [run["verdicts"]] + [verdicts(collect(f)) for f in seeds]
        if longer:
            longer_results = collect(longer)
            run["longer"] = {"duration_s": args.longer, "modes": longer_results,
                             "verdicts": verdicts(longer_results)}
            if longer_seeds:
                run["longer"]["seed_verdicts"] = [run["longer"]["verdicts"]] + [
                    verdicts(collect(f)) for f in longer_seeds]
        if margins:
            run["margins"] = {margin: collect(f)["goodput_routed"]
                              for margin, f in margins.items()}
        if bounded:
            run["tpot_bound"] = collect(bounded)
        if capacity:
            run["capacity"] = {"duration_s": args.capacity_duration,
                               "attainment": args.capacity_attainment,
                               "modes": collect(capacity)}
    return runs


def collect(futures: dict[str, Future]) -> dict[str, dict[str, Any]]:
    return {mode: future.result() for mode, future in futures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=positive, nargs="+", default=[8, 64, 512])
    parser.add_argument("--duration", type=positive_seconds, default=None,
                        help="simulated seconds of arrivals (default: 480 / replicas, at "
                             "least 10: the same simulated work at every scale)")
    parser.add_argument("--rate", type=float, default=LoadShape.rate_per_replica,
                        help="requests per second per replica between bursts")
    parser.add_argument("--burst-factor", type=float, default=LoadShape.burst_factor,
                        help="rate multiplier during a burst (1: stationary load)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--define", type=defined_mode, action="append", default=[],
                        metavar="NAME=JSON",
                        help="a mode named NAME running this policy config (repeatable; NAME "
                             "must be in --modes): a new name runs as a local mode, a mode's "
                             "name replaces its policy and keeps its routing and hub")
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tpot", type=float, default=0.020)
    parser.add_argument("--seed", type=int, default=0)
    # The README's tables come from these: a trial run should name its own files.
    parser.add_argument("--json", type=Path, default=Path("bench/results/cluster_sim.json"),
                        help="default: %(default)s (the README's source)")
    parser.add_argument("--markdown", type=Path, default=Path("bench/results/cluster_sim.md"),
                        help="default: %(default)s (the README's source)")
    parser.add_argument("--plot", type=Path, default=Path("bench/results/cluster_sim.png"),
                        help="default: %(default)s")
    parser.add_argument("--seeds", type=int, default=5,
                        help="at fleets up to --seeds-up-to replicas, also run this many seeds "
                             "in all (other burst patterns), over the longer run too, and "
                             "report the verdicts' spread")
    parser.add_argument("--seeds-up-to", type=int, default=64)
    parser.add_argument("--longer", type=float, default=30.0,
                        help="at every fleet whose default run is shorter, also run every mode "
                             "over this many seconds of arrivals (0: no)")
    parser.add_argument("--margins", default="0.15,0.3,0.5",
                        help="at fleets up to --seeds-up-to replicas, also run goodput_routed "
                             "with these switch margins (seed --seed): what fewer switches cost")
    parser.add_argument("--capacity-at", type=int, default=64,
                        help="at this fleet size, also find each mode's capacity at the SLO: "
                             "the most requests/s per replica (this burst pattern, scaled) at "
                             "which --capacity-attainment of requests meet it (0: no)")
    parser.add_argument("--capacity-attainment", type=float, default=0.9,
                        help="share of requests that must meet the SLO at capacity")
    parser.add_argument("--capacity-duration", type=float, default=30.0,
                        help="simulated seconds of arrivals of each capacity run")
    parser.add_argument("--jobs", type=positive, default=os.cpu_count() or 1,
                        help="simulations run at once, one per worker process (each is "
                             "single-threaded; default: one per core)")
    args = parser.parse_args()
    try:
        args.defined = defined_modes(args.define, args.modes.split(","))
    except ValueError as error:
        parser.error(str(error))
    if ORACLE in args.defined:
        parser.error(f"{ORACLE} is a reference, not a policy: it takes no config")
    if unknown := set(args.modes.split(",")) - set(MODES) - set(args.defined):
        parser.error(f"unknown modes {', '.join(sorted(unknown))}; choose from "
                     f"{', '.join(MODES)}, or --define one")
    check_output_dirs(parser, args.json, args.markdown, args.plot)
    with ProcessPoolExecutor(args.jobs) as pool:
        try:
            runs = run_all(pool, args)
        except BaseException:  # a failed run or Ctrl-C: do not wait for the queued ones
            pool.shutdown(cancel_futures=True)
            raise
    # First: whatever goes wrong in the report, the simulations are kept.
    args.json.write_text(json.dumps({"preset": PRESET, "slo_ttft_s": args.slo_ttft,
                                     "slo_tpot_s": args.slo_tpot, "jobs": args.jobs,
                                     "defined": args.defined, "runs": runs}, indent=2))
    complete = {n: r for n, r in runs.items() if "verdicts" in r}
    text = report(complete) if complete else ""
    if args.defined:
        text = "".join(f"Mode `{name}` runs `{json.dumps(config)}`.\n\n"
                       for name, config in args.defined.items()) + text
    print(f"\nSIMULATOR preset {PRESET}; SLO: TTFT <= {args.slo_ttft} s and TPOT <= "
          f"{args.slo_tpot * 1000:.0f} ms\n\n{text}")
    if complete:
        args.markdown.write_text(text + "\n")
        plot(complete, args.plot)
    written = [args.json, *((args.markdown, args.plot) if complete else ())]
    print("written: " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
