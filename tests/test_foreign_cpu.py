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

# Burns `seconds` of its own CPU, then touches `done` and idles until killed (a process that
# ended between two samples would lose its last interval).
BURNER = """
import sys, time
from pathlib import Path
seconds, done = float(sys.argv[1]), Path(sys.argv[2])
while time.process_time() < seconds:
    pass
done.touch()
time.sleep(30)
"""


def _wait_for(path: Path, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_process_outside_the_tree_is_counted_and_a_child_is_not(tmp_path: Path) -> None:
    orphan_done, child_done, orphan_pid = tmp_path / "orphan", tmp_path / "child", tmp_path / "pid"
    with ForeignCpu(period_s=0.2) as foreign:
        # The shell starts the burner in the background and exits: the burner is reparented
        # away from this process's tree, as an unrelated process on the machine is.
        subprocess.run(["sh", "-c", f'{sys.executable} -c "$0" 1.0 {orphan_done} & '
                        f'echo $! > {orphan_pid}', BURNER], check=True)
        child = subprocess.Popen([sys.executable, "-c", BURNER, "1.0", str(child_done)])
        try:
            _wait_for(orphan_done)
            _wait_for(child_done)
            time.sleep(0.5)  # a sample after both finished burning
        finally:
            child.kill()
            subprocess.run(["kill", orphan_pid.read_text().strip()], check=False)
    report = foreign.report()
    # The orphan's second of CPU (its start-up included), not the child's: with the child
    # counted it would be two.
    assert 0.9 <= report.core_seconds < 1.8, report
    assert report.shared and "python" in " ".join(report.by_name).lower()


def test_the_report_names_its_share_and_the_largest_users() -> None:
    report = ForeignCpuReport(core_seconds=3.0, wall_s=60.0, by_name={"python": 2.5, "sh": 0.5})
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


def test_the_streaming_benchmark_reports_it_per_interval() -> None:
    row = {"throughput": 900.0, "ttft_s": 0.06, "events_per_request": 140.0, "gap_p99_ms": 30.0,
           "cpu_s_per_1k_tokens": 2.0}
    results = {"rounds": 3, "max_tokens": 256, "intervals": {"0": {8: row}, "50": {8: row}},
               "foreign_cpu": {"0": ForeignCpuReport(0.5, 100.0).as_dict(),
                               "50": ForeignCpuReport(30.0, 100.0, {"python": 30.0}).as_dict()}}
    text = stream_report(results)
    assert "| 0 ms | 0.5 | 0.5% | no |" in text and "| 50 ms | 30.0 | 30.0% | YES |" in text
