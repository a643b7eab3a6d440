"""Engine benchmark: the demo model on real vLLM, every static tier side by side in one run.

For each drafter (ngram, draft_model), workload (copy: repetitive text, greedy; free: code
openings sampled at T=0.8), K in {0,1,3,7,15} and concurrency in {1,8}: tokens/s, mean
acceptance length (1 + accepted/drafts, vLLM's definition), speed-up over K=0 in the same run
(every tier warmed first, then measured in rounds that take the tiers in alternating order),
and the median step time per (batch, K), which calibrates the simulator's cpu-demo preset.
Also the share of draft slots the drafter filled (prompt lookup proposes nothing without a
match), the median step time by draft tokens per sequence (what a step costs; `goodput`'s
step-cost profile is keyed by it), and the cost of one tier switch (median, p99) measured
under load.

    python -m bench.engine_bench --markdown bench/results/engine_bench.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.report import number, percentile
from bench.workloads import HIGH, LOW, Prompt
from replicas.engines.base import Engine, GenerationRequest, StepRecord
from replicas.engines.spec import EngineSpec
from replicas.engines.vllm_engine import VllmEngine
from replicas.tier_pool import TierPool

TIERS = (0, 1, 3, 7, 15)
CONCURRENCY = (1, 8)
WORKLOADS = {"copy": HIGH, "free": LOW}


@dataclass
class Row:
    drafter: str
    workload: str
    concurrency: int
    k: int
    tokens_per_s: float
    accept_len: float
    median_step_ms: float
    fill: float
    """Draft tokens verified over the slots the tier offered (K per running sequence)."""
    speedup_vs_k0: float = 1.0


async def run_batch(engine: Engine, prompts: list[Prompt], max_tokens: int) -> int:
    async def one(index: int, prompt: Prompt) -> int:
        request = GenerationRequest(
            request_id=uuid.uuid4().hex, prompt=prompt.text, max_tokens=max_tokens,
            temperature=prompt.temperature, seed=index, ignore_eos=True)
        tokens = 0
        async for chunk in engine.generate(request):
            tokens = chunk.completion_tokens
        return tokens

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def summarise(steps: list[StepRecord]) -> tuple[float, float, float]:
    """(acceptance length, median step ms, share of draft slots filled)."""
    drafts = sum(s.drafts for s in steps)
    accepted = sum(s.accepted_tokens for s in steps)
    timed = [s.wall_s for s in steps if s.times_decoding]
    slots = sum(s.draft_slots for s in steps)
    accept_len = 1 + accepted / drafts if drafts else 1.0
    return (accept_len, 1000 * statistics.median(timed) if timed else 0.0,
            sum(s.draft_tokens for s in steps) / slots if slots else 0.0)


def step_ms_by_depth(drafter: str, concurrency: int, steps: list[StepRecord]
                     ) -> list[dict[str, float | int | str]]:
    """Median step time by draft tokens per sequence (rounded), over full-batch steps."""
    by_depth: dict[int, list[float]] = {}
    for step in steps:
        if step.times_decoding and step.running == concurrency:
            by_depth.setdefault(step.draft_depth, []).append(1000 * step.wall_s)
    return [{"drafter": drafter, "concurrency": concurrency, "depth": depth,
             "steps": len(times), "median_step_ms": statistics.median(times)}
            for depth, times in sorted(by_depth.items())]


async def measure(engine: Engine, pool: TierPool, drafter: str, rounds: int,
                  max_tokens: int, concurrencies: tuple[int, ...] = CONCURRENCY
                  ) -> tuple[list[Row], list[dict[str, float | int | str]]]:
    """The rows, and the step times by depth pooled over workloads and tiers."""
    rows, steps_at = [], {c: [] for c in concurrencies}
    for workload, prompts in WORKLOADS.items():
        for concurrency in concurrencies:
            batch = [prompts[i % len(prompts)] for i in range(concurrency)]
            for k in TIERS:  # warm every tier on this batch shape: none pays a first use
                await pool.switch(k)
                await run_batch(engine, batch, 8)
            tokens, seconds = dict.fromkeys(TIERS, 0), dict.fromkeys(TIERS, 0.0)
            steps: dict[int, list[StepRecord]] = {k: [] for k in TIERS}
            for round_ in range(rounds):
                # Tiers interleaved, in alternating order (K=0 first, then last): a drift in
                # the machine's speed falls on every tier alike. Run back to back, K=0 first,
                # sampled text had every drafting tier 1.07-1.18x K=0 without one draft landing.
                for k in TIERS if round_ % 2 == 0 else TIERS[::-1]:
                    await pool.switch(k)
                    engine.drain_steps()
                    started = time.perf_counter()
                    tokens[k] += await run_batch(engine, batch, max_tokens)
                    seconds[k] += time.perf_counter() - started
                    steps[k].extend(engine.drain_steps())
            for k in TIERS:
                steps_at[concurrency].extend(steps[k])
                accept_len, step_ms, fill = summarise(steps[k])
                rows.append(Row(drafter, workload, concurrency, k, tokens[k] / seconds[k],
                                accept_len, step_ms, fill))
                print(f"{drafter:11s} {workload:4s} c={concurrency} K={k:2d} "
                      f"{tokens[k] / seconds[k]:7.1f} tok/s  accept_len {accept_len:5.2f}  "
                      f"step {step_ms:6.1f} ms  fill {fill:.2f}", flush=True)
    for row in rows:
        base = next(r for r in rows if (r.workload, r.concurrency, r.k) ==
                    (row.workload, row.concurrency, 0))
        row.speedup_vs_k0 = row.tokens_per_s / base.tokens_per_s
    return rows, [entry for concurrency, steps in steps_at.items()
                  for entry in step_ms_by_depth(drafter, concurrency, steps)]


async def acceptance_summary(engine: Engine, pool: TierPool, drafter: str
                             ) -> list[dict[str, float | str]]:
    """Draft acceptance rate (accepted / drafted) at K=3 on each kind of text, greedy and not."""
    kinds = {
        "copy, greedy": list(HIGH),
        "free code, greedy": [Prompt(p.text, 0.0) for p in LOW],
        "free code, T=0.8": list(LOW),
    }
    await pool.switch(3)
    summary = []
    for kind, prompts in kinds.items():
        engine.drain_steps()
        await run_batch(engine, prompts, 128)
        steps = engine.drain_steps()
        drafted = sum(s.draft_tokens for s in steps)
        accepted = sum(s.accepted_tokens for s in steps)
        summary.append({"drafter": drafter, "text": kind,
                        "acceptance_rate": accepted / drafted if drafted else 0.0,
                        "accept_len": summarise(steps)[0]})
    return summary


def switch_targets(switches: int, tiers: tuple[int, ...] = TIERS) -> list[int]:
    """The tiers `switch_cost` switches to, in order: K=0 and each drafting tier in turn
    (0, 1, 0, 3, 0, 7, 0, 15, 0, 1, ...), so every tier is switched to and from."""
    drafting = [k for k in tiers if k]
    return [drafting[i // 2 % len(drafting)] if i % 2 else 0 for i in range(switches)]


def switch_summary(seconds: list[float]) -> dict[str, float | int | None]:
    """Count, median and p99 (ms) of the timed switches; None where none was timed."""
    if not seconds:
        return {"switches": 0, "median_ms": None, "p99_ms": None}
    return {"switches": len(seconds), "median_ms": 1000 * statistics.median(seconds),
            "p99_ms": 1000 * percentile(seconds, 99)}


async def switch_cost(engine: Engine, pool: TierPool, switches: int
                      ) -> dict[str, float | int | None]:
    """Time tier switches while eight requests are decoding."""
    load = asyncio.create_task(run_batch(engine, list(HIGH), 256))
    await asyncio.sleep(0.5)
    seconds = []
    for k in switch_targets(switches):
        change = await pool.switch(k)
        if change is not None:
            seconds.append(change.seconds)
        await asyncio.sleep(0.005)
    await load
    return switch_summary(seconds)


async def bench(args: argparse.Namespace) -> dict:
    results: dict = {"rows": [], "by_depth": [], "switch_cost": {}, "acceptance": []}
    for drafter in args.drafters:
        spec = EngineSpec(drafter=drafter, kmax=max(TIERS), cpu_threads=args.threads)
        engine = VllmEngine(spec)
        await engine.start()
        try:
            pool = TierPool(engine, TIERS, initial_k=0)
            await pool.apply_initial()
            rows, by_depth = await measure(engine, pool, drafter, args.rounds,
                                           args.max_tokens, tuple(args.concurrency))
            results["rows"].extend(asdict(r) for r in rows)
            results["by_depth"].extend(by_depth)
            results["acceptance"].extend(await acceptance_summary(engine, pool, drafter))
            results["switch_cost"][drafter] = await switch_cost(engine, pool, args.switches)
            print(f"{drafter} tier switch: {results['switch_cost'][drafter]}", flush=True)
        finally:
            await engine.shutdown()
    return results


def markdown(results: dict) -> str:
    lines = ["### EVERY TIER SIDE BY SIDE (tiers interleaved, rounds in alternating order)", "",
             "| drafter | workload | concurrency | K | tok/s | vs K=0 | accept len | step ms | "
             "slots filled |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['drafter']} | {r['workload']} | {r['concurrency']} | {r['k']} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup_vs_k0']:.2f}x | "
                     f"{r['accept_len']:.2f} | {r['median_step_ms']:.1f} | "
                     f"{r['fill']:.2f} |")
    lines += ["", "### STEP TIME BY DRAFT TOKENS PER SEQUENCE (full-batch steps)", "",
              "| drafter | concurrency | draft tokens per sequence | steps | median step ms |",
              "|---|---|---|---|---|"]
    for d in results["by_depth"]:
        lines.append(f"| {d['drafter']} | {d['concurrency']} | {d['depth']} | {d['steps']} | "
                     f"{d['median_step_ms']:.1f} |")
    lines += ["", "### ACCEPTANCE AT K=3 (eight requests of 128 tokens)", "",
              "| drafter | text | acceptance rate at K=3 | accept len |", "|---|---|---|---|"]
    for a in results["acceptance"]:
        lines.append(f"| {a['drafter']} | {a['text']} | {a['acceptance_rate']:.2f} | "
                     f"{a['accept_len']:.2f} |")
    lines += ["", "### TIER SWITCH COST (under load)", "",
              "| drafter | tier switches timed | median ms | p99 ms |", "|---|---|---|---|"]
    for drafter, cost in results["switch_cost"].items():
        lines.append(f"| {drafter} | {cost['switches']} | {number(cost['median_ms'])} | "
                     f"{number(cost['p99_ms'])} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["drafter"], r["workload"]) for r in results["rows"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (drafter, workload) in zip(axes[0], panels, strict=True):
        for concurrency in sorted({r["concurrency"] for r in results["rows"]}):
            rows = [r for r in results["rows"] if (r["drafter"], r["workload"],
                                                   r["concurrency"]) == (drafter, workload,
                                                                         concurrency)]
            ax.plot([r["k"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o",
                    label=f"concurrency {concurrency}")
        ax.set(title=f"{drafter}, {workload}", xlabel="K", ylabel="tok/s", xticks=TIERS)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", nargs="+", default=["ngram", "draft_model"])
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds over every tier, in alternating order")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY),
                        help="batch sizes to measure (the step-cost profile's rows)")
    parser.add_argument("--switches", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", type=Path, default=Path("bench/results/engine_bench.md"))
    args = parser.parse_args()
    results = asyncio.run(bench(args))
    table = markdown(results)
    print(table)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(table)
    args.markdown.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.markdown.with_suffix(".png"))


if __name__ == "__main__":
    main()
