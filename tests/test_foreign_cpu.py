"""`bench.foreign_cpu`: CPU taken by processes outside the benchmark's own tree is counted, and
the benchmark's own processes are not."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.foreign_cpu import ForeignCpu, ForeignCpuReport
from bench.http_suite import record_foreign_cpu
from bench.stream_interval import report as stream_report
from bench.transition_report import combine
from tests.test_bench_transition import _round

# Waits for `go`, burns `seconds` of its own CPU, touches `done` and idles until killed (a
# process that ended between two samples would lose its last interval).
BURNER = """
import sys, time
from pathlib import Path
seconds, go, done = float(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
while not go.exists():
    time.sleep(0.01)
start = time.process_time()
while time.process_time() - start < seconds:
    pass
done.touch()
time.sleep(60)
"""


def _wait_for(path: Path, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _orphan(tmp_path: Path, name: str, linger_s: float = 0) -> int:
    """A burner whose parent shell exits (after `linger_s`), so it leaves this process's
    tree as an unrelated process on the machine is outside it; its pid."""
    pid_file = tmp_path / f"{name}.pid"
    subprocess.Popen(["sh", "-c", f'{sys.executable} -c "$0" 1.0 {tmp_path / name}.go '
                      f'{tmp_path / name}.done & echo $! > {pid_file}; sleep {linger_s}',
                      BURNER])
    _wait_for(pid_file)
    # The shell creates the file before it writes the pid: wait for the whole line.
    deadline = time.monotonic() + 20
    while not pid_file.read_text().endswith("\n"):
        assert time.monotonic() < deadline, f"{pid_file} never got its pid"
        time.sleep(0.01)
    return int(pid_file.read_text())


def test_a_process_outside_the_tree_is_counted_and_the_benchmarks_own_are_not(tmp_path: Path
                                                                              ) -> None:
    """An unrelated process (outside this tree before the count starts) is counted; a child
    is not, and neither is a process that was the benchmark's when first seen and was then
    reparented away (an app's engine core that outlives its replica)."""
    foreign_pid = _orphan(tmp_path, "foreign")
    time.sleep(0.3)  # its shell has exited: it is outside the tree from the first sample on
    child = subprocess.Popen([sys.executable, "-c", BURNER, "1.0", str(tmp_path / "child.go"),
                              str(tmp_path / "child.done")])
    pids = [foreign_pid]
    try:
        with ForeignCpu(period_s=0.1) as foreign:
            reparented_pid = _orphan(tmp_path, "reparented", linger_s=0.5)
            pids.append(reparented_pid)
            time.sleep(1.0)  # sampled while its shell lived, then left the tree
            for name in ("foreign", "child", "reparented"):
                (tmp_path / f"{name}.go").touch()
            for name in ("foreign", "child", "reparented"):
                _wait_for(tmp_path / f"{name}.done")
            time.sleep(0.3)  # a sample after all three finished burning
    finally:
        child.kill()
        for pid in pids:
            subprocess.run(["kill", str(pid)], check=False)
    assert 0.9 <= foreign.by_pid[foreign_pid] < 1.5, foreign.by_pid
    assert child.pid not in foreign.by_pid and reparented_pid not in foreign.by_pid
    assert foreign.report().core_seconds >= foreign.by_pid[foreign_pid]


def test_the_report_names_its_share_and_the_largest_users() -> None:
    report = ForeignCpuReport(core_seconds=3.0, wall_s=60.0, by_name={"python": 2.5, "sh": 0.5})
    assert "samples failed" not in str(report)
    assert str(ForeignCpuReport(1.0, 60.0, {}, failed_samples=2)).endswith("; 2 samples failed")
    assert report.share_of_a_core == 0.05 and not report.shared, "5% is the threshold"
    assert str(report) == ("processes outside the benchmark used 3.0 core-seconds in 60 s "
                           "(5.0% of one core): python 2.5 s, sh 0.5 s")
    assert report.as_dict()["share_of_a_core"] == 0.05


def test_the_suite_records_it_in_the_runs_json_and_report(tmp_path: Path) -> None:
    """`record_foreign_cpu` after a workload: the JSON keeps it and the report, re-rendered
    from the JSON, opens with it (flagged when the machine was shared)."""
    modes = {"static1": combine([_round(300, 250, 0, 0)]),
             "goodput": combine([_round(420, 225, 0, 3)])}
    stem = tmp_path / "transition_http"
    stem.with_suffix(".json").write_text(json.dumps(
        {"modes": modes, "phases": ["low_1", "high_1"], "rounds": 1}))
    record_foreign_cpu(stem, ForeignCpuReport(12.0, 120.0, {"python": 12.0}))
    assert json.loads(stem.with_suffix(".json").read_text())["foreign_cpu"]["share_of_a_core"] \
        == 0.1
    assert stem.with_suffix(".md").read_text().startswith(
        "MACHINE SHARED: processes outside the benchmark used 12.0 core-seconds in 120 s "
        "(10.0% of one core): python 12.0 s")
    record_foreign_cpu(stem, ForeignCpuReport(0.6, 120.0, {"sshd": 0.6}))
    assert stem.with_suffix(".md").read_text().startswith("MACHINE: processes outside")


def test_the_streaming_benchmark_reports_it_for_its_one_app() -> None:
    """Every interval runs on one app, so one report covers them all."""
    row = {"throughput": 900.0, "ttft_s": 0.06, "events_per_request": 140.0, "gap_p99_ms": 30.0,
           "cpu_s_per_1k_tokens": 2.0}
    results = {"rounds": 3, "max_tokens": 256, "intervals": {"0": {8: row}, "50": {8: row}},
               "foreign_cpu": ForeignCpuReport(30.0, 100.0, {"python": 30.0}).as_dict()}
    assert "| 30.0 | 30.0% | YES |" in stream_report(results)
    results["foreign_cpu"] = ForeignCpuReport(0.5, 100.0).as_dict()
    assert "| 0.5 | 0.5% | no |" in stream_report(results)
