"""A real Prometheus server (``scripts/prometheus-bin``: built from the Go module proxy) as a host process.

The build starts in the background as soon as collection shows a test using ``prometheus_bin``
(cached: a warm run returns at once; a cold one, minutes, overlaps the tests before it), and is
stopped with the session if it is still running. ``Prometheus`` runs the binary with a given
configuration and asks its HTTP API.
"""
from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import requests
import yaml

from disagg_engine.processes import free_port, log_tail, poll_until, start_logged, stop_group

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "prometheus-bin"
BUILD_TIMEOUT = float(os.environ.get("DISAGG_PROMETHEUS_BUILD_TIMEOUT", "3600"))  # cold, on 2 busy cores
START_TIMEOUT = 60.0
T = TypeVar("T")

_build: subprocess.Popen[str] | None = None


def _start_build() -> subprocess.Popen[str]:
    # Its stderr is a few lines (the build's own log stays in its temporary dir; the tail on failure).
    return subprocess.Popen([str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    global _build
    if not session.config.option.collectonly and any(
            "prometheus_bin" in getattr(item, "fixturenames", ()) for item in session.items):
        _build = _start_build()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _build is not None:
        stop_group(_build)  # no go build outlives the session (it resumes from the Go caches next time)


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    """The Prometheus binary, from the background build (or a build started now)."""
    global _build
    build = _build = _build or _start_build()
    out, err = build.communicate(timeout=BUILD_TIMEOUT)
    assert build.returncode == 0, f"scripts/prometheus-bin failed ({build.returncode}):\n{err}"
    return Path(out.strip())


class Prometheus:
    """``prometheus`` on ``host`` with ``config`` (a prometheus.yml as a dict), its data in ``state_dir``."""

    def __init__(self, binary: Path, config: dict[str, Any], state_dir: Path, host: str) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = state_dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = state_dir / "prometheus.log"
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.proc = start_logged([str(binary), f"--config.file={self.config_path}",
                                  f"--storage.tsdb.path={state_dir / 'data'}", f"--web.listen-address={host}:{self.port}",
                                  "--log.level=info"], self.log_path)
        try:
            if not poll_until(self._ready, START_TIMEOUT, interval=0.2, check=self._running):
                raise AssertionError(f"Prometheus not ready in {START_TIMEOUT}s:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/-/ready", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def _running(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"Prometheus exited ({self.proc.returncode}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def api(self, path: str, **params: str) -> Any:
        body = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector: [{"metric": labels, "value": [t, "v"]}, ...]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def wait_for(self, probe: Callable[[], T], what: str, timeout: float = 60, interval: float = 0.5) -> T:
        """Poll ``probe`` until it returns something truthy; on timeout fail with the last result and the log."""
        deadline, last = time.monotonic() + timeout, None
        while True:
            self._running()
            last = probe()
            if last:
                return last
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}\n{self.log_tail()}")
            time.sleep(interval)

    def stop(self) -> None:
        stop_group(self.proc)
