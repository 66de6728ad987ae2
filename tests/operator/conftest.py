"""Fixtures for the operator's cluster tests: the CRD installed, a running `disagg operator`, a namespace.

Only tests marked ``cluster`` use them; the unit tests here need nothing but Python.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from disagg_engine.servers import free_port, stop_group

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "disagg.dev_disaggregatedmodels.yaml"


@dataclass
class OperatorProcess:
    """`python -m disagg_operator` against the test cluster, started and stopped by its own pid."""

    kubeconfig: Path
    log_dir: Path
    args: list[str] = field(default_factory=list)
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

    def start(self) -> None:
        self.starts += 1
        self.port, self.metrics_port = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "disagg_operator", "--liveness", f"http://127.0.0.1:{self.port}/healthz",
                 "--metrics-port", str(self.metrics_port), "--metrics-address", "127.0.0.1", *self.args],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"the operator exited:\n{self.log_tail()}")
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


@pytest.fixture(scope="session")
def crd_installed(cluster):  # type: ignore[no-untyped-def]
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/disaggregatedmodels.disagg.dev")
    return CRD


@pytest.fixture(scope="module")
def operator(cluster, crd_installed, tmp_path_factory) -> Iterator[OperatorProcess]:  # type: ignore[no-untyped-def]
    process = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator"))
    process.start()
    try:
        cluster.wait_for(process.alive, "the operator's liveness endpoint", timeout=60)
        yield process
    finally:
        process.stop()


@pytest.fixture
def ns(cluster, request: pytest.FixtureRequest) -> Iterator[str]:  # type: ignore[no-untyped-def]
    name = cluster.create_namespace(re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:30].strip("-"))
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
