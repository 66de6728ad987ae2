"""``disagg down`` of the deployment the demo left running: no process, no port, no state left.

That deployment's render, prefill and decode are also the harness's shared set, so this module runs
last (``final_local_tiny``), after the tests that kill its prefill and decode
(tests/sidecar/test_killed_engines.py): ``disagg down`` stops what is left and cleans up after
what died."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from disagg_cli.local.runner import STATE_FILE
from disagg_engine.servers import pid_alive, port_in_use
from tests.harness.engine import disagg

pytestmark = pytest.mark.e2e


def test_down_leaves_no_process_and_no_port(final_local_tiny, demo_run):
    report = json.loads(disagg("status", "--json", "--state-dir", str(final_local_tiny.state)).stdout)
    members = [m for ms in report["pools"].values() for m in ms]
    down = disagg("down", "--state-dir", str(final_local_tiny.state))
    assert down.returncode == 0, down.stderr
    assert down.stdout.startswith(f"stopped {len(members)} processes: "), down.stdout
    for m in members:
        assert not pid_alive(m["pid"]), m
    deadline = time.monotonic() + 10
    ports = [int(m["url"].rsplit(":", 1)[1]) for m in members]
    while any(port_in_use(p) for p in ports):
        assert time.monotonic() < deadline, "ports still in use"
        time.sleep(0.1)
    assert not any(final_local_tiny.state.glob(f"*/{STATE_FILE}"))
    # Nothing the demo started survives, not even a process `disagg status` does not list (an
    # engine core, a tokenizer worker): they all inherited the demo's environment mark.
    assert [pid for pid in _processes_with(demo_run.mark) if pid_alive(pid)] == []


def _processes_with(mark: str) -> list[int]:
    """Pids whose environment carries ``mark`` (every descendant of the demo inherits it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return found
