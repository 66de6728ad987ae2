"""Server-sent events: parsing an upstream's stream, writing the client's, and compact JSON."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from disagg_sidecar import wire

Chunk = dict[str, Any]


class SSEParser:
    """Incremental parser: ``feed(bytes)`` returns the ``data`` payloads of complete events."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        split_crlf = self._buf.endswith(b"\r")
        self._buf += data
        if split_crlf or b"\r" in data:
            self._buf = self._buf.replace(b"\r\n", b"\n")  # a CRLF may be split across reads
        *events, self._buf = self._buf.split(b"\n\n")
        return [p for p in map(_payload, events) if p is not None]

    def flush(self) -> list[bytes]:
        rest, self._buf = self._buf, b""
        payload = _payload(rest)
        return [payload] if payload is not None else []


def _payload(event: bytes) -> bytes | None:
    lines = [line[5:].removeprefix(b" ").rstrip(b"\r") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def sse_json(obj: Any) -> bytes:
    return sse(dumps(obj))


def dumps(obj: Any) -> bytes:
    """Compact JSON, as the engines write it: the sidecar's one definition."""
    return dumps_text(obj).encode()


def dumps_text(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


DONE_EVENT = sse(wire.SSE_DONE)


def split_events(payloads: Iterable[bytes]) -> tuple[list[Chunk], bool]:
    """Decode SSE payloads; returns the JSON events and whether ``[DONE]`` was among them."""
    done = False
    events = []
    for p in payloads:
        if p.strip() == wire.SSE_DONE:
            done = True
        else:
            events.append(json.loads(p))
    return events, done
