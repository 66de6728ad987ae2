"""The harness's vLLM servers start at the lowest CPU priority while the first tests run.

They start in the background while the modules that need no engine run (tests/harness/engine.py):
throughput work with minutes of slack. But each server runs in a session of its own, and with
autogroup scheduling (sched(7)) the kernel gives every session an equal share of the CPU, so ten
starting servers took most of it from the chart and control-plane tests. While the starts run, a
thread sets the autogroup nice of each of this session's vLLM processes to 19 (found by a marker in
their environment), so they get the CPU those tests leave idle; ``stop`` sets it back to 0 before
any test sends them a request. Where the kernel has no autogroups (or the processes sit in CPU
cgroups, where they do not apply) nothing changes but the speed."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator, MutableMapping
from pathlib import Path

MARK = "DISAGG_TEST_SESSION"
LOW = 19
SCAN_SECONDS = 0.5
VLLM = b"vllm.entrypoints"  # an API server or render; the engine core it spawns shares its session


def _ours(token: str) -> Iterator[Path]:
    """/proc/PID of the vLLM processes started under this marker value."""
    mark = f"{MARK}={token}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if VLLM in (proc / "cmdline").read_bytes() and mark in (proc / "environ").read_bytes().split(b"\0"):
                yield proc
        except OSError:  # gone, or not ours to read
            continue


def _set_nice(proc: Path, nice: int) -> None:
    try:
        group = proc / "autogroup"
        if not group.read_text().rstrip().endswith(f"nice {nice}"):
            group.write_text(str(nice))
    except OSError:  # gone, or no autogroups here
        pass


class StartPriority:
    """``start()`` marks ``environ`` (by default this process's, which every process it starts
    inherits); until ``stop()``, the vLLM processes started with the mark run at autogroup nice 19."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, environ: MutableMapping[str, str] = os.environ) -> None:
        environ[MARK] = self.token
        self._thread = threading.Thread(target=self._lower, name="start-priority", daemon=True)
        self._thread.start()

    def _lower(self) -> None:
        while not self._done.wait(SCAN_SECONDS):
            for proc in _ours(self.token):
                _set_nice(proc, LOW)

    def stop(self) -> None:
        if self._thread is None or self._done.is_set():
            return
        self._done.set()
        self._thread.join()
        for proc in _ours(self.token):
            _set_nice(proc, 0)
