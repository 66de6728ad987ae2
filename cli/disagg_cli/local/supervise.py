"""Local mode's kubelet: a pool process that exits is started again on its own port, with a
bounded budget (exponential back-off between attempts, at most ``max_restarts`` within
``window_seconds``); past the budget it stays down and the rest keeps running.

``disagg up`` supervises in its own process; ``disagg up --detach`` leaves a supervisor process
running (``disagg supervise``, recorded in the state file) that adopts the processes by pid.
Each start appends to the process's log, so the log of a crash survives its restart.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from disagg_engine.servers import ServerSpec, pid_alive, reap_group, start

ERROR_LINE = re.compile(r"Error|Exception|Traceback|CRITICAL|FATAL|Killed|exited", re.I)


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    window_seconds: float = 600.0  # restarts older than this no longer count (kubelet: 10 min)
    backoff_seconds: float = 1.0  # first delay; doubles per restart still in the window
    max_backoff_seconds: float = 30.0

    def decide(self, restarts: list[float], now: float) -> float | None:
        """Seconds to wait before the next start, or None: the budget is spent (pure)."""
        recent = [t for t in restarts if now - t < self.window_seconds]
        if len(recent) >= self.max_restarts:
            return None
        return min(self.backoff_seconds * 2 ** len(recent), self.max_backoff_seconds)


def error_lines(log: Path, count: int = 8, scan: int = 400) -> list[str]:
    """The last ``count`` lines that look like errors among the log's last ``scan`` lines (else its
    last lines): what a user needs to see when a process dies."""
    try:
        lines = log.read_text(errors="replace").splitlines()[-scan:]
    except OSError:
        return [f"<no log at {log}>"]
    errors = [line for line in lines if ERROR_LINE.search(line)]
    return [line[:300] for line in (errors or lines)[-count:]]


@dataclass
class Member:
    """One supervised process: its recorded command and the process running it now."""

    name: str
    spec: ServerSpec
    pid: int
    log: Path
    proc: subprocess.Popen | None = None  # ours to reap; None: adopted (started by another process)
    restarts: list[float] = field(default_factory=list)
    due: float | None = None  # when the pending restart starts
    failed: bool = False  # budget spent

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return pid_alive(self.pid)

    def exit_code(self) -> str:
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            return f"killed by signal {-code}" if code < 0 else f"code {code}"
        return "exit code unknown: adopted"


@dataclass
class Supervisor:
    members: list[Member]
    on_change: Callable[[list[Member]], None]  # records new pids (the state file)
    say: Callable[[str], None]
    policy: RestartPolicy = field(default_factory=RestartPolicy)

    def step(self, now: float | None = None) -> None:
        """One look at every process: schedule restarts of exited ones, start those that are due."""
        now = time.monotonic() if now is None else now
        changed = False
        for m in self.members:
            if m.failed:
                continue
            if m.due is None and not m.alive():
                # Its whole process group goes with it: a killed API server leaves its engine core
                # running (ppid 1), which would outlive the restart and `disagg down`.
                reap_group(m.pid)
                delay = self.policy.decide(m.restarts, now)
                tail = "\n    ".join(error_lines(m.log))
                if delay is None:
                    m.failed = True
                    self.say(f"disagg: {m.name} exited ({m.exit_code()}) after {len(m.restarts)} restarts: "
                             f"restart budget spent, it stays down; log: {m.log}\n    {tail}")
                    changed = True
                    continue
                m.due = now + delay
                self.say(f"disagg: {m.name} exited ({m.exit_code()}); restart {len(m.restarts) + 1}/"
                         f"{self.policy.max_restarts} in {delay:.0f} s; log: {m.log}\n    {tail}")
            if m.due is not None and now >= m.due:
                server = start(m.spec, m.log.parent)
                m.proc, m.pid, m.due = server.proc, server.pid, None
                m.restarts.append(now)
                self.say(f"disagg: {m.name} restarted (pid {m.pid})")
                changed = True
        if changed:
            self.on_change(self.members)

    def run(self, stop: Callable[[float], bool], poll: float = 0.5) -> None:
        """Until ``stop(timeout)`` (e.g. ``threading.Event.wait``) returns true."""
        while not stop(poll):
            self.step()
