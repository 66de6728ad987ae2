"""``build_app(config)``: routes, middlewares, state and the one upstream ``ClientSession``.

The app is built here and run elsewhere (``commands`` in production, ``web.AppRunner`` in tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import hdrs, web

from disagg_sidecar.derender import anthropic
from disagg_sidecar.edge import auth
from disagg_sidecar.plan import capabilities
from disagg_sidecar.edge import handlers
from disagg_sidecar.upstream import tls
from disagg_sidecar import vllm_releases, wire
from disagg_sidecar.upstream.affinity import RecentShare
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.connectors import get_connector
from disagg_sidecar.pipeline.decoding import Decoder
from disagg_sidecar.upstream.discovery import make_source
from disagg_sidecar.upstream.endpoints import EndpointPool
from disagg_sidecar.upstream.enginemetrics import EngineMetrics
from disagg_sidecar.errors import SidecarError, error_bytes
from disagg_sidecar.pipeline.context import request_context
from disagg_sidecar.pipeline.coupled import DecodeAlone
from disagg_sidecar.pipeline.flows import Flows
from disagg_sidecar.keys import FLOWS, METRICS, SCRAPE, STATE, TRACING, UPSTREAM
from disagg_sidecar.logs import request_id_var
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.pipeline.poollegs import PoolLegs
from disagg_sidecar.state import SidecarState
from disagg_sidecar.tracing import Tracing, set_request_outcome
from disagg_sidecar.upstream.client import Upstream

log = logging.getLogger("disagg_sidecar")
access_log = logging.getLogger("disagg_sidecar.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_API_BY_PATH = {wire.CHAT: "chat", wire.COMPLETIONS: "completions", wire.GENERATE: "generate",
                wire.MESSAGES: "messages", wire.MESSAGES_COUNT_TOKENS: "count_tokens", wire.RESPONSES: "responses"}



@web.middleware
async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The request's span (``tracing``), around everything else: its status is the client's."""
    tracing = request.app[TRACING]
    if not tracing.enabled or (api := _API_BY_PATH.get(request.path)) is None:
        return await handler(request)
    with tracing.request(f"{request.method} {request.path}", handlers.trace_headers(request), {
            "http.request.method": request.method, "url.path": request.path, "disagg.api": api}) as span:
        try:
            response = await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):
            set_request_outcome(span, 499, {"error.type": "client_disconnected"})
            raise
        set_request_outcome(span, response.status, {"disagg.request_id": response.headers.get(wire.REQUEST_ID),
                                                    "disagg.prefill": response.headers.get(wire.PREFILL_OUTCOME)})
        return response


@web.middleware
async def errors_and_access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """SidecarError -> its OpenAI-shaped answer; one structured access line per request (with
    where its prompt was prefilled: ``Context.access_fields``)."""
    started = time.monotonic()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except SidecarError as exc:
        status = exc.status
        if exc.status >= 500:
            log.warning("%s %s -> %s: %s", request.method, request.path, exc.status, exc.message)
        response = web.Response(body=anthropic.in_api_shape(request.path, exc.status, exc.body), status=exc.status,
                                content_type="application/json", headers=exc.headers)
        if not request.content.at_eof():
            response.force_close()  # the rest of the body is not read (aiohttp would linger and read it)
        return response
    except web.HTTPException as exc:  # aiohttp's own 404/405/413: same error shape as everything else
        status = exc.status
        return web.Response(body=anthropic.in_api_shape(request.path, exc.status, error_bytes(exc.status, exc.reason)),
                            status=exc.status, content_type="application/json")
    except asyncio.CancelledError:
        status = 499  # client closed the request (nginx's convention)
        raise
    except ConnectionResetError:
        status = 499
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        status = 500
        return web.Response(body=anthropic.in_api_shape(request.path, 500, error_bytes(500, "Internal sidecar error")),
                            status=500, content_type="application/json")
    finally:
        if (api := _API_BY_PATH.get(request.path)) is not None:
            request.app[METRICS].requests.labels(api, str(status)).inc()
            if status == 200:
                request.app[STATE].answers.successes += 1
            ctx = request_context.get()  # None: refused before it was made
            access_log.info("%s %s %s", request.method, request.path, status, extra={"fields": {
                "status": status, "path": request.path, "ms": round((time.monotonic() - started) * 1000, 1),
                **(ctx.access_fields() if ctx is not None else {})}})
        request_id_var.set(None)
        request_context.set(None)


async def close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
    """From SIGTERM on, no connection stays open for another request: a client's next one opens
    a new connection, which the Service sends to a pod that stays."""
    if request.app[STATE].draining:
        response.force_close()
        response.headers[hdrs.CONNECTION] = "close"  # headers are computed, not yet written


async def _probe(app: web.Application) -> None:
    """One round of health and capability checks of every upstream."""
    state, up = app[STATE], app[UPSTREAM]

    async def any_healthy(pool: EndpointPool) -> bool:
        urls = pool.endpoints()
        results = await asyncio.gather(*(up.healthy(u) for u in urls))
        for url, ok in zip(urls, results):
            pool.mark_ok(url) if ok else pool.mark_failed(url)  # selection avoids failed ones
        return any(results)

    (decode_ok, refused), *pools_ok = await asyncio.gather(
        up.decode_health(), *(any_healthy(pool) for pool in up.pools.values()))
    state.record_probe("decode", decode_ok, refused=refused)
    for tier, ok in zip(up.pools, pools_ok):
        state.record_probe(tier, ok)
    if decode_ok and state.serving_check_due():
        serving = await up.decode_serves(state.model_name())
        if serving != state.decode_serving:
            (log.info if serving else log.warning)(
                "decode engine %s", "serves again" if serving else "answers 5xx while its /health says 200: not ready")
        state.decode_serving = serving
    if decode_ok and state.config.decode.probe_capabilities:
        served = capabilities.served(await up.served_capabilities())
        if served is not None and served != state.served_capabilities:
            log.info("decode engine capabilities: %s", served)
            state.served_capabilities = served
    if not decode_ok:
        state.decode_version = None  # a restarted engine may run another release
    elif state.decode_version is None:
        state.decode_version = await up.decode_version()
        if state.decode_version is not None:
            log.info("decode engine runs vLLM %s (%s)", state.decode_version,
                     vllm_releases.release(state.decode_version).label)
    if decode_ok and state.model_name() is None:
        try:
            status, body = await up.get_json(up.decode_url, wire.MODELS)
            if status == 200:
                state.served_model = json.loads(body)["data"][0]["id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError):
            pass


async def _probe_forever(app: web.Application) -> None:
    interval = app[STATE].config.limits.health_interval_seconds
    while True:
        await asyncio.sleep(interval)
        try:
            await _probe(app)
        except Exception:  # a probe bug must not stop the loop
            log.exception("health probe failed")


def upstream_sessions(config: SidecarConfig) -> tuple[aiohttp.ClientSession, aiohttp.ClientSession]:
    """The upstream sessions: one keeping connections alive, and one whose connections serve one
    request each (``Upstream.call``'s retry after a disconnect)."""
    ssl = {"ssl": context} if (context := tls.client_context(config)) else {}

    def session(**reuse: Any) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=config.limits.max_upstream_connections,  # more wait for one (within their leg's deadline)
            ttl_dns_cache=10, **reuse, **ssl)
        # The engine key goes on every request of these sessions (legs, aborts, probes); the client's
        # own Authorization header is never forwarded (wire.FORWARDED_HEADERS).
        return aiohttp.ClientSession(connector=connector, auto_decompress=False, headers=auth.upstream_headers(config))
    # Kept alive below vLLM's 5 s (uvicorn closes idle ones).
    return session(keepalive_timeout=config.limits.keepalive_seconds), session(force_close=True)


async def _upstreams(app: web.Application) -> AsyncIterator[None]:
    config = app[STATE].config
    source = make_source(config.prefill.discovery if config.prefill.mode == "remote" else None)
    await source.start()
    session, fresh = upstream_sessions(config)
    upstream = Upstream(
        session, config, app[METRICS],
        render=EndpointPool("render", lambda: config.render_urls, "least-requests"),
        derender=EndpointPool("derender", lambda: config.derender_urls, "least-requests"),
        prefill=EndpointPool("prefill", source.endpoints, config.prefill.selection,
                             block_tokens=config.prefill.affinity_block_tokens,
                             share=RecentShare(config.prefill.affinity_window, config.prefill.affinity_load_bound_percent)),
        tracing=app[TRACING], fresh=fresh,
    )
    app[UPSTREAM] = upstream
    app[SCRAPE] = EngineMetrics(upstream, app[METRICS], config.metrics)
    state = app[STATE]
    kv = get_connector(config.kv_connector) if config.prefill.mode == "remote" and config.kv_connector else None
    decoder = Decoder(config, upstream, app[METRICS], state.answers)
    app[FLOWS] = Flows(config, PoolLegs(config, upstream, app[METRICS], kv), decoder, state.capabilities,
                       state.model_name, DecodeAlone(config, upstream, app[METRICS], decoder),
                       state.decode_release, state.tiers_up)
    await _probe(app)
    prober = asyncio.create_task(_probe_forever(app))
    try:
        yield
    finally:
        prober.cancel()
        await asyncio.gather(prober, return_exceptions=True)
        await upstream.close()
        await session.close()
        await fresh.close()
        await source.stop()
        await asyncio.to_thread(app[TRACING].shutdown)  # the spans still queued are sent


def build_app(config: SidecarConfig) -> web.Application:
    client_key = auth.client_key_middleware(config)
    app = web.Application(middlewares=[traced, errors_and_access_log, *([client_key] if client_key else [])],
                          client_max_size=config.max_body_bytes)
    app[STATE] = state = SidecarState(config)
    app[TRACING] = Tracing(config.tracing, config.served_model_name)
    app[METRICS] = Metrics()
    app[METRICS].in_flight.set_function(lambda: state.in_flight)  # read at scrape time
    app.cleanup_ctx.append(_upstreams)
    app.on_response_prepare.append(close_when_draining)
    expect = auth.expect_handler(config)
    app.router.add_post(wire.CHAT, handlers.chat, expect_handler=expect)
    app.router.add_post(wire.COMPLETIONS, handlers.completions, expect_handler=expect)
    app.router.add_post(wire.GENERATE, handlers.generate, expect_handler=expect)
    app.router.add_post(wire.MESSAGES, handlers.messages, expect_handler=expect)
    app.router.add_post(wire.MESSAGES_COUNT_TOKENS, handlers.count_tokens, expect_handler=expect)
    app.router.add_post(wire.RESPONSES, handlers.responses, expect_handler=expect)
    app.router.add_get(wire.RESPONSES + "/{response_id}", handlers.stored_response)
    app.router.add_post(wire.RESPONSES + "/{response_id}/cancel", handlers.stored_response, expect_handler=expect)
    app.router.add_get(wire.MODELS, handlers.models, expect_handler=expect)
    app.router.add_get(wire.HEALTH, handlers.health)
    app.router.add_get(wire.LIVE, handlers.live)
    app.router.add_get(wire.DRAINED, handlers.drained)
    app.router.add_get(wire.METRICS, handlers.metrics)
    return app
