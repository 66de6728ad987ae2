"""``disagg up`` keeps serving when a pool process is SIGKILLed under a bounded request stream:
prefill's API server killed (its engine core left orphaned: the supervisor reaps the group before the
restart, and nothing of the old group survives it) -> every request still succeeds (decode prefills itself, flagged ``fallback``);
decode killed -> the requests in flight end with a clean OpenAI-shaped error, the sidecar reports
not ready, and requests succeed again once the supervisor has it back. Both processes come back
within their restart budget (the supervisor ``disagg up --detach`` leaves running).

It runs on the demo's deployment, whose prefill and decode are the shared set's: it takes them as
``doomed_engines``, so it runs after every other test that needs them, right before
tests/sidecar/test_killed_engines.py, and hands that module the restarted processes (their new
pids; same URLs and logs). Cost: one round of two engine restarts side by side (1-3 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from disagg_cli.local.runner import Deployment, find_state
from disagg_cli.local.runner import status as deployment_status
from disagg_engine.servers import group_members, pid_alive, signal_group
from tests.harness.engine import disagg
from tests.sidecar.support import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.reliability]
RESTART_TIMEOUT = 600  # two vLLM engines starting side by side on a loaded 2-core machine
POLL = 0.5  # each poll asks every process's /health
PROMPT = [1000 + i for i in range(160)]  # long enough for remote prefill (min_prompt_tokens 130)


def _members(report: dict) -> dict[str, dict]:
    return {m["name"]: m for ms in report["pools"].values() for m in ms}


def _status(local_tiny) -> dict[str, dict]:
    return _members(json.loads(disagg("status", "--json", "--state-dir", str(local_tiny.state)).stdout))


def _all_healthy(local_tiny) -> bool:
    """What `disagg status` reports, read in-process: polled, a CLI process each time would take
    a core from the engines restarting."""
    members = _members(deployment_status(find_state(local_tiny.state, None)))
    return all(m["healthy"] for m in members.values()) and _ready(local_tiny.endpoint)


def _ready(endpoint: str) -> bool:
    return requests.get(endpoint + "/health", timeout=5).status_code == 200


def _complete(endpoint: str, max_tokens: int) -> tuple[int, str | None, dict]:
    resp = requests.post(endpoint + "/v1/completions", timeout=300, json={
        "model": "tiny-qwen3", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True})
    return resp.status_code, resp.headers.get("x-disagg-prefill"), resp.json()


def _stream(endpoint: str, total: int, concurrency: int, max_tokens: int, kill, after) -> list[tuple]:
    """``total`` requests, ``concurrency`` at a time; ``kill()`` once ``after()`` holds."""
    results: list[tuple] = []
    done = threading.Event()

    def killer() -> None:
        assert wait_for(lambda: after(results) or done.is_set(), timeout=300)
        kill()

    with ThreadPoolExecutor(concurrency + 1) as pool:
        killed = pool.submit(killer)
        results_f = [pool.submit(_complete, endpoint, max_tokens) for _ in range(total)]
        for f in results_f:
            results.append(f.result())
        done.set()
        killed.result()
    return results


def _openai_error(status: int, body: dict) -> bool:
    error = body.get("error") or {}
    return status in (502, 503) and isinstance(error.get("message"), str) and error.get("type") and \
        "Traceback" not in error["message"] and "127.0.0.1" not in error["message"]


def test_sigkill_of_prefill_then_decode_under_a_request_stream(local_tiny, doomed_engines):
    local = local_tiny
    assert wait_for(lambda: _all_healthy(local), timeout=RESTART_TIMEOUT, interval=POLL), _status(local)
    state = find_state(local.state, None)
    procs = {p["name"]: p for p in Deployment.load(state).processes}
    before = _status(local)

    # Prefill: SIGKILL of its API server process only (its engine core lives on, orphaned, until the
    # supervisor reaps the group) after a few requests; every request succeeds, the later ones by fallback.
    prefill_pid = procs["prefill-0"]["pid"]
    prefill_group = group_members(prefill_pid)
    assert len(prefill_group) >= 2, "an API server and its engine core"
    results = _stream(local.endpoint, total=16, concurrency=2, max_tokens=4,
                      kill=lambda: os.kill(prefill_pid, signal.SIGKILL), after=lambda r: len(r) >= 3)
    failed = [r for r in results if r[0] != 200]
    print(f"\nprefill SIGKILL: {len(failed)}/{len(results)} requests failed, "
          f"{sum(r[1] == 'fallback' for r in results)} served by fallback")
    assert not failed, failed
    assert any(r[1] == "fallback" for r in results) and results[0][1] == "remote"

    # Decode: SIGKILL while requests are in flight; they end with a clean error, not a hang.
    decode_pid = procs["decode-0"]["pid"]
    metric = "disagg_sidecar_requests_in_flight "

    def in_flight(_results) -> bool:
        text = requests.get(local.endpoint + "/metrics", timeout=5).text
        return any(line.startswith(metric) and float(line.split()[-1]) >= 2 for line in text.splitlines())

    results = _stream(local.endpoint, total=6, concurrency=3, max_tokens=400,
                      kill=lambda: signal_group(decode_pid, signal.SIGKILL), after=in_flight)
    failed = [r for r in results if r[0] != 200]
    print(f"decode SIGKILL: {len(failed)}/{len(results)} requests failed")
    assert failed and all(_openai_error(status, body) for status, _, body in failed), failed
    assert wait_for(lambda: not _ready(local.endpoint), timeout=10)  # readiness reports it

    # Both back within their budget (new pids, one restart more each); then requests succeed.
    assert wait_for(lambda: _all_healthy(local), timeout=RESTART_TIMEOUT, interval=POLL), _status(local)
    after = _status(local)
    for name in ("prefill-0", "decode-0"):
        assert after[name]["restarts"] == before[name]["restarts"] + 1, after[name]
        assert after[name]["pid"] != procs[name]["pid"] and pid_alive(after[name]["pid"])
    # Nothing of the killed server's group survives its restart (its engine core was reaped).
    assert group_members(prefill_pid) == [] and not any(pid_alive(p) for p in prefill_group), prefill_group
    later = [_complete(local.endpoint, 4) for _ in range(3)]
    print(f"after the restarts: {sum(r[0] != 200 for r in later)}/{len(later)} requests failed")
    assert [(status, prefill) for status, prefill, _ in later] == [(200, "remote")] * 3
    for role in ("prefill", "decode"):  # the shared set's servers are these processes now
        if doomed_engines[role].url == procs[f"{role}-0"]["url"]:  # (not an attached set's)
            doomed_engines[role].pid = after[f"{role}-0"]["pid"]
