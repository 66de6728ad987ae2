"""HTTP routes of the engine extension: thin functions that find the serving object on
``app.state``, call one method and turn its result into a response."""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from disagg_engine.capabilities import ABORT_PATH
from disagg_engine.protocol import DisaggGenerateRequest
from disagg_engine.sessions import CHAT_SESSION_PATH, COMPLETIONS_SESSION_PATH, SessionApi, SessionError
from disagg_engine.vllm_compat import (
    ErrorResponse,
    GenerateResponseBase,
    load_aware_call,
    validate_json_request,
    with_cancellation,
)
from disagg_sidecar import wire

router = APIRouter()
abort_router = APIRouter()
# Aborts run after the response; the loop keeps only weak references to tasks.
_background: set[asyncio.Task] = set()


def _error(status: HTTPStatus, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": status.phrase.replace(" ", ""), "param": None, "code": status.value}},
        status_code=status.value,
    )


@router.post(wire.GENERATE, dependencies=[Depends(validate_json_request)])
@with_cancellation
@load_aware_call
async def generate(request: DisaggGenerateRequest, raw_request: Request):
    serving = raw_request.app.state.disagg_serving_tokens
    if serving is None:
        return _error(HTTPStatus.NOT_IMPLEMENTED, "this server does not serve /inference/v1/generate")
    result = await serving.serve_tokens(request, raw_request)
    if isinstance(result, ErrorResponse):
        return JSONResponse(result.model_dump(), status_code=result.error.code)
    if isinstance(result, GenerateResponseBase):
        return JSONResponse(result.model_dump())
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


@router.get(wire.CAPABILITIES)
async def get_capabilities(raw_request: Request):
    state = raw_request.app.state
    caps = getattr(state, "disagg_capabilities", None)
    if caps is None:
        return _error(HTTPStatus.NOT_FOUND,
                      "the disagg engine extension serves nothing here (no generate engine, no derender sessions)")
    if getattr(state, "disagg_sessions", None) is not None:
        return JSONResponse({**caps, "live_derender_sessions": state.disagg_sessions.live})
    return JSONResponse({**caps, "live_derender_requests": state.disagg_serving_tokens.live_derender_requests})


@router.post(CHAT_SESSION_PATH)
async def chat_session(raw_request: Request):
    return await _session(raw_request, "chat")


@router.post(COMPLETIONS_SESSION_PATH)
async def completions_session(raw_request: Request):
    return await _session(raw_request, "completions")


async def _session(raw_request: Request, api: SessionApi):
    sessions = getattr(raw_request.app.state, "disagg_sessions", None)
    if sessions is None:
        return _error(HTTPStatus.NOT_FOUND, "derender sessions run on a render server (launch render) with the "
                                            "disagg extension")
    try:
        request, lines = await sessions.open(raw_request.stream(), api)
    except SessionError as exc:
        return _error(HTTPStatus(exc.status), str(exc))
    return DuplexResponse(sessions.stream(request, lines), media_type="text/event-stream")


class DuplexResponse(StreamingResponse):
    """A streamed answer that leaves the request body to the handler: Starlette's own (ASGI spec
    below 2.4, as uvicorn reports) reads the body concurrently to watch for a disconnect, which
    would swallow the session's lines. A disconnect still ends the session: the body reader sees it."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            raise ClientDisconnect() from None
        finally:
            await self.body_iterator.aclose()


async def abort_requests(raw_request: Request):
    try:
        body = await raw_request.json()
    except json.JSONDecodeError as exc:
        return _error(HTTPStatus.BAD_REQUEST, f"JSON decode error: {exc}")
    if raw_request.app.state.engine_client is None:
        return _error(HTTPStatus.NOT_FOUND, "this server runs no engine requests")
    ids = body.get("request_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return _error(HTTPStatus.BAD_REQUEST, "body must be {\"request_ids\": [str, ...]}")
    task = asyncio.create_task(raw_request.app.state.engine_client.abort(ids))
    _background.add(task)
    task.add_done_callback(_background.discard)
    return Response(status_code=200)


abort_router.add_api_route(ABORT_PATH, abort_requests, methods=["POST"])


def abort_route_missing(app: FastAPI) -> bool:
    return not any(getattr(r, "path", None) == ABORT_PATH for r in app.routes)
