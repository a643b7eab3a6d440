"""The HTTP benchmarks end to end: start the app, run the transition and sweep workloads, stop.

    python -m bench.http_suite                      # serve_config.yaml on 127.0.0.1:8000
    python -m bench.http_suite --config configs/cpu-draft-model.yaml --name draft_model

Starts `serve run serve_config.yaml`, waits until every engine replica answers, runs
`bench.transition` with the issue's settings for both workloads (results in `bench/results/`:
transition_http.* and sweep_http.*; with `--name N`, transition_http_N.* and sweep_http_N.*),
then stops the app. Loopback only; every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import yaml

from bench.cli import positive
from bench.foreign_cpu import ForeignCpu, ForeignCpuReport
from bench.load import is_loopback
from bench.transition_report import report

RESULTS = Path("bench/results")
# The modes plus static0, speculation off: the baseline a user weighs speculation
# against, and in the sampled phases the tier `goodput` mostly holds (there the drafting
# statics and K=0 lie within a few percent of each other, inside their spread across rounds).
MODES = "static0,static1,static3,static7,static15,ema,goodput"
# The deployed policy runs twice a round, the second time reported apart (an A/A test): two
# runs of one configuration show how far this machine moves any ratio in the same run
# (8 rounds of the transition on one app start: 1.069x between them, round-by-round median).
AA_CONTROL = "goodput"
WORKLOADS = {
    # The settings; the sweep's requests are the floor of each phase (2 x concurrency
    # otherwise): 16, so each concurrency-1 phase lasts about 10 s. At 8 (5 s) one round's
    # c1 throughput moved by +-15% for every mode alike, more than the modes differ there,
    # and the verdict against the best of the statics followed the noise (goodput's c1 was
    # 0.842x the best static in one suite run, 1.14x static15 in a 16-request study of c1).
    # Both run several rounds, modes interleaved (medians): one phase of one mode moves by up
    # to 2x between runs on a 2-core machine (the sweep's goodput at concurrency 64 went from
    # 0.68x to 1.24x static3 between two single runs). Six rounds each, three pairs of the
    # counterbalanced order (`transition.round_order`): the transition takes about 2 minutes
    # a round, the sweep about 4.5 (with three, the sweep's per-round ratios spread
    # 0.98-1.02x around a verdict line at 1.0, and one round moved the median).
    "transition": ["--requests", "16", "--concurrency", "8"],
    "sweep": ["--requests", "16"],
}
ROUNDS = 6


def result_name(name: str) -> str:
    """`--name`: a file-name suffix, so nothing outside bench/results/ is written."""
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
        raise argparse.ArgumentTypeError(f"{name!r}: use letters, digits, '_' or '-'")
    return name


def expected_replicas(config: Path) -> int:
    """Engine replicas the first application asks for (its builder args, else one)."""
    app = yaml.safe_load(config.read_text())["applications"][0]
    return int(app.get("args", {}).get("num_replicas", 1))


def wait_ready(url: str, replicas: int, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"serve run exited with {server.returncode} before the app was up")
        try:
            listed = httpx.get(f"{url}/admin/replicas", timeout=5).json().get("replicas", [])
            if len(listed) >= replicas:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(2)
    raise SystemExit(f"the app did not list {replicas} replicas within {timeout_s:.0f} s")


def stop(server: subprocess.Popen) -> list[str]:
    """Ctrl-C, as a user would; if `serve run` is still tearing down its vLLM engines after a
    minute, end it and the local Ray cluster it started (this suite's own: `serving` refuses
    to start beside another). Then end whatever
    the app left running: once a vLLM engine core and its worker outlived the replica that
    started them and took 8% of a core from the next runs. Returns what had to be ended."""
    try:
        spawned = psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        spawned = []
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            ray = Path(sys.executable).with_name("ray")
            subprocess.run([str(ray), "stop", "--force"], check=False, capture_output=True)
    return end_leftovers(spawned)


def end_leftovers(processes: list[psutil.Process], grace_s: float = 10) -> list[str]:
    """Terminate (then kill) those of `processes` still running; their names and pids."""
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    left = [p for p in alive if _running(p)]
    names = [f"{_name(p)} (pid {p.pid})" for p in left]
    for process in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return names


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _name(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()[:1]) or process.name()
    except psutil.Error:
        return "?"


def ray_clusters_running() -> str:
    """The pids of this machine's Ray cluster heads (their GCS servers), if any."""
    heads = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "gcs_server"]
    return ", ".join(f"gcs_server pid {p.pid}" for p in heads)


@contextlib.contextmanager
def serving(config: Path, url: str, startup_timeout_s: float) -> Iterator[dict[str, str]]:
    """`serve run config` until the block ends (loopback only); yields the environment the
    benchmark clients should run with."""
    if not is_loopback(url):
        raise SystemExit("the benchmark starts its own app: use a loopback URL")
    if running := ray_clusters_running():
        # `serve run` would join it, and a teardown that needs `ray stop --force` ends it.
        raise SystemExit(f"a Ray cluster is already running here ({running}): the suite "
                         "starts and stops its own; stop that one first (`ray stop`)")
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "NO_PROXY": "127.0.0.1,localhost"}
    serve = Path(sys.executable).with_name("serve")
    server = subprocess.Popen([str(serve), "run", str(config)], env=env)
    try:
        wait_ready(url, expected_replicas(config), server, startup_timeout_s)
        yield env
    finally:
        for leftover in stop(server):
            print(f"ended a process the app left running: {leftover}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("serve_config.yaml"))
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--workloads", default="transition,sweep")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--rounds", type=positive, default=ROUNDS,
                        help=f"rounds per workload (default {ROUNDS})")
    parser.add_argument("--name", default=None, type=result_name,
                        help="suffix of the result files, for a config other than the default")
    args = parser.parse_args()
    with serving(args.config, args.url, args.startup_timeout) as env:
        for workload in args.workloads.split(","):
            stem = result_stem(workload, args.name)
            with ForeignCpu() as foreign:
                subprocess.run(transition_command(args.url, workload, stem, args.rounds,
                                                  args.config), env=env, check=True)
            record_foreign_cpu(stem, foreign.report())


def transition_command(url: str, workload: str, stem: Path, rounds: int = ROUNDS,
                       config: Path = Path("serve_config.yaml")) -> list[str]:
    """The `bench.transition` run of one workload with the issue's settings on the app
    started from `config`, results at `stem`."""
    return [sys.executable, "-m", "bench.transition", "--url", url, "--workload", workload,
            *WORKLOADS[workload], "--rounds", str(rounds),
            "--warmup", "8", "--max-tokens", "256", "--app-config", str(config),
            "--modes", MODES, "--aa-control", AA_CONTROL,
            "--json", str(stem.with_suffix(".json")), "--plot", str(stem.with_suffix(".png")),
            "--markdown", str(stem.with_suffix(".md"))]


def result_stem(workload: str, name: str | None = None) -> Path:
    """Where a workload's results go, without the suffix: the default config's files keep
    the plain names the README reads, another config's carry its `name`."""
    stem = "transition_http" if workload == "transition" else "sweep_http"
    return RESULTS / (f"{stem}_{name}" if name else stem)


def record_foreign_cpu(stem: Path, foreign: ForeignCpuReport) -> None:
    """The CPU other processes took during a workload's run, into its JSON and report: the
    suite started the app, so every process outside its tree is someone else's."""
    print(foreign, file=sys.stderr)
    if foreign.shared:
        print(f"WARNING: {stem.name} shared the machine; its ratios measure that too",
              file=sys.stderr)
    path = stem.with_suffix(".json")
    results = json.loads(path.read_text())
    results["foreign_cpu"] = foreign.as_dict()
    path.write_text(json.dumps(results, indent=2) + "\n")
    stem.with_suffix(".md").write_text(report(results) + "\n")


if __name__ == "__main__":
    main()
