"""Session-scoped fixtures for the real vLLM CPU servers (started once, in parallel).

``engine_set`` is render, tokens-only prefill, decode and the coupled reference (the roles of
``disagg_engine.testing.server_set``). Its render, prefill and decode are the deployment
``make demo`` brings up (``demo_run``: the demo's program with ``--keep``, i.e. ``disagg up
examples/local-tiny.yaml --detach`` and one chat): the same model, parsers, forced-output logits
processor and ExampleConnector KV hand-over, planned by the operator's own ``build_plan``, so the
engine tests run on what local mode deploys and the suite starts three vLLM servers fewer. The
coupled reference is the harness's own server. ``local_tiny`` is that deployment, for the
local-mode tests. A failing test that used the set gets the servers' log tails attached to its
report. For quick iteration, ``DISAGG_ATTACH_SERVERS=<log dir>/servers.json`` attaches to a full
set started with ``python -m disagg_engine.testing.server_set`` instead.

vLLM start-up is the suite's largest cost, so the demo and the coupled server start in a background
thread as soon as collection shows they are needed, and modules that need no engine run first:
start-up overlaps the control-plane and unit tests instead of adding to them. Then come the engine
modules, e2e, the modules that kill the set's prefill and decode (``doomed_engines``), and last the
one that takes the deployment down (``final_local_tiny``). Test modules add starts of their own to
that thread with ``early_fixture``: queued after the sets when collection ends (a server of their
own), or once the last control-plane test that needs no engine is done (the example on the real
node, which those tests' operators and node restarts must not see), so the work overlaps tests
that leave the CPU idle.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from disagg_cli.local.runner import KV_DIR, STATE_FILE, Deployment, find_state
from disagg_engine.servers import ManagedServer, start_all, stop_all, stop_group
from disagg_engine.testing.lanes import LANES, MAIN
from disagg_engine.testing.server_set import ServerSet, role_specs, start_server_set
from disagg_engine.testing.tiny_model import ensure_model
from tests.engine.session_renders import Render
from tests.harness.forced import Forcer
from tests.harness.start_priority import StartPriority

ROOT = Path(__file__).resolve().parents[2]
_SETS: list = []
# Fixtures started early in the background, one after the other in this order (the demo's start
# returns at once; the set then starts its coupled server and waits for the demo's deployment).
_EARLY_FIXTURES = ["demo_run", "engine_set", "engine_set_033", "engine_set_034", "session_renders"]  # + early_fixture's
_AFTER_CLUSTER_TESTS: list[str] = []  # early_fixture(after_cluster_tests=True)
_ENGINE_FIXTURES = ("engine_set", "lane_set", "engine_set_033", "engine_set_034", "demo_run")
_NEEDS = {"engine_set": "demo_run"}
# `lane_set` runs a test once per vLLM lane: it needs the set of each.
_LANE_SETS = {MAIN: "engine_set", "0.33": "engine_set_033", "0.34": "engine_set_034"}


@dataclass
class AttachedServer:
    url: str
    pid: int
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(line[:300] for line in self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _attached_set(path: str) -> ServerSet:
    desc = json.loads(Path(path).read_text())
    servers = {name: AttachedServer(d["url"], d["pid"], Path(d["log"])) for name, d in desc["servers"].items()}
    return ServerSet(servers, Path(desc["model_dir"]), Path(desc["kv_dir"]), Path(desc["log_dir"]),
                     desc.get("vllm_lane", MAIN))


@dataclass
class LocalDeployment:
    """A deployment ``disagg up`` left running, in the state directory ``state``."""
    endpoint: str
    state: Path


def _down(state: Path) -> None:
    """``disagg down`` for whatever is still up in ``state`` (a test may have taken it down)."""
    if any(state.glob(f"*/{STATE_FILE}")):
        disagg("down", "--state-dir", str(state), timeout=120)


@dataclass
class SharedSet(ServerSet):
    """A set whose render, prefill and decode belong to a local deployment: stopping it stops only
    the servers the harness started (``owned``); the deployment is the demo's to take down."""
    owned: tuple[ManagedServer, ...] = ()

    def stop(self) -> None:
        stop_all(self.owned)


def _start_engine_set() -> SharedSet:
    coupled = start_server_set(Path(tempfile.mkdtemp(prefix="disagg-engine-logs-")), roles=("coupled",))
    try:
        state = find_state(_early.result("demo_run").deployment().state, None)
    except BaseException:
        coupled.stop()
        raise
    tiers = {p["pool"]: AttachedServer(p["url"], p["pid"], Path(p["log"]))
             for p in Deployment.load(state).processes if p["pool"] in ("render", "prefill", "decode")}
    return SharedSet({**tiers, **coupled.servers}, coupled.model_dir, state / KV_DIR, coupled.log_dir,
                     owned=tuple(coupled.servers.values()))


@dataclass
class DemoRun:
    """``python -m disagg_cli.demo --keep`` running in the background. Every process it starts
    inherits ``mark`` (KEY=VALUE) in its environment; ``tmp`` is its TMPDIR, ``tmp/state`` the
    state directory of the deployment it leaves running."""
    proc: subprocess.Popen
    mark: str
    tmp: Path
    started: float

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """Exit code, stdout and stderr, within ``timeout`` seconds of the start."""
        self.proc.wait(timeout=max(1.0, self.started + timeout - time.monotonic()))
        return self.proc.returncode, (self.tmp / "stdout").read_text(), (self.tmp / "stderr").read_text()

    def deployment(self) -> LocalDeployment:
        code, out, err = self.wait(timeout=1500)
        if code != 0:
            raise RuntimeError(f"the demo exited {code}\n{out}\n{err}")
        return LocalDeployment(re.search(r"^endpoint: (http://127\.0\.0\.1:\d+)$", out, re.M).group(1),
                               self.tmp / "state")

    def stop(self) -> None:
        """Interrupt a demo still running (one still starting stops what it started), then take
        down what it left running."""
        stop_group(self.proc, signal.SIGINT, grace=60)
        _down(self.tmp / "state")
        shutil.rmtree(self.tmp, ignore_errors=True)


class _EarlyStarts:
    """Server sets and deployments started one after another in one background thread. Each is
    stopped after its last module and at the end of the session, also when its fixture never ran."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-start")
        self._futures: dict[str, Future] = {}
        self.last_user: dict[str, str] = {}  # set name -> nodeid of the last test of its last module
        self.after: dict[str, list[str]] = {}  # nodeid -> starts submitted after that test

    def submit(self, name: str) -> None:
        if name in _NEEDS:
            self.submit(_NEEDS[name])  # queued first: the single thread must never wait on a later task
        if name not in self._futures:
            self._futures[name] = self._pool.submit(_STARTERS[name])

    def result(self, name: str):
        self.submit(name)  # not foreseen at collection (e.g. getfixturevalue): start now
        return self._futures[name].result()

    def then(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in the thread once the starts submitted so far are done."""
        self._pool.submit(fn)

    def stop(self, name: str) -> None:
        future = self._futures.get(name)
        if future is not None and future.done() and not future.cancelled() and future.exception() is None:
            future.result().stop()  # idempotent

    def stop_many(self, names: list[str]) -> None:
        """Each takes seconds (vLLM's shutdown): all at once."""
        with ThreadPoolExecutor(max(1, len(names))) as pool:
            list(pool.map(self.stop, names))

    def stop_all(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # a start in progress finishes, then is stopped
        self.stop_many(list(self._futures))


DISAGG = [sys.executable, "-m", "disagg_cli.main"]


def disagg(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """The ``disagg`` CLI, run from the repository root."""
    return subprocess.run([*DISAGG, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)


def _start_demo() -> DemoRun:
    tmp = Path(tempfile.mkdtemp(prefix="disagg-demo-test-"))
    key, value = "DISAGG_DEMO_RUN", uuid.uuid4().hex
    with open(tmp / "stdout", "w") as out, open(tmp / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "disagg_cli.demo", "--keep", "--state-dir", str(tmp / "state")],
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT,
                                env={**os.environ, key: value, "TMPDIR": str(tmp)}, start_new_session=True)
    return DemoRun(proc, f"{key}={value}", tmp, time.monotonic())


def _lane_starter(lane: str) -> Callable[[], ServerSet]:
    tag = lane.replace(".", "")
    return lambda: start_server_set(Path(tempfile.mkdtemp(prefix=f"disagg-engine-{tag}-logs-")), lane=lane)


@dataclass
class SessionRenders:
    """A ``launch render`` server with the engine extension that a test may kill (the demo's render
    has the extension too, and others rely on it)."""
    servers: list[ManagedServer]

    def stop(self) -> None:
        stop_all(self.servers)


def _start_session_renders() -> SessionRenders:
    kv = Path(tempfile.mkdtemp(prefix="disagg-kv-"))
    specs = role_specs(("render",), ensure_model(), kv, name_prefix="killable-")
    return SessionRenders(start_all(specs, Path(tempfile.mkdtemp(prefix="disagg-session-logs-")), timeout=900))


_STARTERS: dict[str, Callable] = {"engine_set": _start_engine_set, "demo_run": _start_demo,
                                  "engine_set_033": _lane_starter("0.33"), "engine_set_034": _lane_starter("0.34"),
                                  "session_renders": _start_session_renders}
_early = _EarlyStarts()
_start_priority = StartPriority()


def _uses(item: pytest.Item, name: str) -> bool:
    return name in getattr(item, "fixturenames", ())


def _dependents(name: str) -> tuple[str, ...]:
    return tuple(k for k, v in _NEEDS.items() if v == name)


def _uses_start(item: pytest.Item, name: str) -> bool:
    """Whether the test needs the early start ``name``, itself or through one that needs it."""
    return any(_uses(item, n) for n in (name, *_dependents(name)))


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection: plan only for the tests that run
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules needing no engine first: those needing neither the cluster nor a background start
    while the control plane starts (tests/harness/cluster.py), then those using the cluster (so the
    starts waiting for them begin sooner), then the rest; then the engine modules, e2e, the modules
    that kill the set's prefill and decode, and last the one that takes the deployment down;
    stable, so module and test order are kept within each group."""
    def weight(item: pytest.Item) -> int:
        if _uses(item, "final_local_tiny"):
            return 4
        if _uses(item, "doomed_engines"):
            return 3
        # The example on the real node waits for the control-plane tests: its modules run with e2e.
        if not any(_uses(item, name) for name in (*_ENGINE_FIXTURES, *_AFTER_CLUSTER_TESTS)):
            return 0
        return 2 if item.get_closest_marker("e2e") else 1

    module = lambda item: item.nodeid.split("::", 1)[0]
    weights: dict[str, int] = {}
    for item in items:
        weights[module(item)] = max(weights.get(module(item), 0), weight(item))
    on_cluster = {module(item) for item in items if _uses(item, "cluster")}
    waiting = {module(item) for item in items if any(_uses(item, name) for name in _STARTERS)}
    no_engine_group = lambda m: 1 if m in on_cluster else 2 if m in waiting else 0
    items.sort(key=lambda item: (weights[module(item)], weights[module(item)] or no_engine_group(module(item))))
    first_group = [item for item in items if weights[module(item)] == 0 and _uses(item, "cluster")]
    for name in _AFTER_CLUSTER_TESTS:
        if first_group and any(_uses(item, name) for item in items):
            _early.after.setdefault(first_group[-1].nodeid, []).append(name)
    for name in (*_EARLY_FIXTURES, *_AFTER_CLUSTER_TESTS):  # a start is stopped after the last module needing it
        modules = {module(item) for item in items if _uses_start(item, name)
                   or (_uses(item, "lane_set") and _LANE_SETS[item.callspec.params["lane_set"]] in (name, *_dependents(name)))}
        users = [item.nodeid for item in items if module(item) in modules]
        if users:
            _early.last_user[name] = users[-1]


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    wanted = {f for item in session.items for f in item.fixturenames if f in _EARLY_FIXTURES}
    for item in session.items:
        if _uses(item, "lane_set"):
            wanted.add(_LANE_SETS[item.callspec.params["lane_set"]])
    for name, var in _ATTACH.items():
        if os.environ.get(var):
            wanted.discard(name)
    starts = [name for name in _EARLY_FIXTURES if name in wanted]
    if starts:
        _start_priority.start()  # before the first server: they inherit its marker
        for name in starts:
            _early.submit(name)
        _early.then(_start_priority.stop)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator:
    yield
    _early.stop_many([name for name, nodeid in _early.last_user.items() if item.nodeid == nodeid])
    for name in _early.after.get(item.nodeid, []):
        _early.submit(name)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _start_priority.stop()  # also when a failed start left it queued
    _early.stop_all()


# For quick iteration: a set started with `python -m disagg_engine.testing.server_set` (with the
# lane's environment for 0.33) instead of the harness's.
_ATTACH = {"engine_set": "DISAGG_ATTACH_SERVERS", "engine_set_033": "DISAGG_ATTACH_SERVERS_033",
           "engine_set_034": "DISAGG_ATTACH_SERVERS_034", "session_renders": "DISAGG_ATTACH_SESSION_RENDERS"}


def _shared_set(name: str):
    if attach := os.environ.get(_ATTACH[name]):
        return _attached_set(attach)
    return _early.result(name)


@pytest.fixture(scope="session")
def engine_set() -> Iterator:
    sset = _shared_set("engine_set")
    _SETS.append(sset)
    yield sset
    _SETS.remove(sset)


@pytest.fixture(scope="session")
def engine_set_033() -> Iterator:
    """The full set of four on the vLLM 0.33 lane (``disagg_engine.testing.lanes``)."""
    sset = _shared_set("engine_set_033")
    _SETS.append(sset)
    yield sset
    _SETS.remove(sset)


@pytest.fixture(scope="session")
def engine_set_034() -> Iterator:
    """The full set of four on the vLLM 0.34 lane: the parity modules run on it
    (``PARITY_LANES``), and tests/engine/test_lane_034.py uses its coupled server."""
    sset = _shared_set("engine_set_034")
    _SETS.append(sset)
    yield sset
    _SETS.remove(sset)


@pytest.fixture(scope="session", params=LANES)
def lane_set(request) -> ServerSet:
    """The set of each vLLM lane in turn: render, prefill, decode (with the extension) and coupled.
    A module may run on other lanes: ``pytest.mark.parametrize("lane_set", PARITY_LANES, indirect=True)``."""
    return request.getfixturevalue(_LANE_SETS[request.param])


@pytest.fixture(scope="session")
def session_renders(engine_set) -> list[Render]:
    """Two renders with derender sessions (tests/engine/session_renders.py): first one of the
    session tests' own, which a test may kill, then the shared set's (the demo's)."""
    if attach := os.environ.get(_ATTACH["session_renders"]):
        killable = [Render(r["url"], r["pid"]) for r in json.loads(Path(attach).read_text())]
    else:
        killable = [Render(s.url, s.pid) for s in _early.result("session_renders").servers]
    return [*killable, Render(engine_set.url("render"), engine_set.servers["render"].pid)]


def early_fixture(name: str, start: Callable[[], Any], *, after_cluster_tests: bool = False) -> Any:
    """A fixture ``name`` whose value ``start()`` makes in the background thread (see the module
    docstring); the value's ``stop()`` runs after the last module using it. Assign it in the test
    module: ``keyed_render = early_fixture("keyed_render", start_keyed_render)``."""
    _STARTERS[name] = start
    (_AFTER_CLUSTER_TESTS if after_cluster_tests else _EARLY_FIXTURES).append(name)

    @pytest.fixture(name=name, scope="session")
    def started() -> Any:
        return _early.result(name)
    return started


@pytest.fixture(scope="session")
def doomed_engines(engine_set) -> dict:
    """The set's prefill and decode servers, for tests that kill them: modules using this run after
    every other test that needs those servers (see pytest_collection_modifyitems)."""
    return {role: engine_set.servers[role] for role in ("prefill", "decode")}


@pytest.fixture(scope="session")
def demo_run() -> DemoRun:
    """``make demo``'s program, started in the background (see the module docstring)."""
    return _early.result("demo_run")


@pytest.fixture(scope="session")
def local_tiny(demo_run) -> LocalDeployment:
    """The deployment the demo left running (``disagg up examples/local-tiny.yaml``)."""
    return demo_run.deployment()


@pytest.fixture(scope="session")
def final_local_tiny(local_tiny) -> LocalDeployment:
    """The same deployment, for the module that takes it down: it runs last of all."""
    return local_tiny


@pytest.fixture(scope="session")
def forcer(engine_set) -> Forcer:
    return Forcer(engine_set.model_dir)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    outcome = yield
    report = outcome.get_result()
    funcargs = getattr(item, "funcargs", {})
    sset = funcargs.get("lane_set") or funcargs.get("engine_set")
    if report.failed and sset is not None:
        for name, server in sset.servers.items():
            report.sections.append((f"server log: {name}", server.log_tail(30)))
