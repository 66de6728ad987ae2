"""The system under test: the harness's real vLLM CPU servers (started here, or attached with
``DISAGG_ATTACH_SERVERS``), ``disagg sidecar`` processes in front of them, and what passes
between a sidecar and its render/derender tier (a counting pass-through that streams both ways,
so a derender session's body reaches the render server chunk by chunk as the sidecar writes it)."""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from disagg_engine.servers import ServerSpec, free_port, start_all
from disagg_engine.testing.server_set import ENGINE_ENV, ROLE_ENV, ROLES, ServerSet, role_argv, start_server_set
from disagg_engine.testing.tiny_model import ensure_model
from tests.harness.engine import _attached_set
from tests.sidecar.support import LoopThread, SidecarProcess, serve_every_path, sidecar_config, sidecar_process

__all__ = ["counting_proxy", "lane_server_set", "server_set", "sidecar", "sidecar_config", "traffic"]


# The harness's 8,192 leaves no room for an 8,192-token answer after its prompt.
MAX_MODEL_LEN = 9216


def max_output_tokens(sset: ServerSet) -> int:
    """The longest answer the set's servers allow after a short prompt (an attached harness set: 8,192 in all)."""
    return (MAX_MODEL_LEN if getattr(sset, "bench_owned", False) else 8192) - 512


@contextmanager
def server_set(log_dir: Path) -> Iterator[ServerSet]:
    """The four servers (render, prefill, decode with the extension, coupled = stock vLLM):
    ``disagg_engine.testing.server_set``'s flags with a longer context, or attached ones."""
    if attach := os.environ.get("DISAGG_ATTACH_SERVERS"):
        yield _attached_set(attach)
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model()
    kv_dir = Path(tempfile.mkdtemp(prefix="disagg-kv-"))
    extra = ["--max-model-len", str(MAX_MODEL_LEN)]
    # The tiny model's config says 8,192 positions; its RoPE has no learned limit beyond that.
    env = {**ENGINE_ENV, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    specs = [ServerSpec(name=role, argv=role_argv(role, model, port, kv_dir, extra), port=port,
                        env={**env, **ROLE_ENV.get(role, {})}) for role in ROLES for port in [free_port()]]
    servers = start_all(specs, log_dir, timeout=1800)
    sset = ServerSet({s.spec.name: s for s in servers}, model, kv_dir, log_dir)
    sset.bench_owned = True  # type: ignore[attr-defined]
    try:
        yield sset
    finally:
        sset.stop()


@contextmanager
def lane_server_set(lane: str, log_dir: Path) -> Iterator[ServerSet]:
    """A vLLM lane's four servers as the test harness runs them (its context length), or attached
    ones (``DISAGG_ATTACH_SERVERS_034`` for the 0.34 lane)."""
    if attach := os.environ.get(f"DISAGG_ATTACH_SERVERS_{lane.replace('.', '')}"):
        yield _attached_set(attach)
        return
    sset = start_server_set(log_dir, lane=lane, timeout=1800)
    try:
        yield sset
    finally:
        sset.stop()


@contextmanager
def sidecar(config: dict[str, Any]) -> Iterator[SidecarProcess]:
    """``disagg sidecar --config FILE`` as its own process (its CPU is measured by pid)."""
    with tempfile.TemporaryDirectory(prefix="bench-sidecar-") as tmp:
        with sidecar_process(config, Path(tmp)) as proc:
            yield proc


@dataclass
class Call:
    path: str
    bytes_out: int = 0  # sidecar -> tier (the request body)
    bytes_in: int = 0  # tier -> sidecar (the response body)


@dataclass
class CountingProxy:
    url: str = ""
    calls: list[Call] = field(default_factory=list)


@contextmanager
def counting_proxy(target: str) -> Iterator[CountingProxy]:
    """A pass-through to ``target`` that streams request and response bodies as they come (a
    session's request body lasts as long as its answer) and counts their bytes per call."""
    proxy, lt, port = CountingProxy(), LoopThread(), free_port()

    async def start() -> tuple[web.AppRunner, aiohttp.ClientSession]:
        client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

        async def forward(request: web.Request) -> web.StreamResponse:
            proxy.calls.append(call := Call(request.path))

            async def body() -> AsyncIterator[bytes]:
                async for chunk in request.content.iter_any():
                    call.bytes_out += len(chunk)
                    yield chunk

            headers = {k: v for k, v in request.headers.items()
                       if k.lower() not in ("host", "content-length", "transfer-encoding")}
            data = body() if request.can_read_body else None
            async with client.request(request.method, target + request.path_qs, data=data, headers=headers) as resp:
                out = web.StreamResponse(status=resp.status, headers={
                    "Content-Type": resp.headers.get("Content-Type", "application/json")})
                await out.prepare(request)
                try:
                    async for chunk in resp.content.iter_any():
                        call.bytes_in += len(chunk)
                        await out.write(chunk)
                    await out.write_eof()
                except ConnectionResetError:  # the sidecar hung up after the answer's [DONE]
                    pass
                return out

        return await serve_every_path(forward, port), client

    runner, client = lt.run(start())
    proxy.url = f"http://127.0.0.1:{port}"
    try:
        yield proxy
    finally:
        lt.run(runner.cleanup())
        lt.run(client.close())
        lt.close()


def traffic(calls: list[Call]) -> dict[str, dict[str, int]]:
    """Calls and bytes by path through a ``counting_proxy``."""
    out: dict[str, dict[str, int]] = {"calls": defaultdict(int), "bytes_out": defaultdict(int), "bytes_in": defaultdict(int)}
    for call in calls:
        out["calls"][call.path] += 1
        out["bytes_out"][call.path] += call.bytes_out
        out["bytes_in"][call.path] += call.bytes_in
    return {k: dict(v) for k, v in out.items()}
