"""Hostile clients against the real ``disagg sidecar`` process (docs/security.md, "Sidecar limits"): a bad-input corpus,
memory per request (peak RSS of the process), slow clients, and error hygiene.

The upstreams are fake recording engines (``support.fake_engine``): the point is to count what
the sidecar forwards; every request they get is answered with an OpenAI-shaped 400.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from disagg_engine.servers import free_port
from disagg_sidecar.keys import STATE
from tests.sidecar.hostile import (
    CHAT,
    COMPLETIONS,
    VALID_CHAT,
    VALID_COMPLETION,
    MiB,
    Answer,
    generated_cases,
    gzip_bomb,
    issue_cases,
    request,
    send_raw,
)
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
FAKE_MESSAGE = json.loads(REFUSED)["error"]["message"]


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
            "4 MiB of token ids": (request(COMPLETIONS, b'{"model":"m","prompt":[' + b",".join(
                [b"151643"] * (4 * MiB // 7)) + b"]}"), 400),
            "8 MiB of token ids": (request(COMPLETIONS, b'{"model":"m","prompt":[' + b",".join(
                [b"151643"] * (8 * MiB // 7)) + b"]}"), 413),
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


def _open(conn: socket.socket) -> bool:
    """Still open and unanswered (a non-blocking read finds nothing yet)."""
    try:
        conn.recv(1)  # data: answered; b"": closed
        return False
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
