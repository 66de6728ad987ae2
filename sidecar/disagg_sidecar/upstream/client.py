"""The legs on the wire: one shared ``ClientSession``, per-leg timeouts, retries on another
endpoint, aborts, health and capability probes. No request-level decisions live here.

Retries: a leg that could not connect, timed out, lost its connection or got a 5xx is repeated
(up to ``retries`` more times) on an endpoint not tried yet, or on the same one if it is the only
one (behind a Service that is another pod, and a stale keep-alive connection is worth one more
try). 4xx answers are the client's problem and are returned as they are.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from disagg_sidecar import wire
from disagg_sidecar.budget import Charge, Reservation
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.upstream.endpoints import EndpointPool
from disagg_sidecar.upstream.reading import (IdleWatch, Leg, LegError, encoded, is_redirect, read_bounded,
                                             transport_error)
from disagg_sidecar.metrics import Metrics, api_var
from disagg_sidecar.tracing import Tracing

log = logging.getLogger(__name__)

PoolLeg = Literal["render", "prefill", "derender"]  # legs to a pool of endpoints (decode: this pod's engine)
JSON_HEADERS = {"Content-Type": "application/json"}
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2, sock_connect=1)
ABORT_TIMEOUT = aiohttp.ClientTimeout(total=5, sock_connect=1)
ABORT_GRACE_SECONDS = 1.0
NO_REDIRECTS = {"allow_redirects": False}  # every call of the upstream session (module docstring)
CAPABILITY_TTL_SECONDS = 30.0  # how long a render/derender endpoint's capabilities are trusted
# The serving check: a two-token prompt (vLLM's ExampleConnector mis-handles one-token prompts, see
# disagg_sidecar.connectors.example), one output token, on the engine's OpenAI completions route so
# that it never counts as one of the sidecar's own generate legs.
SERVING_CHECK = {"prompt": [0, 0], "max_tokens": 1}
SERVING_CHECK_TIMEOUT = aiohttp.ClientTimeout(total=30)
PROBE_ANSWER_BYTES = 1 << 20  # read of a probe's answer (health, serving check, capabilities) at most


@dataclass
class Reply:
    status: int
    body: bytes
    url: str
    charge: Charge | None = None  # its part of the request's memory budget

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class InFlight:
    """Engine URLs a request currently has a generate leg on (to abort them on disconnect)."""

    engine_request_id: str
    # The engine legs' headers: the request's unique engine id as X-Request-Id (so that clients
    # repeating an id cannot abort each other), the trace context.
    headers: Mapping[str, str] = field(default_factory=dict)
    urls: set[str] = field(default_factory=set)


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, config: SidecarConfig, metrics: Metrics,
                 render: EndpointPool, derender: EndpointPool, prefill: EndpointPool, tracing: Tracing | None = None,
                 fresh: aiohttp.ClientSession | None = None):
        self.session = session
        # Connections used once: a retry after a disconnect goes over one (``call``).
        self.fresh = fresh or session
        self.tracing = tracing or Tracing(None)  # a span per leg attempt when configured
        self.config = config
        self.metrics = metrics
        self.pools: dict[PoolLeg, EndpointPool] = {"render": render, "derender": derender, "prefill": prefill}
        self.decode_url = config.decode.url
        t = config.timeouts
        connect = t.connect_seconds
        # ``total`` covers the whole leg, the answer's body included (a trickle is cut there);
        # a streamed decode leg also may not fall silent for longer than ``decode_idle_seconds``.
        self.timeouts: dict[Leg, aiohttp.ClientTimeout] = {
            "render": aiohttp.ClientTimeout(total=t.render_seconds, sock_connect=connect),
            "prefill": aiohttp.ClientTimeout(total=t.prefill_seconds, sock_connect=connect),
            "decode": aiohttp.ClientTimeout(total=t.decode_seconds, sock_connect=connect),
            "derender": aiohttp.ClientTimeout(total=config.derender_timeout, sock_connect=connect),
        }
        lim = config.limits
        self.answer_bytes: dict[Leg, int] = {"render": lim.render_answer_bytes, "prefill": lim.prefill_answer_bytes,
                                             "decode": lim.decode_answer_bytes, "derender": lim.derender_answer_bytes}
        self.stream_timeout = aiohttp.ClientTimeout(total=t.decode_seconds, sock_connect=connect,
                                                    sock_read=t.decode_idle_seconds)
        # The streamed decode leg's idle bound is kept by ``IdleWatch`` (headers: ``asyncio.timeout``).
        self.decode_stream_timeout = aiohttp.ClientTimeout(total=t.decode_seconds, sock_connect=connect)
        self.idle_seconds = t.decode_idle_seconds
        self._background: set[asyncio.Task] = set()
        self._capabilities: dict[str, tuple[float, Any]] = {}  # url -> (when asked, answer)

    # -- one attempt ---------------------------------------------------------------------------

    async def post(self, leg: Leg, url: str, path: str, body: bytes, headers: Mapping[str, str],
                   held: Reservation | None = None, fresh: bool = False) -> Reply:
        """POST and read the whole answer (charged to ``held``); transport failures become
        ``LegError``. ``fresh``: over a new connection, not a pooled one."""
        started = time.monotonic()
        charge = Charge(held) if held is not None else None
        with self.tracing.leg(leg, url, path, headers) as (span, headers):
            try:
                async with (self.fresh if fresh else self.session).post(url + path, data=body, headers={**headers, **JSON_HEADERS},
                                             timeout=self.timeouts[leg], **NO_REDIRECTS) as resp:
                    span.answered(resp.status)
                    if is_redirect(resp.status):
                        raise LegError(leg, "redirect", url, resp.status)
                    if encoded(resp):
                        raise LegError(leg, "invalid", url, resp.status, detail="a compressed answer")
                    return Reply(resp.status, await read_bounded(resp, leg, url, self.answer_bytes[leg], charge), url,
                                 charge)
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                error = transport_error(leg, url, exc)
                span.failed(error.kind)
                raise error from exc
            except LegError as exc:
                span.failed(exc.kind)
                raise
            finally:
                self.metrics.leg_seconds.labels(leg, api_var.get()).observe(time.monotonic() - started)

    # -- a pool leg with retries ---------------------------------------------------------------

    async def call(self, leg: PoolLeg, path: str, body: bytes, headers: Mapping[str, str], *,
                   first: str | None = None, inflight: InFlight | None = None, prompt: Sequence[int] = (),
                   held: Reservation | None = None) -> Reply:
        """The leg on ``first`` (or a picked endpoint of its pool), retried elsewhere on failure;
        2xx/4xx returned, its answer charged to ``held``. An answer the memory budget cannot hold
        is no endpoint's fault: no retry. A retry after a disconnect goes over a new connection:
        the other pooled ones may lead to the same gone server (a Service's pod that was replaced:
        kube-proxy sends only new connections to the current pods, and a steady stream of legs
        keeps the old ones from ever idling out)."""
        pool = self.pools[leg]
        tried: list[str] = []
        error: LegError | None = None
        if inflight is not None:
            headers = inflight.headers
        for attempt in range(1 + self.config.retries):
            url = first if attempt == 0 and first else (pool.pick(exclude=tried, prompt=prompt) or pool.pick())
            if url is None:
                error = error or LegError(leg, "no endpoint", None)
                break
            if attempt:
                self.metrics.retries.labels(leg).inc()
                log.warning("retrying %s leg on %s after: %s", leg, url, error)
            tried.append(url)
            if inflight is not None:
                inflight.urls.add(url)  # left registered if cancelled: the disconnect handler aborts it
            reply: Reply | None = None
            try:
                with pool.lease(url):
                    reply = await self.post(leg, url, path, body, headers, held,
                                            fresh=error is not None and error.kind == "disconnect")
            except LegError as exc:
                if exc.kind == "budget":
                    if inflight is not None:
                        inflight.urls.discard(url)
                    self.metrics.leg_errors.labels(leg, exc.kind).inc()
                    raise
                error = exc
            if inflight is not None:
                inflight.urls.discard(url)
            if reply is not None:
                if reply.status < 500:
                    pool.mark_ok(url)
                    return reply
                error = LegError(leg, "status", url, reply.status, reply.body)
            pool.mark_failed(url)
            assert error is not None
            self.metrics.leg_errors.labels(leg, error.kind).inc()
        assert error is not None
        raise error

    # -- the decode leg ------------------------------------------------------------------------

    @asynccontextmanager
    async def decode(self, body: bytes | None, headers: Mapping[str, str], inflight: InFlight | None = None,
                     stream: bool = False, path: str = wire.GENERATE,
                     method: str = "POST") -> AsyncIterator[aiohttp.ClientResponse]:
        """The local engine's response at ``path`` (its generate route, or an OpenAI route when it
        answers a client's request itself; ``GET`` with no body for a stored response), open;
        leaving the block early closes the connection (which makes vLLM abort the request)."""
        started = time.monotonic()
        url = self.decode_url
        if inflight is not None:
            headers = inflight.headers
        with self.tracing.leg("decode", url, path, headers) as (span, headers):
            try:
                async with asyncio.timeout(self.idle_seconds if stream else None):  # a stream's wait for headers
                    resp = await self.session.request(method, url + path, data=body, headers={**headers, **JSON_HEADERS},
                                                   timeout=self.decode_stream_timeout if stream else self.timeouts["decode"],
                                                   **NO_REDIRECTS)
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                error = transport_error("decode", url, exc)
                self.metrics.leg_errors.labels("decode", error.kind).inc()
                span.failed(error.kind)
                raise error from exc
            span.answered(resp.status)
            if is_redirect(resp.status) or encoded(resp):
                resp.close()
                kind = "redirect" if is_redirect(resp.status) else "invalid"
                self.metrics.leg_errors.labels("decode", kind).inc()
                span.failed(kind)
                raise LegError("decode", kind, url, resp.status, detail="" if kind == "redirect" else "a compressed answer")
            if inflight is not None:
                inflight.urls.add(url)
            watch = IdleWatch(resp, self.idle_seconds) if stream else None
            try:
                yield resp
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                # Reading the body failed (stalled past the leg timeout, or the engine went away after
                # its headers); other legs inside this block raise LegError themselves.
                resp.close()
                error = transport_error("decode", url, exc)
                self.metrics.leg_errors.labels("decode", error.kind).inc()
                span.failed(error.kind)
                raise error from exc
            except LegError as exc:
                resp.close()
                if exc.leg == "decode":  # a bad decode answer; another leg's failure is on its own span
                    span.failed(exc.kind)
                raise
            except BaseException:
                resp.close()  # left in `inflight`: a disconnect handler aborts it
                raise
            else:
                if inflight is not None:
                    inflight.urls.discard(url)
            finally:
                if watch is not None:
                    watch.cancel()
                resp.release()
                self.metrics.leg_seconds.labels("decode", api_var.get()).observe(time.monotonic() - started)

    # -- aborts, probes --------------------------------------------------------------------------

    def abort(self, inflight: InFlight) -> None:
        """Ask every engine the request is still on to abort it (fire and forget).

        Closing the connection already aborts on vLLM; the explicit call also covers a leg
        whose connection is pooled or still being set up.
        """
        for url in list(inflight.urls):
            self.metrics.aborts.inc()
            task = asyncio.create_task(self._abort(url, inflight.engine_request_id, inflight.headers))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _abort(self, url: str, engine_request_id: str, headers: Mapping[str, str]) -> None:
        body = json.dumps({"request_ids": [engine_request_id]}).encode()
        try:  # with the legs' headers: the abort belongs to the same request and trace
            async with self.session.post(url + wire.ABORT, data=body, headers={**headers, **JSON_HEADERS},
                                         timeout=ABORT_TIMEOUT, **NO_REDIRECTS) as resp:
                await resp.read()
                if resp.status != 200:
                    log.warning("abort of %s on %s answered %s", engine_request_id, url, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("abort of %s on %s failed: %s", engine_request_id, url, exc)

    async def healthy(self, url: str) -> bool:
        try:
            async with self.session.get(url + wire.HEALTH, timeout=PROBE_TIMEOUT, **NO_REDIRECTS) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def served_capabilities(self) -> dict[str, Any] | Literal["absent"] | None:
        """The decode engine's ``/disagg/v1/capabilities``; "absent" without the extension, None if unreachable."""
        try:
            async with self.session.get(self.decode_url + wire.CAPABILITIES, timeout=PROBE_TIMEOUT,
                                        **NO_REDIRECTS) as resp:
                body = await resp.read()
                if resp.status == 404:
                    return "absent"
                if resp.status != 200:
                    return None
                data = json.loads(body)
                return data if isinstance(data, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def decode_version(self) -> str | None:
        """The decode engine's own ``GET /version`` (every vLLM server has it); None if it did not say."""
        try:
            async with self.session.get(self.decode_url + wire.VERSION, timeout=PROBE_TIMEOUT,
                                        **NO_REDIRECTS) as resp:
                body = await resp.read()
                version = json.loads(body).get("version") if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None
        return version if isinstance(version, str) and len(version) <= 64 else None

    async def get_json(self, url: str, path: str) -> tuple[int, bytes]:
        async with self.session.get(url + path, timeout=self.timeouts["render"], **NO_REDIRECTS) as resp:
            return resp.status, await resp.read()

    async def decode_health(self) -> tuple[bool, bool]:
        """The decode engine's ``/health``: (healthy, refused); a refused connection means its
        process is gone."""
        try:
            async with self.session.get(self.decode_url + wire.HEALTH, timeout=PROBE_TIMEOUT,
                                        **NO_REDIRECTS) as resp:
                await read_bounded(resp, "decode", self.decode_url, PROBE_ANSWER_BYTES)
                return resp.status == 200, False
        except aiohttp.ClientConnectorError:
            return False, True
        except (aiohttp.ClientError, asyncio.TimeoutError, LegError):
            return False, False

    async def decode_serves(self, model: str | None) -> bool:
        """The serving check: a real request to the decode engine; false only on a 5xx (a timeout or
        4xx says nothing about an engine that answers everything with 500)."""
        body = {**SERVING_CHECK, **({"model": model} if model else {})}
        try:
            async with self.session.post(self.decode_url + wire.COMPLETIONS, json=body,
                                         timeout=SERVING_CHECK_TIMEOUT, **NO_REDIRECTS) as resp:
                try:
                    await read_bounded(resp, "decode", self.decode_url, PROBE_ANSWER_BYTES)
                except LegError:
                    pass  # an oversized answer: its status has said it
                return resp.status < 500
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return True

    async def endpoint_capabilities(self, url: str) -> Any:
        """A render/derender endpoint's ``/disagg/v1/capabilities`` answer (None: none), asked once
        per ``CAPABILITY_TTL_SECONDS``."""
        now = time.monotonic()
        at, capabilities = self._capabilities.get(url, (-1e9, None))
        if now - at > CAPABILITY_TTL_SECONDS:
            try:
                async with self.session.get(url + wire.CAPABILITIES, timeout=self.timeouts["render"],
                                            **NO_REDIRECTS) as resp:
                    body = await read_bounded(resp, "render", url, PROBE_ANSWER_BYTES)
                    capabilities = json.loads(body) if resp.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, LegError):
                capabilities = None
            self._capabilities[url] = (now, capabilities)
        return capabilities

    @asynccontextmanager
    async def session_stream(self, url: str, lines: AsyncIterator[bytes],
                             headers: Mapping[str, str]) -> AsyncIterator[aiohttp.ClientResponse]:
        """A derender session (``derender.sessions``): ``lines`` written as they come, the answer
        open; with the streamed decode leg's timeouts (a session lives as long as its decode stream)."""
        with self.tracing.leg("derender", url, "", headers) as (span, headers):
            async with self.session.post(url, data=lines, headers={**headers, "Content-Type": "application/x-ndjson"},
                                         timeout=self.stream_timeout, **NO_REDIRECTS) as resp:
                span.answered(resp.status)
                yield resp

    async def close(self) -> None:
        # Aborts sent as the last streams were cut (drain deadline) get a moment to land.
        if self._background:
            await asyncio.wait(list(self._background), timeout=ABORT_GRACE_SECONDS)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
