"""SIGTERM on the real ``disagg sidecar`` process, the part a Service needs: after the signal the
pod's endpoints and kube-proxy's rules are removed asynchronously, so the sidecar turns readiness
off but keeps accepting new connections for ``limits.deregister_seconds`` before it drains and
closes its listener; every response from then on closes its connection. (Draining streams in
flight is covered with real engines in test_reliability.py.)"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

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
