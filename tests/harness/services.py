"""Kubernetes Services in miniature, whose endpoints a test changes while traffic flows (a rollout).

- ``ClusterIP``: what kube-proxy does for a ClusterIP Service: each new TCP connection goes to one
  of the current endpoints (round-robin here, random in iptables mode); a connection stays on its
  pod. ``remove`` takes an endpoint out and closes its connections (the pod is gone), so a
  client's next request on them fails and opens a new connection.
- ``Gateway``: an HTTP front that picks an endpoint per request (as an InferencePool's endpoint
  picker does for the client Service) and names it in the ``x-test-backend`` response header, so a
  test knows which decode pod answered.
"""

from __future__ import annotations

import asyncio
import itertools
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from disagg_engine.servers import free_port
from tests.sidecar.support import LoopThread

BACKEND_HEADER = "x-test-backend"
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class ClusterIP:
    def __init__(self, endpoints: list[str]):
        self.endpoints = list(endpoints)
        self.connections: dict[str, int] = {}  # endpoint -> connections it was given
        self._open: dict[str, set[asyncio.StreamWriter]] = {}
        self._turn = itertools.count()
        self._lt = LoopThread()
        self._server = self._lt.run(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def add(self, endpoint: str) -> None:
        self._lt.loop.call_soon_threadsafe(self.endpoints.append, endpoint)

    def remove(self, endpoint: str) -> None:
        """The endpoint's pod is gone: no new connections, and its open ones are closed."""
        async def drop() -> None:
            self.endpoints.remove(endpoint)
            for writer in self._open.pop(endpoint, set()):
                writer.close()
        self._lt.run(drop())

    def close(self) -> None:
        for endpoint in list(self.endpoints):
            self.remove(endpoint)
        self._server.close()
        self._lt.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.endpoints:
            writer.close()  # no endpoints: kube-proxy rejects the connection
            return
        endpoint = self.endpoints[next(self._turn) % len(self.endpoints)]
        self.connections[endpoint] = self.connections.get(endpoint, 0) + 1
        parts = urlsplit(endpoint)
        try:
            up_reader, up_writer = await asyncio.open_connection(parts.hostname, parts.port)
        except OSError:
            writer.close()
            return
        pair = self._open.setdefault(endpoint, set())
        pair.update((writer, up_writer))
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            pair.difference_update((writer, up_writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


class Gateway:
    """Requests to ``url`` go round-robin to the named endpoints current when each request comes."""

    def __init__(self, endpoints: dict[str, str]):
        self.endpoints = dict(endpoints)  # name -> base URL
        self.routed: dict[str, int] = {}
        self._turn = itertools.count()
        self._lt = LoopThread()
        port = free_port()
        self._runner, self._session = self._lt.run(self._start(port))
        self.url = f"http://127.0.0.1:{port}"

    def set(self, endpoints: dict[str, str]) -> None:
        self._lt.loop.call_soon_threadsafe(lambda: setattr(self, "endpoints", dict(endpoints)))

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            await self._session.close()
        self._lt.run(stop())
        self._lt.close()

    async def _start(self, port: int) -> tuple[web.AppRunner, aiohttp.ClientSession]:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        names = sorted(self.endpoints)
        if not names:
            return web.Response(status=503, text="no endpoints")
        name = names[next(self._turn) % len(names)]
        self.routed[name] = self.routed.get(name, 0) + 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(request.method, self.endpoints[name] + request.path_qs,
                                         data=await request.read(), headers=headers) as resp:
            out = web.StreamResponse(status=resp.status, headers={
                **{k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}, BACKEND_HEADER: name})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
