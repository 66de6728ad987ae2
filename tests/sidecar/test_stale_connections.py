"""A retried leg after a disconnect goes over a new connection, not another pooled one: when a
Service's pod is replaced under a steady stream of legs, the sidecar's keep-alive connections all
still lead to the old pod (kube-proxy sends only new connections to the current pods), and when it
exits, each of them fails. A raw TCP server plays that pod: it answers on every connection until
it is "replaced", then resets every connection opened before, while new ones are answered."""

from __future__ import annotations

import asyncio
import socket
import struct

from disagg_sidecar.app import upstream_sessions
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.upstream.client import Upstream
from disagg_sidecar.upstream.endpoints import EndpointPool
from disagg_sidecar.upstream.reading import LegError
from tests.sidecar.support import SERVED

ANSWER = b'{"ok": true}'


class ReplacedServer:
    """HTTP/1.1 keep-alive answers of ``ANSWER``; the first requests are held until ``hold``
    connections are open (so the client pools that many); after ``replace()`` a request on a
    connection opened before is answered with a reset (RST)."""

    def __init__(self, hold: int) -> None:
        self.hold, self.opened, self.old = hold, 0, set()
        self.all_open = asyncio.Event()
        self.replaced = False
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def replace(self) -> None:
        self.replaced = True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        born_replaced = self.replaced
        if self.opened >= self.hold:
            self.all_open.set()
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if self.replaced and not born_replaced:  # the old pod is gone: a reset
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                               struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                await self.all_open.wait()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


def _config(url: str, retries: int = 1) -> SidecarConfig:
    return SidecarConfig.model_validate({
        "served_model_name": SERVED, "listen": {"host": "127.0.0.1", "port": 8000}, "decode": {"url": url},
        "render": {"url": url}, "prefill": {"mode": "local"}, "retries": retries})


async def _replaced_under_pooled_connections(retries: int) -> tuple[ReplacedServer, Upstream, Metrics]:
    server = ReplacedServer(hold=2)
    url = await server.start()
    config = _config(url, retries)
    session, fresh = upstream_sessions(config)
    metrics = Metrics()
    pools = {tier: EndpointPool(tier, lambda: (url,), "least-requests") for tier in ("render", "derender", "prefill")}
    up = Upstream(session, config, metrics, **pools, fresh=fresh)
    # Two legs at once: two connections, both pooled once answered.
    replies = await asyncio.gather(*(up.call("render", "/render", b"{}", {}) for _ in range(2)))
    assert [r.status for r in replies] == [200, 200] and server.opened == 2
    server.replace()
    return server, up, metrics


async def test_a_retry_after_a_disconnect_opens_a_new_connection() -> None:
    server, up, metrics = await _replaced_under_pooled_connections(retries=1)
    try:
        reply = await up.call("render", "/render", b"{}", {})  # a pooled connection: reset; the retry: a new one
        assert (reply.status, reply.body) == (200, ANSWER)
        assert server.opened == 3
        assert metrics.registry.get_sample_value("disagg_sidecar_leg_retries_total", {"leg": "render"}) == 1
        assert metrics.registry.get_sample_value("disagg_sidecar_leg_errors_total",
                                                 {"leg": "render", "kind": "disconnect"}) == 1
        again = await up.call("render", "/render", b"{}", {})  # the new server's connections serve on
        assert again.status == 200
    finally:
        await up.session.close()
        await up.fresh.close()
        await server.close()


async def test_without_a_retry_the_disconnect_is_the_legs_error() -> None:
    """The reset is what the legs meet (the server is not broken for new connections only)."""
    server, up, _ = await _replaced_under_pooled_connections(retries=0)
    try:
        try:
            await up.call("render", "/render", b"{}", {})
            raise AssertionError("a pooled connection to the replaced server answered")
        except LegError as exc:
            assert exc.kind == "disconnect"
        assert server.opened == 2
    finally:
        await up.session.close()
        await up.fresh.close()
        await server.close()
