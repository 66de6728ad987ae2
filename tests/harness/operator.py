"""``python -m disagg_operator`` as a test runs it: its own process group, a log file per start,
health from its liveness endpoint, optionally its ``/metrics``."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from disagg_engine.servers import free_port, stop_group

REPO = Path(__file__).resolve().parents[2]


@dataclass
class OperatorProcess:
    """The operator against ``kubeconfig`` with ``args``, started and stopped by its own pid.
    ``metrics`` adds ``--metrics-port`` (tests that check the chart's exact arguments leave it out)."""

    kubeconfig: Path
    log_dir: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    metrics_endpoint: bool = True
    proc: subprocess.Popen | None = None
    port: int = 0
    metrics_port: int = 0
    starts: int = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"operator-{self.starts}.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def start(self) -> OperatorProcess:
        self.starts += 1
        self.port = free_port()
        metrics_args: list[str] = []
        if self.metrics_endpoint:
            self.metrics_port = free_port()
            metrics_args = ["--metrics-port", str(self.metrics_port), "--metrics-address", "127.0.0.1"]
        env = {**os.environ, **self.env, "KUBECONFIG": str(self.kubeconfig)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "disagg_operator", "--liveness", f"http://127.0.0.1:{self.port}/healthz",
                 *metrics_args, *self.args],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                cwd=REPO,
            )
        return self

    def alive(self) -> bool:
        """Whether the liveness endpoint answers 200; an exited operator fails the test with its log."""
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise AssertionError(f"the operator exited ({code}):\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def metrics(self) -> dict[str, float]:
        """Sample name with labels (``'x_total{kind="Service"}'``) -> value, from /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
        return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines if line[:1] not in ("#", ""))}

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=30)
