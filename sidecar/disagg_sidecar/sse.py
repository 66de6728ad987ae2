"""Server-sent events: parsing an upstream's stream, writing the client's, and compact JSON."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import orjson

from disagg_sidecar import wire

Chunk = dict[str, Any]


class EventTooLarge(ValueError):
    """An upstream event longer than the parser's bound, or no event separator within it."""


class SSEParser:
    """Incremental parser: ``feed(bytes)`` returns the ``data`` payloads of complete events. With
    ``max_event``, an incomplete event that grows past it raises ``EventTooLarge`` (the buffer is
    what an upstream without separators would make the sidecar hold)."""

    def __init__(self, max_event: int | None = None) -> None:
        self._buf = b""
        self._parts: list[bytes] = []  # reads with no event end in them yet, joined once one comes
        self._size = 0
        self.max_event = max_event

    def feed(self, data: bytes) -> list[bytes]:
        return [p for p in map(payload, self.events(data)) if p is not None]

    def events(self, data: bytes) -> list[bytes]:
        """The complete events ``data`` ends, as written (their fields unread: ``payload``, ``field``)."""
        last = (self._parts[-1] if self._parts else self._buf)[-1:]
        if b"\n\n" not in data and b"\r" not in data and last + data[:1] != b"\n\n" and last != b"\r":
            # No event ends here: kept as it is (a long event grows linearly, not by a copy per read).
            self._parts.append(data)
            self._size += len(data)
            if self.max_event is not None and len(self._buf) + self._size > self.max_event:
                raise EventTooLarge(f"an event of more than {self.max_event} bytes")
            return []
        if self._parts:
            self._buf = b"".join([self._buf, *self._parts])
            self._parts, self._size = [], 0
        split_crlf = self._buf.endswith(b"\r")
        self._buf += data
        if split_crlf or b"\r" in data:
            self._buf = self._buf.replace(b"\r\n", b"\n")  # a CRLF may be split across reads
        *events, self._buf = self._buf.split(b"\n\n")
        if self.max_event is not None and (len(self._buf) > self.max_event
                                           or any(len(e) > self.max_event for e in events)):
            raise EventTooLarge(f"an event of more than {self.max_event} bytes")
        return events

    @property
    def pending(self) -> bool:
        """Bytes of an event not complete yet (other than blank lines)."""
        return bool(self._buf.strip()) or any(p.strip() for p in self._parts)

    def discard(self) -> None:
        """Drop what is buffered: a failed stream's frames may outlive it in a reference cycle
        (its exception's traceback) until the garbage collector runs."""
        self._buf, self._parts, self._size = b"", [], 0

    def flush(self) -> list[bytes]:
        rest, self._buf = b"".join([self._buf, *self._parts]), b""
        self._parts, self._size = [], 0
        data = payload(rest)
        return [data] if data is not None else []


def payload(event: bytes) -> bytes | None:
    """The ``data`` of an event (its lines joined), None without any."""
    lines = [line[5:].removeprefix(b" ").rstrip(b"\r") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def field(event: bytes, name: bytes) -> bytes | None:
    """The value of an event's first field ``name`` (``name: value``), None without one."""
    head = name + b":"
    for line in event.split(b"\n"):
        if line.startswith(head):
            return line[len(head):].removeprefix(b" ").rstrip(b"\r")
    return None


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def sse_json(obj: Any) -> bytes:
    return sse(dumps(obj))


def dumps(obj: Any) -> bytes:
    """Compact JSON, as the engines write it: the sidecar's one definition. orjson writes what
    vLLM's pydantic writes (floats too: ``0.00001``, not ``1e-05``) at a tenth of ``json``'s CPU;
    what it refuses (ints past 64 bits) is written by ``json``."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def loads(raw: bytes | str) -> Any:
    """JSON from an upstream, strictly: not UTF-8, ``NaN``/``Infinity``, lone surrogates or nesting
    past 1,024 levels raise ``ValueError`` (orjson's ``JSONDecodeError``). An int past 64 bits reads
    as a float, which every check of an int field (token ids, indices) refuses."""
    return orjson.loads(raw)


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
