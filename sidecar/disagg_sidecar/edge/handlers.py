"""HTTP handlers: read and check the request, hand it to ``flows``, nothing else.

Everything refused here (body size, JSON, headers, concurrency) is refused before any leg is
sent, so a bad request never costs an upstream connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
import zlib
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestPayloadError

from disagg_sidecar.edge import allowlist
from disagg_sidecar.edge import bodycheck
from disagg_sidecar.plan import decisions
from disagg_sidecar.plan.request import RequestPlan, plan_request
from disagg_sidecar import wire
from disagg_sidecar.budget import Reservation
from disagg_sidecar.errors import SidecarError, bad_request
from disagg_sidecar.pipeline.context import Context, request_context
from disagg_sidecar.pipeline.flows import Flows
from disagg_sidecar.keys import FLOWS, METRICS, SCRAPE, STATE, UPSTREAM
from disagg_sidecar.logs import request_id_var
from disagg_sidecar.metrics import CONTENT_TYPE, api_var

log = logging.getLogger(__name__)

# Request ids end up in engine request ids and response ids: keep them printable and short.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_TRACESTATE_MAX = 512


def valid_traceparent(value: str) -> bool:
    """W3C trace context: the shape, and no all-zero trace or parent id, no version ff."""
    if not _TRACEPARENT.match(value):
        return False
    version, trace, parent, _ = value.split("-")
    return version != "ff" and trace != "0" * 32 and parent != "0" * 16


def trace_headers(request: web.Request) -> dict[str, str]:
    """The client's trace context the legs carry (and the request's span continues): an invalid
    ``traceparent`` is dropped, as W3C says, and ``tracestate`` goes only with a valid one."""
    traceparent = request.headers.get(wire.TRACEPARENT)
    if not traceparent or not valid_traceparent(traceparent):
        return {}
    headers = {wire.TRACEPARENT: traceparent}
    if (tracestate := request.headers.get(wire.TRACESTATE)) and len(tracestate) <= _TRACESTATE_MAX:
        headers[wire.TRACESTATE] = tracestate
    return headers


def _too_large(limit: int) -> SidecarError:
    return SidecarError(413, f"request body larger than {limit} bytes (max_body_bytes)",
                        type_="RequestEntityTooLargeError")


def _over_budget() -> SidecarError:
    return SidecarError(503, "the sidecar's memory budget for request bodies is in use (limits.memory_budget_bytes)",
                        type_="ServiceUnavailableError", headers={"Retry-After": "1"})


async def read_body(request: web.Request, reservation: Reservation) -> bytes:
    """The body as it arrives, decompressed bytes counted against ``max_body_bytes`` and the memory
    budget (4 bytes per body byte: what holding and parsing it may cost) chunk by chunk, all
    within ``limits.body_read_seconds``."""
    config = request.app[STATE].config
    limit = config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    if request.content_type != "application/json":
        raise bad_request(f"Content-Type must be application/json (got {request.content_type[:100]!r})")
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(config.limits.body_read_seconds):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                if not reservation.grow_to(bodycheck.BOUND_FACTOR * size):
                    raise _over_budget()
                parts.append(chunk)
    except TimeoutError:
        raise SidecarError(408, f"the request body did not arrive within {config.limits.body_read_seconds:g} s "
                                "(limits.body_read_seconds)", type_="RequestTimeoutError") from None
    except (RequestPayloadError, BadHttpMessage, zlib.error, EOFError) as exc:  # bad compression or chunking
        raise bad_request(f"the request body could not be read: {type(exc).__name__}") from None
    return b"".join(parts)


async def read_json(request: web.Request, reservation: Reservation) -> tuple[bytes, Any]:
    raw = await read_body(request, reservation)
    depth = request.app[STATE].config.limits.max_json_depth
    if not reservation.grow_to(bodycheck.check(raw, depth)):
        raise _over_budget()
    return raw, bodycheck.loads(raw, depth)


def context(request: web.Request, body: Any) -> Context:
    """Request id, forwarded headers and the prefill target; the header checks run here. The
    access log reads it (``request_context``): where the request's prompt was prefilled."""
    ids = request.headers.getall(wire.REQUEST_ID, [])
    if len(ids) > 1 or (ids and not _REQUEST_ID.match(ids[0])):
        raise bad_request(f"{wire.REQUEST_ID} must be one value of 1-128 characters [A-Za-z0-9._:-]", wire.REQUEST_ID)
    body_id = body.get("request_id") if isinstance(body, dict) else None
    if not ids and isinstance(body_id, str) and _REQUEST_ID.match(body_id):
        ids = [body_id]  # what vLLM itself uses when there is no header
    # Clients may repeat ids; the engines get one of their own per request (aborts go by it).
    request_id, engine_id = (ids[0], f"{ids[0]}-{uuid.uuid4().hex[:12]}") if ids else (uuid.uuid4().hex, None)
    headers = {wire.REQUEST_ID: request_id, **trace_headers(request)}
    state = request.app[STATE]
    target = None
    if state.config.prefill.trust_prefiller_header:
        target = allowlist.select_prefill(request.headers.getall(wire.PREFILLER_HOST_PORT, []),
                                          request.app[UPSTREAM].pools["prefill"].endpoints(),
                                          state.config.prefill.pool_port)
    ctx = Context(request_id, headers, target, engine_id=engine_id)
    request_context.set(ctx)
    return ctx


async def _serve(request: web.Request, api: decisions.Api) -> web.StreamResponse:
    state = request.app[STATE]
    if state.full():  # refused before reading a byte of the body when no slot is free now
        raise _no_slot(request)
    api_var.set(api)
    reservation = Reservation(state.budget)
    state.start_reading()
    try:
        # A slow upload holds no slot (only its connection and its share of the memory budget,
        # both bounded): the slot is taken once the body is in and checked, with no await between
        # the check and the take.
        try:
            raw, body = await read_json(request, reservation)
            plan = plan_request(api, body, state.capabilities(), state.config)
            ctx = context(request, body)
            ctx.reservation = reservation
        finally:
            state.done_reading()
        if not state.try_reserve():
            raise _no_slot(request)
        try:
            request_id_var.set(ctx.request_id)
            return await _run(request, plan, raw, body, ctx)
        finally:
            state.release()
    finally:
        reservation.release()


def _no_slot(request: web.Request) -> SidecarError:
    request.app[METRICS].rejected.labels("concurrency").inc()
    return SidecarError(503, "too many concurrent requests", type_="ServiceUnavailableError",
                        headers={"Retry-After": "1"})


async def _run(request: web.Request, plan: RequestPlan, raw: bytes, body: Any, ctx: Context) -> web.StreamResponse:
    flows: Flows = request.app[FLOWS]
    try:
        if plan.api == "generate":
            return await flows.generate(request, body, plan, ctx)
        return await flows.serve(request, raw, body, plan, ctx)
    except (asyncio.CancelledError, ConnectionResetError):
        request.app[UPSTREAM].abort(ctx.inflight)  # the client is gone
        raise


async def chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions")


async def generate(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "generate")


async def messages(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "messages")


async def count_tokens(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "count_tokens")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "responses")


# vLLM's response ids (``resp_<hex>``, or a client's ``request_id``): a path segment of printable characters.
_RESPONSE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,160}$")
_STORED_QUERY = ("stream", "starting_after")  # what vLLM's GET /v1/responses/{id} reads


async def stored_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: the decode engine in this
    pod answers, as a coupled server with the same response store does (Disagg's pods run without
    one: vLLM's 404 naming the id; decisions.responses_route)."""
    api_var.set("responses")
    response_id = request.match_info["response_id"]
    if not _RESPONSE_ID.match(response_id):
        raise SidecarError(404, f"Response with id '{response_id[:160]}' not found.", type_="invalid_request_error",
                           param="response_id")
    path = f"{wire.RESPONSES}/{response_id}" + ("/cancel" if request.method == "POST" else "")
    query = {k: v for k in _STORED_QUERY if (v := request.query.get(k)) is not None}
    state = request.app[STATE]
    if not state.try_reserve():
        raise _no_slot(request)
    ctx = context(request, None)
    try:
        body = await request.app[FLOWS].alone.stored(path, query, ctx)
    finally:
        state.release()
    return web.Response(body=body, content_type="application/json", headers=ctx.response_headers())


async def models(request: web.Request) -> web.Response:
    """The decode engine's model list (the served name every tier shares), checked to be one: an
    answer that is not is a 502 whose detail stays in the log. It takes a request slot like any
    other call that costs an upstream connection."""
    state = request.app[STATE]
    if not state.try_reserve():
        raise _no_slot(request)
    try:
        up = request.app[UPSTREAM]
        try:
            status, body = await up.get_json(up.decode_url, wire.MODELS)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("GET %s on the decode engine failed: %r", wire.MODELS, exc)
            raise SidecarError(503, "The decode engine is not reachable", type_="ServiceUnavailableError",
                               headers={"Retry-After": "1"}) from exc
    finally:
        state.release()
    if status != 200:
        log.warning("GET %s on the decode engine answered %d: %r", wire.MODELS, status, body[:300])
        raise SidecarError(502, f"The decode engine answered GET /v1/models with status {status}",
                           type_="BadGatewayError")
    try:
        listed = json.loads(body)
    except ValueError:
        listed = None
    if not isinstance(listed, dict) or not isinstance(listed.get("data"), list):
        log.warning("GET %s on the decode engine answered no model list: %r", wire.MODELS, body[:300])
        raise SidecarError(502, "The decode engine answered GET /v1/models with an invalid answer",
                           type_="BadGatewayError")
    return web.Response(body=body, status=200, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if reasons := state.not_ready():
        return web.json_response({"status": "not ready", "reasons": reasons}, status=503)
    if degraded := state.degraded():
        return web.json_response({"status": "ready", "degraded": degraded})
    return web.json_response({"status": "ready"})


async def live(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


SIGTERM_ALLOWANCE_SECONDS = 5.0  # kubelet signals the sidecar and runs the hook at about the same time
# Kubelet sends one, from the node's address; an open path must not let anyone hold many
# connections, nor use up a shared allowance (which would turn kubelet's hook away): per address.
MAX_DRAINED_WAITERS = 1


async def drained(request: web.Request) -> web.Response:
    """The decode engine's preStop hook (``GET /health/drained``, the operator's
    ``objects/deployments.py``): answers once this sidecar is stopping and nothing it serves is in
    flight, so kubelet signals vLLM only when no leg can reach it any more (at most the sidecar's
    ``limits.stop_seconds``: it stops then). Asked while the sidecar is not stopping, it answers 409
    after ``SIGTERM_ALLOWANCE_SECONDS`` (the hook's request may come before the sidecar's SIGTERM);
    beyond ``MAX_DRAINED_WAITERS`` at once from one address, 429 at once (other addresses, the
    node's kubelet among them, are not affected)."""
    state = request.app[STATE]
    source = request.remote or ""
    if state.drained_waiters[source] >= MAX_DRAINED_WAITERS:
        raise SidecarError(429, f"{MAX_DRAINED_WAITERS} request(s) from this address already wait on /health/drained")
    state.drained_waiters[source] += 1
    try:
        await asyncio.wait_for(state.stopping.wait(), SIGTERM_ALLOWANCE_SECONDS)
        await state.drained.wait()
    except asyncio.TimeoutError:
        raise SidecarError(409, "this sidecar is not stopping: /health/drained is the decode engine's "
                                "preStop hook") from None
    finally:
        state.drained_waiters[source] -= 1
        if not state.drained_waiters[source]:
            del state.drained_waiters[source]
    return web.json_response({"status": "drained"})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=await request.app[SCRAPE].render(), headers={"Content-Type": CONTENT_TYPE})
