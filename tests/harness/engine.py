"""Session-scoped fixtures for the real vLLM CPU servers (started once, in parallel).

``engine_set`` starts render, tokens-only prefill, decode and the coupled reference (see
``disagg_engine.testing.server_set``); ``spare_engines`` a prefill and a decode server of their
own, for tests that kill servers. A failing test that used them gets the servers' log tails
attached to its report. For quick iteration, ``DISAGG_ATTACH_SERVERS=<log dir>/servers.json``
attaches to a set already started with ``python -m disagg_engine.testing.server_set``.

vLLM start-up is the suite's largest cost, so the sets start in a background thread as soon as
collection shows they are needed, and modules that need no engine run first (then engine
modules, then e2e): start-up overlaps the control-plane and unit tests instead of adding to them.
A set is stopped after the last test that uses it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.forced import Forcer

_SETS: list = []
# Modules with a test using one of these fixtures, or marked e2e (local mode starts vLLM itself),
# run after the others.
_ENGINE_FIXTURES = ("engine_set", "spare_engines")


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


def _start_engine_set():
    from disagg_engine.testing.server_set import start_server_set

    return start_server_set(Path(tempfile.mkdtemp(prefix="disagg-engine-logs-")))


def _start_spares():
    from disagg_engine.servers import start_all
    from disagg_engine.testing.server_set import role_specs

    sset = _shared_set()  # same model and KV directory
    specs = role_specs(("prefill", "decode"), sset.model_dir, sset.kv_dir, name_prefix="spare-")
    servers = start_all(specs, Path(tempfile.mkdtemp(prefix="disagg-spare-logs-")), timeout=900)
    return {s.spec.name.removeprefix("spare-"): s for s in servers}


class _EarlyStarts:
    """Server sets started one after another in one background thread. Each is stopped after its
    last user (memory: 24 GiB hold the shared set plus the spares or a local-mode deployment, not
    all three) and at the end of the session, also when its fixture never ran."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-start")
        self._futures: dict[str, Future] = {}
        self.last_user: dict[str, str] = {}  # set name -> nodeid of the last test that uses it

    def submit(self, name: str) -> None:
        if name not in self._futures:
            self._futures[name] = self._pool.submit(_STARTERS[name])

    def result(self, name: str):
        self.submit(name)  # not foreseen at collection (e.g. getfixturevalue): start now
        return self._futures[name].result()

    def stop(self, name: str) -> None:
        future = self._futures.get(name)
        if future is not None and future.done() and future.exception() is None:
            started = future.result()
            for server in (started.values() if isinstance(started, dict) else started.servers.values()):
                server.stop()  # idempotent

    def stop_all(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # a start in progress finishes, then is stopped
        for name in reversed(list(self._futures)):
            self.stop(name)


_STARTERS: dict[str, Callable] = {"engine_set": _start_engine_set, "spare_engines": _start_spares}
_early = _EarlyStarts()


def _uses(item: pytest.Item, name: str) -> bool:
    return name in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules needing no engine first, then engine modules, then e2e (local mode starts its own
    vLLM set); stable, so module and test order are kept within each group."""
    def weight(item: pytest.Item) -> int:
        return 2 if item.get_closest_marker("e2e") else 1 if any(_uses(item, f) for f in _ENGINE_FIXTURES) else 0

    module = lambda item: item.nodeid.split("::", 1)[0]
    weights: dict[str, int] = {}
    for item in items:
        weights[module(item)] = max(weights.get(module(item), 0), weight(item))
    items.sort(key=lambda item: weights[module(item)])
    for name in _ENGINE_FIXTURES:
        users = [item.nodeid for item in items if _uses(item, name)]
        if users:
            _early.last_user[name] = users[-1]


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    wanted = {f for item in session.items for f in item.fixturenames if f in _ENGINE_FIXTURES}
    if "spare_engines" in wanted:
        wanted.add("engine_set")
    if os.environ.get("DISAGG_ATTACH_SERVERS"):
        wanted.discard("engine_set")
    for name in _ENGINE_FIXTURES:  # the shared set first: most tests need it
        if name in wanted:
            _early.submit(name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator:
    yield
    for name, nodeid in _early.last_user.items():
        if item.nodeid == nodeid:
            _early.stop(name)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _early.stop_all()


def _shared_set():
    if attach := os.environ.get("DISAGG_ATTACH_SERVERS"):
        return _attached_set(attach)
    return _early.result("engine_set")


@pytest.fixture(scope="session")
def engine_set() -> Iterator:
    sset = _shared_set()
    _SETS.append(sset)
    yield sset
    _SETS.remove(sset)


@pytest.fixture(scope="session")
def spare_engines(engine_set) -> dict:
    """A prefill and a decode server of their own (the shared set's model and KV directory), to kill."""
    return _early.result("spare_engines")


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
