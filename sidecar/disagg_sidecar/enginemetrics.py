"""``/metrics`` with the decode engine's families (``metrics.include_engine``): fetched on each
scrape with a short timeout, merged by ``exposition.merge``. A scrape never fails or waits longer
on the engine's account: without them it serves the sidecar's own, the miss counted by reason."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from disagg_sidecar import exposition, wire
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.upstream import Upstream

log = logging.getLogger(__name__)

MAX_BYTES = 16 << 20  # a vLLM exposition is tens of KB; more is not one
# The classic text format, not gzipped: the upstream session does not decompress (app._upstreams).
_HEADERS = {"Accept": "text/plain; version=0.0.4", "Accept-Encoding": "identity"}


async def _fetch(up: Upstream, timeout: float) -> str:
    """The engine's exposition; raises LookupError(reason) when there is none to use."""
    try:
        async with up.session.get(up.decode_url + wire.METRICS, headers=_HEADERS,
                                  timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
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


async def render(up: Upstream, metrics: Metrics, timeout: float) -> bytes:
    """The sidecar's exposition followed by the engine's families it does not export itself."""
    try:
        engine = await _fetch(up, timeout)
        return exposition.merge(metrics.render().decode(), engine).encode()
    except LookupError as exc:
        reason = str(exc)
    except ValueError as exc:
        log.warning("the decode engine's /metrics is not a Prometheus exposition: %s", str(exc)[:300])
        reason = "invalid"
    metrics.engine_metrics_missing.labels(reason).inc()
    return metrics.render()
