"""Per-request transport pieces shared by the flows: the request context every leg carries,
how a failed leg looks to the client, and the client's event stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from disagg_sidecar import legs, streaming, wire
from disagg_sidecar.errors import SidecarError, error_body
from disagg_sidecar.upstream import InFlight, LegError, transport_error

log = logging.getLogger(__name__)


@dataclass
class Context:
    """Per request: the id every leg carries, the headers they get, where the prefill goes."""

    request_id: str  # the client's (or a new) id: logs, response ids and headers, render/derender legs
    headers: dict[str, str]
    prefill_target: str | None = None
    engine_id: str | None = None  # X-Request-Id of the engine legs, unique per request; None: request_id
    inflight: InFlight = field(init=False)
    prefill_outcomes: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        engine_id = self.engine_id or self.request_id
        self.inflight = InFlight(legs.engine_request_id(engine_id), {**self.headers, wire.REQUEST_ID: engine_id})

    @property
    def prefill_header(self) -> str | None:
        for outcome in ("fallback", "skipped", "remote", "local"):
            if outcome in self.prefill_outcomes:
                return outcome
        return None

    def response_headers(self) -> dict[str, str]:
        headers = {wire.REQUEST_ID: self.request_id}
        if self.prefill_header:
            headers[wire.PREFILL_OUTCOME] = self.prefill_header
        return headers


@dataclass(frozen=True)
class Prefilled:
    kv: dict[str, Any] | None = None  # for the decode leg
    cached_tokens: int | None = None  # the prefill engine's cache hits (NIXL reports them)


def leg_failure(exc: LegError) -> SidecarError:
    """A leg that failed after its retries, as the client sees it (the details only in the log)."""
    log.warning("%s", exc)
    if exc.leg == "decode":
        if exc.kind == "connect":
            return SidecarError(503, "The decode engine is not reachable; is it running?",
                                type_="ServiceUnavailableError", headers={"Retry-After": "1"})
        # Its body stays in the log (LegError's text): tracebacks and addresses are not the client's.
        detail = f"status {exc.status}" if exc.status else exc.kind
        return SidecarError(502, f"The decode engine failed: {detail}", type_="BadGatewayError")
    return SidecarError(503, f"The {exc.leg} tier is unavailable ({exc.kind})", type_="ServiceUnavailableError",
                        headers={"Retry-After": "1"})


def streamed_error(error: Mapping[str, Any]) -> SidecarError:
    """An error event in the decode stream: a 4xx as the engine said it; anything else a 502
    whose detail stays in the log."""
    code = error.get("code")
    if isinstance(code, int) and 400 <= code < 500:
        return SidecarError(code, str(error.get("message")))
    log.warning("decode stream error event: %.500s", error)
    return SidecarError(502, "The decode engine failed during the stream", type_="BadGatewayError")


def with_raw_field(body: bytes, key: str, raw: bytes) -> bytes:
    """``body`` (a serialised JSON object) with ``key: raw`` added, without re-serialising ``raw``."""
    assert body.endswith(b"}")
    return body[:-1] + b',"' + key.encode() + b'":' + raw + b"}"


class SSEWriter:
    """The client's event stream; headers are sent with the first event (errors before it are
    ordinary HTTP errors). Writes are serialised: several lanes write to one stream."""

    def __init__(self, request: web.Request, headers: Mapping[str, str]):
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache", **headers})
        self._lock = asyncio.Lock()

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def write(self, data: bytes) -> None:
        async with self._lock:
            if not self.response.prepared:
                await self.response.prepare(self.request)
            await self.response.write(data)

    async def send(self, obj: Mapping[str, Any]) -> None:
        await self.write(streaming.sse_json(obj))

    async def fail(self, status: int, message: str) -> None:
        await self.send(error_body(status, message))
        await self.write(streaming.DONE_EVENT)


async def chunks(resp: aiohttp.ClientResponse, url: str) -> AsyncIterator[bytes]:
    """The decode stream's bytes; a broken stream becomes a ``LegError``."""
    try:
        async for data in resp.content.iter_any():
            yield data
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        raise transport_error("decode", url, exc) from exc
