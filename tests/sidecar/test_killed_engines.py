"""Killed engines: a prefill server that dies (the sidecar falls back, fails or retries, as
configured) and a decode engine that dies mid-stream (the client's stream ends with an error).

The victims are the shared set's prefill and decode servers (``doomed_engines``): the harness runs
this module after every other test that uses them (only ``disagg down`` of their deployment comes
later), so killing them costs no other test anything and no extra engines start for it.
The live prefill endpoint beside the dead one is the coupled server, which serves prefill legs
like any engine (its KV is not handed over, so decode computes the prompt again; the answer is the
same).
"""

from __future__ import annotations

import signal

import pytest
import requests

from disagg_engine.servers import pid_alive, signal_group
from tests.harness.openai_views import chat_view, sse_events
from tests.sidecar.support import chat, host_port, long_body, run_sidecar, sidecar_config, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.reliability]


def kill(server) -> None:
    """SIGKILL the server's process group (also an attached set's, DISAGG_ATTACH_SERVERS) and wait
    until it is gone."""
    signal_group(server.pid, signal.SIGKILL)
    assert wait_for(lambda: not pid_alive(server.pid), timeout=30)


# -- prefill failures ----------------------------------------------------------------------------

def test_prefill_server_killed(engine_set, forcer, doomed_engines) -> None:
    own = doomed_engines["prefill"].url
    live = engine_set.url("coupled")
    fast = {"health_interval_seconds": 0.2}
    fallback = sidecar_config(engine_set, prefill={"discovery": {"kind": "static", "urls": [own]}}, limits=fast)
    fail = sidecar_config(engine_set, prefill={"discovery": {"kind": "static", "urls": [own]},
                                               "failure_policy": "fail"}, limits=fast)
    retry = sidecar_config(engine_set, prefill={"discovery": {"kind": "static", "urls": [own, live]},
                                                "trust_prefiller_header": True}, limits=fast)
    body = forcer.chat_body("reasoning_tool_call")
    want = chat_view(chat(engine_set.url("coupled"), body).json())
    with run_sidecar(fallback) as a, run_sidecar(fail) as b, run_sidecar(retry) as c:
        for sidecar in (a, b, c):
            resp = chat(sidecar.url, body)
            assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "remote"
        kill(doomed_engines["prefill"])

        # fallback: decode prefills the prompt itself; same answer, and the client is told.
        resp = chat(a.url, body)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-disagg-prefill"] == "fallback"
        assert chat_view(resp.json()) == want
        streamed = chat(a.url, forcer.chat_body("reasoning_tool_call", stream=True), stream=True)
        assert streamed.headers["x-disagg-prefill"] == "fallback"
        assert list(sse_events(streamed.iter_lines()))[-1] == "[DONE]"
        assert a.metric("disagg_sidecar_prefill_total", outcome="fallback") == 2
        assert a.metric("disagg_sidecar_leg_errors_total", leg="prefill", kind="connect") >= 2
        # ...and it stays ready (decode can serve alone), reporting the prefill pool as degraded;
        # under failure_policy fail the dead prefill pool makes it unready.
        assert wait_for(lambda: "prefill unreachable" in requests.get(a.url + "/health", timeout=5).json()
                        .get("degraded", []), timeout=10)
        assert requests.get(a.url + "/health", timeout=5).status_code == 200
        assert wait_for(lambda: "prefill unreachable" in requests.get(b.url + "/health", timeout=5).json()
                        .get("reasons", []), timeout=10)

        # fail: an OpenAI-shaped 503, no decode leg.
        resp = chat(b.url, body)
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
        assert resp.headers["x-disagg-prefill"] == "failed"
        assert resp.json()["error"]["type"] == "ServiceUnavailableError"
        assert b.metric("disagg_sidecar_decode_output_mode_total", mode="derender") == 1  # only the first request

        # retry: the header names the dead endpoint, the leg is retried on the live one.
        resp = chat(c.url, body, headers={"x-prefiller-host-port": host_port(own)})
        assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "remote"
        assert chat_view(resp.json()) == want
        assert c.metric("disagg_sidecar_leg_retries_total", leg="prefill") == 1


# -- decode failures -----------------------------------------------------------------------------

def test_decode_engine_dies_mid_stream(engine_set, forcer, doomed_engines) -> None:
    decode = doomed_engines["decode"]
    config = sidecar_config(engine_set, decode={"url": decode.url},
                            prefill={"discovery": {"kind": "static", "urls": [engine_set.url("coupled")]}})
    with run_sidecar(config) as sidecar:
        resp = chat(sidecar.url, long_body(forcer, 2000), stream=True)
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = [e for e in sse_events(next(lines) for _ in range(6))]
        assert first and first[0]["choices"][0]["delta"]["role"] == "assistant"
        kill(decode)
        rest = list(sse_events(lines))
        assert rest[-1] == "[DONE]", "the stream is terminated properly"
        error = rest[-2]["error"]
        assert error["code"] == 502 and "decode" in error["message"]
