"""Test helpers: the sidecar in-process on a free port, and a recording pass-through proxy.

The proxy forwards every request to a real vLLM server and records what it got; with a delay it
is the "artificially slow derender endpoint", with ``fail`` an engine answering 5xx (faults the
real servers cannot produce on demand).
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
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import requests
import yaml
from aiohttp import web

from disagg_engine.servers import free_port
from disagg_operator.engine_args import engine_max_logprobs, vllm_features
from disagg_sidecar.app import build_app
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.edge.server import SidecarRunner

SERVED = "tiny-qwen3"

# What a sidecar asks its upstreams on its own (probes, capabilities, version), not for a request.
PROBE_PATHS = ("/health", "/v1/models", "/disagg/v1/capabilities", "/metrics", "/version")


class LoopThread:
    """An asyncio loop in a daemon thread, for servers the (synchronous) tests talk to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class RunningSidecar:
    url: str
    app: web.Application
    config: SidecarConfig

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the sidecar's own Prometheus registry (0 when absent)."""
        from disagg_sidecar.keys import METRICS

        value = self.app[METRICS].registry.get_sample_value(name, labels)
        return value or 0.0


LANE_VERSIONS = {"0.32": "0.32.0", "0.33": "0.33.0", "0.34": "0.34.0"}


CLIENT_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: the coupled server's (server_set.MAX_LOGPROBS_FLAGS)


def lane_engine(sset) -> dict[str, Any]:
    """The ``engine`` section the operator writes for the set's vLLM version (decode with the
    extension), with a stateless derender tier (the session tests turn ``derender_sessions`` on:
    the 0.33 set's render offers sessions, and the chained-path tests test the stateless path)."""
    version = LANE_VERSIONS[sset.vllm_lane]
    return {"vllm_version": version, "extension": True, "prefill_tokens_only": True, "derender_sessions": False,
            "features": vllm_features(version), "max_logprobs": engine_max_logprobs(CLIENT_MAX_LOGPROBS)}


def sidecar_config(sset, **overrides: Any) -> dict[str, Any]:
    """The config a decode pod's sidecar gets for the harness's servers (ExampleConnector KV)."""
    config: dict[str, Any] = {
        "served_model_name": SERVED,
        "listen": {"host": "127.0.0.1", "port": 0},
        "decode": {"url": sset.url("decode")},
        "render": {"url": sset.url("render")},
        "prefill": {"mode": "remote", "discovery": {"kind": "static", "urls": [sset.url("prefill")]}},
        "kv_connector": "ExampleConnector",
        "engine": lane_engine(sset),
        "limits": {"max_logprobs": CLIENT_MAX_LOGPROBS},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


@contextmanager
def run_sidecar(config: dict[str, Any]) -> Iterator[RunningSidecar]:
    """``build_app`` on a free port in a background loop, as ``disagg sidecar`` runs it."""
    port = free_port()
    cfg = SidecarConfig.model_validate({**config, "listen": {"host": "127.0.0.1", "port": port}})
    lt = LoopThread()

    async def start() -> web.AppRunner:
        runner = SidecarRunner(build_app(cfg), cfg, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = lt.run(start())
    try:
        yield RunningSidecar(f"http://127.0.0.1:{port}", runner.app, cfg)
    finally:
        lt.run(runner.cleanup())
        lt.close()


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: Any
    response: bytearray = field(default_factory=bytearray)  # the bytes sent back, as forwarded


async def record(request: web.Request) -> Recorded:
    """What a fake upstream or proxy received: the body as JSON when it parses, else its bytes."""
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw
    return Recorded(request.path, dict(request.headers), body)


@dataclass
class RecordingProxy:
    """Forwards to ``target`` after ``delay`` seconds and records each request; a path in
    ``fail`` is answered with that (status, body) instead. Both may change while it runs."""

    target: str
    delay: float = 0.0
    url: str = ""
    calls: list[Recorded] = field(default_factory=list)
    fail: dict[str, tuple[int, bytes]] = field(default_factory=dict)

    _stop: Callable[[], None] | None = None

    def count(self, path: str) -> int:
        return sum(1 for c in self.calls if c.path == path)

    def stop(self) -> None:
        """Take the endpoint away (its port refuses connections from now on)."""
        if self._stop is not None:
            self._stop()

    def bodies(self, path: str) -> list[Any]:
        return [c.body for c in self.calls if c.path == path]


@contextmanager
def recording_proxy(target: str, delay: float = 0.0) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(target, delay)
    lt = LoopThread()
    port = free_port()

    async def start() -> tuple[web.AppRunner, aiohttp.ClientSession]:
        session = aiohttp.ClientSession()

        async def forward(request: web.Request) -> web.StreamResponse:
            proxy.calls.append(recorded := await record(request))
            raw = await request.read()  # aiohttp keeps the body: the same bytes record() read
            if proxy.delay:
                await asyncio.sleep(proxy.delay)  # cancelled if the caller gives up first
            if (fault := proxy.fail.get(request.path)) is not None:
                return web.Response(status=fault[0], body=fault[1], content_type="application/json")
            # The body goes on whole (a streamed one, e.g. a derender session's, is read first): framed anew.
            headers = {k: v for k, v in request.headers.items()
                       if k.lower() not in ("host", "content-length", "transfer-encoding")}
            async with session.request(request.method, proxy.target + request.path_qs, data=raw,
                                       headers=headers) as resp:
                out = web.StreamResponse(status=resp.status, headers={
                    "Content-Type": resp.headers.get("Content-Type", "application/json")})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    recorded.response += chunk
                    await out.write(chunk)
                await out.write_eof()
                return out

        return await serve_every_path(forward, port), session

    runner, session = lt.run(start())
    proxy.url = f"http://127.0.0.1:{port}"
    stopped = threading.Event()

    def stop() -> None:
        if not stopped.is_set():
            stopped.set()
            lt.run(runner.cleanup())

    proxy._stop = stop
    try:
        yield proxy
    finally:
        stop()
        lt.run(session.close())
        lt.close()


def engine_metric(url: str, name: str) -> float:
    """Sum of a vLLM server's Prometheus samples named ``name`` (all label sets)."""
    text = requests.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


GENERATED = "vllm:generation_tokens_total"


def check_engine_stopped(decode: str, generated_before: float, answer_tokens: int) -> float:
    """After a client left a stream of ``answer_tokens`` tokens: the decode engine goes idle (the
    seconds it took are returned) having generated fewer tokens than the answer has, so the abort
    reached it and the answer was not finished (a bound in tokens, which load does not move). The
    wait is generous: with the machine loaded by engines starting beside the test, a quiet 0.3 s
    abort was seen to take over 5 s; an answer that ran to its end fails the token bound instead."""
    started = time.monotonic()
    assert wait_for(lambda: engine_metric(decode, "vllm:num_requests_running") == 0, timeout=15.0), \
        "decode still generating 15 s after the client left"
    elapsed = time.monotonic() - started
    generated = engine_metric(decode, GENERATED) - generated_before
    assert generated < answer_tokens, f"the engine finished the answer ({generated:.0f} tokens): no abort reached it"
    return elapsed


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes (no blind sleeps)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


def chat(url: str, body: dict, **kw) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", json=body, timeout=120, **kw)


def long_body(forcer, tokens: int, stream: bool = True, **extra) -> dict:
    """A forced plain answer of exactly ``tokens`` tokens (EOS included)."""
    text = "word" + " word" * (tokens - 2)  # one token per word, plus EOS
    assert len(forcer.ids(text)) == tokens
    return forcer.chat_body("plain", stream=stream, vllm_xargs=forcer.xargs(text), max_tokens=tokens + 8, **extra)


# -- engine-free upstreams and the sidecar as its own process ---------------------------------------

REFUSED = json.dumps({"error": {"message": "refused by the fake engine", "type": "BadRequestError",
                                "param": None, "code": 400}}).encode()


async def serve_every_path(handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                           port: int) -> web.AppRunner:
    """``handler`` for every method and path on 127.0.0.1:``port`` (bodies up to 64 MiB). With
    handler_cancellation, a caller that hangs up cancels its handler: a delayed answer or a
    forwarded call does not outlive it (no task left at close)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@dataclass
class FakeEngine:
    """An upstream that records every request and answers every POST with an OpenAI-shaped 400
    (GET /health 200, /v1/models one model): what a test needs to count what the sidecar
    forwards, without engines. ``answer`` replaces the 400 for a path with (status, body);
    ``metrics``: the text GET /metrics answers (None: 404), after ``delay`` seconds for a path."""

    url: str = ""
    calls: list[Recorded] = field(default_factory=list)
    answer: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    metrics: str | None = None
    delay: dict[str, float] = field(default_factory=dict)

    def posts(self) -> list[Recorded]:
        return [c for c in self.calls if c.path not in PROBE_PATHS]


@contextmanager
def serving(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Iterator[str]:
    """``handler`` for every path on a free loopback port, in a loop thread of its own: its URL."""
    lt = LoopThread()
    port = free_port()
    runner = lt.run(serve_every_path(handler, port))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        lt.run(runner.cleanup())
        lt.close()


@contextmanager
def fake_engine() -> Iterator[FakeEngine]:
    engine = FakeEngine()

    async def handle(request: web.Request) -> web.Response:
        raw = await request.read()
        engine.calls.append(Recorded(request.path, dict(request.headers), raw))
        await asyncio.sleep(engine.delay.get(request.path, 0))  # a slow engine, not synchronisation
        if (fault := engine.answer.get(request.path)) is not None:
            return web.Response(status=fault[0], body=fault[1], content_type="application/json")
        if request.method == "GET":
            if request.path == "/health":
                return web.Response(text="")
            if request.path == "/v1/models":
                return web.json_response({"object": "list", "data": [{"id": SERVED, "object": "model"}]})
            if request.path == "/metrics" and engine.metrics is not None:
                return web.Response(text=engine.metrics, content_type="text/plain")
            return web.Response(status=404)
        return web.Response(status=400, body=REFUSED, content_type="application/json")

    with serving(handle) as engine.url:
        yield engine


def fake_config(engine: FakeEngine, **overrides: Any) -> dict[str, Any]:
    """A sidecar config whose every tier is ``engine``."""
    config: dict[str, Any] = {
        "served_model_name": SERVED,
        "listen": {"host": "127.0.0.1", "port": 0},
        "decode": {"url": engine.url},
        "render": {"url": engine.url},
        "prefill": {"mode": "remote", "discovery": {"kind": "static", "urls": [engine.url]}},
        "kv_connector": "ExampleConnector",
        "engine": {"vllm_version": "0.32.0", "extension": True},
    }
    config.update(overrides)
    return config


@dataclass
class SidecarProcess:
    """``disagg sidecar --config FILE`` as its own process."""

    proc: subprocess.Popen
    url: str
    log: Path

    def logged(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def status(self, key: str) -> int:
        """A /proc/<pid>/status value in bytes (VmRSS, VmHWM)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def reset_peak(self) -> None:
        """Start VmHWM again from the current RSS (Linux: write 5 to clear_refs)."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")


@contextmanager
def sidecar_process(config: dict[str, Any], tmp_path: Path) -> Iterator[SidecarProcess]:
    port = free_port()
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": port}}))
    log_path = tmp_path / "sidecar.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "disagg_cli.main", "sidecar", "--config", str(path)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sidecar = SidecarProcess(proc, f"http://127.0.0.1:{port}", log_path)

    def ready() -> bool:
        try:
            return requests.get(sidecar.url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    try:
        assert wait_for(ready, timeout=60), log_path.read_text()
        yield sidecar
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

def named_events(lines: Iterable[bytes]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A named-event stream's (event, data) pairs (the Messages and Responses APIs); every event's
    name is its data's type."""
    name = None
    for raw in lines:
        line = raw.decode()
        if line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data = json.loads(line[len("data:"):])
            assert name == data["type"], (name, data)
            yield name, data
            name = None


def post_named(url: str, body: dict[str, Any], request_id: str) -> Any:
    """A 200 answer of a named-event API at ``url`` (the server and the path): the JSON, or the
    stream's (event, data) pairs."""
    resp = requests.post(url, json=body, headers={"X-Request-Id": request_id}, stream=bool(body.get("stream")),
                         timeout=120)
    assert resp.status_code == 200, resp.text[:1000]
    if not body.get("stream"):
        return resp.json()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return list(named_events(resp.iter_lines()))
