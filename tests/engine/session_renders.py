"""Render processes that run the engine extension's derender sessions, for the session
tests: two, so that one can be killed mid-stream. ``DISAGG_ATTACH_SESSION_RENDERS=<json file: a
list of {url, pid}>`` attaches to ones already running; otherwise they are started once per test
session (``launch render`` with ``VLLM_PLUGINS=disagg``, server_set's render role)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from disagg_engine.servers import start_all, stop_all
from disagg_engine.testing.server_set import role_specs


class Render:
    def __init__(self, url: str, pid: int):
        self.url, self.pid = url, pid

    def capabilities(self) -> dict:
        return requests.get(self.url + "/disagg/v1/capabilities", timeout=10).json()

    def live_sessions(self) -> int:
        return self.capabilities()["live_derender_sessions"]

    def alive(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False


def live(renders: list[Render]) -> Render:
    """One that runs (a reliability test kills one of them)."""
    return next(r for r in renders if r.alive())


@pytest.fixture(scope="session")
def session_renders(engine_set) -> Iterator[list[Render]]:
    if attach := os.environ.get("DISAGG_ATTACH_SESSION_RENDERS"):
        yield [Render(r["url"], r["pid"]) for r in json.loads(Path(attach).read_text())]
        return
    kv = Path(tempfile.mkdtemp(prefix="disagg-kv-"))
    specs = [role_specs(("render",), engine_set.model_dir, kv, name_prefix=f"session{i}-")[0] for i in range(2)]
    servers = start_all(specs, Path(tempfile.mkdtemp(prefix="disagg-session-logs-")), timeout=900)
    try:
        yield [Render(s.url, s.pid) for s in servers]
    finally:
        stop_all(servers)
