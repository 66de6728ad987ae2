"""Session-scoped fixtures for the real vLLM CPU servers (started once, in parallel).

``engine_set`` starts render, tokens-only prefill, decode and the coupled reference (see
``disagg_engine.testing.server_set``). A failing test that used it gets the servers' log tails
attached to its report. For quick iteration, ``DISAGG_ATTACH_SERVERS=<log dir>/servers.json``
attaches to a set already started with ``python -m disagg_engine.testing.server_set``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.forced import Forcer

_SETS: list = []


@dataclass
class AttachedServer:
    url: str
    pid: int
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(line[:300] for line in self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _attached_set(path: str):
    from disagg_engine.testing.server_set import ServerSet

    desc = json.loads(Path(path).read_text())
    servers = {name: AttachedServer(d["url"], d["pid"], Path(d["log"])) for name, d in desc["servers"].items()}
    return ServerSet(servers, Path(desc["model_dir"]), Path(desc["kv_dir"]), Path(desc["log_dir"]))


@pytest.fixture(scope="session")
def engine_set(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from disagg_engine.testing.server_set import start_server_set

    if attach := os.environ.get("DISAGG_ATTACH_SERVERS"):
        sset = _attached_set(attach)
        _SETS.append(sset)
        yield sset
        return
    log_dir = Path(tmp_path_factory.mktemp("engine-logs"))
    sset = start_server_set(log_dir)
    _SETS.append(sset)
    try:
        yield sset
    finally:
        sset.stop()
        _SETS.remove(sset)


@pytest.fixture(scope="session")
def forcer(engine_set) -> Forcer:
    return Forcer(engine_set.model_dir)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    outcome = yield
    report = outcome.get_result()
    if report.failed and _SETS and "engine_set" in getattr(item, "fixturenames", ()):
        for name, server in _SETS[-1].servers.items():
            report.sections.append((f"server log: {name}", server.log_tail(30)))
