"""Local mode's supervisor: the restart budget (pure) and restarts of real (tiny) processes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from disagg_cli.local.supervise import Member, RestartPolicy, Supervisor, error_lines
from disagg_engine.servers import ServerSpec, free_port, pid_alive, start, stop_group


def test_backoff_doubles_and_the_budget_is_bounded_within_the_window():
    policy = RestartPolicy(max_restarts=3, window_seconds=100, backoff_seconds=1, max_backoff_seconds=3)
    assert policy.decide([], now=0) == 1
    assert policy.decide([0], now=5) == 2
    assert policy.decide([0, 5], now=10) == 3  # capped
    assert policy.decide([0, 5, 10], now=20) is None  # spent
    assert policy.decide([0, 5, 10], now=104) == 3  # the first one left the window


def test_error_lines_prefer_errors_and_fall_back_to_the_tail(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("\n".join([f"info {i}" for i in range(50)] + ["Traceback (most recent call last):",
                                                                 "IndexError: index out of range in self", "info end"]))
    assert error_lines(log, count=2) == ["Traceback (most recent call last):", "IndexError: index out of range in self"]
    log.write_text("a\nb\nc\n")
    assert error_lines(log, count=2) == ["b", "c"]
    assert error_lines(tmp_path / "missing.log") == [f"<no log at {tmp_path / 'missing.log'}>"]


def _wait(predicate, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_crashed_process_is_restarted_on_its_port_until_the_budget_is_spent(tmp_path):
    # A process that prints and dies at once: every start is a crash.
    spec = ServerSpec("crashy-0", [sys.executable, "-c", "import sys; print('boom: ValueError: bad'); sys.exit(3)"],
                      free_port())
    first = start(spec, tmp_path)
    member = Member(spec.name, spec, first.pid, first.log_path, first.proc)
    said, recorded = [], []
    sup = Supervisor([member], lambda ms: recorded.append([m.pid for m in ms]), said.append,
                     RestartPolicy(max_restarts=2, backoff_seconds=0.05, max_backoff_seconds=0.1))
    assert _wait(lambda: (sup.step(), member.failed)[1])
    assert len(member.restarts) == 2 and len(recorded) == 3  # two restarts, then the budget
    assert "exited (code 3); restart 1/2" in said[0] and "boom: ValueError: bad" in said[0]
    assert "restart budget spent, it stays down" in said[-1] and str(member.log) in said[-1]
    assert member.log.read_text().count("boom") == 3  # each start appends: the crash logs survive


def test_an_adopted_process_is_watched_by_pid_and_restarted(tmp_path):
    spec = ServerSpec("sleepy-0", [sys.executable, "-c", "import time; time.sleep(600)"], free_port())
    first = start(spec, tmp_path)
    member = Member(spec.name, spec, first.pid, first.log_path)  # adopted: no Popen of ours
    sup = Supervisor([member], lambda ms: None, lambda line: None, RestartPolicy(backoff_seconds=0.05))
    try:
        sup.step()
        assert member.restarts == []
        stop_group(first.proc)  # our Popen here only to reap it; the supervisor sees the pid go
        assert _wait(lambda: (sup.step(), member.restarts)[1] != [])
        assert member.pid != first.pid and pid_alive(member.pid)
    finally:
        if member.proc is not None:
            stop_group(member.proc)


def _deployment(tmp_path: Path, *argvs: list[str]):
    from disagg_cli.local.runner import Deployment

    servers = [start(ServerSpec(f"p-{i}", argv, free_port()), tmp_path / "logs") for i, argv in enumerate(argvs)]
    deployment = Deployment("t", "http://127.0.0.1:1", str(tmp_path), [
        {"name": s.spec.name, "pool": "prefill", "url": s.url, "pid": s.pid, "log": str(s.log_path),
         "argv": s.spec.argv, "env": {}, "port": s.spec.port, "restarts": 0, "failed": False} for s in servers])
    deployment.save()
    (tmp_path / "kv").mkdir()
    return deployment, servers


SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
CRASH = [sys.executable, "-c", "raise SystemExit('RuntimeError: engine core died')"]


def test_down_keeps_the_logs_when_a_process_had_crashed(tmp_path):
    from disagg_cli.local.runner import STATE_FILE, down

    deployment, servers = _deployment(tmp_path, SLEEP, CRASH)
    assert _wait(lambda: servers[1].proc.poll() is not None)
    stopped, logs = down(tmp_path)
    assert stopped == ["p-0", "p-1"] and logs == tmp_path / "logs"
    assert not servers[0].alive() and not (tmp_path / STATE_FILE).exists() and not (tmp_path / "kv").exists()
    assert "RuntimeError: engine core died" in (logs / "p-1.log").read_text()


def test_down_of_a_healthy_deployment_removes_everything(tmp_path):
    from disagg_cli.local.runner import down

    deployment, servers = _deployment(tmp_path / "state", SLEEP)
    assert down(tmp_path / "state") == (["p-0"], None)
    assert not (tmp_path / "state").exists() and not servers[0].alive()


# A server whose own child stays in its process group, as vLLM's engine core does: it prints the
# child's pid, then serves (sleeps).
WITH_CORE = [sys.executable, "-c", "import subprocess, sys, time\n"
             "core = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
             "print('core', core.pid, flush=True)\ntime.sleep(600)"]


def test_a_killed_server_leaves_no_process_of_its_group_behind_its_restart(tmp_path):
    """SIGKILL of the server process only (its core is orphaned to init, still in the group): the
    supervisor kills what is left of the group before it starts the server again."""
    import os
    import signal

    from disagg_engine.servers import group_members

    spec = ServerSpec("cored-0", WITH_CORE, free_port())
    first = start(spec, tmp_path)
    member = Member(spec.name, spec, first.pid, first.log_path, first.proc)
    sup = Supervisor([member], lambda ms: None, lambda line: None, RestartPolicy(backoff_seconds=0.05))
    try:
        assert _wait(lambda: "core " in member.log.read_text())
        core = int(member.log.read_text().split("core ", 1)[1].split()[0])
        assert sorted(group_members(first.pid)) == sorted([first.pid, core])
        os.kill(first.pid, signal.SIGKILL)  # the server only, as a crash or the OOM killer would
        first.proc.wait(10)
        assert pid_alive(core), "the core outlives its server on its own"
        assert _wait(lambda: (sup.step(), member.restarts)[1] != [])
        assert not pid_alive(core) and group_members(first.pid) == [], "nothing of the old group survives"
        assert member.pid != first.pid and pid_alive(member.pid)
    finally:
        if member.proc is not None:
            stop_group(member.proc)
