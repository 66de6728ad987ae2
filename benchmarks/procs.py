"""CPU and memory of the real server processes, by pid (psutil)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import psutil


def cpu_seconds(pid: int) -> float:
    """CPU time of the process itself (a vLLM API server, not its engine core): the scheduler's
    nanosecond run time of its live threads (/proc/PID/task/*/schedstat); user + system from
    psutil, in 10 ms clock ticks, where schedstat is missing. A thread that exited mid-measurement
    takes its time with it: the servers measured here keep theirs."""
    total, seen = 0, False
    for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(task.read_text().split()[0])
            seen = True
        except (OSError, ValueError, IndexError):
            pass
    if seen:
        return total / 1e9
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def tree_cpu_seconds(pid: int) -> float:
    """The process and its live children (the vLLM engine core is a child of the API server)."""
    total = 0.0
    for p in [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]:
        try:
            total += cpu_seconds(p)
        except psutil.NoSuchProcess:
            pass
    return total


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def open_connections(pid: int) -> int:
    return len(psutil.Process(pid).net_connections(kind="tcp"))


class CpuMeter:
    """CPU seconds of several processes between ``start()`` and ``stop()``, by name."""

    def __init__(self, pids: dict[str, int], tree: Iterable[str] = ()) -> None:
        self.pids = pids
        self.tree = set(tree)
        self._start: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        return {n: (tree_cpu_seconds if n in self.tree else cpu_seconds)(pid) for n, pid in self.pids.items()}

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict[str, float]:
        end = self._read()
        return {n: end[n] - self._start[n] for n in self.pids}
