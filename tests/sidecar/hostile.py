"""Hostile requests for the sidecar's tests: a raw HTTP client (it sends what no HTTP library
would) and the bad-input corpus (docs/security.md, "Sidecar limits"), generated deterministically from a seed."""

from __future__ import annotations

import gzip
import http.client
import json
import random
import socket
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# -- a raw HTTP client (the corpus sends what no HTTP library would) --------------------------------

@dataclass
class Answer:
    status: int | None
    headers: dict[str, str]
    body: bytes
    error: str = ""

    def openai_error(self) -> dict | None:
        """The ``error`` object when the body is an OpenAI-shaped error of the same status."""
        try:
            data = json.loads(self.body)
        except ValueError:
            return None
        error = data.get("error") if isinstance(data, dict) else None
        if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
            return None
        return error if error["code"] == self.status and isinstance(error["message"], str) else None


def send_raw(url: str, data: bytes, timeout: float = 30) -> Answer:
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the whole body was read: the answer is waiting
        resp = http.client.HTTPResponse(sock)
        try:
            resp.begin()
            return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        except (http.client.HTTPException, OSError) as exc:
            return Answer(None, {}, b"", f"{type(exc).__name__}: {exc}")
    finally:
        sock.close()


def request(path: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: sidecar", "Connection: close"]
    headers = {"Content-Type": "application/json", **(headers or {})}
    if "Content-Length" not in headers and "Transfer-Encoding" not in headers:
        headers["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body


# -- the corpus ------------------------------------------------------------------------------------

VALID_CHAT = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
VALID_COMPLETION = {"model": "tiny-qwen3", "prompt": "Hello", "max_tokens": 4}
FIELDS = ["model", "messages", "stop", "cache_salt", "n", "stream", "max_tokens", "temperature", "user",
          "tools", "logit_bias", "response_format", "seed", "prompt"]


def _nested(rng: random.Random, depth: int) -> bytes:
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}"), (b"[0,", b"]")])
    return opener * depth + b"1" + closer * depth


def _lone_surrogate(rng: random.Random) -> bytes:
    high, low = f"\\ud{rng.randrange(0x800, 0xc00):03x}", f"\\ud{rng.randrange(0xc00, 0x1000):03x}"
    return rng.choice([high, low, low + high, high + "x", "ok " + high, high + "\\u0041"]).encode()


def _bad_utf8(rng: random.Random) -> bytes:
    return rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xe2\x82",
                       b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\xfe\xfe"])


def _with_field(base: dict, field: str, raw_value: bytes) -> bytes:
    """``base`` with ``field`` set to the raw JSON ``raw_value`` (spliced, so it can be invalid)."""
    body = {k: v for k, v in base.items() if k != field}
    return json.dumps(body).encode()[:-1] + b', "' + field.encode() + b'": ' + raw_value + b"}"


def generated_cases(seed: int = 17, count: int = 300) -> list[tuple[str, bytes]]:
    """``count`` hostile requests, the same ones every run."""
    rng = random.Random(seed)
    kinds = ["depth", "surrogate", "utf8", "encoding", "n", "prompts", "legs", "json", "constant", "bigint",
             "content-type", "request-id", "http", "shape", "gzip", "type", "method"]
    cases = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        base, path = (VALID_COMPLETION, COMPLETIONS) if rng.random() < 0.3 else (VALID_CHAT, CHAT)
        field = rng.choice(FIELDS)
        headers: dict[str, str] = {}
        if kind == "depth":
            body = _with_field(base, field, _nested(rng, rng.choice([65, 100, 1000, 10_000, 100_000])))
        elif kind == "surrogate":
            body = _with_field(base, rng.choice(["stop", "cache_salt", "user", "model"]),
                               b'"' + _lone_surrogate(rng) + b'"')
        elif kind == "utf8":
            body = _with_field(base, rng.choice(["stop", "cache_salt", "user", "model"]),
                               b'"ab' + _bad_utf8(rng) + b'cd"')
        elif kind == "encoding":
            codec = rng.choice(["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-sig"])
            body = json.dumps({**base, "user": f"case {i}"}).encode(codec)
        elif kind == "n":
            body = _with_field(base, "n", rng.choice([b"1000000000", b"129", b"0", b"-1", b'"2"', b"true", b"2.5",
                                                      b"1e9", b"null1"]))
        elif kind == "prompts":
            path, body = COMPLETIONS, json.dumps({**VALID_COMPLETION, "prompt": ["p"] * rng.choice([65, 500, 5000])}
                                                 ).encode()
        elif kind == "legs":
            path, body = COMPLETIONS, json.dumps({**VALID_COMPLETION, "prompt": ["p"] * rng.randrange(9, 64),
                                                  "n": rng.randrange(8, 128)}).encode()
        elif kind == "json":
            good = json.dumps(base).encode()
            cut = rng.randrange(1, len(good) - 1)
            body = rng.choice([good[:cut], good + b"x", b"{" + good, good.replace(b":", b"", 1), b"", b"[1, 2]",
                               b'"a string"', b"null", b"{'a': 1}", good[:cut] + b"\x00" + good[cut:]])
        elif kind == "constant":
            body = _with_field(base, field, rng.choice([b"NaN", b"Infinity", b"-Infinity", b"[NaN]"]))
        elif kind == "bigint":
            body = _with_field(base, field, b"9" * rng.choice([4301, 10_000, 100_000]))
        elif kind == "content-type":
            body = json.dumps(base).encode()
            headers["Content-Type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded",
                                                  "multipart/form-data; boundary=x", "application/jsonx"])
        elif kind == "request-id":
            body = json.dumps(base).encode()
            headers["X-Request-Id"] = rng.choice(["a b", "x" * 129, "../../etc", "id;rm", "ü", "<script>", "a,b"])
        elif kind == "http":
            body = b""
        elif kind == "shape":
            n = rng.choice([200_000, 400_000, 700_000])
            item = rng.choice([b"{}", b"[]", b'{"role":"user"}', b'""', b"0.5"])
            body = b'{"model":"tiny-qwen3","messages":[' + b",".join([item] * n) + b"]}"
        elif kind == "gzip":
            headers["Content-Encoding"] = rng.choice(["gzip", "deflate", "br", "zstd", "x-unknown"])
            body = rng.choice([b"not compressed at all", gzip.compress(json.dumps(base).encode())[:-9],
                               b"\x1f\x8b\x08\x00garbage"])
        elif kind == "type":
            body = _with_field(base, rng.choice(["stream", "n"]), rng.choice([b'"yes"', b"[]", b"{}", b'"1"']))
        else:  # method / path
            method, path = rng.choice([("GET", CHAT), ("PUT", COMPLETIONS), ("DELETE", "/v1/models"),
                                       ("POST", "/v1/nothing"), ("POST", "/v1/../admin"), ("GET", "/v1/chat")])
            cases.append((f"{i}:{kind}", request(path, json.dumps(base).encode(), method=method)))
            continue
        if kind == "http":
            cases.append((f"{i}:{kind}", _malformed_http(rng)))
        else:
            cases.append((f"{i}:{kind}", request(path, body, headers)))
    return cases


def _malformed_http(rng: random.Random) -> bytes:
    good = request(CHAT, json.dumps(VALID_CHAT).encode())
    return rng.choice([
        b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\x01: <script>alert(1)</script>\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % k for k in range(200)) + b"\r\n",
        b"G\x00T / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\n Folded: continuation\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        good.replace(b"HTTP/1.1", b"HTTP/1.1 extra", 1),
        good.replace(b"\r\n", b"\n\r", 2),
    ])


def issue_cases() -> list[tuple[str, bytes]]:
    """The hand-picked cases beside the generated ones (docs/security.md, "Sidecar limits")."""
    chat = json.dumps(VALID_CHAT).encode()
    return [
        ("10,000-level nesting", request(CHAT, b"[" * 10_000 + b"]" * 10_000)),
        ("10,000-level object nesting", request(CHAT, _with_field(VALID_CHAT, "user", b'{"a":' * 10_000 + b"1"
                                                                 + b"}" * 10_000))),
        ("lone surrogate in stop", request(CHAT, _with_field(VALID_CHAT, "stop", b'"\\ud800"'))),
        ("lone surrogate in cache_salt", request(CHAT, _with_field(VALID_CHAT, "cache_salt", b'"\\udfff"'))),
        ("encoded surrogate in cache_salt", request(CHAT, _with_field(VALID_CHAT, "cache_salt", b'"\xed\xa0\x80"'))),
        ("UTF-16 body", request(CHAT, json.dumps(VALID_CHAT).encode("utf-16"))),
        ("UTF-32 body", request(CHAT, json.dumps(VALID_CHAT).encode("utf-32"))),
        ("n 1e9", request(CHAT, _with_field(VALID_CHAT, "n", b"1000000000"))),
        ("500 prompts", request(COMPLETIONS, json.dumps({**VALID_COMPLETION, "prompt": ["x"] * 500}).encode())),
        ("2 MiB of empty messages", request(CHAT, b'{"messages":[' + b",".join([b"{}"] * (2 * MiB // 3)) + b"]}")),
        ("gzip of 64 MiB", request(CHAT, gzip_bomb(64), {"Content-Encoding": "gzip"})),
        ("header echo", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Evil\x01: <secret-echo>\r\n\r\n"),
        ("X-Request-Id repeated", request(CHAT, chat, {"X-Request-Id": "a"}).replace(
            b"X-Request-Id: a\r\n", b"X-Request-Id: a\r\nX-Request-Id: b\r\n")),
    ]


def gzip_bomb(mib: int) -> bytes:
    """``mib`` MiB of zeros, gzipped (about 1 KB per MiB): one compressed block repeated, which a
    full flush makes possible (each block starts with an empty dictionary)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    zeros = bytes(MiB)
    block = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    assert deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH) == block
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    trailer = crc.to_bytes(4, "little") + (mib * MiB % 2**32).to_bytes(4, "little")
    return header + block * mib + deflate.flush() + trailer


def corpus_on(path: str) -> list[tuple[str, bytes]]:
    """The corpus's requests to the OpenAI API paths, sent to ``path`` instead (another API's)."""
    cases = []
    for name, data in issue_cases() + generated_cases():
        for api in (b"/v1/chat/completions", b"/v1/completions"):
            if data.startswith(b"POST " + api + b" "):
                cases.append((name, b"POST " + path.encode() + data[len(b"POST ") + len(api):]))
    return cases


def corpus_outcomes(url: str, engine: Any, path: str, render_path: str, refused_by: str,
                    error_of: Callable[[Answer], dict | None]) -> tuple[list[Any], int, int]:
    """``corpus_on(path)`` sent to the sidecar at ``url`` in front of the recording ``engine``
    (its ``posts()``), whose render refuses everything with the message ``refused_by``: (failures,
    refused, forwarded). Each answer must be a 4xx that ``error_of`` reads as the API's error; one
    that passed the sidecar's rules reached render only, one the sidecar refused reached nothing.
    Bytes aiohttp refuses before a route is known get the default (OpenAI) shape, nothing forwarded."""
    cases = corpus_on(path)
    assert len(cases) >= 200
    failures: list[Any] = []
    refused = forwarded = 0
    for name, data in cases:
        before = len(engine.posts())
        answer = send_raw(url, data)
        default = answer.openai_error()
        if default is not None and default["message"] == "malformed HTTP request":
            if len(engine.posts()) != before:
                failures.append((name, "malformed HTTP forwarded"))
            continue
        error = error_of(answer)
        if answer.status is None or not 400 <= answer.status < 500 or error is None:
            failures.append((name, answer.status, answer.body[:200], answer.error))
        elif error["message"] == refused_by:
            forwarded += 1
            if [c.path for c in engine.posts()[before:]] != [render_path]:
                failures.append((name, "forwarded past render"))
        elif len(engine.posts()) != before:
            failures.append((name, "forwarded although refused"))
        else:
            refused += 1
    return failures, refused, forwarded
