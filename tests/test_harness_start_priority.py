"""The harness's start-up priority (tests/harness/start_priority.py) on real processes: a marked
vLLM process in a session of its own is lowered to autogroup nice 19 and restored to 0 by
``stop()``; an unmarked one, and a marked one that is not vLLM, are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from disagg_engine.servers import stop_group
from tests.harness.start_priority import MARK, StartPriority
from tests.sidecar.support import wait_for

AUTOGROUPS = Path("/proc/sys/kernel/sched_autogroup_enabled")
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def _nice(proc: subprocess.Popen) -> int:
    return int(Path(f"/proc/{proc.pid}/autogroup").read_text().split()[-1])


def test_marked_vllm_processes_start_low_and_are_restored() -> None:
    priority = StartPriority()
    unmarked_env = {k: v for k, v in os.environ.items() if k != MARK}
    # Before the marked ones: any scan that sees those has this one to see too.
    unmarked = subprocess.Popen([*SLEEP, "vllm.entrypoints.unmarked"], env=unmarked_env, start_new_session=True)
    env = dict(unmarked_env)
    priority.start(env)
    assert env[MARK] == priority.token
    other = subprocess.Popen([*SLEEP, "not-an-engine"], env=env, start_new_session=True)
    marked = subprocess.Popen([*SLEEP, "vllm.entrypoints.marked"], env=env, start_new_session=True)
    try:
        if AUTOGROUPS.exists() and AUTOGROUPS.read_text().strip() == "1":
            assert wait_for(lambda: _nice(marked) == 19, timeout=10, interval=0.1)
            assert (_nice(unmarked), _nice(other)) == (0, 0)
            priority.stop()
            assert [_nice(p) for p in (marked, unmarked, other)] == [0, 0, 0]
        else:  # no autogroups: nothing to lower, and stopping is harmless
            priority.stop()
        priority.stop()  # idempotent
    finally:
        priority.stop()
        for proc in (unmarked, other, marked):
            stop_group(proc, grace=5)
