"""OpenAI-shaped errors (the body vLLM itself returns) and the exception that carries one.

Every failure the sidecar decides on reaches the client as
``{"error": {"message", "type", "param", "code"}}`` with the same status code, so OpenAI SDKs
raise their usual exception classes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_ or _type_for(status), "param": param,
                      "code": status if code is None else code}}


def error_bytes(status: int, message: str, type_: str | None = None, param: str | None = None,
                code: str | int | None = None) -> bytes:
    return json.dumps(error_body(status, message, type_, param, code)).encode()


def _type_for(status: int) -> str:
    try:
        name = HTTPStatus(status).phrase.replace(" ", "")
    except ValueError:
        return "Error"
    return name if name.endswith("Error") else name + "Error"


class SidecarError(Exception):
    """A request-level failure with the status, body and headers the client gets."""

    def __init__(self, status: int, message: str, *, type_: str | None = None, param: str | None = None,
                 code: str | int | None = None, headers: Mapping[str, str] | None = None, body: bytes | None = None,
                 done: bool = True):
        super().__init__(message)
        # After a stream's first byte: whether ``[DONE]`` follows the error event (as vLLM sends it);
        # not when an upstream stream ended without its own end, so no client takes it for complete.
        self.done = done
        # A leg that failed (``pipeline.failures.leg_failure``): which, and whether its tier was
        # unavailable (not a bad answer): the render failure policy reads them.
        self.leg: str | None = None
        self.unavailable = False
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        self.body = body if body is not None else error_bytes(status, message, type_, param, code)

    @classmethod
    def upstream(cls, status: int, body: bytes, leg: str) -> SidecarError:
        """An engine's answer other than 200, summarised: a 4xx in OpenAI's shape keeps its status and
        its fields (vLLM's own message, as the coupled server gives it), rebuilt from them; any other
        body (a proxy's HTML page, a traceback, pod names and addresses) never reaches the client.
        401/403 are the engine refusing the sidecar's engine key, not the client's: a 502."""
        who = "decode engine" if leg == "decode" else f"{leg} tier"
        if status in (401, 403, 407):
            return cls(502, f"The {who} refused the sidecar's engine key (status {status})", type_="BadGatewayError")
        if not 400 <= status < 500:
            return cls(502, f"The {who} failed (status {status})", type_="BadGatewayError")
        fields = openai_error_fields(body)
        if fields is None:
            return cls(status, f"The {who} refused the request (status {status})")
        message, type_, param, code = fields
        return cls(status, message, type_=type_, param=param, code=code)


def openai_error_fields(body: bytes) -> tuple[str, str | None, str | None, str | int | None] | None:
    """(message, type, param, code) of an OpenAI-shaped error body with fields of the right types,
    the message cut to ``MAX_UPSTREAM_MESSAGE`` characters; None for anything else."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    type_, param, code = error.get("type"), error.get("param"), error.get("code")
    return (error["message"][:MAX_UPSTREAM_MESSAGE], type_ if isinstance(type_, str) else None,
            param if isinstance(param, str) else None,
            code if isinstance(code, (str, int)) and not isinstance(code, bool) else None)


MAX_UPSTREAM_MESSAGE = 4096


def bad_request(message: str, param: str | None = None) -> SidecarError:
    return SidecarError(400, message, type_="BadRequestError", param=param)
