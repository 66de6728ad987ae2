"""Scripted upstreams for the hostile-upstream tests (``test_hostile_upstreams``): a render, a
prefill and a decode engine that answer like small well-behaved vLLM servers until a test
replaces the answer of one path with something hostile (a redirect, a wrong shape, a trickle, a
stream cut short), and a bystander: a host that is no endpoint of any tier, which must never be
asked anything.

Every upstream records what it got. The well-behaved answers are the wire shapes vLLM's generate
and render endpoints use (``docs/`` and ``sidecar/disagg_sidecar/wire.py`` name the fields).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from aiohttp import web

from disagg_engine.servers import free_port
from tests.sidecar.support import PROBE_PATHS, SERVED, LoopThread, Recorded, record, serve_every_path

Handler = Callable[[web.Request, Any], Awaitable[web.StreamResponse]]

PROMPT_IDS = [11, 12, 13, 14]
ANSWER = "hello there"


def rendered(request_id: str = "chatcmpl-fake", client: Any = None) -> dict[str, Any]:
    """Render's answer for ``client``'s request: its stream flag and ``n`` carried over, as vLLM's are."""
    client = client if isinstance(client, dict) else {}
    sampling = {"max_tokens": 4, **({"n": client["n"]} if client.get("n") else {})}
    return {"request_id": request_id, "token_ids": list(PROMPT_IDS), "sampling_params": sampling,
            "model": SERVED, "stream": bool(client.get("stream"))}


def text_answer(body: Any) -> dict[str, Any]:
    """A batch generate answer in ``text`` mode, ``n`` choices."""
    n = ((body or {}).get("sampling_params") or {}).get("n") or 1
    return {"request_id": "gen-fake", "output_mode": "text",
            "choices": [{"index": i, "text": ANSWER, "token_ids": [21, 22], "finish_reason": "stop",
                         "stop_reason": None} for i in range(n)],
            "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 2, "total_tokens": len(PROMPT_IDS) + 2}}


def text_events(n: int = 1) -> list[dict[str, Any]]:
    """A streamed ``text`` answer: two pieces per choice, the last with its finish reason."""
    return [event for i in range(n) for event in (
        {"request_id": "gen-fake", "output_mode": "text",
         "choices": [{"index": i, "text": "hello", "token_ids": [21], "finish_reason": None}]},
        {"request_id": "gen-fake", "output_mode": "text",
         "choices": [{"index": i, "text": " there", "token_ids": [22], "finish_reason": "stop",
                      "stop_reason": None}]})]


def sse_bytes(events: list[Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


# -- answers a test can script -------------------------------------------------------------------

def answer_json(obj: Any, status: int = 200) -> Handler:
    async def handle(request: web.Request, body: Any) -> web.StreamResponse:
        return web.Response(status=status, body=json.dumps(obj).encode(), content_type="application/json")
    return handle


def answer_raw(data: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Handler:
    async def handle(request: web.Request, body: Any) -> web.StreamResponse:
        return web.Response(status=status, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    return handle


def redirect(to: str, status: int = 307) -> Handler:
    async def handle(request: web.Request, body: Any) -> web.StreamResponse:
        return web.Response(status=status, headers={"Location": to + request.path})
    return handle


def stream_raw(data: bytes, status: int = 200) -> Handler:
    """An event stream of exactly ``data``."""
    async def handle(request: web.Request, body: Any) -> web.StreamResponse:
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(data)
        await resp.write_eof()
        return resp
    return handle


def trickle(data: bytes, every: float, content_type: str = "application/json") -> Handler:
    """Headers at once, then ``data`` one byte per ``every`` seconds (a slow engine, the fault itself)."""
    async def handle(request: web.Request, body: Any) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        resp.content_length = len(data)
        await resp.prepare(request)
        for i in range(len(data)):
            await resp.write(data[i:i + 1])
            await asyncio.sleep(every)
        await resp.write_eof()
        return resp
    return handle


def silent_after(data: bytes = b"", content_type: str = "text/event-stream") -> Handler:
    """Headers (and ``data``), then nothing until the caller hangs up."""
    async def handle(request: web.Request, body: Any) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        await resp.prepare(request)
        if data:
            await resp.write(data)
        await asyncio.Event().wait()  # cancelled when the sidecar closes the connection
        return resp
    return handle


# -- the well-behaved defaults ---------------------------------------------------------------------

async def _render_chat(request: web.Request, body: Any) -> web.StreamResponse:
    return web.json_response(rendered(client=body))


async def _render_completions(request: web.Request, body: Any) -> web.StreamResponse:
    prompt = body.get("prompt") if isinstance(body, dict) else None
    count = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return web.json_response([rendered("cmpl-fake", body) for _ in range(count)])


async def _generate(request: web.Request, body: Any) -> web.StreamResponse:
    """Prefill legs (``max_tokens`` 1, tokens) get one token; decode legs a ``text`` answer."""
    sampling = (body or {}).get("sampling_params") or {}
    if isinstance(body, dict) and body.get("stream"):
        return await stream_raw(sse_bytes(text_events(sampling.get("n") or 1)))(request, body)
    if (body or {}).get("output_mode") == "tokens" and sampling.get("max_tokens") == 1:
        return web.json_response({"request_id": "prefill-fake", "kv_transfer_params": None,
                                  "choices": [{"index": 0, "token_ids": [21], "finish_reason": "length"}]})
    return web.json_response(text_answer(body))


def tokens_answer(stream: bool) -> Any:
    """A ``tokens`` answer (an engine without inline modes): the ids, for the derender tier."""
    choice = {"index": 0, "token_ids": [21, 22], "finish_reason": "length", "stop_reason": None}
    if not stream:
        return {"request_id": "gen-fake", "choices": [choice]}
    return [{"request_id": "gen-fake", "choices": [{**choice, "token_ids": [21], "finish_reason": None}]},
            {"request_id": "gen-fake", "choices": [{**choice, "token_ids": [22]}]}]


async def _chat_derender(request: web.Request, body: Any) -> web.StreamResponse:
    """vLLM's chat derender: a batch answer, or one chunk and its stream_state per streamed call."""
    if body.get("stream"):
        gen = body["generate_chunk"]["choices"][0]
        text = "".join({21: "hello", 22: " there"}[t] for t in gen["token_ids"])
        return web.json_response({"chunk": {"id": "x", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"content": text}, "finish_reason": gen.get("finish_reason")}]},
            "stream_state": {"seen": len(gen["token_ids"])}})
    return web.json_response({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"}]})


DEFAULT_ROUTES: dict[str, Handler] = {
    "/v1/chat/completions/derender": _chat_derender,
    "/v1/chat/completions/render": _render_chat,
    "/v1/completions/render": _render_completions,
    "/inference/v1/generate": _generate,
}


@dataclass
class Upstream:
    """One scripted upstream: ``routes`` (path -> handler) over the defaults; every request recorded."""

    url: str = ""
    calls: list[Recorded] = field(default_factory=list)
    routes: dict[str, Handler] = field(default_factory=dict)

    def posts(self, path: str | None = None) -> list[Recorded]:
        return [c for c in self.calls if c.path not in PROBE_PATHS and (path is None or c.path == path)]

    @property
    def host_port(self) -> str:
        return self.url.split("//", 1)[1]


@dataclass
class Upstreams:
    render: Upstream
    prefill: Upstream
    decode: Upstream
    bystander: Upstream  # no endpoint of any tier: must never be asked anything

    def all(self) -> tuple[Upstream, ...]:
        return self.render, self.prefill, self.decode, self.bystander

    def reset(self) -> None:
        for u in self.all():
            u.calls.clear()
            u.routes.clear()


async def _start(up: Upstream, port: int) -> web.AppRunner:
    async def handle(request: web.Request) -> web.StreamResponse:
        up.calls.append(recorded := await record(request))
        body = recorded.body
        if (handler := up.routes.get(request.path)) is not None:
            return await handler(request, body)
        if request.method == "GET":
            if request.path == "/health":
                return web.Response(text="")
            if request.path == "/v1/models":
                return web.json_response({"object": "list", "data": [{"id": SERVED, "object": "model"}]})
            return web.Response(status=404)
        if (handler := DEFAULT_ROUTES.get(request.path)) is not None:
            return await handler(request, body)
        return web.Response(status=404)
    return await serve_every_path(handle, port)


@contextmanager
def upstreams() -> Iterator[Upstreams]:
    lt = LoopThread()
    made, runners = [], []
    try:
        for _ in range(4):
            up, port = Upstream(), free_port()
            runners.append(lt.run(_start(up, port)))
            up.url = f"http://127.0.0.1:{port}"
            made.append(up)
        yield Upstreams(*made)
    finally:
        for runner in runners:
            lt.run(runner.cleanup())
        lt.close()


# Decode answers in ``text`` (batch and streamed), no parser: the sidecar shapes them itself.
TEXT_DECODE = {"output_modes": ["text"], "streaming_output_modes": ["text"], "parser_configured": False}


def config(ups: Upstreams, **overrides: Any) -> dict[str, Any]:
    """A sidecar in front of the scripted tiers (prefill remote, ExampleConnector), answers in text."""
    cfg: dict[str, Any] = {
        "served_model_name": SERVED,
        "listen": {"host": "127.0.0.1", "port": 0},
        "decode": {"url": ups.decode.url, "capabilities": TEXT_DECODE, "probe_capabilities": False},
        "render": {"url": ups.render.url},
        "prefill": {"mode": "remote", "discovery": {"kind": "static", "urls": [ups.prefill.url]},
                    "failure_policy": "fail"},
        "kv_connector": "ExampleConnector",
        "engine": {"vllm_version": "0.32.0", "extension": False},
        "retries": 0,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


# -- what the tests share (fixtures: import ``module_ups`` and ``ups``) --------------------------------

CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": SERVED, "prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def module_ups() -> Iterator[Upstreams]:
    with upstreams() as made:
        yield made


@pytest.fixture
def ups(module_ups: Upstreams) -> Upstreams:
    module_ups.reset()
    return module_ups


def post(url: str, path: str, body: dict, timeout: float = 30) -> requests.Response:
    return requests.post(url + path, json=body, timeout=timeout)


def openai_error(resp: requests.Response) -> dict:
    assert resp.headers["Content-Type"].startswith("application/json"), resp.text[:300]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def assert_clean(resp: requests.Response | bytes, ups: Upstreams) -> None:
    """Nothing of an upstream's address or body in the client's answer; the bystander never asked."""
    content = resp if isinstance(resp, bytes) else resp.content
    for up in ups.all():
        assert up.host_port.encode() not in content, content[:300]
    assert b"Traceback" not in content and b"10.66.66.66" not in content
    assert not ups.bystander.calls, [c.path for c in ups.bystander.calls]


def assert_healthy(sidecar, ups: Upstreams) -> None:
    """The sidecar still answers a plain request correctly."""
    saved = {u.url: dict(u.routes) for u in ups.all()}
    for u in ups.all():
        u.routes.clear()
    try:
        assert requests.get(sidecar.url + "/health", timeout=10).status_code == 200
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == ANSWER, resp.text
    finally:
        for u in ups.all():
            u.routes.update(saved[u.url])


def read_stream(resp: requests.Response) -> list:
    events = []
    for block in resp.content.split(b"\n\n"):
        lines = [line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines:
            payload = b"\n".join(lines)
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def stream_error(resp: requests.Response) -> dict:
    """The error the client of a stream sees: an HTTP error before the first event, else the last
    event, never followed by ``[DONE]``."""
    if resp.status_code != 200:
        return openai_error(resp)
    events = read_stream(resp)
    assert events and events[-1] != "[DONE]" and "[DONE]" not in events, events[-3:]
    assert set(events[-1]) == {"error"}, events[-1]
    return events[-1]["error"]
