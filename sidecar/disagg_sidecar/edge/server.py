"""The HTTP server around the app: what aiohttp decides before a handler runs.

- malformed HTTP (bad request line, header, chunking): aiohttp answers a text/plain 400 and logs
  an ERROR with a traceback per request; here it is an OpenAI-shaped 400 that echoes nothing,
  and one WARNING line;
- header deadline: aiohttp's keep-alive timer also runs from the moment a connection opens and
  closes it if no complete request arrived by then (``limits.header_read_seconds``);
- ``limits.max_connections_per_ip``: connections past the cap get a 429 and are closed.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.errors import error_bytes

log = logging.getLogger("disagg_sidecar")


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = error_bytes(status, message)
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


class GuardedHandler(RequestHandler):
    """One client connection."""

    _peer: str | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        server = self._manager
        assert isinstance(server, GuardedServer)
        peer = transport.get_extra_info("peername")
        ip = peer[0] if isinstance(peer, (tuple, list)) and peer else None
        cap = server.per_ip_cap
        if cap and ip is not None and server.per_ip[ip] >= cap:
            log.warning("connection from %s refused: %d open (limits.max_connections_per_ip)", ip, cap)
            transport.write(_raw_response(429, "Too Many Requests",
                                          f"too many open connections from this address (limit {cap})"))
            self.force_close()
            return
        if ip is not None:
            server.per_ip[ip] += 1
            self._peer = ip

    def connection_lost(self, exc: BaseException | None) -> None:
        server = self._manager
        if self._peer is not None and isinstance(server, GuardedServer):
            server.per_ip[self._peer] -= 1
            if server.per_ip[self._peer] <= 0:
                del server.per_ip[self._peer]
            self._peer = None
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, (RequestPayloadError, BadHttpMessage)):
            # The unread rest of a body the handler refused (and logged) for being undecodable.
            log.debug("request body left unread: %r", exc)
            return
        super().log_exception(*args, **kwargs)

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        if status >= 500:
            log.error("internal error handling a request from %s", request.remote, exc_info=exc)
            text = "Internal sidecar error"
        else:  # the client's bytes are not HTTP: say so, without repeating them to anyone
            log.warning("malformed HTTP request from %s (%s): answered %d", request.remote,
                        type(exc).__name__ if exc is not None else "unknown", status)
            text = "malformed HTTP request"
        resp = web.Response(status=status, body=error_bytes(status, text), content_type="application/json")
        resp.force_close()
        return resp


class GuardedServer(Server):
    """aiohttp's ``Server`` making ``GuardedHandler`` connections."""

    def __init__(self, *args: Any, per_ip_cap: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.per_ip_cap = per_ip_cap
        self.per_ip: Counter[str] = Counter()

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)


class SidecarRunner(web.AppRunner):
    """``web.AppRunner`` whose server is a ``GuardedServer`` set from the config's limits."""

    def __init__(self, app: web.Application, config: SidecarConfig, **kwargs: Any):
        kwargs.setdefault("keepalive_timeout", config.limits.header_read_seconds)
        super().__init__(app, **kwargs)
        self._per_ip_cap = config.limits.max_connections_per_ip

    async def _make_server(self) -> Server:
        plain = await super()._make_server()
        return GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                             handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                             per_ip_cap=self._per_ip_cap, **plain._kwargs)
