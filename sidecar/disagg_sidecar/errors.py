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
                 code: str | None = None, headers: Mapping[str, str] | None = None, body: bytes | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        self.body = body if body is not None else error_bytes(status, message, type_, param, code)

    @classmethod
    def upstream(cls, status: int, body: bytes, leg: str) -> SidecarError:
        """An engine's own 4xx answer, passed through unchanged when it is already OpenAI-shaped.
        A 5xx body (tracebacks, addresses) never reaches the client."""
        if status >= 500:
            return cls(502, f"The {leg} tier failed (status {status})", type_="BadGatewayError")
        try:
            parsed = json.loads(body)
            if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
                return cls(status, str(parsed["error"].get("message")), body=body)
        except ValueError:
            pass
        text = body.decode(errors="replace")[:2000]
        return cls(status, f"{leg} leg answered {status}: {text}")


def bad_request(message: str, param: str | None = None) -> SidecarError:
    return SidecarError(400, message, type_="BadRequestError", param=param)
