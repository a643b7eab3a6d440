"""CPU that processes outside a benchmark take from it while it runs.

On a 2-core machine a benchmark that shares the cores with anything else measures that too:
one run of the HTTP suite shared them for a minute with a simulation at the lowest priority,
and only the note said so. `ForeignCpu` counts, while a block runs, the core-seconds of every
process that is not this one or a descendant of it (the app `serve run` starts here, its
Ray and vLLM processes, the benchmark clients), so each result file can say how much of the
machine it did not have.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psutil

# Above this share of one core taken by other processes, a run is reported as shared.
SHARED_ABOVE = 0.05


@dataclass
class ForeignCpuReport:
    core_seconds: float
    wall_s: float
    by_name: dict[str, float] = field(default_factory=dict)
    """Core-seconds per process name, largest first (the five largest)."""
    failed_samples: int = 0

    @property
    def share_of_a_core(self) -> float:
        return self.core_seconds / self.wall_s if self.wall_s else 0.0

    @property
    def shared(self) -> bool:
        return self.share_of_a_core > SHARED_ABOVE

    def as_dict(self) -> dict[str, Any]:
        return {"core_seconds": self.core_seconds, "wall_s": self.wall_s,
                "share_of_a_core": self.share_of_a_core, "by_name": self.by_name,
                "failed_samples": self.failed_samples}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ForeignCpuReport:
        return cls(data["core_seconds"], data["wall_s"], data["by_name"],
                   data.get("failed_samples", 0))

    def __str__(self) -> str:
        names = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.by_name.items())
        failed = f"; {self.failed_samples} samples failed" if self.failed_samples else ""
        return (f"processes outside the benchmark used {self.core_seconds:.1f} core-seconds in "
                f"{self.wall_s:.0f} s ({self.share_of_a_core:.1%} of one core)"
                + (f": {names}" if names else "") + failed)


class ForeignCpu:
    """`with ForeignCpu() as foreign: ...`, then `foreign.report()`. Samples every process's
    CPU time each `period_s` on a thread and counts the growth of the processes that are not
    ours. Whose a process is, is settled when it is first seen and kept: one in this process's
    tree then (the app, its Ray and vLLM processes) stays ours after its parent ends and it is
    reparented (an engine core that outlives its replica, as `http_suite.stop` finds); one
    outside it then is someone else's. A process that ends between samples loses its last
    interval, and one that starts and ends between two is not seen: the count is a lower
    bound."""

    def __init__(self, period_s: float = 1.0):
        self.period_s = period_s
        self._seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU seconds
        self._ours: set[tuple[int, float]] = set()
        self._foreign: Counter[str] = Counter()  # by process name
        self.by_pid: Counter[int] = Counter()
        """Foreign core-seconds per process id."""
        self.failed_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="foreign-cpu", daemon=True)
        self._started = self._ended = 0.0

    def __enter__(self) -> ForeignCpu:
        self._started = time.monotonic()
        self._sample(count=False)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample_safely()
        self._ended = time.monotonic()

    def report(self) -> ForeignCpuReport:
        return ForeignCpuReport(sum(self._foreign.values()), self._ended - self._started,
                                dict(self._foreign.most_common(5)), self.failed_samples)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample_safely()

    def _sample_safely(self) -> None:
        """A sample that fails (the process table changing under it) is counted and skipped;
        the next one takes up the growth since the last that succeeded."""
        try:
            self._sample(count=True)
        except (psutil.Error, OSError):
            self.failed_samples += 1

    def _sample(self, count: bool) -> None:
        tree = {os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))}
        alive: set[int] = set()
        for process in psutil.process_iter(["name", "create_time", "cpu_times"]):
            alive.add(process.pid)
            info = process.info
            if info["cpu_times"] is None or info["create_time"] is None:
                continue  # gone, or not readable: its last reading carries on
            key = (process.pid, info["create_time"])
            seconds = info["cpu_times"].user + info["cpu_times"].system
            if key not in self._seen and process.pid in tree:
                self._ours.add(key)
            # Every process running at the start is in the first sample, so one not seen
            # before started since then: all of its time is new.
            before = self._seen.get(key, 0.0)
            self._seen[key] = seconds
            if count and key not in self._ours and seconds > before:
                self._foreign[info["name"] or str(process.pid)] += seconds - before
                self.by_pid[process.pid] += seconds - before
        for key in [key for key in self._seen if key[0] not in alive]:
            del self._seen[key]
            self._ours.discard(key)
