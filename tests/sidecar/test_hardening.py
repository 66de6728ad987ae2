"""Hostile clients against the real ``disagg sidecar`` process (issue 17): a bad-input corpus,
memory per request (peak RSS of the process), slow clients, and error hygiene.

The upstreams are fake recording engines (``support.fake_engine``): the point is to count what
the sidecar forwards; every request they get is answered with an OpenAI-shaped 400.
"""

from __future__ import annotations

import gzip
import http.client
import json
import random
import socket
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from disagg_engine.servers import free_port
from disagg_sidecar.keys import STATE
from tests.sidecar.support import (
    REFUSED,
    FakeEngine,
    SidecarProcess,
    fake_config,
    fake_engine,
    run_sidecar,
    sidecar_process,
    wait_for,
)

pytestmark = pytest.mark.reliability
MiB = 1 << 20
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FAKE_MESSAGE = json.loads(REFUSED)["error"]["message"]


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
    """The cases issue 17 names."""
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
    return header + block * mib + deflate.flush() + crc.to_bytes(4, "little") + (mib * MiB % 2**32).to_bytes(4, "little")


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    with fake_engine() as fake:
        yield fake


def test_bad_input_corpus(engine: FakeEngine, tmp_path: Path) -> None:
    cases = issue_cases() + generated_cases()
    assert len(cases) >= 300
    with sidecar_process(fake_config(engine), tmp_path) as sidecar:
        base = sidecar.status("VmRSS")
        statuses: Counter[int | None] = Counter()
        refused = forwarded = leaked = 0
        failures = []
        for name, data in cases:
            before = len(engine.posts())
            answer = send_raw(sidecar.url, data)
            new = len(engine.posts()) - before
            statuses[answer.status] += 1
            error = answer.openai_error()
            if answer.status is None or not 400 <= answer.status < 500 or error is None:
                failures.append((name, answer.status, answer.body[:200], answer.error))
                continue
            if error["message"] == FAKE_MESSAGE:
                forwarded += 1  # passed the sidecar's rules; the engine refused it
            else:
                refused += 1
                leaked += new
                if new:
                    failures.append((name, "forwarded although refused", new))
            for secret in (b"<secret-echo>", b"<script>", engine.url.encode(), b"Traceback"):
                if secret in answer.body:
                    failures.append((name, f"answer repeats {secret!r}"))
        assert requests.get(sidecar.url + "/health", timeout=5).status_code == 200
        after = sidecar.status("VmRSS")
        logged = sidecar.logged()
    fives = sum(v for k, v in statuses.items() if k is not None and k >= 500)
    print(f"corpus: {len(cases)} cases: {sum(v for k, v in statuses.items() if k and 400 <= k < 500)} "
          f"OpenAI-shaped 4xx, {fives} 5xx, {refused} refused by the sidecar ({leaked} upstream requests for them), "
          f"{forwarded} forwarded and refused by the engine; statuses {dict(sorted(statuses.items(), key=str))}; "
          f"RSS {base / MiB:.0f} MiB before, {after / MiB:.0f} MiB after")
    assert not failures, failures[:10]
    assert fives == 0 and leaked == 0 and refused + forwarded == len(cases)
    assert after <= base + 48 * MiB, "RSS back near its base"
    bad_lines = [line for line in logged if line["level"] in ("ERROR", "CRITICAL") or "exc" in line]
    assert not bad_lines, bad_lines[:3]
    malformed = [line for line in logged if line["msg"].startswith("malformed HTTP request")]
    assert malformed and all(line["level"] == "WARNING" and "<" not in line["msg"] for line in malformed)


# -- memory per request ------------------------------------------------------------------------------

def _peak_for(sidecar: SidecarProcess, data: bytes) -> tuple[Answer, int]:
    """The answer and the process's peak RSS while it was served (VmHWM from the current RSS)."""
    sidecar.reset_peak()
    answer = send_raw(sidecar.url, data, timeout=120)
    return answer, sidecar.status("VmHWM")


def test_peak_rss_per_request_is_bounded(engine: FakeEngine, tmp_path: Path) -> None:
    """Peak RSS of the sidecar process for one request stays within 4 x the body it holds + 32 MiB
    above the RSS before it, whatever the JSON shape; a gzip bomb costs no more than
    ``max_body_bytes`` of it."""
    with sidecar_process(fake_config(engine), tmp_path) as sidecar:
        limit = 16 * MiB
        warm = request(CHAT, json.dumps(VALID_CHAT).encode())
        assert send_raw(sidecar.url, warm).status == 400  # the fake engine's answer
        cases = {
            "16 MiB of empty messages": (request(CHAT, b'{"messages":[' + b",".join([b"{}"] * (limit // 3 - 10))
                                                 + b"]}"), 413),
            "16 MiB prompt": (request(COMPLETIONS, b'{"model":"m","prompt":"' + b"a" * (limit - 40) + b'"}'), 400),
            "16 MiB of short strings": (request(CHAT, b'{"stop":[' + b",".join([b'"ab"'] * (limit // 5 - 10))
                                                + b"]}"), 413),
            "6 MiB of token ids": (request(COMPLETIONS, b'{"model":"m","prompt":[' + b",".join(
                [b"151643"] * (6 * MiB // 7)) + b"]}"), 400),
            "gzip of 1 GiB (1 MiB on the wire)": (request(CHAT, gzip_bomb(1024), {"Content-Encoding": "gzip"}), 413),
        }
        report = []
        for name, (data, status) in cases.items():
            before = sidecar.status("VmRSS")
            answer, peak = _peak_for(sidecar, data)
            assert answer.status == status, (name, answer.status, answer.body[:300])
            held = min(len(data), limit) if "gzip" not in name else limit
            bound = before + 4 * held + 32 * MiB
            report.append(f"{name}: RSS {before / MiB:.0f} -> peak {peak / MiB:.0f} MiB "
                          f"(+{(peak - before) / MiB:.0f}; bound +{(bound - before) / MiB:.0f})")
            assert peak <= bound, report[-1]
        print("\n".join(report))


def test_memory_budget_refuses_concurrent_large_bodies(engine: FakeEngine) -> None:
    """Bodies being read count against ``limits.memory_budget_bytes`` (4 bytes per body byte):
    past it a request is refused with 503 and Retry-After, and the budget comes back."""
    config = fake_config(engine, limits={"memory_budget_bytes": 64 * MiB})
    with run_sidecar(config) as sidecar:
        state = sidecar.app[STATE]
        big = b'{"model":"m","prompt":"' + b"a" * (12 * MiB) + b'"}'
        host, port = sidecar.url.rsplit("/", 1)[-1].split(":")
        holder = socket.create_connection((host, int(port)))
        try:
            holder.sendall(request(COMPLETIONS, big)[:-MiB])  # all but the last MiB: about 44 MiB reserved
            assert wait_for(lambda: state.budget.used >= 40 * MiB, timeout=30), state.budget.used
            answer = send_raw(sidecar.url, request(COMPLETIONS, big))
            assert answer.status == 503 and answer.headers["retry-after"] == "1", answer.body[:200]
            assert "limits.memory_budget_bytes" in answer.openai_error()["message"]
            small = send_raw(sidecar.url, request(COMPLETIONS, json.dumps(VALID_COMPLETION).encode()))
            assert small.openai_error()["message"] == FAKE_MESSAGE, "small bodies still fit"
        finally:
            holder.close()
        assert wait_for(lambda: state.budget.used == 0 and state.reading == 0, timeout=10), state.budget.used


# -- slow clients -------------------------------------------------------------------------------------

def test_read_deadlines_release_everything(engine: FakeEngine) -> None:
    """A body that stops arriving gets a 408 at ``limits.body_read_seconds`` and gives back its
    reservation; a connection whose headers never complete is closed at ``header_read_seconds``."""
    config = fake_config(engine, limits={"body_read_seconds": 1, "header_read_seconds": 1})
    with run_sidecar(config) as sidecar:
        state = sidecar.app[STATE]
        started = time.monotonic()
        answer = send_raw(sidecar.url, request(CHAT, b"{}", {"Content-Length": "100"}))
        elapsed = time.monotonic() - started
        assert answer.status == 408 and "limits.body_read_seconds" in answer.openai_error()["message"]
        assert 1 <= elapsed < 5, elapsed
        assert state.reading == 0 and state.in_flight == 0 and state.budget.used == 0
        host, port = sidecar.url.rsplit("/", 1)[-1].split(":")
        slow = socket.create_connection((host, int(port)), timeout=10)
        try:
            slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            started = time.monotonic()
            assert slow.recv(1024) == b"", "closed without an answer"
            assert time.monotonic() - started < 5
        finally:
            slow.close()


def test_per_ip_connection_cap(engine: FakeEngine) -> None:
    with run_sidecar(fake_config(engine, limits={"max_connections_per_ip": 2})) as sidecar:
        host, port = sidecar.url.rsplit("/", 1)[-1].split(":")
        held = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            answer = send_raw(sidecar.url, request("/v1/models", b"", method="GET"))
            assert answer.status == 429 and "limit 2" in answer.openai_error()["message"]
        finally:
            for s in held:
                s.close()
        assert wait_for(lambda: send_raw(sidecar.url, request("/v1/models", b"", method="GET")).status == 200,
                        timeout=10)


# -- error hygiene --------------------------------------------------------------------------------------

TRACEBACK = b'Traceback (most recent call last):\n  File "/srv/vllm/serving.py", line 1\nOSError: 10.1.2.3:8200'


def test_upstream_5xx_bodies_and_addresses_never_reach_clients(engine: FakeEngine) -> None:
    with fake_engine() as broken:
        broken.answer["/v1/models"] = (500, TRACEBACK)
        broken.answer["/inference/v1/generate"] = (500, TRACEBACK)
        config = fake_config(engine, decode={"url": broken.url}, render={"url": broken.url},
                             prefill={"mode": "remote", "failure_policy": "fail",
                                      "discovery": {"kind": "static", "urls": [broken.url]}})
        with run_sidecar(config) as sidecar:
            models = requests.get(sidecar.url + "/v1/models", timeout=10)
            assert models.status_code == 502 and models.json()["error"]["type"] == "BadGatewayError"
            broken.answer["/v1/chat/completions/render"] = (200, json.dumps(
                {"request_id": "chatcmpl-x", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2},
                 "model": "tiny-qwen3"}).encode())
            chat = requests.post(sidecar.url + CHAT, json=VALID_CHAT, timeout=30)
            assert chat.status_code == 503 and chat.json()["error"]["message"] == \
                "The prefill tier is unavailable (status)", chat.text
            for resp in (models, chat):
                assert b"10.1.2.3" not in resp.content and b"Traceback" not in resp.content
                assert broken.url.split("//")[1].encode() not in resp.content
        dead = f"http://127.0.0.1:{free_port()}"
        with run_sidecar(fake_config(engine, decode={"url": dead})) as sidecar:
            resp = requests.get(sidecar.url + "/v1/models", timeout=10)
            assert resp.status_code == 503 and resp.json()["error"]["message"] == "The decode engine is not reachable"
            assert dead.split("//")[1].encode() not in resp.content


def test_malformed_http_is_one_warning_and_an_openai_400(engine: FakeEngine, tmp_path: Path) -> None:
    with sidecar_process(fake_config(engine), tmp_path) as sidecar:
        answer = send_raw(sidecar.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Evil\x01: <secret-echo>\r\n\r\n")
        assert answer.status == 400 and answer.headers["content-type"].startswith("application/json")
        assert answer.openai_error() == {"message": "malformed HTTP request", "type": "BadRequestError",
                                         "param": None, "code": 400}
        assert wait_for(lambda: any(line["msg"].startswith("malformed") for line in sidecar.logged()), timeout=5)
        logged = sidecar.logged()
    (line,) = [line for line in logged if line["msg"].startswith("malformed")]
    assert line["level"] == "WARNING" and "secret-echo" not in json.dumps(line) and "exc" not in line
    assert not [line for line in logged if line["level"] == "ERROR"]


# -- many trickling clients ---------------------------------------------------------------------------

def trickle(url: str, count: int, stop: threading.Event, body: bool) -> list[socket.socket]:
    """``count`` connections that send a request a byte at a time (stuck in a body that claims
    100 kB, or in their headers), one byte per connection every half second until ``stop``."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    conns = []
    for _ in range(count):
        s = socket.create_connection((host, int(port)))
        s.setblocking(False)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        if body:
            head += b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
        s.send(head)
        conns.append(s)

    def drip() -> None:
        while not stop.wait(0.5):
            for s in conns:
                try:
                    s.send(b" ")
                except OSError:
                    pass

    threading.Thread(target=drip, daemon=True).start()
    return conns


@pytest.mark.engine
def _open(conn: socket.socket) -> bool:
    """Still open and unanswered (a non-blocking read finds nothing yet)."""
    try:
        return conn.recv(1) != b""  # data: answered, b"": closed
    except BlockingIOError:
        return True
    except OSError:
        return False


@pytest.mark.engine
def test_trickling_clients_do_not_deny_service(engine_set, tmp_path: Path) -> None:
    """600 connections trickling their bodies (more than the 512 request slots) and 100 more
    trickling their headers, against the default limits: a normal chat request still gets its
    200 within 2 s, and the trickling connections are still being read when it does."""
    from tests.sidecar.support import sidecar_config

    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
    with sidecar_process(sidecar_config(engine_set), tmp_path) as sidecar:
        started = time.monotonic()
        assert requests.post(sidecar.url + CHAT, json=body, timeout=30).status_code == 200
        alone = time.monotonic() - started
        stop = threading.Event()
        conns = trickle(sidecar.url, 600, stop, body=True) + trickle(sidecar.url, 100, stop, body=False)
        try:
            started = time.monotonic()
            resp = requests.post(sidecar.url + CHAT, json=body, timeout=30)
            loaded = time.monotonic() - started
            assert resp.status_code == 200, resp.text
            assert loaded < 2.0, loaded
            still = sum(_open(c) for c in conns)
            assert still == len(conns), f"{len(conns) - still} trickling connections ended early"
        finally:
            stop.set()
            for s in conns:
                s.close()
    print(f"trickling: a chat request took {alone * 1000:.0f} ms alone, {loaded * 1000:.0f} ms beside 600 "
          "trickling connections")
