"""How an engine's answer is read off the wire, whatever the leg: its size bounded, what it holds
charged to the request's memory budget, a streamed one watched for silence; a redirect or a
compressed body refused; every such failure a ``LegError`` of the leg (``Upstream`` makes the calls).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Literal

import aiohttp

from disagg_sidecar.budget import ANSWER_BYTE_COST, STREAM_BYTE_COST, Charge, Reservation, answer_values_cost

Leg = Literal["render", "prefill", "decode", "derender"]


def is_redirect(status: int) -> bool:
    return 300 <= status < 400


def encoded(resp: aiohttp.ClientResponse) -> bool:
    """A compressed body: the session does not decompress (``app._upstreams``) and asks for none,
    so an engine that compresses anyway answers bytes no leg reads."""
    return resp.headers.get("Content-Encoding", "identity").strip().lower() not in ("identity", "")


class LegError(Exception):
    """A leg attempt that failed at the transport level or with a 5xx."""

    def __init__(self, leg: Leg, kind: str, url: str | None, status: int | None = None, body: bytes = b"",
                 detail: str = ""):
        super().__init__(f"{leg} leg {kind} at {url}: {status or ''} {detail or body[:300]!r}".strip())
        self.leg, self.kind, self.url, self.status, self.body = leg, kind, url, status, body
        self.detail = detail


def transport_error(leg: Leg, url: str, exc: BaseException) -> LegError:
    """A transport failure as the leg's error: ``timeout`` (no byte within the leg's timeout),
    ``connect`` (the endpoint was never reached) or ``disconnect`` (it went away)."""
    kind = ("timeout" if isinstance(exc, asyncio.TimeoutError)
            else "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "disconnect")
    return LegError(leg, kind, url, detail=str(exc))


async def chunks(resp: aiohttp.ClientResponse, leg: Leg, url: str,
                 held: Reservation | None = None) -> AsyncIterator[bytes]:
    """A leg's streamed answer, bytes as they come; a broken stream becomes a ``LegError``. With
    ``held``, what the reader holds of it (the chunk in hand and the event not complete yet, which
    an SSE parser buffers, and what parsing them costs) is charged to the request's memory budget
    (kind ``budget`` when that does not fit): the most it held at once, until the stream ends (the
    reader's last event may outlive the next read)."""
    charge = Charge(held) if held is not None else None
    pending = 0  # bytes since the last event separator
    try:
        async for data in resp.content.iter_any():
            if charge is not None:  # the events this chunk completes are the buffer and the chunk
                if not charge.hold(max(charge.taken, STREAM_BYTE_COST * (pending + len(data)))):
                    raise LegError(leg, "budget", url, resp.status, detail=f"{pending + len(data)} bytes of events")
                end = data.rfind(b"\n\n")
                pending = pending + len(data) if end < 0 else len(data) - end - 2
            yield data
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        raise transport_error(leg, url, exc) from exc
    finally:
        if charge is not None:
            charge.give_back()


async def read_bounded(resp: aiohttp.ClientResponse, leg: Leg, url: str, limit: int,
                       charge: Charge | None = None) -> bytes:
    """The whole body, refused (``LegError`` kind ``oversize``) as soon as it passes ``limit``:
    an engine's answer is never held beyond its leg's bound (``limits.*_answer_bytes``). With
    ``charge``, what holding and parsing it costs is taken from its request's memory budget as it
    arrives (kind ``budget`` when that does not fit: read no further), given back on failure."""
    if resp.content_length is not None and resp.content_length > limit:
        raise LegError(leg, "oversize", url, resp.status, detail=f"{resp.content_length} bytes")
    body = bytearray()
    try:
        async for chunk in resp.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise LegError(leg, "oversize", url, resp.status, detail=f"over {limit} bytes")
            if charge is not None and not charge.take(ANSWER_BYTE_COST * len(chunk)):
                raise LegError(leg, "budget", url, resp.status, detail=f"{len(body)} bytes read")
        if charge is not None and not charge.take(answer_values_cost(body)):
            raise LegError(leg, "budget", url, resp.status, detail=f"{len(body)} bytes to parse")
    except BaseException:
        body.clear()  # the exception's traceback keeps this frame (a cycle) until the collector runs
        if charge is not None:
            charge.give_back()
        raise
    return bytes(body)


class IdleWatch:
    """A streamed answer that falls silent for ``idle`` seconds fails as aiohttp's ``sock_read``
    fails it (``ServerTimeoutError``), without its cost: aiohttp re-arms a timer on every read,
    a sixth of the relay's CPU per chunk. This one looks every ``idle / 4`` seconds whether bytes
    came, so a silence is cut between ``idle`` and ``1.25 * idle``."""

    def __init__(self, resp: aiohttp.ClientResponse, idle: float):
        self.resp, self.idle = resp, idle
        self.loop = asyncio.get_running_loop()
        self.seen, self.since = resp.content.total_bytes, self.loop.time()
        self.handle = self.loop.call_later(idle / 4, self._check)

    def _check(self) -> None:
        now, total = self.loop.time(), self.resp.content.total_bytes
        if total != self.seen:
            self.seen, self.since = total, now
        elif now - self.since >= self.idle:
            self.resp.content.set_exception(aiohttp.ServerTimeoutError("Timeout on reading data from socket"))
            return
        self.handle = self.loop.call_later(self.idle / 4, self._check)

    def cancel(self) -> None:
        self.handle.cancel()
