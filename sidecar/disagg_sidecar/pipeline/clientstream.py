"""The client's event stream: headers go with the first event, so a failure before it is an
ordinary HTTP error and a failure after it an SSE error event followed by ``[DONE]``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from disagg_sidecar import sse
from disagg_sidecar.errors import SidecarError, error_body
from disagg_sidecar.pipeline.failures import leg_failure
from disagg_sidecar.upstream.reading import LegError

log = logging.getLogger(__name__)


def json_answer(obj: Any, headers: Mapping[str, str]) -> web.Response:
    """A JSON answer, encoded once (``web.json_response`` would encode the text ``sse.dumps`` decoded)."""
    return web.Response(body=sse.dumps(obj), content_type="application/json", charset="utf-8", headers=headers)


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

    async def start(self) -> None:
        """Send the headers before the first event."""
        async with self._lock:
            await self._start()

    async def write(self, data: bytes) -> None:
        async with self._lock:
            await self._start()
            await self.response.write(data)

    async def _start(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)

    async def send(self, obj: Mapping[str, Any]) -> None:
        await self.write(sse.sse_json(obj))

    async def fail(self, status: int, message: str, done: bool = True) -> None:
        """An error event, and ``[DONE]`` unless the stream must not look finished (``SidecarError.done``)."""
        await self.send(error_body(status, message))
        if done:
            await self.write(sse.DONE_EVENT)


async def run_stream(writer: SSEWriter, run: Callable[[], Awaitable[None]], *,
                     end: Callable[[], Awaitable[None]] | None = None,
                     fail: Callable[[int, str], Awaitable[None]] | None = None) -> web.StreamResponse:
    """``run`` writing to ``writer``, then ``end`` (OpenAI's ``[DONE]``); a failure after the
    first byte is ``fail``'s error event (OpenAI's by default; before the first byte, the error
    is raised for an ordinary HTTP answer)."""
    own_fail, fail = fail, fail or writer.fail
    try:
        await run()
    except (SidecarError, LegError) as exc:
        err = exc if isinstance(exc, SidecarError) else leg_failure(exc)
        if not writer.started:
            raise err from exc
        log.warning("stream failed after the first byte: %s", err.message)
        if own_fail is None:  # OpenAI's event; no [DONE] where the stream must not look finished
            await writer.fail(err.status, err.message, err.done)
        else:
            await own_fail(err.status, err.message)
        return writer.response
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        if not writer.started:
            raise
        log.exception("stream failed after the first byte")
        await fail(500, "Internal sidecar error")
        return writer.response
    if end is None:
        await writer.write(sse.DONE_EVENT)
    else:
        await end()
    return writer.response
