"""The HTTP benchmark's bookkeeping: rounds combine into medians, errors add up, and a run
that goes wrong keeps what it measured."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from bench.cli import defined_mode, defined_modes
from bench.http_suite import (
    end_leftovers,
    result_name,
    result_stem,
    serving,
    transition_command,
)
from bench.load import is_loopback, run_load
from bench.policy_replay import phases_for
from bench.report import RatioInterval, percentile, t_975
from bench.transition import (
    Client,
    Phase,
    again,
    bench,
    build_parser,
    check_modes,
    counter_growth,
    policy_for_mode,
    round_order,
    run_phase,
    select_phases,
    sweep_phases,
    with_aa_copy,
)
from bench.transition_report import (
    RUN_SHAPE,
    combine,
    paired_ratios,
    plot,
    pool,
    report,
    typical_round,
)
from bench.workloads import HIGH, LOW, MIX, interleaved


def _round(throughput: float, low: float, errors: int, switches: int) -> dict:
    return {"throughput": throughput, "latency_s": throughput / 100, "accept_len": 1.5,
            "switches": switches, "errors": errors, "phases": {"low_1": low, "high_1": 900.0},
            "phase_tokens": {"low_1": 1000, "high_1": 1000},
            "phase_accept_len": {"low_1": 1.0, "high_1": 5.0},
            "timeline": [{"t": throughput, "replica": "r", "k": 1}], "started_s": throughput,
            "phase_started_s": [throughput, throughput + 1]}


def test_rounds_combine_into_medians_and_summed_errors() -> None:
    combined = combine([_round(300, 250, 0, 4), _round(500, 150, 1, 2), _round(400, 200, 2, 9)])
    assert combined["throughput"] == 400
    assert combined["phases"] == {"low_1": 200, "high_1": 900}
    assert combined["switches"] == 4
    assert combined["errors"] == 3
    assert len(combined["timeline"]) == 3 and combined["started_s"] == [300, 500, 400]
    assert [r["throughput"] for r in combined["rounds"]] == [300, 500, 400]


def test_a_defined_mode_runs_its_own_config_beside_the_deployed_one() -> None:
    deployed = {"name": "goodput", "profile": [[1, 0, 0.002]], "switch_margin": 0.05}
    name, config = defined_mode('goodput_m15={"name": "goodput", "switch_margin": 0.15}')
    defined = {name: config}
    assert policy_for_mode("goodput_m15", deployed, defined) == \
        {"name": "goodput", "switch_margin": 0.15}
    assert policy_for_mode("goodput", deployed, defined) is deployed
    assert policy_for_mode("static7", deployed, defined) == {"name": "static", "k": 7}
    assert policy_for_mode("ema", deployed, defined) == {"name": "ema"}


@pytest.mark.parametrize("text", [
    "goodput", "=1", "a,b={\"name\": \"goodput\"}", 'static2={"name": "ema"}',
    "g={not json", "g=[1]", 'g={"k": 3}', 'g={"name": "goodput", "switch_margin": -1}',
    'g={"name": "goodput", "no_such_field": 1}', 'g={"name": "static", "k": 2}'])
def test_a_malformed_define_is_refused_with_its_reason(text: str) -> None:
    """Checked as the application checks a policy, when the command is read, not when the
    mode's turn comes in a run of an hour."""
    with pytest.raises(argparse.ArgumentTypeError):
        defined_mode(text)


def test_each_define_is_named_once_and_runs() -> None:
    config = {"name": "goodput", "switch_margin": 0.15}
    assert defined_modes([("g", config)], ["static1", "g"]) == {"g": config}
    with pytest.raises(ValueError, match="'g' is defined twice"):
        defined_modes([("g", config), ("g", {"name": "ema"})], ["g"])
    with pytest.raises(ValueError, match="'h' is defined but not in --modes"):
        defined_modes([("h", config)], ["static1"])


@pytest.mark.parametrize(("arguments", "reason"), [
    (["--modes", "static1", "--define", 'g={"name": "goodput"}'],
     "'g' is defined but not in --modes"),
    (["--modes", "static1,ema", "--aa-control", "goodput"],
     "--aa-control 'goodput' is not one of --modes"),
    (["--modes", "static1,static,staticx"],
     "static, staticx: a static mode is static<K>, K a number")])
def test_the_command_line_refuses_a_mode_it_would_not_run(arguments: list[str], reason: str
                                                          ) -> None:
    """Refused when the command is read, before it reaches for the app."""
    command = [sys.executable, "-m", "bench.transition", "--url", "http://127.0.0.1:9",
               *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 2 and reason in done.stderr


def test_rounds_are_counterbalanced_in_pairs() -> None:
    """Over each pair of rounds every mode holds the same mean position (a steady drift of
    the machine's speed favours none), follows a different mode in each round of the pair,
    and the pairs start from different modes."""
    modes = ["static0", "static1", "static3", "static7", "static15", "ema", "goodput"]
    orders = [round_order(modes, r) for r in range(6)]
    assert all(sorted(order) == sorted(modes) for order in orders)
    for first, second in zip(orders[::2], orders[1::2], strict=True):
        positions = {m: first.index(m) + second.index(m) for m in modes}
        assert set(positions.values()) == {len(modes) - 1}
        before = [{order[i]: order[i - 1] for i in range(1, len(order))}
                  for order in (first, second)]
        assert all(before[0][m] != before[1][m] for m in before[0] if m in before[1])
    assert len({order[0] for order in orders[::2]}) == 3


def test_report_compares_adaptive_modes_with_the_best_static_per_phase() -> None:
    modes = {"static1": combine([_round(300, 250, 0, 0)]),
             "static15": combine([_round(400, 100, 0, 0)]),
             "goodput": combine([_round(420, 225, 0, 3)])}
    text = report({"modes": modes, "phases": ["low_1", "high_1"], "rounds": 1})
    row = next(line for line in text.splitlines() if line.startswith("| goodput | 1.050"))
    assert row == "| goodput | 1.050 | 0.900 | 1.000 |"
    # static1's low_1 (250 tok/s) and either's high_1 (900): 2000 tokens in 5.11 s.
    ceiling = 2000 / (1000 / 250 + 1000 / 900)
    assert f"| each phase's best static | {ceiling:.1f} | {ceiling / 400:.3f} | 1.000 |" in text
    assert f"| goodput | 420.0 | 1.050 | {420 / ceiling:.3f} |" in text


def test_report_pairs_each_round_with_that_rounds_best_static() -> None:
    """Round 2 ran at half speed for every mode; each round is compared with its own best
    static, so the slow round does not count against any mode."""
    modes = {"static1": combine([_round(400, 200, 0, 0), _round(200, 100, 0, 0)]),
             "static15": combine([_round(380, 210, 0, 0), _round(190, 95, 0, 0)]),
             "goodput": combine([_round(410, 220, 0, 3), _round(205, 90, 0, 3)])}
    assert paired_ratios(modes, ["static1", "static15"], "goodput") == \
        pytest.approx([1.025, 1.025])
    assert paired_ratios(modes, ["static1", "static15"], "goodput", "low_1") == \
        pytest.approx([220 / 210, 0.9])
    text = report({"modes": modes, "phases": ["low_1", "high_1"], "rounds": 2})
    row = next(line for line in text.splitlines() if line.startswith("| goodput | 1.025 ["))
    assert row == ("| goodput | 1.025 [1.025-1.025] 2/2 | 0.974 [0.900-1.048] 2/2 "
                   "| 1.000 [1.000-1.000] 2/2 |")


def test_an_aa_control_is_reported_against_its_mode_and_nowhere_else() -> None:
    """The second copy of `goodput` ran the same configuration: it gets its own table (its
    runs over the first copy's), and no verdict counts it as an adaptive mode of its own."""
    modes = {"static15": combine([_round(400, 100, 0, 0), _round(400, 100, 0, 0)]),
             "goodput": combine([_round(400, 200, 0, 3), _round(500, 100, 0, 3)])}
    again = combine([_round(440, 150, 0, 3), _round(450, 120, 0, 3)])
    text = report({"modes": modes, "phases": ["low_1", "high_1"], "rounds": 2,
                   "aa_control": {"mode": "goodput", "again": again}})
    assert "### A/A CONTROL: goodput RUN TWICE IN EVERY ROUND" in text
    # medians 445 / 450 overall, 135 / 150 in low_1; rounds 1.1 and 0.9, 0.75 and 1.2
    assert f"| medians | {445 / 450:.3f} | 0.900 | 1.000 |" in text
    assert "| round by round: median [min-max] | 1.000 [0.900-1.100] | 0.975 [0.750-1.200] " \
        "| 1.000 [1.000-1.000] |" in text
    assert "again" not in text, "the control has no row in any other table"


def test_the_plot_shows_each_adaptive_mode_in_its_median_round(tmp_path: Path) -> None:
    rounds = [_round(300, 250, 0, 4), _round(500, 150, 1, 2), _round(400, 200, 2, 9)]
    assert typical_round(rounds) == 2, "the round with the median throughput"
    assert typical_round(rounds[:2]) == 0, "the lower of two"
    modes = {"static1": combine([_round(300, 250, 0, 0)]), "goodput": combine(rounds)}
    plot({"modes": modes, "phases": ["low_1", "high_1"], "rounds": 3}, tmp_path / "k.png")
    assert (tmp_path / "k.png").read_bytes()[:4] == b"\x89PNG"


def test_a_saved_run_is_drawn_again_from_its_json(tmp_path: Path) -> None:
    """`python -m bench.transition_report run.json --plot out.png` redraws a run's plot (a
    fix to the plot need not wait for the next run); pooled runs have no timelines to draw."""
    modes = {"static1": combine([_round(300, 250, 0, 0)]),
             "goodput": combine([_round(400, 200, 0, 3)])}
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"modes": modes, "phases": ["low_1", "high_1"], "rounds": 1}))
    drawn = subprocess.run([sys.executable, "-m", "bench.transition_report", str(run),
                            "--plot", str(tmp_path / "k.png")], capture_output=True, text=True)
    assert drawn.returncode == 0, drawn.stderr
    assert (tmp_path / "k.png").read_bytes()[:4] == b"\x89PNG"
    refused = subprocess.run([sys.executable, "-m", "bench.transition_report", str(run),
                              str(run), "--plot", str(tmp_path / "two.png")],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "--plot takes one run" in refused.stderr
    assert not (tmp_path / "two.png").exists()


def test_a_subset_of_phases_runs_in_the_workloads_order() -> None:
    phases = sweep_phases(8)
    assert [p.name for p in select_phases(phases, ["c1_end", "c1"])] == ["c1", "c1_end"]
    assert [p.concurrency for p in select_phases(phases, ["c64"])] == [64]
    with pytest.raises(SystemExit, match="c32"):
        select_phases(phases, ["c32"])


def test_the_http_sweep_mixes_both_kinds_of_text_and_the_replay_sweep_has_its_shape() -> None:
    """One sweep shape for both benchmarks; the HTTP phases alternate repetitive and free
    text, the replay's hold one class each (its tables say so)."""
    http = sweep_phases(16)
    assert [(p.name, p.concurrency, p.requests) for p in http] == \
        [("c1", 1, 16), ("c16", 16, 32), ("c64", 64, 128), ("c1_end", 1, 16)]
    assert all(p.prompts == MIX for p in http)
    assert MIX[:4] == (HIGH[0], LOW[0], HIGH[1], LOW[1])
    assert len(MIX) == len(HIGH) + len(LOW)
    replay = phases_for("sweep", requests=16, concurrency=8)
    assert [(p.name, p.concurrency, p.requests) for p in replay] == \
        [(p.name, p.concurrency, p.requests) for p in http]
    assert [p.request_class for p in replay] == ["low", "high", "low", "high"]
    assert interleaved(LOW, HIGH)[:2] == (LOW[0], HIGH[0])


@pytest.mark.parametrize(("url", "loopback"), [
    ("http://127.0.0.1:8000", True), ("http://localhost:8000/v1", True),
    ("http://127.0.0.1", True), ("http://localhost.example.com:8000", False),
    ("http://127.0.0.1.example.com", False), ("https://127.0.0.1:8000", False),
    ("http://10.0.0.1:8000", False)])
def test_the_benchmarks_load_only_this_machine(url: str, loopback: bool) -> None:
    assert is_loopback(url) is loopback
    if not loopback:
        with pytest.raises(ValueError, match="loopback"):
            asyncio.run(run_load(url, requests=1, concurrency=1, time_limit_s=1))
        with pytest.raises(SystemExit, match="loopback"), serving(Path("x.yaml"), url, 1):
            pass


def test_the_suite_ends_processes_the_app_left_running() -> None:
    """A process that ignores SIGTERM (as an engine core stuck in a step would) is killed;
    one that already exited is not reported."""
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('ready', flush=True); time.sleep(120)"],
                                stdout=subprocess.PIPE, text=True)
    gone = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    processes = [psutil.Process(stubborn.pid), psutil.Process(gone.pid)]
    assert stubborn.stdout.readline() == "ready\n"
    gone.communicate()  # it exits once its input closes
    ended = end_leftovers(processes, grace_s=1)
    assert ended == [f"{sys.executable} (pid {stubborn.pid})"]
    assert stubborn.wait(timeout=5) == -9


def test_another_configs_suite_writes_beside_the_defaults_results() -> None:
    """The default config keeps the names the README reads; a named one gets its own files,
    and a name that is not a plain suffix is refused before anything runs."""
    assert result_stem("transition").name == "transition_http"
    assert result_stem("sweep", "draft_model").name == "sweep_http_draft_model"
    assert result_stem("sweep", "draft_model").parent == result_stem("sweep").parent
    for bad in ("../x", "a/b", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            result_name(bad)


def test_the_suite_runs_each_workload_with_the_issues_settings_and_a_rounds_override() -> None:
    """The transition module's own parser reads the suite's command: an override of the
    rounds reaches the run and the default stays six."""
    stem = result_stem("sweep", "draft_model")
    for rounds, expected in (((), 6), ((4,), 4)):
        command = transition_command("http://127.0.0.1:8000", "sweep", stem, *rounds)
        assert command[1:3] == ["-m", "bench.transition"]
        parsed = build_parser().parse_args(command[3:])
        assert (parsed.rounds, parsed.workload, parsed.requests) == (expected, "sweep", 16)
        assert parsed.json == stem.with_suffix(".json")
        assert parsed.aa_control == "goodput" and "static0" in parsed.modes
        assert parsed.app_config == "serve_config.yaml"
    command = transition_command("http://127.0.0.1:8000", "sweep", stem, 4,
                                 Path("configs/cpu-draft-model.yaml"))
    assert build_parser().parse_args(command[3:]).app_config == "configs/cpu-draft-model.yaml"


def test_the_aa_copy_runs_half_a_round_from_its_twin_in_every_round() -> None:
    """Next to each other the two copies would measure back-to-back noise only, and the
    copy would always start from the state its twin left."""
    for count in range(1, 9):
        modes = [f"m{i}" for i in range(count)]
        for twin in modes:
            order = with_aa_copy(modes, twin)
            assert sorted(order) == sorted([*modes, again(twin)])
            for round_ in range(2 * len(order)):
                ran = round_order(order, round_)
                apart = abs(ran.index(twin) - ran.index(again(twin)))
                assert min(apart, len(order) - apart) == len(order) // 2


def test_a_mode_the_app_would_refuse_is_refused_before_the_first_round() -> None:
    deployed = {"name": "goodput"}
    policies = {mode: policy_for_mode(mode, deployed)
                for mode in ("static2", "emaa", "static3", "goodput")}
    with pytest.raises(SystemExit) as refused:
        check_modes(policies, [0, 1, 3, 7, 15])
    message = str(refused.value)
    assert "static2: K=2 is not one of the replicas' tiers" in message
    refused_modes = {line.strip().split(":")[0] for line in message.splitlines()[1:]}
    assert refused_modes == {"static2", "emaa"}, message
    check_modes({"static3": policies["static3"], "goodput": deployed}, [0, 3])


def test_a_static_mode_that_made_nothing_leaves_the_report_readable() -> None:
    """Every request of static1 failed (0 tok/s, no latency): the ratios against it read
    n/a instead of ending the run's report with a ZeroDivisionError."""
    dead = _round(0, 0, 16, 0)
    dead.update(latency_s=None, phases={"low_1": 0.0, "high_1": 0.0})
    modes = {"static1": combine([dead, dead]),
             "goodput": combine([_round(420, 225, 0, 3), _round(400, 200, 0, 3)])}
    again_ = combine([_round(0, 0, 0, 3), _round(0, 0, 0, 3)])
    text = report({"modes": modes, "phases": ["low_1", "high_1"], "rounds": 2,
                   "aa_control": {"mode": "goodput", "again": again_}})
    assert "| static1 | 0.0 | n/a | n/a | 1.50 | 0 | 32 |" in text
    assert "| goodput | n/a | n/a | n/a |" in text  # against the best static
    assert "| goodput | n/a | n/a [" not in text and "| goodput | n/a | n/a | n/a |" in text


def test_the_summary_gives_each_modes_tail_latency_and_older_runs_read_without_it() -> None:
    """p99 latency is the median over rounds of each round's p99 (a run recorded before the
    column existed reads n/a there)."""
    rounds = [_round(300, 250, 0, 0) | {"latency_p99_s": p99} for p99 in (1.0, 3.0, 2.0)]
    modes = {"static1": combine(rounds), "goodput": combine([_round(420, 225, 0, 3)])}
    text = report({"modes": modes, "phases": ["low_1", "high_1"], "rounds": 3})
    assert "| static1 | 300.0 | 3.00 | 2.00 | 1.50 | 0 | 0 |" in text
    assert "| goodput | 420.0 | 4.20 | n/a | 1.50 | 3 | 0 |" in text


def test_percentiles_are_taken_by_nearest_rank() -> None:
    """The value at rank ceil(q% of n): of 100 values the p99 is the 99th, not the maximum."""
    latencies = [float(i) for i in range(1, 101)]  # 1 .. 100
    assert percentile(latencies, 99) == 99.0 and percentile(latencies, 50) == 50.0
    assert percentile(list(reversed(latencies)), 99) == 99.0
    assert percentile(latencies, 99.5) == 100.0 and percentile(latencies, 100) == 100.0
    assert percentile(latencies, 0) == 1.0
    assert percentile(range(100), 99) == 98 and percentile([1, 2, 3, 4], 50) == 2
    assert percentile([1, 2, 3], 50) == 2
    assert percentile([2.5], 99) == 2.5 and percentile([], 99) is None


def test_a_round_records_every_requests_latency_by_phase(monkeypatch) -> None:
    monkeypatch.setattr("bench.transition.Client", FlakyApp)
    monkeypatch.setattr(FlakyApp, "fail_on_change", 0)
    args = argparse.Namespace(url="http://127.0.0.1:1", model="m", max_tokens=10, api_key=None,
                              workload="transition", requests=3, concurrency=2, warmup=1,
                              phases=None, modes=["static1"], defined={}, aa_control=None,
                              rounds=1, app_config="configs/x.yaml")
    results = asyncio.run(bench(args))
    # The load and the deployment, for `pool` to compare.
    assert {key: results[key] for key in RUN_SHAPE} == {
        "requests": [3] * 4, "concurrency": [2] * 4, "warmup": 1, "model": "m", "replicas": 1,
        "candidates": [0, 1, 3], "app_config": "configs/x.yaml"}
    run = results["modes"]["static1"]["rounds"][0]
    assert {phase: len(latencies) for phase, latencies in run["phase_latencies_s"].items()} \
        == dict.fromkeys(["low_1", "high_1", "low_2", "high_2"], 3)
    assert run["latency_p99_s"] == pytest.approx(0.01, abs=0.005)


def test_the_acceptance_contrast_of_the_workload_is_printed() -> None:
    modes = {"static7": combine([_round(300, 250, 0, 0)]),
             "goodput": combine([_round(420, 225, 0, 3)])}
    text = report({"modes": modes, "phases": ["low_1", "high_1"], "rounds": 1})
    assert "| 5.00 | 1.00 | 5.00 | yes |" in text  # high_1 5.0 against low_1 1.0
    modes["static7"]["phase_accept_len"]["high_1"] = 1.5
    assert "| 1.50 | 1.00 | 1.50 | NO |" in report(
        {"modes": modes, "phases": ["low_1", "high_1"], "rounds": 1})


class FlakyApp:
    """`bench.transition.Client` against an app whose admin route fails on a given policy
    change: every request completes at once with 10 tokens."""

    fail_on_change = 0

    model = "m"

    def __init__(self, *_: object) -> None:
        self.changes = 0
        self.http = httpx.AsyncClient()

    async def resolve_model(self) -> None:
        pass

    async def complete(self, prompt: object, seed: int) -> tuple[int, float]:
        return 10, 0.01

    async def replicas(self) -> list[dict]:
        return [{"replica_id": "r", "policy": {"name": "goodput"}, "candidates": [0, 1, 3],
                 "switch_count": 0, "active_k": 1, "counters": {"sequence_steps": 0}}]

    async def set_policy(self, policy: dict) -> None:
        self.changes += 1
        if self.changes == self.fail_on_change:
            raise httpx.ConnectError("the app went away")


def test_a_run_the_app_fails_partway_keeps_the_rounds_every_mode_finished(monkeypatch) -> None:
    monkeypatch.setattr("bench.transition.Client", FlakyApp)
    monkeypatch.setattr(FlakyApp, "fail_on_change", 8)  # round 3 (3 modes a round), 2nd mode
    args = argparse.Namespace(url="http://127.0.0.1:1", model="m", max_tokens=10, api_key=None,
                              workload="transition", requests=2, concurrency=1, warmup=1,
                              phases=None, modes=["static1", "static3", "goodput"],
                              defined={}, aa_control=None, rounds=4, app_config=None)
    results = asyncio.run(bench(args))
    assert results["rounds"] == 2 and "the app went away" in \
        results["stopped_early"]["error"]
    assert all(len(mode["rounds"]) == 2 for mode in results["modes"].values())
    assert report(results).startswith("STOPPED EARLY: 2 of 4 rounds finished for every mode")
    monkeypatch.setattr(FlakyApp, "fail_on_change", 1)
    with pytest.raises(SystemExit, match="no round finished"):
        asyncio.run(bench(args))


def test_counters_grow_per_replica_across_a_change_of_the_replica_set() -> None:
    """A mode's switches and steps are each replica's growth: a replica that left adds
    nothing and one that joined counts from zero (the fleet's sums would give 3 - 12)."""
    def stats(replica_id: str, switches: int) -> dict:
        return {"replica_id": replica_id, "switch_count": switches}

    before = [stats("a", 10), stats("b", 2)]
    after = [stats("b", 5), stats("c", 0)]  # a was replaced by c
    assert counter_growth(before, after, lambda r: r["switch_count"]) == 3
    assert counter_growth(before, [stats("a", 11), stats("b", 2), stats("c", 4)],
                          lambda r: r["switch_count"]) == 5


def test_a_ratio_interval_is_a_t_interval_on_the_logs_of_the_rounds_ratios() -> None:
    interval = RatioInterval.of([math.exp(0.1), math.exp(-0.1)])
    half = 12.706 * statistics.stdev([0.1, -0.1]) / math.sqrt(2)  # t at one degree of freedom
    assert (interval.mean, interval.low, interval.high) == \
        pytest.approx((1.0, math.exp(-half), math.exp(half)))
    assert interval.against(1.0) == "not resolved"
    assert RatioInterval.of([1.2, 1.25, 1.22]).against(1.0) == "above"
    assert RatioInterval.of([0.8, 0.82, 0.79]).against(0.9) == "below"
    assert RatioInterval.of([1.1]) is None, "one round has no spread to judge by"
    assert RatioInterval.of([1.1, 0.0]) is None, "a round where a mode made nothing has no log"


def test_an_interval_over_groups_takes_each_groups_geometric_mean_as_one_sample() -> None:
    """Runs whose rounds agree among themselves but not with each other: the rounds alone
    look resolved, the runs do not."""
    runs = [[1.10, 1.105, 1.095] * 2, [1.04, 1.045, 1.035] * 2, [0.99, 0.995, 0.985] * 2]
    by_rounds = RatioInterval.of([r for run in runs for r in run])
    by_runs = RatioInterval.over_groups(runs)
    assert by_rounds.against(1.0) == "above" and by_runs.against(1.0) == "not resolved"
    means = [statistics.fmean(math.log(r) for r in run) for run in runs]
    half = t_975(2) * statistics.stdev(means) / math.sqrt(3)
    assert by_runs.mean == pytest.approx(math.exp(statistics.fmean(means)))
    assert by_runs.low == pytest.approx(math.exp(statistics.fmean(means) - half))
    assert RatioInterval.over_groups(runs[:1]) is None, "one run: no spread between runs"
    assert RatioInterval.over_groups([runs[0], []]) is None


@pytest.mark.parametrize(("degrees_of_freedom", "exact", "tolerance"), [
    # Exact two-sided 95% quantiles (from the regularised incomplete beta function): the
    # table's, rounded to three places, then the expansion's past it.
    (1, 12.706205, 1e-3), (5, 2.570582, 1e-3), (10, 2.228139, 1e-3), (30, 2.042272, 1e-3),
    (31, 2.039513, 1e-4), (33, 2.034515, 1e-4), (40, 2.021075, 1e-4), (60, 2.000298, 1e-4),
    (100, 1.983972, 1e-4), (1000, 1.962339, 1e-4)])
def test_t_quantiles_match_the_exact_values(degrees_of_freedom: int, exact: float,
                                            tolerance: float) -> None:
    assert t_975(degrees_of_freedom) == pytest.approx(exact, abs=tolerance)


def test_verdicts_against_statics_come_from_the_rounds_not_the_medians() -> None:
    """goodput's median is 3.6% above static1's, but round by round the two swap places: on
    par. It is 2.2% above static15's, and ahead by about 2% in every round: better."""
    rounds = {"static1": [_round(300, 200, 0, 0), _round(500, 200, 0, 0),
                          _round(340, 200, 0, 0), _round(560, 200, 0, 0)],
              "static15": [_round(392, 200, 0, 0), _round(440, 200, 0, 0),
                           _round(411, 200, 0, 0), _round(470, 200, 0, 0)],
              "goodput": [_round(400, 200, 0, 3), _round(450, 200, 0, 3),
                          _round(420, 200, 0, 3), _round(480, 200, 0, 3)]}
    modes = {mode: combine(runs) for mode, runs in rounds.items()}
    rows = report({"modes": modes, "phases": ["low_1", "high_1"], "rounds": 4}).splitlines()
    static1 = next(line for line in rows if line.startswith("| goodput | static1 |"))
    static15 = next(line for line in rows if line.startswith("| goodput | static15 |"))
    assert static1.endswith("| on par |") and static15.endswith("| better |")
    one_round = {mode: combine(runs[:1]) for mode, runs in rounds.items()}
    text = report({"modes": one_round, "phases": ["low_1", "high_1"], "rounds": 1})
    assert "| goodput | static15 | +2.0% | n/a | on par |" in text, "one round: the band"


def test_the_bars_are_judged_with_their_interval_against_the_best_static_by_medians() -> None:
    modes = {"static1": combine([_round(400, 200, 0, 0), _round(200, 100, 0, 0),
                                 _round(300, 150, 0, 0)]),
             "goodput": combine([_round(440, 150, 0, 3), _round(222, 76, 0, 3),
                                 _round(327, 111, 0, 3)])}
    text = report({"modes": modes, "phases": ["low_1", "high_1"], "rounds": 3})
    table = text.split("### ADAPTIVE VS BEST STATIC, ROUND BY ROUND WITH 95% INTERVALS")[1]
    row = next(line for line in table.splitlines() if line.startswith("| goodput |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1].endswith("above"), "ahead by 9-11% in every round"
    assert cells[2].endswith("below"), "low_1 at 0.74-0.76 of static1 against a bar of 0.9"
    assert cells[3] == "1.000 [1.000-1.000] above"


def test_runs_pool_into_one_run_of_all_their_rounds() -> None:
    """Two runs, as their JSON keeps them: pooled, the report's intervals are over all their
    rounds, each still paired within its own round; the A/A control pools only when every
    run had one, and runs of another benchmark are refused."""
    def run(goodput: list[float], static: list[float], again: list[float] | None = None
            ) -> dict:
        modes = {"static1": combine([_round(t, 200, 0, 0) for t in static]),
                 "goodput": combine([_round(t, 200, 0, 3) for t in goodput])}
        results = {"workload": "transition", "max_tokens": 256, "modes": modes,
                   "phases": ["low_1", "high_1"], "rounds": len(goodput),
                   "policies": {"goodput": {"name": "goodput"}}}
        if again:
            results["aa_control"] = {"mode": "goodput", "again": combine(
                [_round(t, 200, 0, 3) for t in again])}
        return json.loads(json.dumps(results))  # through JSON, as read back

    first = run([440, 210], [400, 200], again=[400, 200])
    second = run([330, 690, 300], [300, 600, 300], again=[300, 600, 330])
    pooled = pool([first, second])
    ratios = [1.1, 1.05, 1.1, 1.15, 1.0]
    assert pooled["rounds"] == 5
    assert paired_ratios(pooled["modes"], ["static1"], "goodput") == pytest.approx(ratios)
    interval = RatioInterval.of(ratios)
    row = next(line for line in report(pooled).splitlines()
               if line.startswith("| goodput | static1 |"))
    assert f"| {interval} | better |" in row, "five rounds, every one ahead"
    assert paired_ratios({"a": pooled["modes"]["goodput"], "b": pooled["aa_control"]["again"]},
                         ["a"], "b") == pytest.approx([400 / 440, 200 / 210, 300 / 330, 600 / 690,
                                                       1.1])
    without_control = pool([first, run([330], [300])])
    assert "aa_control" not in without_control
    assert without_control["pooled"]["aa_control_left_out"]
    with pytest.raises(ValueError, match="phases"):
        pool([first, {**second, "phases": ["c1"]}])
    with pytest.raises(ValueError, match="workload"):
        pool([first, {**second, "workload": "sweep"}])
    with pytest.raises(ValueError, match="policy configs"):
        pool([first, {**second, "policies": {"goodput": {"name": "goodput",
                                                         "switch_margin": 0.15}}}])


@pytest.mark.parametrize(("recorded", "pools"), [(True, True), (False, False)])
def test_a_retired_option_pools_only_at_the_value_the_code_kept(recorded: bool,
                                                                pools: bool) -> None:
    """A run that recorded a since-removed option pools with today's runs when it held the
    behaviour the code kept, and is refused when it ran the variant."""
    def run(**goodput: object) -> dict:
        return {"workload": "transition", "max_tokens": 256, "phases": ["low_1", "high_1"],
                "rounds": 1, "policies": {"goodput": {"name": "goodput", **goodput}},
                "modes": {"goodput": combine([_round(400, 200, 0, 3)])}}

    old, today = run(switch_margin=0.05, request_class_priors=recorded), run(switch_margin=0.05)
    if pools:
        assert pool([today, old])["rounds"] == 2
    else:
        with pytest.raises(ValueError, match="policy configs"):
            pool([today, old])
    with pytest.raises(ValueError, match="policy configs"):
        pool([run(switch_margin=0.15, request_class_priors=True), today])


@pytest.mark.parametrize(("key", "value", "other"), [
    ("requests", [16] * 4, [32] * 4), ("concurrency", [8] * 4, [4] * 4), ("warmup", 8, 0),
    ("model", "target", "other"), ("replicas", 2, 1), ("candidates", [0, 1, 3], [0, 1]),
    ("app_config", "serve_config.yaml", "configs/cpu-draft-model.yaml")])
def test_runs_of_another_load_or_deployment_are_not_pooled(key: str, value: object,
                                                           other: object) -> None:
    """Runs that record different loads or deployments are refused; a run recorded before
    the field existed pools with either (the committed pooled runs predate them all)."""
    def run(**recorded: object) -> dict:
        return {"workload": "transition", "max_tokens": 256, "phases": ["low_1", "high_1"],
                "rounds": 1, "policies": {},
                "modes": {"static1": combine([_round(400, 200, 0, 0)])}, **recorded}

    with pytest.raises(ValueError, match=f"differ in {key}"):
        pool([run(**{key: value}), run(**{key: other})])
    assert pool([run(**{key: value}), run(**{key: value}), run()])["rounds"] == 3


@pytest.mark.parametrize(("flags", "reason"), [
    (["--modes", "static1,goodput,static1"], "names static1 twice"),
    (["--json", "/no/such/dir/out.json"], "its directory /no/such/dir does not exist"),
    (["--plot", "/no/such/dir/out.png"], "does not exist"),
    (["--concurrency", "0"], "not a positive count"),
    (["--rounds", "0"], "not a positive count"),
    (["--warmup", "-1"], "below 0"),
])
def test_a_command_that_cannot_run_or_keep_its_results_is_refused_at_once(flags, reason):
    """Before anything is sent: a run takes up to an hour, and its results were lost when
    the output's directory turned out missing at the end."""
    done = subprocess.run([sys.executable, "-m", "bench.transition",
                           "--url", "http://127.0.0.1:9", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and reason in done.stderr


def test_an_app_that_cannot_be_reached_or_lacks_the_model_ends_the_run_in_one_line():
    done = subprocess.run([sys.executable, "-m", "bench.transition",
                           "--url", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("cannot use the app at http://127.0.0.1:9")

    def served(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": [{"id": "target"}]})

    client = Client("http://127.0.0.1:1", "nope", 8, None)
    client.http = httpx.AsyncClient(base_url="http://127.0.0.1:1",
                                    transport=httpx.MockTransport(served))
    with pytest.raises(SystemExit, match="the app serves target, not 'nope'"):
        asyncio.run(client.resolve_model())


def test_a_reply_that_is_not_a_completion_is_an_error_and_the_phase_goes_on() -> None:
    """A 200 whose body is not the completion asked for (not JSON, or JSON without usage)
    counts as that request's error; the phase's other requests still count."""
    served = iter(range(8))

    def app(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/replicas":
            return httpx.Response(200, json={"replicas": [
                {"replica_id": "r", "counters": {"sequence_steps": 0}}]})
        number = next(served)
        if number == 1:
            return httpx.Response(200, text="<html>proxy error</html>")
        if number == 4:
            return httpx.Response(200, json={"choices": []})
        if number in (5, 6):
            return httpx.Response(200, json=None if number == 5 else {"usage": None})
        return httpx.Response(200, json={"usage": {"completion_tokens": 8}})

    client = Client("http://127.0.0.1:1", "m", 8, None)
    client.http = httpx.AsyncClient(base_url="http://127.0.0.1:1",
                                    transport=httpx.MockTransport(app))
    result = asyncio.run(run_phase(client, Phase("high_1", HIGH, 2, 8), seed_base=0))
    assert (result.errors, result.tokens, len(result.latencies)) == (4, 32, 4)
