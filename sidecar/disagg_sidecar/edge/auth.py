"""API keys: the one the sidecar sends to its engines and the one it requires from clients.

Each key is a file (a mounted Secret, or local mode's state directory) read once at start.
Clients are checked like vLLM's own ``--api-key`` middleware does (a Bearer token, SHA-256
digests compared in constant time), but a refusal is OpenAI's 401 body rather than vLLM's
``{"error": "Unauthorized"}``, so OpenAI SDKs raise ``AuthenticationError`` (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from disagg_sidecar import wire
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.errors import SidecarError

OPEN_PATHS = frozenset({wire.HEALTH, wire.LIVE, wire.DRAINED, wire.METRICS})  # probes, hooks and scrapers carry no key
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def read_key(path: str) -> str:
    """The key in ``path`` (surrounding whitespace dropped); an empty file is an error."""
    key = Path(path).read_text().strip()
    if not key:
        raise ValueError(f"{path}: the API key file is empty")
    return key


def upstream_headers(config: SidecarConfig) -> dict[str, str]:
    """Headers for every request to the engines: the engine key, when one is configured."""
    path = config.auth.engine_api_key_file
    return {"Authorization": f"Bearer {read_key(path)}"} if path else {}


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def _refusal(message: str) -> SidecarError:
    return SidecarError(401, message, type_="invalid_request_error", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})


def client_key_check(config: SidecarConfig) -> Callable[[web.Request], SidecarError | None] | None:
    """The client key check (the refusal, or None when the request may pass); None without a key."""
    path = config.auth.client_api_key_file
    if not path:
        return None
    expected = _digest(read_key(path))

    def refusal(request: web.Request) -> SidecarError | None:
        if request.path in OPEN_PATHS:
            return None
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return _refusal("Missing API key: send it as 'Authorization: Bearer <key>'.")
        if not hmac.compare_digest(_digest(token.strip()), expected):
            return _refusal("Incorrect API key provided.")
        return None

    return refusal


def client_key_middleware(config: SidecarConfig) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]] | None:
    """A middleware requiring the client key on every path but ``OPEN_PATHS``; None without one."""
    check = client_key_check(config)
    if check is None:
        return None

    @web.middleware
    async def require_client_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (refused := check(request)) is not None:
            raise refused
        return await handler(request)

    return require_client_key


def expect_handler(config: SidecarConfig) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """``Expect:`` before the body is read: ``100-continue`` gets ``100 Continue`` only once the
    client key is known to pass (else the 401 at once, no body invited); any other expectation an
    OpenAI-shaped 417 (aiohttp's own is text/plain)."""
    check = client_key_check(config)

    async def handle(request: web.Request) -> web.StreamResponse | None:
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            error = SidecarError(417, "Expect supports only 100-continue", type_="ExpectationFailedError")
        elif check is not None and (refused := check(request)) is not None:
            error = refused
        else:
            if request.version >= (1, 1):
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # as aiohttp's own handler: the answer has not started
            return None
        response = web.Response(body=error.body, status=error.status, content_type="application/json",
                                headers=error.headers)
        response.force_close()  # the body is not read
        return response

    return handle
