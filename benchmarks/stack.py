"""The system under test: the harness's real vLLM CPU servers (started here, or attached with
``DISAGG_ATTACH_SERVERS``), ``disagg sidecar`` processes in front of them, and a byte-counting
pass-through between a sidecar and its render/derender tier."""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from disagg_engine.servers import ServerSpec, free_port, start_all
from disagg_engine.testing.server_set import ENGINE_ENV, ROLE_ENV, ROLES, ServerSet, role_argv
from disagg_engine.testing.tiny_model import ensure_model
from tests.harness.engine import _attached_set
from tests.sidecar.conftest import TOKENS_ONLY
from tests.sidecar.support import LoopThread, SidecarProcess, sidecar_config, sidecar_process

__all__ = ["TOKENS_ONLY", "Counter", "counting_proxy", "server_set", "sidecar", "sidecar_config"]


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
    specs = [ServerSpec(name=role, argv=role_argv(role, model, port, kv_dir, extra), port=port,
                        env={**ENGINE_ENV, **ROLE_ENV.get(role, {})}) for role in ROLES for port in [free_port()]]
    servers = start_all(specs, log_dir, timeout=1800)
    sset = ServerSet({s.spec.name: s for s in servers}, model, kv_dir, log_dir)
    sset.bench_owned = True  # type: ignore[attr-defined]
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
class Counter:
    """Bytes and calls through the pass-through, by path (request bodies + response bodies)."""

    url: str = ""
    bytes_out: dict[str, int] = field(default_factory=lambda: defaultdict(int))   # sidecar -> tier
    bytes_in: dict[str, int] = field(default_factory=lambda: defaultdict(int))    # tier -> sidecar
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"bytes_out": dict(self.bytes_out), "bytes_in": dict(self.bytes_in), "calls": dict(self.calls)}

    @staticmethod
    def delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        return {k: {p: n - before[k].get(p, 0) for p, n in after[k].items() if n - before[k].get(p, 0)}
                for k in after}


@contextmanager
def counting_proxy(target: str) -> Iterator[Counter]:
    """Forwards every request to ``target`` unchanged, streaming, counting what passes."""
    counter = Counter()
    lt = LoopThread()
    port = free_port()

    async def start() -> tuple[web.AppRunner, aiohttp.ClientSession]:
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600))

        async def forward(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            counter.calls[request.path] += 1
            counter.bytes_out[request.path] += len(raw)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            async with session.request(request.method, target + request.path_qs, data=raw, headers=headers) as resp:
                out = web.StreamResponse(status=resp.status, headers={
                    "Content-Type": resp.headers.get("Content-Type", "application/json")})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    counter.bytes_in[request.path] += len(chunk)
                    await out.write(chunk)
                await out.write_eof()
                return out

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, session

    runner, session = lt.run(start())
    counter.url = f"http://127.0.0.1:{port}"
    try:
        yield counter
    finally:
        lt.run(runner.cleanup())
        lt.run(session.close())
        lt.close()
