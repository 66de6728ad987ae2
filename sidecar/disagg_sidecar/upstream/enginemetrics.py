"""``/metrics`` with the decode engine's families (``metrics.include_engine``): fetched with a short
timeout, merged by ``exposition``. A scrape never fails or waits longer on the engine's account:
without them it serves the sidecar's own, the miss counted by reason.

Parsing the engine's exposition costs milliseconds of the event loop (docs/llm-d.md), and an
endpoint picker scrapes every 50 ms by default: the merged part is reused for
``metrics.engine_max_age_seconds``, shared by every scraper.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from disagg_sidecar.upstream import exposition
from disagg_sidecar import wire
from disagg_sidecar.config import Exposition
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.upstream.client import NO_REDIRECTS, Upstream

log = logging.getLogger(__name__)

MAX_BYTES = 16 << 20  # a vLLM exposition is tens of KB; more is not one
# The classic text format, not gzipped: the upstream session does not decompress (app._upstreams).
_HEADERS = {"Accept": "text/plain; version=0.0.4", "Accept-Encoding": "identity"}


async def _fetch(up: Upstream, timeout: float) -> str:
    """The engine's exposition; raises LookupError(reason) when there is none to use."""
    try:
        async with up.session.get(up.decode_url + wire.METRICS, headers=_HEADERS,
                                  timeout=aiohttp.ClientTimeout(total=timeout), **NO_REDIRECTS) as resp:
            if resp.status != 200:
                raise LookupError("status")
            body = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_BYTES:
                    raise LookupError("too_large")
            return body.decode("utf-8")
    except asyncio.TimeoutError as exc:
        raise LookupError("timeout") from exc
    except aiohttp.ClientError as exc:
        raise LookupError("unreachable") from exc
    except UnicodeDecodeError as exc:
        raise LookupError("invalid") from exc


class EngineMetrics:
    """The scrape of one app: its own exposition, then the engine's part (fresh or recent)."""

    def __init__(self, up: Upstream, metrics: Metrics, config: Exposition) -> None:
        self.up, self.metrics, self.config = up, metrics, config
        self._part: tuple[float, str] | None = None  # (monotonic time fetched, engine part)
        self._fetching: asyncio.Future[bytes] | None = None

    async def render(self) -> bytes:
        own = self.metrics.render()
        if not self.config.include_engine:
            return own
        if self._part is not None and time.monotonic() - self._part[0] < self.config.engine_max_age_seconds:
            return own + self._part[1].encode()
        # One fetch at a time, shared by every scrape that comes meanwhile (single flight): a
        # hundred scrapers cost the engine one request, and the sidecar one parse.
        if self._fetching is None:
            self._fetching = asyncio.ensure_future(self._fetch_and_render())
            self._fetching.add_done_callback(self._fetched)
        return await asyncio.shield(self._fetching)

    def _fetched(self, future: asyncio.Future[bytes]) -> None:
        self._fetching = None
        if not future.cancelled():
            future.exception()  # retrieved: a failure was the fetch's, each scrape sees it

    async def _fetch_and_render(self) -> bytes:
        fetched = time.monotonic()
        own = self.metrics.render()
        try:
            part = exposition.engine_part(own.decode(), await _fetch(self.up, self.config.engine_timeout_seconds))
        except LookupError as exc:
            reason = str(exc)
        except ValueError as exc:
            log.warning("the decode engine's /metrics is not a Prometheus exposition: %s", str(exc)[:300])
            reason = "invalid"
        else:
            self._part = (fetched, part)
            return self.metrics.render() + part.encode()  # own as of now: the fetch took a while
        self._part = None
        self.metrics.engine_metrics_missing.labels(reason).inc()
        return self.metrics.render()
