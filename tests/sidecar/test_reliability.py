"""Failures and slow tiers with real processes: a decode engine that answers 5xx or stalls, legs
slower than their timeouts, a derender endpoint that goes away mid-stream, client disconnects (the
engine stops generating), chunk coalescing with a slow derender tier, and SIGTERM draining of
``disagg sidecar --config FILE`` (streams finish; past the deadline they are cut). Killed engines:
test_killed_engines.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml
from aiohttp import web

from disagg_engine.servers import free_port
from tests.harness.openai_views import chat_stream_view, chat_view, sse_events
from tests.harness.overlap import in_background
from tests.sidecar.conftest import TOKENS_ONLY
from tests.sidecar.support import (
    GENERATED,
    LoopThread,
    RecordingProxy,
    chat,
    check_engine_stopped,
    engine_metric,
    host_port,
    long_body,
    recording_proxy,
    run_sidecar,
    sidecar_config,
    wait_for,
)

pytestmark = [pytest.mark.engine, pytest.mark.reliability]
RUNNING = "vllm:num_requests_running"
GENERATE = "/inference/v1/generate"


# -- derender failures ---------------------------------------------------------------------------

def test_derender_endpoint_lost_mid_stream_is_retried_elsewhere(engine_set, forcer) -> None:
    body = long_body(forcer, 120)
    want = chat_stream_view(list(sse_events(chat(engine_set.url("coupled"), body, stream=True).iter_lines())))
    with recording_proxy(engine_set.url("render"), delay=0.02) as flaky:
        # No coalescing: one event per token, so the stream is surely still running at the 5th
        # (coalesced under load, 120 tokens can arrive in fewer events).
        config = sidecar_config(engine_set, decode={"capabilities": TOKENS_ONLY},
                                derender={"urls": [flaky.url, engine_set.url("render")]},
                                limits={"health_interval_seconds": 60, "coalesce": False})
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


# -- slow legs, engine errors ---------------------------------------------------------------------

SLOW = 120.0  # a proxy this slow never answers within a test's leg timeout
LEG_TIMEOUT = 3.0


@contextmanager
def slow_legs(engine_set) -> Iterator[tuple[dict[str, RecordingProxy], dict]]:
    """Every leg behind a proxy that can be made slow or failing; the sidecar chains (so a
    derender leg exists) and every leg times out after ``LEG_TIMEOUT`` seconds without a byte."""
    with recording_proxy(engine_set.url("render")) as render, recording_proxy(engine_set.url("render")) as derender, \
            recording_proxy(engine_set.url("prefill")) as prefill, recording_proxy(engine_set.url("decode")) as decode:
        proxies = {"render": render, "derender": derender, "prefill": prefill, "decode": decode}
        timeouts = {f"{leg}_seconds": LEG_TIMEOUT for leg in proxies}
        config = sidecar_config(engine_set, render={"url": render.url}, derender={"url": derender.url},
                                decode={"url": decode.url, "capabilities": TOKENS_ONLY}, timeouts=timeouts,
                                prefill={"discovery": {"kind": "static", "urls": [prefill.url, engine_set.url("prefill")]},
                                         "trust_prefiller_header": True})
        yield proxies, config


@pytest.fixture
def slowable(engine_set) -> Iterator[tuple[dict[str, RecordingProxy], dict]]:
    with slow_legs(engine_set) as legs:
        yield legs


def test_a_leg_slower_than_its_timeout(engine_set, forcer) -> None:
    """Past its timeout a leg is retried once (render, prefill, derender; on another endpoint when
    there is one), then: render/derender -> 503 with Retry-After, prefill -> the decode engine
    prefills itself (``x-disagg-prefill: fallback``), decode -> 502 (the pod's own engine, no retry).
    The cases mostly wait out timeouts, so each runs beside the others with its own proxies and
    sidecar."""
    body = forcer.chat_body("plain")
    want = chat_view(chat(engine_set.url("coupled"), body).json())

    def timed_out(leg: str, attempts: int, prefill_urls: int = 2) -> tuple[requests.Response, RecordingProxy]:
        """The chat request with ``leg``'s proxy slow, through a sidecar whose legs are all in time
        first; ``attempts`` of that leg time out. ``prefill_urls`` 1: the slow proxy is the only
        prefill endpoint."""
        with slow_legs(engine_set) as (proxies, config):
            if prefill_urls == 1:
                config = {**config, "prefill": {**config["prefill"], "discovery": {
                    "kind": "static", "urls": [proxies["prefill"].url]}}}
            with run_sidecar(config) as sidecar:
                assert chat_view(chat(sidecar.url, body).json()) == want  # every leg in time
                proxies[leg].delay = SLOW
                started = time.monotonic()
                try:
                    # The header sends the first prefill attempt to the slow proxy.
                    resp = chat(sidecar.url, body, headers={"x-prefiller-host-port": host_port(proxies["prefill"].url)})
                finally:
                    proxies[leg].delay = 0
                elapsed = time.monotonic() - started
                assert sidecar.metric("disagg_sidecar_leg_errors_total", leg=leg, kind="timeout") == attempts
                assert LEG_TIMEOUT * attempts <= elapsed < LEG_TIMEOUT * attempts + 30, elapsed
                if leg == "prefill" and prefill_urls == 2:
                    assert sidecar.metric("disagg_sidecar_leg_retries_total", leg="prefill") == 1
                assert chat_view(chat(sidecar.url, body).json()) == want, "all legs in time again"
                return resp, proxies[leg]

    with ThreadPoolExecutor(max_workers=5) as pool:
        cases = {"render": pool.submit(timed_out, "render", attempts=2),
                 "prefill": pool.submit(timed_out, "prefill", attempts=1),
                 "prefill alone": pool.submit(timed_out, "prefill", attempts=2, prefill_urls=1),
                 "derender": pool.submit(timed_out, "derender", attempts=2),
                 "decode": pool.submit(timed_out, "decode", attempts=1)}
    resp, proxy = cases["render"].result()
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    assert resp.json()["error"] == {"message": "The render tier is unavailable (timeout)",
                                    "type": "ServiceUnavailableError", "param": None, "code": 503}
    assert proxy.count("/v1/chat/completions/render") == 1 + 2 + 1  # in time, two timeouts, in time

    # The retry goes to the real server.
    resp, _ = cases["prefill"].result()
    assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "remote"
    assert chat_view(resp.json()) == want

    # A single prefill endpoint too slow: the fallback.
    resp, _ = cases["prefill alone"].result()
    assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "fallback"
    assert chat_view(resp.json()) == want

    resp, _ = cases["derender"].result()
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    assert resp.json()["error"]["message"] == "The derender tier is unavailable (timeout)"

    resp, _ = cases["decode"].result()
    assert resp.status_code == 502 and "Retry-After" not in resp.headers
    assert resp.json()["error"] == {"message": "The decode engine failed: timeout", "type": "BadGatewayError",
                                    "param": None, "code": 502}


ENGINE_500 = json.dumps({"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError",
                                   "param": None, "code": 500}}).encode()


def test_decode_5xx_before_the_first_byte_is_an_openai_502(engine_set, forcer, slowable) -> None:
    """The decode engine answers 500: the client gets an OpenAI-shaped 502 (not a stream, even
    when it asked for one: nothing was sent yet), on every API; the decode leg is not retried."""
    proxies, config = slowable
    decode = proxies["decode"]
    with run_sidecar(config) as sidecar:
        decode.fail[GENERATE] = (500, ENGINE_500)
        gen = requests.post(engine_set.url("render") + "/v1/chat/completions/render",
                            json=forcer.chat_body("plain"), timeout=60).json()
        requests_ = [
            ("/v1/chat/completions", forcer.chat_body("plain")),
            ("/v1/chat/completions", forcer.chat_body("plain", stream=True)),
            ("/v1/completions", {"model": "tiny-qwen3", "prompt": "Say:", "max_tokens": 5}),
            ("/v1/completions", {"model": "tiny-qwen3", "prompt": "Say:", "max_tokens": 5, "stream": True}),
            (GENERATE, gen),
            (GENERATE, {**gen, "stream": True}),
        ]
        for path, body in requests_:
            before = decode.count(GENERATE)
            resp = requests.post(sidecar.url + path, json=body, timeout=60)
            assert resp.status_code == 502, (path, resp.text)
            assert resp.headers["Content-Type"].startswith("application/json"), (path, resp.headers)
            error = resp.json()["error"]
            assert error["type"] == "BadGatewayError" and error["code"] == 502 and error["param"] is None
            assert error["message"] == "The decode engine failed: status 500", "the engine's body stays in the log"
            assert decode.count(GENERATE) == before + 1, "the decode leg is not retried"
        assert sidecar.metric("disagg_sidecar_leg_errors_total", leg="decode", kind="status") == len(requests_)
        assert sidecar.metric("disagg_sidecar_requests_total", api="chat", code="502") == 2
        del decode.fail[GENERATE]
        assert chat(sidecar.url, forcer.chat_body("plain")).status_code == 200


@contextmanager
def stalling_decode_engine() -> Iterator[str]:
    """A decode engine that answers 200 with its headers and then sends nothing: a fault a real
    engine cannot be made to show on demand."""
    lt = LoopThread()
    port = free_port()

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await asyncio.sleep(SLOW)  # cancelled when the sidecar gives up and closes the connection
        return resp

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_post(GENERATE, generate)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = lt.run(start())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        lt.run(runner.cleanup())
        lt.close()


def test_decode_stalling_after_its_headers_is_an_openai_502(engine_set, forcer) -> None:
    with stalling_decode_engine() as decode:
        config = sidecar_config(engine_set, decode={"url": decode, "capabilities": TOKENS_ONLY},
                                timeouts={"decode_seconds": LEG_TIMEOUT})
        with run_sidecar(config) as sidecar:
            started = time.monotonic()
            resp = chat(sidecar.url, forcer.chat_body("plain"))
            assert LEG_TIMEOUT <= time.monotonic() - started < LEG_TIMEOUT + 30
            assert resp.status_code == 502, resp.text
            assert resp.json()["error"] == {"message": "The decode engine failed: timeout", "type": "BadGatewayError",
                                            "param": None, "code": 502}
            assert sidecar.metric("disagg_sidecar_leg_errors_total", leg="decode", kind="timeout") == 1


# -- client disconnects --------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["inline", "chained"])
def test_client_disconnect_stops_the_engine(engine_set, forcer, request, path: str) -> None:
    sidecar = request.getfixturevalue(f"{path}_sidecar")
    decode = engine_set.url("decode")
    assert wait_for(lambda: engine_metric(decode, RUNNING) == 0, timeout=30), "decode busy before the test"
    resp = chat(sidecar.url, long_body(forcer, 8000), stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    events = list(sse_events(next(lines) for _ in range(10)))
    assert events and engine_metric(decode, RUNNING) == 1
    aborts, generated = sidecar.metric("disagg_sidecar_aborts_total"), engine_metric(decode, GENERATED)
    resp.close()  # the client goes away
    elapsed = check_engine_stopped(decode, generated, 8000)
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
    reference = in_background(
        lambda: chat_stream_view(list(sse_events(chat(engine_set.url("coupled"), body, stream=True).iter_lines()))))
    with recording_proxy(engine_set.url("render"), delay=delay) as slow:
        config = sidecar_config(engine_set, decode={"capabilities": TOKENS_ONLY}, derender={"url": slow.url})
        with run_sidecar(config) as sidecar:
            started = time.monotonic()
            got = list(sse_events(chat(sidecar.url, body, stream=True).iter_lines()))
            elapsed = time.monotonic() - started
            calls = slow.count("/v1/chat/completions/derender")
            coalesced = sidecar.metric("disagg_sidecar_coalesced_chunks_total")
    want = reference.result()
    assert want["usage"]["completion_tokens"] == 2 * 512
    assert chat_stream_view(got) == want, "coalescing changes nothing the client sees"
    per_choice = (calls - 1) / 2  # the usage chunk is one call of its own
    assert per_choice < 512 / 4, calls
    assert calls <= 2 * elapsed / delay + 3, (calls, elapsed)
    assert coalesced >= 512, coalesced  # generate chunks that rode along in a later call
    print(f"coalescing: {calls} derender calls for 2 x 512 tokens in {elapsed:.1f}s")


# -- the command, SIGTERM --------------------------------------------------------------------------

@dataclass
class Command:
    proc: subprocess.Popen
    url: str
    log: Path

    def logged(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def in_flight(self) -> float:
        """The sidecar's own ``disagg_sidecar_requests_in_flight`` gauge."""
        text = requests.get(self.url + "/metrics", timeout=5).text
        (line,) = [line for line in text.splitlines() if line.startswith("disagg_sidecar_requests_in_flight ")]
        return float(line.split()[1])


@contextmanager
def sidecar_command(engine_set, tmp_path: Path, drain_seconds: float) -> Iterator[Command]:
    """``disagg sidecar --config FILE`` as its own process, ready."""
    port = free_port()
    config = sidecar_config(engine_set, listen={"host": "127.0.0.1", "port": port},
                            limits={"drain_seconds": drain_seconds, "health_interval_seconds": 0.5,
                                    "deregister_seconds": 0})  # the drain alone (test_shutdown.py: the window)
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "sidecar.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "disagg_cli.main", "sidecar", "--config", str(path)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    command = Command(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        assert wait_for(lambda: _status(command.url + "/health") == 200, timeout=60), log_path.read_text()
        yield command
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _drained(command: Command) -> list[str]:
    return [line["msg"] for line in command.logged() if line["logger"] == "disagg_sidecar"
            and ("draining" in line["msg"] or "drain deadline" in line["msg"])]


def test_sidecar_command_drains_on_sigterm(engine_set, forcer, tmp_path) -> None:
    with sidecar_command(engine_set, tmp_path, drain_seconds=60) as command:
        out: list = []
        resp = chat(command.url, long_body(forcer, 300), stream=True)
        lines = resp.iter_lines()
        out += list(sse_events(next(lines) for _ in range(4)))
        assert out and out[-1] != "[DONE]"
        assert command.in_flight() == 1, "a stream is in flight when SIGTERM arrives"
        command.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: _status(command.url + "/health") == 503, timeout=10), "readiness still on while draining"
        reader = threading.Thread(target=lambda: out.extend(sse_events(lines)))
        reader.start()
        reader.join(120)
        assert not reader.is_alive()
        assert out[-1] == "[DONE]" and chat_stream_view(out)["choices"][0]["finish_reason"] == "stop"
        assert chat_stream_view(out)["usage"]["completion_tokens"] == 300, "the stream completed"
        assert command.proc.wait(30) == 0
    assert _drained(command) == ["draining 1 in-flight requests (up to 60s)"]
    access = [line for line in command.logged() if line["logger"] == "disagg_sidecar.access"]
    assert access and all("request_id" in line for line in access), "structured logs carry the request id"
    assert [line["status"] for line in access if line["path"] == "/v1/chat/completions"] == [200]


def test_sidecar_command_cuts_streams_past_the_drain_deadline(engine_set, forcer, tmp_path) -> None:
    """A stream longer than the drain deadline is cut at the deadline (no ``[DONE]``), its decode
    leg stops, and the process exits."""
    decode = engine_set.url("decode")
    assert wait_for(lambda: engine_metric(decode, RUNNING) == 0, timeout=30), "decode busy before the test"
    drain = 4.0  # the cut comes at the deadline (plus CUT_SECONDS), not at a second deadline after it
    with sidecar_command(engine_set, tmp_path, drain_seconds=drain) as command:
        # 8,000 tokens keep the engine busy well past the deadline (3,000 once ended within it)
        resp = chat(command.url, long_body(forcer, 8000), stream=True)
        lines = resp.iter_lines()
        out: list = list(sse_events(next(lines) for _ in range(4)))
        assert out and command.in_flight() == 1
        signalled = time.monotonic()
        command.proc.send_signal(signal.SIGTERM)
        cut: list[BaseException] = []

        def read() -> None:
            try:
                out.extend(sse_events(lines))
            except requests.RequestException as exc:  # the connection closes mid-stream
                cut.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(60)
        ended = time.monotonic() - signalled
        assert not reader.is_alive()
        assert "[DONE]" not in out, "the stream was cut, not finished"
        assert drain <= ended < 2 * drain - 0.5, ended
        assert chat_stream_view([e for e in out if e != "[DONE]"])["usage"] is None
        assert command.proc.wait(30) == 0
        assert wait_for(lambda: engine_metric(decode, RUNNING) == 0, timeout=5), "decode still generating"
    assert _drained(command) == ["draining 1 in-flight requests (up to 4s)",
                                 "drain deadline reached with 1 requests in flight"]
    access = [line for line in command.logged() if line["logger"] == "disagg_sidecar.access"]
    assert [line["status"] for line in access if line["path"] == "/v1/chat/completions"] == [499]
    print(f"drain deadline {drain:.0f}s: stream cut {ended:.1f}s after SIGTERM")


def _status(url: str) -> int | None:
    try:
        return requests.get(url, timeout=2).status_code
    except requests.RequestException:
        return None


# -- request ids -------------------------------------------------------------------------------------

def test_streams_sharing_a_client_request_id_are_separate_engine_requests(engine_set, forcer, inline_sidecar) -> None:
    """Two clients send the same X-Request-Id: each request gets its own engine id, so when one
    disconnects (and its legs are aborted by id) the other stream still completes."""
    sidecar = inline_sidecar
    body = long_body(forcer, 300)
    headers = {"X-Request-Id": "same-id"}
    aborts = sidecar.metric("disagg_sidecar_aborts_total")
    first = chat(sidecar.url, body, stream=True, headers=headers)
    second = chat(sidecar.url, body, stream=True, headers=headers)
    assert first.status_code == second.status_code == 200
    assert first.headers["X-Request-Id"] == second.headers["X-Request-Id"] == "same-id"
    first_lines, second_lines = first.iter_lines(), second.iter_lines()
    assert list(sse_events(next(first_lines) for _ in range(6)))
    kept = list(sse_events(next(second_lines) for _ in range(6)))
    assert kept, "both streams started"
    first.close()  # one client goes away: its legs are aborted
    assert wait_for(lambda: sidecar.metric("disagg_sidecar_aborts_total") >= aborts + 1, timeout=10)
    kept += list(sse_events(second_lines))
    assert kept[-1] == "[DONE]"
    view = chat_stream_view(kept)
    assert view["choices"][0]["finish_reason"] == "stop" and view["usage"]["completion_tokens"] == 300, \
        "the other stream completed"
