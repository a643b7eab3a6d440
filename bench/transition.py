"""HTTP benchmark: every speculation mode side by side on the running application.

    python -m bench.transition --url http://127.0.0.1:8000 --workload transition \\
        --requests 16 --concurrency 8 --warmup 8 --max-tokens 256 \\
        --modes static1,static3,static7,static15,ema,goodput --json out.json --plot out.png

A mode is `static<K>`, a policy's name (the deployed policy keeps its deployed config, any
other takes its defaults), or a name given its own config with `--define NAME=JSON`, e.g.
`--define 'goodput_m15={"name": "goodput", "switch_margin": 0.15}' --modes goodput,goodput_m15`
to weigh a setting against the deployed one in the same run. `--aa-control goodput` runs
`goodput` a second time in every round, half the round away from the first, and reports the
two runs against each other apart from the other tables: an A/A test, the noise of this run's
ratios.

Each mode is applied by reconfiguring the running application (`POST /admin/policy`, no
restart), followed by a warm-up. The modes share what the app measured: a policy change
starts the new policy afresh, but each replica's and the fleet's acceptance per request class
and draft position carry on (as in a deployment that changes policy), so a mode can start from
rates measured under the mode before it; the rounds' counterbalanced order (`round_order`)
puts a different mode before each one from round to round.

The transition workload runs the phases low_1, high_1, low_2, high_2 (free text sampled at
T=0.8, then repetitive text decoded greedily; see `bench.workloads`); the sweep workload
moves concurrency 1 -> 16 -> 64 -> 1 over a mix of both.
Per phase, throughput = completion tokens / phase wall time and acceptance length = completion
tokens / sequence-steps (engine verify steps summed over sequences), read from the replicas'
counters (`GET /admin/replicas`).

With several rounds (`--rounds`) the tables give medians, and the ratios that decide something
are also taken round by round (the modes of a round run back to back, so a slow spell of the
machine cancels out) with a 95% interval over the rounds: the verdicts against each static,
and whether each bar is met, missed, or not resolved by the run (`bench.transition_report`
holds the tables and the plot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.cli import check_output_dirs, defined_mode, defined_modes, non_negative, positive
from bench.report import is_static, percentile
from bench.transition_report import combine, plot, report
from bench.workloads import HIGH, LOW, MIX, Prompt, interleaved, sweep_shape
from policies.registry import parse_policy_config

ADMIN_POLL_S = 0.5


@dataclass(frozen=True)
class Phase:
    name: str
    prompts: tuple[Prompt, ...]
    concurrency: int
    requests: int


def transition_phases(requests: int, concurrency: int) -> list[Phase]:
    return [Phase(name, LOW if name.startswith("low") else HIGH, concurrency, requests)
            for name in ("low_1", "high_1", "low_2", "high_2")]


def sweep_phases(requests: int) -> list[Phase]:
    """Every phase the mix of both kinds of text (the simulator replay's sweep differs)."""
    return [Phase(name, MIX, c, n) for name, c, n in sweep_shape(requests)]


def select_phases(phases: list[Phase], names: list[str]) -> list[Phase]:
    """The named phases, in the workload's order (e.g. to study one phase on its own)."""
    unknown = set(names) - {p.name for p in phases}
    if unknown:
        raise SystemExit(f"unknown phases {sorted(unknown)}: the workload has "
                         f"{[p.name for p in phases]}")
    return [p for p in phases if p.name in names]


def policy_for_mode(mode: str, deployed: dict[str, Any],
                    defined: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A mode `--define`d -> its config; `static7` -> static K=7; the deployed policy's
    name -> its deployed config (e.g. the goodput policy keeps its step-cost profile); any
    other name -> that policy's defaults."""
    if defined and mode in defined:
        return defined[mode]
    if is_static(mode):
        return {"name": "static", "k": int(mode.removeprefix("static"))}
    return deployed if deployed.get("name") == mode else {"name": mode}


@dataclass
class PhaseResult:
    name: str
    tokens: int = 0
    started: float = 0.0
    """`time.perf_counter()` when its first request went out."""
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    sequence_steps: int = 0

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accept_len(self) -> float:
        return self.tokens / self.sequence_steps if self.sequence_steps else 0.0


class Client:
    def __init__(self, url: str, model: str | None, max_tokens: int, api_key: str | None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=url, headers=headers, timeout=600)
        self.model = model
        self.max_tokens = max_tokens

    async def resolve_model(self) -> None:
        """The model to ask for: the one given, if the app serves it, else its first."""
        served = [m["id"] for m in
                  (await self.http.get("/v1/models")).raise_for_status().json()["data"]]
        if self.model is None:
            self.model = served[0]
        elif self.model not in served:
            raise SystemExit(f"the app serves {', '.join(served)}, not {self.model!r}")

    async def complete(self, prompt: Prompt, seed: int) -> tuple[int, float]:
        started = time.perf_counter()
        response = await self.http.post("/v1/completions", json={
            "model": self.model, "prompt": prompt.text, "max_tokens": self.max_tokens,
            "temperature": prompt.temperature, "seed": seed, "ignore_eos": True})
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"], time.perf_counter() - started

    async def replicas(self) -> list[dict[str, Any]]:
        return (await self.http.get("/admin/replicas")).raise_for_status().json()["replicas"]

    async def set_policy(self, policy: dict[str, Any]) -> None:
        (await self.http.post("/admin/policy", json={"policy": policy})).raise_for_status()


async def run_phase(client: Client, phase: Phase, seed_base: int) -> PhaseResult:
    result = PhaseResult(phase.name)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(phase.requests):
        queue.put_nowait(index)

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            try:
                tokens, latency = await client.complete(
                    phase.prompts[index % len(phase.prompts)], seed_base + index)
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                # Refused, cut, or a reply without a completion's usage (a body that is not
                # the JSON asked for): an error of this request; the phase goes on.
                result.errors += 1
                continue
            result.tokens += tokens
            result.latencies.append(latency)

    before = await client.replicas()
    result.started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(phase.concurrency)))
    result.seconds = time.perf_counter() - result.started
    after = await client.replicas()
    result.sequence_steps = counter_growth(before, after,
                                           lambda replica: replica["counters"]["sequence_steps"])
    return result


def counter_growth(before: list[dict], after: list[dict], read: Callable[[dict], int]) -> int:
    """Sum over the replicas of a counter's growth (`read` from a replica's admin stats): a
    replica that left meanwhile adds nothing and one that joined (a restarted one has a new
    id) counts from zero, where the difference of the fleet's sums would count a departed
    replica's whole count against the rest."""
    start = {r["replica_id"]: read(r) for r in before}
    return sum(max(0, read(r) - start.get(r["replica_id"], 0)) for r in after)


async def track_tiers(client: Client, stop: asyncio.Event, origin: float,
                      timeline: list[dict[str, Any]]) -> None:
    while not stop.is_set():
        for replica in await client.replicas():
            timeline.append({"t": time.perf_counter() - origin, "replica": replica["replica_id"],
                             "k": replica["active_k"]})
        await asyncio.sleep(ADMIN_POLL_S)


async def run_mode(client: Client, mode: str, phases: list[Phase], warmup: int,
                   origin: float, policy: dict[str, Any]) -> dict[str, Any]:
    await client.set_policy(policy)
    warm = Phase("warmup", interleaved(LOW, HIGH), phases[0].concurrency, warmup)
    await run_phase(client, warm, seed_base=10_000)
    replicas_before = await client.replicas()
    timeline: list[dict[str, Any]] = []
    stop = asyncio.Event()
    tracker = asyncio.create_task(track_tiers(client, stop, origin, timeline))
    mode_started = time.perf_counter() - origin
    results = []
    try:
        for i, phase in enumerate(phases):
            results.append(await run_phase(client, phase, seed_base=100 * i))
    except BaseException:  # the app went away: the tracker must not go on polling it
        tracker.cancel()
        await asyncio.gather(tracker, return_exceptions=True)
        raise
    stop.set()
    await tracker
    switches = counter_growth(replicas_before, await client.replicas(),
                              lambda replica: replica["switch_count"])
    tokens = sum(r.tokens for r in results)
    seconds = sum(r.seconds for r in results)
    latencies = [lat for r in results for lat in r.latencies]
    steps = sum(r.sequence_steps for r in results)
    summary = {
        "throughput": tokens / seconds if seconds else 0.0,
        "latency_s": sum(latencies) / len(latencies) if latencies else None,
        "latency_p99_s": percentile(latencies, 99),
        "accept_len": tokens / steps if steps else 0.0,
        "switches": switches,
        "errors": sum(r.errors for r in results),
        "phases": {r.name: r.throughput for r in results},
        "phase_tokens": {r.name: r.tokens for r in results},
        "phase_accept_len": {r.name: r.accept_len for r in results},
        # Every request's latency, so a phase's tail (its last requests end the phase) can
        # be studied later.
        "phase_latencies_s": {r.name: [round(lat, 4) for lat in r.latencies] for r in results},
        "timeline": timeline,
        "started_s": mode_started,
        "phase_started_s": [r.started - origin for r in results],
    }
    print(f"{mode:10s} {summary['throughput']:8.1f} tok/s  accept_len "
          f"{summary['accept_len']:.2f}  switches {switches}  errors {summary['errors']}",
          flush=True)
    return summary


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    client = Client(args.url, args.model, args.max_tokens, args.api_key)
    try:
        await client.resolve_model()
    except httpx.HTTPError as error:  # nothing listening, no scheme, a refused key
        await client.http.aclose()
        raise SystemExit(f"cannot use the app at {args.url}: {error!r}") from None
    phases = (transition_phases(args.requests, args.concurrency)
              if args.workload == "transition" else sweep_phases(args.requests))
    if args.phases:
        phases = select_phases(phases, args.phases)
    origin = time.perf_counter()
    found = await client.replicas()
    deployed = found[0]["policy"]  # as deployed, before any mode changes it
    policies = {mode: policy_for_mode(mode, deployed, args.defined) for mode in args.modes}
    check_modes(policies, found[0]["candidates"])
    order = list(args.modes)
    if args.aa_control:
        order = with_aa_copy(order, args.aa_control)
        policies[again(args.aa_control)] = policies[args.aa_control]
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in order}
    stopped_by = None
    try:
        for round_ in range(args.rounds):  # modes interleaved, so a slow spell hits all
            for mode in round_order(order, round_):
                rounds[mode].append(await run_mode(client, mode, phases, args.warmup, origin,
                                                   policies[mode]))
    except (httpx.HTTPError, KeyError) as error:
        # The app failed mid-run (an admin call, a replica gone): keep the rounds every mode
        # finished rather than lose an hour of them; the results say why they are fewer.
        stopped_by = repr(error)
        print(f"the run stopped early: {stopped_by}", file=sys.stderr, flush=True)
    finally:
        # The app as it was found: a run after this one (the suite's sweep after its
        # transition) reads the deployed policy from it, and left on the last mode it ran
        # the deployed policy's name with defaults (no step-cost profile). A failed restore
        # is reported, not raised: it must not lose the rounds run or hide a round's error.
        try:
            await client.set_policy(deployed)
        except httpx.HTTPError as error:
            print(f"could not put the deployed policy back ({error!r}); the app runs the "
                  f"last mode's", file=sys.stderr, flush=True)
        await client.http.aclose()
    finished = min(len(runs) for runs in rounds.values())
    if not finished:
        raise SystemExit(f"no round finished: {stopped_by}")
    combined = {mode: combine(runs[:finished]) for mode, runs in rounds.items()}
    results = {"workload": args.workload, "url": args.url, "max_tokens": args.max_tokens,
               "rounds": finished, "phases": [p.name for p in phases],
               # The load and what it ran on, so runs of another shape are not pooled.
               "requests": [p.requests for p in phases],
               "concurrency": [p.concurrency for p in phases], "warmup": args.warmup,
               "model": client.model, "replicas": len(found),
               "tier_sample_s": ADMIN_POLL_S,  # the plot's K timeline misses faster moves
               "candidates": found[0]["candidates"],
               "policies": policies,  # what each mode ran, so a run can be repeated
               "modes": {mode: combined[mode] for mode in args.modes}}
    if args.app_config:
        results["app_config"] = args.app_config
    if stopped_by:
        results["stopped_early"] = {"rounds_asked": args.rounds, "error": stopped_by}
    if args.aa_control:  # kept apart: no table but its own may count it as a mode
        results["aa_control"] = {"mode": args.aa_control,
                                 "again": combined[again(args.aa_control)]}
    return results


def again(mode: str) -> str:
    """The name `--aa-control` runs `mode`'s second copy under."""
    return f"{mode} (again)"


def with_aa_copy(modes: list[str], mode: str) -> list[str]:
    """`modes` with `mode`'s A/A copy half the list away from it: `round_order` rotates and
    reverses the list, which keeps that distance, so in every round the two run about as far
    apart as any two modes the report compares, each behind some other mode (next to each
    other they would measure only back-to-back noise, and the copy would always start from
    the state its twin left)."""
    order, half = list(modes), (len(modes) + 1) // 2
    # Inserted at j, the copy runs (j - i) modes after its twin at i, or, cyclically, when
    # it goes in before the twin, len(modes) - i + j: this j makes it `half` either way.
    order.insert((order.index(mode) + half - 1) % len(order) + 1, again(mode))
    return order


def check_modes(policies: dict[str, dict[str, Any]], candidates: list[int]) -> None:
    """Refuse, before the first round, a mode the app would refuse at its turn: a policy
    config it cannot parse, or a static K that is not one of the replicas' tiers."""
    problems = []
    for mode, policy in policies.items():
        try:
            parsed = parse_policy_config(policy)
        except ValueError as error:
            problems.append(f"{mode}: {error}")
            continue
        if parsed.name == "static" and parsed.k not in candidates:
            problems.append(f"{mode}: K={parsed.k} is not one of the replicas' tiers "
                            f"{candidates}")
    if problems:
        raise SystemExit("modes the app would refuse:\n  " + "\n  ".join(problems))


def round_order(modes: list[str], round_: int) -> list[str]:
    """The order of `modes` in round `round_` (from 0): counterbalanced in pairs of rounds.
    An even round runs them rotated by one more mode than the even round before, the odd
    round after it the reverse of that order. So over each pair every mode holds the mean
    position (a speed that drifts steadily through a pair of rounds favours no mode), and
    each mode follows one neighbour in one round and the other in the next. (A rotation
    alone kept every mode behind the same one, `goodput` behind `ema` in the suite, and
    left some modes early in most rounds of five.)"""
    shift = round_ // 2 % len(modes)
    order = modes[shift:] + modes[:shift]
    return order[::-1] if round_ % 2 else order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--workload", choices=["transition", "sweep"], default="transition")
    parser.add_argument("--requests", type=positive, default=16)
    parser.add_argument("--concurrency", type=positive, default=8,
                        help="the transition's clients (the sweep sets its own: 1, 16, 64, 1)")
    parser.add_argument("--warmup", type=non_negative, default=8)
    parser.add_argument("--max-tokens", type=positive, default=256)
    parser.add_argument("--rounds", type=positive, default=1,
                        help="run every mode this many times, interleaved; report medians")
    parser.add_argument("--modes", type=lambda s: s.split(","),
                        default=["static1", "static3", "static7", "static15", "ema", "goodput"])
    parser.add_argument("--define", type=defined_mode, action="append", default=[],
                        metavar="NAME=JSON",
                        help="a mode named NAME running this policy config (repeatable; "
                             "NAME must be in --modes; the deployed policy's name replaces "
                             "its deployed config), e.g. 'goodput_m15={\"name\": "
                             "\"goodput\", \"switch_margin\": 0.15}'")
    parser.add_argument("--aa-control", default=None, metavar="MODE",
                        help="run MODE (one of --modes) a second time in every round, "
                             "reported apart as the run's noise (an A/A test)")
    parser.add_argument("--phases", type=lambda s: s.split(","), default=None,
                        help="run only these of the workload's phases (default: all)")
    parser.add_argument("--app-config", default=None,
                        help="the config the app was started from, recorded in the results "
                             "(the app does not say; runs of different ones are not pooled)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    try:
        args.defined = defined_modes(args.define, args.modes)
    except ValueError as error:
        parser.error(str(error))
    if duplicated := sorted({m for m in args.modes if args.modes.count(m) > 1}):
        parser.error(f"--modes names {', '.join(duplicated)} twice (for an A/A control: "
                     "--aa-control)")
    check_output_dirs(parser, args.json, args.plot, args.markdown)
    if args.aa_control and args.aa_control not in args.modes:
        parser.error(f"--aa-control {args.aa_control!r} is not one of --modes")
    if bad := [m for m in args.modes
               if is_static(m) and not m.removeprefix("static").isdigit()]:
        parser.error(f"{', '.join(bad)}: a static mode is static<K>, K a number")
    results = asyncio.run(bench(args))
    if args.json:  # first: whatever goes wrong below, the rounds are kept
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    text = report(results)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
