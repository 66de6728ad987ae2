"""HTTP handlers: read and check the request, hand it to ``flows``, nothing else.

Everything refused here (body size, JSON, headers, concurrency) is refused before any leg is
sent, so a bad request never costs an upstream connection.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from disagg_sidecar import allowlist, plan, wire
from disagg_sidecar.errors import SidecarError, bad_request
from disagg_sidecar.exchange import Context
from disagg_sidecar.flows import Flows
from disagg_sidecar.keys import FLOWS, METRICS, STATE, UPSTREAM
from disagg_sidecar.logs import request_id_var
from disagg_sidecar.metrics import CONTENT_TYPE

# Request ids end up in engine request ids and response ids: keep them printable and short.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_TRACESTATE_MAX = 512


async def read_json(request: web.Request) -> tuple[bytes, Any]:
    limit = request.app[STATE].config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise SidecarError(413, f"request body larger than {limit} bytes", type_="RequestEntityTooLargeError")
    if request.content_type != "application/json":
        raise bad_request(f"Content-Type must be application/json (got {request.content_type!r})")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise SidecarError(413, f"request body larger than {limit} bytes",
                           type_="RequestEntityTooLargeError") from exc
    try:
        return raw, json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc


def context(request: web.Request, body: Any) -> Context:
    """Request id, forwarded headers and the prefill target; the header checks run here."""
    ids = request.headers.getall(wire.REQUEST_ID, [])
    if len(ids) > 1 or (ids and not _REQUEST_ID.match(ids[0])):
        raise bad_request(f"{wire.REQUEST_ID} must be one value of 1-128 characters [A-Za-z0-9._:-]", wire.REQUEST_ID)
    body_id = body.get("request_id") if isinstance(body, dict) else None
    if not ids and isinstance(body_id, str) and _REQUEST_ID.match(body_id):
        ids = [body_id]  # what vLLM itself uses when there is no header
    request_id = ids[0] if ids else uuid.uuid4().hex
    headers = {wire.REQUEST_ID: request_id}
    traceparent = request.headers.get(wire.TRACEPARENT)
    if traceparent and _TRACEPARENT.match(traceparent):  # an invalid one is dropped, as W3C says
        headers[wire.TRACEPARENT] = traceparent
        if (tracestate := request.headers.get(wire.TRACESTATE)) and len(tracestate) <= _TRACESTATE_MAX:
            headers[wire.TRACESTATE] = tracestate
    state = request.app[STATE]
    target = None
    if state.config.prefill.trust_prefiller_header:
        target = allowlist.select_prefill(request.headers.getall(wire.PREFILLER_HOST_PORT, []),
                                          request.app[UPSTREAM].prefill.endpoints())
    return Context(request_id, headers, target)


async def _serve(request: web.Request, api: plan.Api) -> web.StreamResponse:
    state = request.app[STATE]
    # Check and reserve the slot with no await in between: a slot taken only after the body is
    # read would let any number of slow uploads pass the check together.
    if not state.try_reserve():
        request.app[METRICS].rejected.labels("concurrency").inc()
        raise SidecarError(503, "too many concurrent requests", type_="ServiceUnavailableError",
                           headers={"Retry-After": "1"})
    try:
        raw, body = await read_json(request)
        if api == "generate":
            plan.check_generate_request(body)
        else:
            plan.check_openai_request(api, body)
        ctx = context(request, body)
        request_id_var.set(ctx.request_id)
        flows: Flows = request.app[FLOWS]
        try:
            if api == "chat":
                return await flows.chat(request, raw, body, ctx)
            if api == "completions":
                return await flows.completions(request, raw, body, ctx)
            return await flows.generate(request, body, ctx)
        except (asyncio.CancelledError, ConnectionResetError):
            request.app[UPSTREAM].abort(ctx.inflight)  # the client is gone
            raise
    finally:
        state.release()


async def chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions")


async def generate(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "generate")


async def models(request: web.Request) -> web.Response:
    """The decode engine's model list (the served name every tier shares)."""
    up = request.app[UPSTREAM]
    try:
        status, body = await up.get_json(up.decode_url, wire.MODELS)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise SidecarError(503, f"The decode engine is not reachable: {exc}", type_="ServiceUnavailableError",
                           headers={"Retry-After": "1"}) from exc
    return web.Response(body=body, status=status, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    reasons = request.app[STATE].not_ready()
    if reasons:
        return web.json_response({"status": "not ready", "reasons": reasons}, status=503)
    return web.json_response({"status": "ready"})


async def live(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})
