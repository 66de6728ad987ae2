"""Hostile upstreams and clients against the real sidecar app, the limits side (docs/security.md,
"Upstream answers"): deadlines per leg, answer sizes, token ids, the drain hook, shared metrics
fetches, ``Expect`` and other small client-side items. Fake upstreams: ``upstreams``.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp import web

from disagg_sidecar.keys import STATE
from disagg_sidecar.plan import legs
from tests.sidecar import upstreams as fake
from tests.sidecar.hostile import MiB
from tests.sidecar.support import SERVED, run_sidecar, sidecar_process, wait_for
from tests.sidecar.upstreams import (  # noqa: F401 (fixtures)
    CHAT, COMPLETION, Upstreams, assert_clean, assert_healthy, module_ups, openai_error, post, read_stream, ups,
)


# -- 5. deadlines --------------------------------------------------------------------------------------

def timed_post(url: str, path: str, body: dict) -> tuple[requests.Response, float]:
    started = time.monotonic()
    resp = post(url, path, body, timeout=60)
    return resp, time.monotonic() - started


@pytest.mark.parametrize("leg", ["render", "prefill", "decode", "decode-stream-silent", "decode-stream-trickle"])
def test_a_trickling_or_silent_engine_holds_no_client_or_slot_past_its_deadline(ups: Upstreams, leg: str) -> None:
    """Each leg's deadline covers the whole leg: a byte every 0.2 s (the answer would take minutes)
    or silence after the headers ends at the deadline, the slot given back."""
    every = 0.2
    if leg == "render":
        ups.render.routes["/v1/chat/completions/render"] = fake.trickle(json.dumps(fake.rendered()).encode(), every)
    elif leg == "prefill":
        ups.prefill.routes["/inference/v1/generate"] = fake.trickle(json.dumps({"kv_transfer_params": None}).encode(),
                                                                    every)
    elif leg == "decode":
        ups.decode.routes["/inference/v1/generate"] = fake.trickle(json.dumps(fake.text_answer(None)).encode(), every)
    elif leg == "decode-stream-silent":
        ups.decode.routes["/inference/v1/generate"] = fake.silent_after(fake.sse_bytes(fake.text_events()[:1], False))
    else:  # bytes keep coming, but the whole stream takes longer than decode_seconds
        ups.decode.routes["/inference/v1/generate"] = fake.trickle(fake.sse_bytes(fake.text_events()), every,
                                                                   "text/event-stream")
    timeouts = {"render_seconds": 1, "prefill_seconds": 1, "decode_seconds": 2, "decode_idle_seconds": 1}
    with run_sidecar(fake.config(ups, timeouts=timeouts)) as sidecar:
        resp, took = timed_post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": leg.startswith("decode-stream")})
        assert took < 6, took
        if leg.startswith("decode-stream"):  # cut like a decode engine that went away: vLLM's error event, [DONE]
            if resp.status_code == 200:  # after the first event
                events = read_stream(resp)
                assert events[-1] == "[DONE]" and set(events[-2]) == {"error"}, events
                error = events[-2]["error"]
            else:  # before it
                error = openai_error(resp)
            assert error == {"message": "The decode engine failed: timeout", "type": "BadGatewayError",
                             "param": None, "code": 502}, error
        else:
            assert resp.status_code in (502, 503), resp.text
            assert "timeout" in openai_error(resp)["message"]
        assert_clean(resp, ups)
        assert wait_for(lambda: sidecar.app[STATE].in_flight == 0, timeout=5), "the slot is given back"
        ups.reset()
        assert_healthy(sidecar, ups)


def paced(pieces: list[bytes], gaps: list[float]) -> fake.Handler:
    """An event stream of ``pieces``, waiting ``gaps[i]`` before piece i (headers after ``gaps[0]``
    when ``pieces[0]`` is empty); silent after the last one until the caller hangs up when the
    pieces end without ``[DONE]``."""
    async def handle(request: web.Request, body: object) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        for i, (piece, gap) in enumerate(zip(pieces, gaps)):
            await asyncio.sleep(gap)
            if i == 0:
                await resp.prepare(request)
            if piece:
                await resp.write(piece)
        if not pieces[-1].endswith(b"[DONE]\n\n"):
            await asyncio.Event().wait()
        await resp.write_eof()
        return resp
    return handle


@pytest.mark.parametrize("case", ["silent-after-headers", "silent-before-headers", "gaps-below-the-bound"])
def test_a_streamed_decode_leg_is_cut_after_its_idle_bound_and_only_then(ups: Upstreams, case: str) -> None:
    """``decode_idle_seconds`` (1 s here; the leg's deadline is 30 s) bounds the silence before the
    headers and between reads, not the stream: a silence is cut within 1-1.25 s (``IdleWatch``),
    gaps of 0.6 s between events never are."""
    first, second = (fake.sse_bytes([e], done=False) for e in fake.text_events())
    ups.decode.routes["/inference/v1/generate"] = {
        "silent-after-headers": paced([first], [0]),
        "silent-before-headers": paced([b""], [3]),
        "gaps-below-the-bound": paced([b"", first, second + b"data: [DONE]\n\n"], [0, 0.6, 0.6]),
    }[case]
    timeouts = {"decode_seconds": 30, "decode_idle_seconds": 1}
    with run_sidecar(fake.config(ups, timeouts=timeouts)) as sidecar:
        resp, took = timed_post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True})
        if case == "gaps-below-the-bound":
            events = read_stream(resp)
            assert resp.status_code == 200 and events[-1] == "[DONE]", events
            assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]
                           if e["choices"]) == "hello there", events
            assert took >= 1.2, took  # both gaps were waited out
        else:
            assert 1 <= took < 2.5, took
            if case == "silent-after-headers":
                events = read_stream(resp)
                assert events[-1] == "[DONE]" and set(events[-2]) == {"error"}, events
                error = events[-2]["error"]
            else:
                error = openai_error(resp)
            assert error["message"] == "The decode engine failed: timeout", error
        assert_clean(resp, ups)
        assert wait_for(lambda: sidecar.app[STATE].in_flight == 0, timeout=5), "the slot is given back"


# -- 6. sizes and numbers --------------------------------------------------------------------------------

def test_an_answer_over_its_legs_size_bound_is_a_502_and_never_held_whole(ups: Upstreams) -> None:
    big = {**fake.rendered(), "padding": "x" * (1 << 20)}
    limits = {"render_answer_bytes": 1 << 17, "prefill_answer_bytes": 1 << 17, "decode_answer_bytes": 1 << 17}
    with run_sidecar(fake.config(ups, limits=limits)) as sidecar:
        for tier, path in ((ups.render, "/v1/chat/completions/render"), (ups.prefill, "/inference/v1/generate"),
                           (ups.decode, "/inference/v1/generate")):
            ups.reset()
            tier.routes[path] = fake.answer_json(big)
            resp = post(sidecar.url, "/v1/chat/completions", CHAT)
            assert resp.status_code == 502, resp.text
            assert "answered with an answer over its size limit" in openai_error(resp)["message"]
            assert_clean(resp, ups)
        ups.reset()
        assert_healthy(sidecar, ups)


BUDGET_REFUSAL = ("The sidecar's memory budget cannot hold the {}'s answer now (limits.memory_budget_bytes)")


def test_upstream_answers_are_counted_in_the_memory_budget(ups: Upstreams, tmp_path: Path) -> None:
    """A real ``disagg sidecar`` process with a 64 MiB budget: a 48 MiB decode answer, 2 M token ids
    from render, eight concurrent 12 MiB decode answers (each within its leg's 64 MiB bound) and
    eight concurrent streams with an 8 MiB event each are refused with a 503 (in a stream: its error
    event) that names the budget once they would not fit, so the process's peak RSS grows by less
    than the budget; the sidecar serves normally after."""
    budget = 64 * MiB
    huge = json.dumps({**fake.text_answer(None), "padding": "x" * (48 * MiB)}).encode()
    large = json.dumps({**fake.text_answer(None), "padding": "x" * (12 * MiB)}).encode()
    ids = json.dumps({**fake.rendered(), "token_ids": [151643] * 2_000_000}).encode()
    config = fake.config(ups, limits={"memory_budget_bytes": budget})
    with sidecar_process(config, tmp_path) as sidecar:
        assert post(sidecar.url, "/v1/chat/completions", CHAT).status_code == 200  # warm
        base = sidecar.status("VmRSS")
        sidecar.reset_peak()
        for tier, path, data, who in ((ups.decode, "/inference/v1/generate", huge, "decode engine"),
                                      (ups.render, "/v1/chat/completions/render", ids, "render tier")):
            ups.reset()
            tier.routes[path] = fake.answer_raw(data)
            resp = post(sidecar.url, "/v1/chat/completions", CHAT, timeout=120)
            assert resp.status_code == 503 and resp.headers["Retry-After"] == "1", resp.text[:300]
            assert openai_error(resp)["message"] == BUDGET_REFUSAL.format(who)
            assert len(tier.posts(path)) == 1, "no retry: the endpoint is not at fault"
        ups.reset()
        ups.decode.routes["/inference/v1/generate"] = fake.answer_raw(large)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: post(sidecar.url, "/v1/chat/completions", CHAT, timeout=120), range(8)))
        refused = [r for r in answers if r.status_code == 503]
        assert refused and all(openai_error(r)["message"] == BUDGET_REFUSAL.format("decode engine") for r in refused)
        assert all(r.json()["choices"][0]["message"]["content"] == fake.ANSWER for r in answers if r.status_code == 200)
        assert {r.status_code for r in answers} <= {200, 503}
        # Streams: eight at once, each with an 8 MiB event (within upstream_event_bytes, 16 MiB).
        ups.reset()
        first, rest = fake.text_events()
        ups.decode.routes["/inference/v1/generate"] = fake.stream_raw(fake.sse_bytes(
            [{**first, "padding": "x" * (8 * MiB)}, rest]))
        with ThreadPoolExecutor(8) as pool:
            streams = list(pool.map(lambda _: post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True},
                                                   timeout=120), range(8)))
        cut = 0
        for resp in streams:
            if resp.status_code == 503:
                assert openai_error(resp)["message"] == BUDGET_REFUSAL.format("decode engine")
                cut += 1
                continue
            events = read_stream(resp)
            assert events[-1] == "[DONE]", events[-2:]
            if "error" in events[-2]:
                assert events[-2]["error"]["message"] == BUDGET_REFUSAL.format("decode engine")
                cut += 1
            else:
                assert "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"]) == fake.ANSWER
        peak = sidecar.status("VmHWM")
        print(f"RSS {base / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB (+{(peak - base) / MiB:.0f}); "
              f"{len(refused)} of 8 concurrent answers refused, {cut} of 8 streams")
        assert cut, "some streams did not fit"
        assert peak - base < budget, (base, peak)
        ups.reset()
        assert requests.get(sidecar.url + "/health", timeout=10).status_code == 200
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == fake.ANSWER


@pytest.mark.parametrize("path, body", [
    ("/inference/v1/generate", {"token_ids": [2**63] * 20, "sampling_params": {"max_tokens": 1}}),
    ("/inference/v1/generate", {"token_ids": [2**31], "sampling_params": {"max_tokens": 1}}),
    ("/inference/v1/generate", {"token_ids": [-1, 5], "sampling_params": {"max_tokens": 1}}),
    ("/v1/completions", {**COMPLETION, "prompt": [2**63] * 20}),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [2**64]]}),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"extra_args": ["kv_transfer_params"]}}),
])
def test_token_ids_no_vocabulary_has_are_a_400_before_any_leg(ups: Upstreams, path: str, body: dict) -> None:
    with run_sidecar(fake.config(ups, prefill={"selection": "prefix-affinity", "affinity_block_tokens": 4})) as sidecar:
        resp = post(sidecar.url, path, body)
        assert resp.status_code == 400 and openai_error(resp)["type"] == "BadRequestError", resp.text
        assert not any(u.posts() for u in ups.all()), "nothing was sent"
        assert_healthy(sidecar, ups)


def test_a_streamed_completions_request_parses_its_body_once_for_all_its_prompts(
        ups: Upstreams, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 prompts and a 1 MiB suffix: the parser context is made once per request (it was once per
    prompt: 64 parses of the whole body), and each prompt's chained derender calls carry that one
    context (the stateless protocol's ``completion_request``), never the prompts' text."""
    made = []
    real = legs.parser_context
    monkeypatch.setattr(legs, "parser_context", lambda *a: made.append(1) or real(*a))  # a counting spy
    tokens = {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}

    async def generate(request: web.Request, body: Any) -> web.StreamResponse:
        if body.get("stream"):
            return await fake.stream_raw(fake.sse_bytes(fake.tokens_answer(True)))(request, body)
        return await fake.DEFAULT_ROUTES["/inference/v1/generate"](request, body)

    async def derender(request: web.Request, body: Any) -> web.StreamResponse:
        gen = body["generate_chunk"]["choices"][0]
        return web.json_response({"chunk": {"id": "x", "object": "text_completion", "choices": [
            {"index": 0, "text": "w" * len(gen["token_ids"]), "finish_reason": gen.get("finish_reason")}]},
            "stream_state": {"n": 1}})
    ups.decode.routes["/inference/v1/generate"] = generate
    ups.render.routes["/v1/completions/derender"] = derender
    suffix = "s" * MiB
    body = {**COMPLETION, "prompt": [f"prompt number {i}" for i in range(64)], "suffix": suffix, "stream": True}
    config = fake.config(ups, decode={"capabilities": tokens}, limits={"coalesce": False})
    with run_sidecar(config) as sidecar:
        started = time.process_time()
        resp = post(sidecar.url, "/v1/completions", body, timeout=120)
        cpu = time.process_time() - started
        events = read_stream(resp)
    assert resp.status_code == 200 and events[-1] == "[DONE]", events[-2:]
    assert len(made) == 1, f"{len(made)} parses of the body"
    calls = ups.render.posts("/v1/completions/derender")
    assert len(calls) == 64 * 2  # two chunks per prompt, one call each (no coalescing)
    for call in calls:
        assert call.body["completion_request"]["suffix"] == suffix
        assert "prompt number" not in json.dumps(call.body)
    print(f"64 prompts, {len(calls)} derender calls of {len(json.dumps(calls[0].body)) >> 20} MiB each; "
          f"test process CPU {cpu:.2f} s")


# -- 7. probes, metrics and the drain hook -----------------------------------------------------------------

def _drained_from(url: str, source: str, got: list) -> threading.Thread:
    """GET /health/drained from the loopback address ``source`` (as another host would ask)."""
    host, port = url.rsplit("/", 1)[-1].split(":")

    def run() -> None:
        with socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0)) as s:
            s.sendall(b"GET /health/drained HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        got.append((source, int(data.split(b" ", 2)[1]), time.monotonic()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_drain_hook_cannot_be_exhausted_from_other_addresses(ups: Upstreams) -> None:
    """Many waiters from other addresses (each gets one; more from one address: 429) do not turn
    away the hook's request from the node's address: it waits for the SIGTERM like any first one."""
    with run_sidecar(fake.config(ups)) as sidecar:
        got: list = []
        started = time.monotonic()
        attackers = [_drained_from(sidecar.url, f"127.0.0.{i}", got) for i in range(2, 8) for _ in range(2)]
        assert wait_for(lambda: sum(1 for _, status, _ in got if status == 429) == 6, timeout=5), got
        kubelet = _drained_from(sidecar.url, "127.0.0.100", got)
        for t in [*attackers, kubelet]:
            t.join(30)
        by_source = {source: status for source, status, _ in got if status != 429}
        assert by_source["127.0.0.100"] == 409, got  # waited for a SIGTERM, was not turned away
        assert sorted(status for _, status, _ in got) == [409] * 7 + [429] * 6
        assert time.monotonic() - started < 20


def test_concurrent_scrapes_share_one_engine_metrics_fetch(ups: Upstreams) -> None:
    text = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"

    async def slow_metrics(request, body):
        await asyncio.sleep(0.5)  # a slow engine: the scrapes overlap
        return web.Response(text=text, content_type="text/plain")

    ups.decode.routes["/metrics"] = slow_metrics
    with run_sidecar(fake.config(ups, metrics={"include_engine": True, "engine_max_age_seconds": 0})) as sidecar:
        started = time.monotonic()
        with ThreadPoolExecutor(50) as pool:
            answers = list(pool.map(lambda _: requests.get(sidecar.url + "/metrics", timeout=30), range(50)))
        elapsed = time.monotonic() - started
        assert all(a.status_code == 200 and "vllm:num_requests_running 3" in a.text for a in answers)
        fetches = sum(1 for c in ups.decode.calls if c.path == "/metrics")
        # Shared: one fetch at a time, each 0.5 s, however slowly a loaded machine sends the 50 scrapes
        # (unshared, each scrape would be a fetch of its own).
        assert 1 <= fetches <= 1 + math.ceil(elapsed / 0.5) and fetches < 25, (fetches, elapsed)


def test_models_takes_a_slot(ups: Upstreams) -> None:
    async def slow_models(request, body):
        await asyncio.sleep(1)
        return web.json_response({"object": "list", "data": [{"id": SERVED}]})

    ups.decode.routes["/v1/models"] = slow_models
    with run_sidecar(fake.config(ups, limits={"max_concurrent_requests": 2})) as sidecar:
        with ThreadPoolExecutor(6) as pool:
            statuses = sorted(pool.map(lambda _: requests.get(sidecar.url + "/v1/models", timeout=30).status_code,
                                       range(6)))
        assert statuses.count(200) >= 2 and statuses.count(503) >= 2, statuses
        assert sum(1 for c in ups.decode.calls if c.path == "/v1/models") <= 2 + 1  # + the startup probe's


# -- 8. smaller client-side items ------------------------------------------------------------------------

def raw_exchange(url: str, head: bytes, body: bytes = b"", wait_first: bool = False) -> bytes:
    """Send ``head`` (and ``body``, after the first answer bytes with ``wait_first``); all answered bytes."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head)
        first = s.recv(65536)
        if body and wait_first and first.startswith(b"HTTP/1.1 100"):
            s.sendall(body)
        elif body and not wait_first:
            s.sendall(body)
        data = first
        while b"\r\n\r\n" not in data.split(b"HTTP/1.1 100 Continue\r\n\r\n")[-1] or len(data) < 20:
            if not (chunk := s.recv(65536)):
                break
            data += chunk
        return data


def test_expect_headers(ups: Upstreams, tmp_path: Path) -> None:
    body = json.dumps(CHAT).encode()

    def head(expect: str, key: str | None = None) -> bytes:
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nExpect: {expect}\r\n{auth}Connection: close\r\n\r\n").encode()

    with run_sidecar(fake.config(ups)) as sidecar:
        answer = raw_exchange(sidecar.url, head("foo"))
        assert answer.startswith(b"HTTP/1.1 417") and b"application/json" in answer, answer[:300]
        assert b'"Expect supports only 100-continue"' in answer
        answer = raw_exchange(sidecar.url, head("100-continue"), body, wait_first=True)
        assert answer.startswith(b"HTTP/1.1 100 Continue") and b"HTTP/1.1 200" in answer, answer[:300]
    keyfile = tmp_path / "client-key"
    keyfile.write_text("sekrit")
    with run_sidecar(fake.config(ups, auth={"client_api_key_file": str(keyfile)})) as sidecar:
        before = len(ups.render.posts())
        answer = raw_exchange(sidecar.url, head("100-continue"), body, wait_first=True)
        assert answer.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in answer, answer[:300]
        assert len(ups.render.posts()) == before
        answer = raw_exchange(sidecar.url, head("100-continue", "sekrit"), body, wait_first=True)
        assert answer.startswith(b"HTTP/1.1 100 Continue") and b"HTTP/1.1 200" in answer, answer[:300]


def test_numbers_no_double_holds_are_a_400(ups: Upstreams) -> None:
    with run_sidecar(fake.config(ups)) as sidecar:
        for body in (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}',
                     b'{"model": "m", "prompt": "hi", "top_p": -1E+999}'):
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            resp = requests.post(sidecar.url + path, data=body, headers={"Content-Type": "application/json"},
                                 timeout=30)
            assert resp.status_code == 400 and "out of range" in openai_error(resp)["message"], resp.text
        assert not any(u.posts() for u in ups.all())


def test_an_invalid_traceparent_is_not_forwarded(ups: Upstreams) -> None:
    valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with run_sidecar(fake.config(ups)) as sidecar:
        for value, forwarded in ((valid, True), ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", False),
                                 ("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", False),
                                 ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),
                                 ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", False)):
            ups.reset()
            resp = requests.post(sidecar.url + "/v1/chat/completions", json=CHAT, headers={"traceparent": value},
                                 timeout=30)
            assert resp.status_code == 200, resp.text
            for up in (ups.render, ups.prefill, ups.decode):
                (call,) = up.posts()
                assert (call.headers.get("traceparent") == value) if forwarded else "traceparent" not in {
                    k.lower() for k in call.headers}, (value, call.headers)


def test_a_float_logprobs_is_held_to_the_limit(ups: Upstreams) -> None:
    with run_sidecar(fake.config(ups, limits={"max_logprobs": 5})) as sidecar:
        for logprobs in (25.0, 6.0):
            resp = post(sidecar.url, "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {
                "max_tokens": 1, "logprobs": logprobs}})
            assert resp.status_code == 400 and "greater than max allowed: 5" in openai_error(resp)["message"]
        assert not any(u.posts() for u in ups.all())
        ok = post(sidecar.url, "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {
            "max_tokens": 1, "logprobs": 5.0}})
        assert ok.status_code == 200, ok.text


def test_a_chained_streams_derender_calls_carry_at_most_derender_stream_bytes(ups: Upstreams) -> None:
    """A chat with 3 MiB of tools, streamed through the stateless chain: every derender call carries
    the tools (vLLM's stateless derender reads them from each call's ``chat_request``), so the calls
    of one stream take more tokens each to stay within ``limits.derender_stream_bytes`` (before:
    one call per chunk, 32 x 3 MiB); the client still gets every token, in fewer chunks."""
    tokens = {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}
    count = 32
    events = [{"request_id": "gen-fake", "choices": [{"index": 0, "token_ids": [21 + i % 2], "stop_reason": None,
                                                      "finish_reason": "length" if i == count - 1 else None}]}
              for i in range(count)]

    async def render(request: web.Request, body: Any) -> web.StreamResponse:
        return web.json_response({**fake.rendered(client=body), "sampling_params": {"max_tokens": count}})
    ups.render.routes["/v1/chat/completions/render"] = render
    ups.decode.routes["/inference/v1/generate"] = fake.stream_raw(fake.sse_bytes(events))
    tool = {"type": "function", "function": {"name": "f", "description": "d" * (3 * MiB), "parameters": {}}}
    body = {**fake.CHAT, "max_tokens": count, "tools": [tool], "stream": True}
    budget = 8 * MiB
    config = fake.config(ups, decode={"capabilities": tokens}, limits={"coalesce": False, "derender_stream_bytes": budget})
    with run_sidecar(config) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", body, timeout=120)
        got = read_stream(resp)
    assert resp.status_code == 200 and got[-1] == "[DONE]", got[-2:]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in got[:-1] if c.get("choices"))
    assert text == "".join(("hello", " there")[i % 2] for i in range(count))
    calls = ups.render.posts("/v1/chat/completions/derender")
    sent = sum(len(json.dumps(c.body)) for c in calls)
    one = len(json.dumps(calls[0].body))
    assert one > 3 * MiB and sent <= budget + one, f"{len(calls)} calls, {sent >> 20} MiB"
    assert 1 <= len(calls) <= 3  # ceil(32 tokens x 3 MiB / 8 MiB) = 12 tokens a call at least: 12 + 12 + 8

