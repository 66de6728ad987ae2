"""Failures and slow tiers with real processes: a killed prefill server (retry, fallback, fail),
a decode engine that dies mid-stream, a derender endpoint that goes away mid-stream, client
disconnects (the engine stops generating), chunk coalescing with a slow derender tier, and
SIGTERM draining of ``disagg sidecar --config FILE``.

Killed servers are this module's own (``own_servers``), never the shared harness set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
import yaml

from disagg_engine.servers import ManagedServer, ServerSpec, free_port, start_all, stop_all
from disagg_engine.testing.server_set import ENGINE_ENV, ROLE_ENV, role_argv
from tests.harness.openai_views import chat_stream_view, chat_view, sse_events
from tests.sidecar.conftest import TOKENS_ONLY
from tests.sidecar.support import engine_metric, recording_proxy, run_sidecar, sidecar_config, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.reliability]
RUNNING = "vllm:num_requests_running"


@pytest.fixture(scope="module")
def own_servers(engine_set, tmp_path_factory) -> Iterator[dict[str, ManagedServer]]:
    """A prefill and a decode server of our own (same model and KV directory) to kill."""
    log_dir = Path(tmp_path_factory.mktemp("own-servers"))
    specs = []
    for role in ("prefill", "decode"):
        port = free_port()
        specs.append(ServerSpec(name=f"own-{role}", port=port,
                                argv=role_argv(role, engine_set.model_dir, port, engine_set.kv_dir),
                                env={**ENGINE_ENV, **ROLE_ENV.get(role, {})}))
    servers = start_all(specs, log_dir, timeout=900)
    try:
        yield {s.spec.name.removeprefix("own-"): s for s in servers}
    finally:
        stop_all(servers)


def kill(server: ManagedServer) -> None:
    os.killpg(server.pid, signal.SIGKILL)
    server.proc.wait(30)


def host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


def chat(url: str, body: dict, **kw) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", json=body, timeout=120, **kw)


def long_body(forcer, tokens: int, stream: bool = True, **extra) -> dict:
    text = "word" + " word" * (tokens - 2)  # one token per word, plus EOS
    assert len(forcer.ids(text)) == tokens
    return forcer.chat_body("plain", stream=stream, vllm_xargs=forcer.xargs(text), max_tokens=tokens + 8, **extra)


# -- prefill failures ----------------------------------------------------------------------------

def test_prefill_server_killed(engine_set, forcer, own_servers) -> None:
    own = own_servers["prefill"].url
    shared = engine_set.url("prefill")
    fast = {"health_interval_seconds": 0.2}
    fallback = sidecar_config(engine_set, prefill={"discovery": {"kind": "static", "urls": [own]}}, limits=fast)
    fail = sidecar_config(engine_set, prefill={"discovery": {"kind": "static", "urls": [own]},
                                               "failure_policy": "fail"}, limits=fast)
    retry = sidecar_config(engine_set, prefill={"discovery": {"kind": "static", "urls": [own, shared]}}, limits=fast)
    body = forcer.chat_body("reasoning_tool_call")
    want = chat_view(chat(engine_set.url("coupled"), body).json())
    with run_sidecar(fallback) as a, run_sidecar(fail) as b, run_sidecar(retry) as c:
        for sidecar in (a, b, c):
            resp = chat(sidecar.url, body)
            assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "remote"
        kill(own_servers["prefill"])

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
        assert wait_for(lambda: "prefill unreachable" in requests.get(a.url + "/health", timeout=5).json()
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

def test_decode_engine_dies_mid_stream(engine_set, forcer, own_servers) -> None:
    decode = own_servers["decode"]
    config = sidecar_config(engine_set, decode={"url": decode.url})
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


# -- derender failures ---------------------------------------------------------------------------

def test_derender_endpoint_lost_mid_stream_is_retried_elsewhere(engine_set, forcer) -> None:
    body = long_body(forcer, 120)
    want = chat_stream_view(list(sse_events(chat(engine_set.url("coupled"), body, stream=True).iter_lines())))
    with recording_proxy(engine_set.url("render"), delay=0.02) as flaky:
        config = sidecar_config(engine_set, decode={"capabilities": TOKENS_ONLY},
                                derender={"urls": [flaky.url, engine_set.url("render")]},
                                limits={"health_interval_seconds": 60})
        with run_sidecar(config) as sidecar:
            resp = chat(sidecar.url, body, stream=True)
            events = []
            for event in sse_events(resp.iter_lines()):
                events.append(event)
                if len(events) == 5:
                    flaky_calls = flaky.count("/v1/chat/completions/derender")
                    flaky.stop()  # the endpoint goes away mid-stream
            assert flaky_calls >= 1
            assert chat_stream_view(events) == want
            assert sidecar.metric("disagg_sidecar_leg_retries_total", leg="derender") >= 1


# -- client disconnects --------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["inline", "chained"])
def test_client_disconnect_stops_the_engine(engine_set, forcer, request, path: str) -> None:
    sidecar = request.getfixturevalue(f"{path}_sidecar")
    decode = engine_set.url("decode")
    assert wait_for(lambda: engine_metric(decode, RUNNING) == 0, timeout=30), "decode busy before the test"
    resp = chat(sidecar.url, long_body(forcer, 3000), stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    events = list(sse_events(next(lines) for _ in range(10)))
    assert events and engine_metric(decode, RUNNING) == 1
    aborts = sidecar.metric("disagg_sidecar_aborts_total")
    resp.close()  # the client goes away
    started = time.monotonic()
    assert wait_for(lambda: engine_metric(decode, RUNNING) == 0, timeout=1.0), "decode still generating after 1 s"
    elapsed = time.monotonic() - started
    assert wait_for(lambda: sidecar.metric("disagg_sidecar_aborts_total") == aborts + 1, timeout=5)
    print(f"{path}: decode idle {elapsed * 1000:.0f} ms after the disconnect")


# -- coalescing ------------------------------------------------------------------------------------

def test_slow_derender_tier_gets_coalesced_chunks(engine_set, forcer) -> None:
    """512 tokens per choice (n=2) through a derender endpoint that takes 0.5 s per call: each
    choice's lane sends what arrived while its previous call was in flight, so the number of calls
    follows the tier's speed (about elapsed / delay per choice), not the number of tokens."""
    delay = 0.5
    body = forcer.chat_body("reasoning", stream=True, n=2)
    text = "<think>\n" + "hmm " * 300 + "\n</think>\n\n" + "answer " * 400
    ids = forcer.ids(text)
    body["vllm_xargs"] = {"forced_token_ids": ids[:511] + ids[-1:]}  # 512 tokens per choice
    body["max_tokens"] = 600
    want = chat_stream_view(list(sse_events(chat(engine_set.url("coupled"), body, stream=True).iter_lines())))
    assert want["usage"]["completion_tokens"] == 2 * 512
    with recording_proxy(engine_set.url("render"), delay=delay) as slow:
        config = sidecar_config(engine_set, decode={"capabilities": TOKENS_ONLY}, derender={"url": slow.url})
        with run_sidecar(config) as sidecar:
            started = time.monotonic()
            got = list(sse_events(chat(sidecar.url, body, stream=True).iter_lines()))
            elapsed = time.monotonic() - started
            calls = slow.count("/v1/chat/completions/derender")
            coalesced = sidecar.metric("disagg_sidecar_coalesced_chunks_total")
    assert chat_stream_view(got) == want, "coalescing changes nothing the client sees"
    per_choice = (calls - 1) / 2  # the usage chunk is one call of its own
    assert per_choice < 512 / 4, calls
    assert calls <= 2 * elapsed / delay + 3, (calls, elapsed)
    assert coalesced >= 512, coalesced  # generate chunks that rode along in a later call
    print(f"coalescing: {calls} derender calls for 2 x 512 tokens in {elapsed:.1f}s")


# -- the command, SIGTERM --------------------------------------------------------------------------

def test_sidecar_command_drains_on_sigterm(engine_set, forcer, tmp_path) -> None:
    port = free_port()
    config = sidecar_config(engine_set, listen={"host": "127.0.0.1", "port": port},
                            limits={"drain_seconds": 60, "health_interval_seconds": 0.5})
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (tmp_path / "sidecar.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "disagg_cli.main", "sidecar", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _status(url + "/health") == 200, timeout=60), (tmp_path / "sidecar.log").read_text()
        out: list = []
        resp = chat(url, long_body(forcer, 300), stream=True)
        lines = resp.iter_lines()
        out += list(sse_events(next(lines) for _ in range(4)))
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: _status(url + "/health") == 503, timeout=10), "readiness still on while draining"
        reader = threading.Thread(target=lambda: out.extend(sse_events(lines)))
        reader.start()
        reader.join(120)
        assert out[-1] == "[DONE]" and chat_stream_view(out)["choices"][0]["finish_reason"] == "stop"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
    lines_logged = [json.loads(line) for line in (tmp_path / "sidecar.log").read_text().splitlines()
                    if line.startswith("{")]
    access = [line for line in lines_logged if line["logger"] == "disagg_sidecar.access"]
    assert access and all("request_id" in line for line in access), "structured logs carry the request id"


def _status(url: str) -> int | None:
    try:
        return requests.get(url, timeout=2).status_code
    except requests.RequestException:
        return None
