"""SIGTERM on the real ``disagg sidecar`` process, the part a Service needs: after the signal the
pod's endpoints and kube-proxy's rules are removed asynchronously, so the sidecar turns readiness
off but keeps accepting new connections for ``limits.deregister_seconds`` before it drains and
closes its listener; every response from then on closes its connection. (Draining streams in
flight is covered with real engines in test_reliability.py.)"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from disagg_sidecar import wire
from disagg_sidecar.edge.handlers import MAX_DRAINED_WAITERS, SIGTERM_ALLOWANCE_SECONDS

from tests.sidecar.support import SERVED, FakeEngine, fake_config, fake_engine, sidecar_process, wait_for

pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    with fake_engine() as fake:
        yield fake


def _status(url: str) -> int | None:
    try:
        return requests.get(url, timeout=2).status_code
    except requests.RequestException:
        return None


def test_sigterm_keeps_accepting_connections_for_the_deregister_window(engine: FakeEngine, tmp_path: Path) -> None:
    window = 3.0
    config = fake_config(engine, limits={"deregister_seconds": window, "drain_seconds": 30,
                                         "health_interval_seconds": 0.5})
    with sidecar_process(config, tmp_path) as sidecar:
        kept = requests.Session()  # a client's keep-alive connection, open before the signal
        before = kept.get(sidecar.url + "/v1/models", timeout=5)
        assert before.status_code == 200 and before.headers.get("Connection") != "close"
        signalled = time.monotonic()
        sidecar.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: _status(sidecar.url + "/health") == 503, timeout=window), "readiness still on"
        again = kept.get(sidecar.url + "/v1/models", timeout=5)
        assert again.status_code == 200 and again.headers["Connection"] == "close"
        served = 0
        while time.monotonic() - signalled < window - 0.5:  # new connections, each one a request
            resp = requests.get(sidecar.url + "/v1/models", timeout=5)
            assert resp.status_code == 200 and resp.headers["Connection"] == "close"
            assert [m["id"] for m in resp.json()["data"]] == [SERVED]  # the decode engine's answer, relayed
            served += 1
        assert served > 0
        assert sidecar.proc.wait(window + 30) == 0
        exited = time.monotonic() - signalled
        assert _status(sidecar.url + "/health/live") is None, "the listener is closed once it exited"
    assert window <= exited < window + 5, exited  # idle: the drain itself takes no time
    messages = [line["msg"] for line in sidecar.logged() if line["logger"] == "disagg_sidecar"]
    assert "readiness off; serving new connections for 3s while endpoints are removed" in messages
    assert "draining 0 in-flight requests (up to 30s)" in messages
    print(f"deregister window {window:.0f}s: {served} new connections served after SIGTERM, exit {exited:.1f}s")


def _get_in_background(url: str) -> tuple[dict, threading.Thread]:
    """GET ``url`` in a thread; the result's status, body and monotonic answer time."""
    got: dict = {}

    def run() -> None:
        resp = requests.get(url, timeout=60)
        got.update(status=resp.status_code, body=resp.json(), at=time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return got, thread


def test_drained_answers_the_engines_prestop_hook_once_nothing_is_in_flight(engine: FakeEngine, tmp_path: Path) -> None:
    """``GET /health/drained`` (decode vLLM's preStop hook): 409 in OpenAI's shape while the sidecar
    is not stopping, 429 at once past the one it lets wait per address; after SIGTERM, 200 only once the
    deregister window is over and the request in flight has been answered, before the sidecar exits."""
    window, slow = 1.0, 4.0
    engine.delay[wire.CHAT_RENDER] = slow  # a request that stays in flight past the window
    config = fake_config(engine, limits={"deregister_seconds": window, "drain_seconds": 30,
                                         "health_interval_seconds": 0.5})
    with sidecar_process(config, tmp_path) as sidecar:
        asked = time.monotonic()
        early = [_get_in_background(sidecar.url + wire.DRAINED) for _ in range(MAX_DRAINED_WAITERS + 1)]
        for _, thread in early:
            thread.join(30)
        answers = sorted((got["status"], got["at"] - asked, got["body"]["error"]["message"]) for got, _ in early)
        assert [status for status, _, _ in answers] == [409] * MAX_DRAINED_WAITERS + [429], answers
        for status, after, message in answers:
            if status == 409:  # waited for a SIGTERM that did not come
                assert "not stopping" in message and after >= SIGTERM_ALLOWANCE_SECONDS - 0.5
            else:  # one too many: at once
                assert "already wait" in message and after < SIGTERM_ALLOWANCE_SECONDS - 0.5

        chat: dict = {}
        in_flight = threading.Thread(target=lambda: chat.update(
            status=requests.post(sidecar.url + wire.CHAT, json={"model": SERVED, "messages": [
                {"role": "user", "content": "hi"}]}, timeout=60).status_code, at=time.monotonic()), daemon=True)
        in_flight.start()
        assert wait_for(lambda: any(c.path == wire.CHAT_RENDER for c in engine.calls), timeout=10)
        hook, hook_thread = _get_in_background(sidecar.url + wire.DRAINED)  # before the signal, as it may come
        signalled = time.monotonic()
        sidecar.proc.send_signal(signal.SIGTERM)
        in_flight.join(60)
        hook_thread.join(60)
        assert hook["status"] == 200 and hook["body"] == {"status": "drained"}, hook
        assert chat["status"] == 400  # the fake render's refusal, relayed: the request was served
        # Not before the chat's answer (the two client threads stamp their answers a little apart):
        # a hook that ignored the request in flight would answer ~3 s before it.
        assert hook["at"] >= chat["at"] - 0.25 and hook["at"] - signalled >= window
        assert sidecar.proc.wait(30) == 0
    engine.delay.clear()
