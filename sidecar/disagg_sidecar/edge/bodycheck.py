"""A request body checked before and while it is parsed (pure functions over bytes).

``json.loads`` alone turns hostile bodies into 500s or into memory: 10,000 nested arrays raise
RecursionError, a lone ``\\ud800`` escape parses but fails when re-encoded for a leg, UTF-16 is
silently accepted, and 16 MiB of ``{},`` becomes 5.6 million dicts (about 450 MB). So, in C-speed
passes over the bytes and before anything is parsed:
- the body must be UTF-8 (no BOM, no NUL, valid sequences, no encoded surrogates);
- no ``\\uD800``-``\\uDFFF`` escape outside a valid pair;
- nesting at most ``max_depth``;
- what parsing would cost (``parse_cost``) must fit ``memory_bound(size)``; beyond it the body
  is refused instead of parsed.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from disagg_sidecar.errors import SidecarError, bad_request

# Per parsed value, bytes of Python objects beyond the body's own bytes (measured with
# tracemalloc on lists of empty dicts / empty lists / short strings / ints, rounded up).
OBJECT_BYTES = 200  # a dict with a few keys (184-232; 64 empty) and its slot in the parent
ARRAY_BYTES = 80  # a list (56) plus its slot and growth
ITEM_BYTES = 48  # per comma or colon (a value or a key): its object (int 32, float 24), slot and growth
STRING_BYTES = 64  # per string, beyond its characters: the str header (49+) rounded by the allocator
PARSE_BASE_BYTES = 32 * 1024 * 1024  # the fixed part of the per-request bound
BOUND_FACTOR = 4  # the per-byte part

_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]")  # starts with a literal: a fast scan
_SURROGATE_ESCAPE = re.compile(rb"(\\+)u[dD]([89a-fA-F])[0-9a-fA-F]{2}")
_ESCAPE4 = re.compile(rb"\\u[dD][89abAB]")  # a character outside the BMP: 4 bytes per char in a str
_ESCAPE2 = re.compile(rb"\\u(?!00[0-9a-fA-F]{2})")  # past Latin-1: 2 bytes per char
_BELOW_WIDE = bytes(range(0xC4))  # ASCII, continuation bytes and the leads of Latin-1 characters
_BRACKETS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BOMS = (codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)  # UTF-32 BOMs start with these too
_VALIDATE_CHUNK = 1 << 20
_WINDOW = 1 << 20


@dataclass(frozen=True)
class Shape:
    """What the body holds, counted without parsing it."""

    size: int
    objects: int
    arrays: int
    items: int  # upper bound on the values and keys
    strings: int
    width: int  # bytes per character of the widest string it decodes to (1, 2 or 4)

    def parse_cost(self) -> int:
        """Bytes ``json.loads`` holds at its peak beyond the body: the decoded document (one str,
        ``width`` bytes per character), the strings parsed out of it (as wide at most) and the
        value objects."""
        return (4096 + 2 * self.width * self.size + self.objects * OBJECT_BYTES + self.arrays * ARRAY_BYTES
                + self.items * ITEM_BYTES + self.strings * STRING_BYTES)


def memory_bound(size: int) -> int:
    """What one request may cost to read and parse (the body itself included)."""
    return BOUND_FACTOR * size + PARSE_BASE_BYTES


def check_utf8(raw: bytes) -> None:
    if raw.startswith(_BOMS) or b"\x00" in raw[:4]:
        raise bad_request("the request body must be JSON encoded as UTF-8 (no byte order mark, not UTF-16/32)")
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    view = memoryview(raw)
    try:  # in slices: validating must not build a str as large as the body
        for start in range(0, len(raw), _VALIDATE_CHUNK):
            decoder.decode(view[start:start + _VALIDATE_CHUNK])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte offset {exc.start + start})") from None


def check_surrogates(raw: bytes) -> None:
    """Every ``\\uD800``-``\\uDBFF`` escape followed at once by a ``\\uDC00``-``\\uDFFF`` one, and
    those only after it (an escape counts when its backslash is not itself escaped)."""
    if not _SURROGATE_HINT.search(raw):
        return
    pending = -1  # where the low half of the last high surrogate must start
    for match in _SURROGATE_ESCAPE.finditer(raw):
        if len(match.group(1)) % 2 == 0:
            continue  # an escaped backslash, then text
        start, low = match.end(1) - 1, match.group(2) in b"cdefCDEF"
        if pending != -1:
            if low and start == pending:
                pending = -1
                continue
            _lone(pending - 6)
        if low:
            _lone(start)
        pending = match.end()
    if pending != -1:
        _lone(pending - 6)


def _lone(offset: int) -> None:
    raise bad_request(f"the request body has a lone UTF-16 surrogate escape at byte offset {offset}")


def depth_exceeds(skeleton: bytes, max_depth: int) -> bool:
    """``skeleton`` is the body's brackets alone, as ``(`` and ``)``: each pass removes the
    innermost pairs, one level; a balanced skeleton is empty after exactly its depth passes."""
    if b"(" * (max_depth + 1) in skeleton:
        return True
    for _ in range(max_depth):
        shorter = skeleton.replace(b"()", b"")
        if shorter == skeleton:
            return False  # empty, or unbalanced (the parser says so)
        skeleton = shorter
    return b"()" in skeleton


def structure(raw: bytes) -> tuple[bytes, int]:
    """``raw`` without its strings, in C-speed passes: escaped backslashes and quotes go first
    (left to right, as JSON pairs them), then the quotes delimit the strings; in windows, so the
    pieces of a body of many short strings never exist all at once. Also: how many strings."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw
    outside: list[bytes] = []
    inside = False
    for start in range(0, len(text), _WINDOW):
        pieces = text[start:start + _WINDOW].split(b'"')
        outside.append(b"".join(pieces[int(inside)::2]))
        inside ^= len(pieces) % 2 == 0  # an odd number of quotes in the window
    return b"".join(outside), text.count(b'"') // 2


def width(raw: bytes) -> int:
    """Bytes per character of the widest str parsing ``raw`` makes (CPython stores 1, 2 or 4)."""
    wide = raw.translate(None, _BELOW_WIDE)
    chars = 4 if wide and max(wide) >= 0xF0 else 2 if wide else 1
    if chars < 4 and b"\\u" in raw:
        chars = 4 if _ESCAPE4.search(raw) else max(chars, 2) if _ESCAPE2.search(raw) else chars
    return chars


def shape(raw: bytes, max_depth: int) -> Shape:
    """Counts of what parsing ``raw`` would build; raises a 400 past ``max_depth``."""
    bare, strings = structure(raw)  # strings cannot hide brackets or commas any more
    skeleton = bare.translate(_BRACKETS, _NOT_BRACKETS)
    if depth_exceeds(skeleton, max_depth):
        raise bad_request(f"the request body nests deeper than {max_depth} levels (limits.max_json_depth)")
    items = bare.count(b",") + bare.count(b":") + 1
    return Shape(len(raw), bare.count(b"{"), bare.count(b"["), items, strings, width(raw))


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    """A JSON number as Python's float, refused where it is none (``1e400`` would be infinity,
    which the engines get as ``Infinity``, no JSON)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def check(raw: bytes, max_depth: int) -> int:
    """Every check that needs no parsing; returns what holding and parsing ``raw`` costs at its peak."""
    check_utf8(raw)
    # At least this many strings (a quote after a backslash may end one): refused on counts alone.
    cost = len(raw) + (raw.count(b'"') - raw.count(b'\\"')) // 2 * STRING_BYTES
    if cost <= memory_bound(len(raw)):
        cost = len(raw) + shape(raw, max_depth).parse_cost()
    if cost > memory_bound(len(raw)):
        raise SidecarError(
            413, f"the request body would take about {cost >> 20} MiB to parse; at most {BOUND_FACTOR} x its size "
                 f"+ {PARSE_BASE_BYTES >> 20} MiB ({memory_bound(len(raw)) >> 20} MiB) is allowed: "
                 "send fewer JSON values", type_="RequestEntityTooLargeError")
    check_surrogates(raw)
    return cost


def loads(raw: bytes, max_depth: int) -> Any:
    """The body parsed (after ``check``); a parse error is a 400."""
    try:
        return json.loads(raw, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {max_depth} levels (limits.max_json_depth)") from None
    except ValueError as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise bad_request(f"the request body is not valid JSON: {str(exc)[:200]}") from None
