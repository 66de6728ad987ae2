"""The sidecar's HTTP surface against the real servers: GenerateRequest clients, the legs'
headers, the x-prefiller-host-port contract, limits, health, models and metrics.

Recording proxies sit in front of real servers where a test needs to see what a leg received.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from urllib.parse import urlsplit

import pytest
import requests

from tests.harness.forced import MULTIBYTE, OUTPUTS
from tests.harness.openai_views import chat_stream_view, chat_view, completion_stream_full_view, sse_events
from tests.sidecar.conftest import TOKENS_ONLY
from tests.sidecar.support import (
    RunningSidecar,
    engine_metric,
    recording_proxy,
    run_sidecar,
    sidecar_config,
    wait_for,
)
from disagg_engine.servers import free_port
from disagg_sidecar import sse
from disagg_sidecar.keys import STATE
from disagg_sidecar.plan.legs import engine_request_id

pytestmark = pytest.mark.engine
GENERATE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def proxied(engine_set) -> Iterator[tuple[RunningSidecar, dict]]:
    """A sidecar whose render, prefill and decode legs go through recording proxies."""
    with recording_proxy(engine_set.url("render")) as render, recording_proxy(engine_set.url("prefill")) as prefill, \
            recording_proxy(engine_set.url("decode")) as decode:
        config = sidecar_config(engine_set, render={"url": render.url}, decode={"url": decode.url},
                                prefill={"discovery": {"kind": "static", "urls": [prefill.url, engine_set.url("prefill")]},
                                         "trust_prefiller_header": True})
        with run_sidecar(config) as sidecar:
            yield sidecar, {"render": render, "prefill": prefill, "decode": decode}


def _clear(proxies: dict) -> None:
    for p in proxies.values():
        p.calls.clear()


def _post_with_headers(url: str, body: dict, headers: list[tuple[str, str]]) -> tuple[int, dict]:
    """POST with repeated header lines (requests folds them into one)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        data = json.dumps(body).encode()
        conn.putrequest("POST", parts.path)
        for name, value in [("Content-Type", "application/json"), ("Content-Length", str(len(data))), *headers]:
            conn.putheader(name, value)
        conn.endheaders(data)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


# -- GenerateRequest clients -------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
def test_generate_request_client(engine_set, forcer, proxied, stream: bool) -> None:
    sidecar, proxies = proxied
    chat = forcer.chat_body("reasoning_tool_call", stream=stream)
    gen = requests.post(engine_set.url("render") + "/v1/chat/completions/render", json=chat, timeout=60).json()
    client_body = {**gen, "output_mode": "derender", "chat_request": chat}
    prefill_url = proxies["prefill"].url
    _clear(proxies)
    finished_before = engine_metric(engine_set.url("prefill"), "vllm:request_success_total")
    resp = requests.post(sidecar.url + GENERATE, json=client_body, stream=stream, timeout=120,
                         headers={"x-prefiller-host-port": _host_port(prefill_url), "X-Request-Id": f"gen-{stream}"})
    assert resp.status_code == 200, resp.text
    coupled = requests.post(engine_set.url("coupled") + "/v1/chat/completions", json=chat, stream=stream, timeout=60)
    if stream:
        raw = resp.content
        # Passed through byte for byte: the client's stream is the decode engine's, as it wrote it.
        (decode_call,) = [c for c in proxies["decode"].calls if c.path == GENERATE]
        assert raw == bytes(decode_call.response) and raw.endswith(b"data: [DONE]\n\n")
        events = list(sse_events(raw.splitlines()))
        assert events[-1] == "[DONE]"
        assert all(e["output_mode"] == "derender" for e in events[:-1])
        # The engine's own generate chunks, passed through; their deltas add up to coupled's.
        assert chat_stream_view(events) == chat_stream_view(list(sse_events(coupled.iter_lines())))
    else:
        out = resp.json()
        # The engine's answer passes through: its id is the request's unique engine id.
        assert out["output_mode"] == "derender" and out["request_id"].startswith(f"generate-tokens-gen-{stream}-")
        assert resp.headers["X-Request-Id"] == f"gen-{stream}"
        assert chat_view(out) == chat_view(coupled.json())
    # The prefill leg: tokens, one token, not streamed, no chat context; observed by the engine too.
    (prefill_leg,) = proxies["prefill"].bodies(GENERATE)
    assert prefill_leg["output_mode"] == "tokens" and prefill_leg["stream"] is False
    assert "chat_request" not in prefill_leg and "parse_context" not in prefill_leg
    assert prefill_leg["sampling_params"]["max_tokens"] == 1 and prefill_leg["sampling_params"]["n"] == 1
    assert "stream_options" not in prefill_leg and prefill_leg["token_ids"] == gen["token_ids"]
    assert wait_for(lambda: engine_metric(engine_set.url("prefill"), "vllm:request_success_total")
                    == finished_before + 1, timeout=10)
    # The decode leg: the client's mode and chat context, the client's stream flag.
    (decode_leg,) = proxies["decode"].bodies(GENERATE)
    assert decode_leg["output_mode"] == "derender" and decode_leg["chat_request"] == chat
    assert decode_leg["stream"] is stream and decode_leg["kv_transfer_params"] is None
    assert decode_leg["sampling_params"] == gen["sampling_params"]
    assert proxies["render"].count("/v1/chat/completions/render") == 0, "a GenerateRequest is not rendered"


def test_generate_request_tokens_mode_passes_through(engine_set, forcer, proxied) -> None:
    sidecar, proxies = proxied
    chat = forcer.chat_body("plain")
    gen = requests.post(engine_set.url("render") + "/v1/chat/completions/render", json=chat, timeout=60).json()
    direct = requests.post(engine_set.url("decode") + GENERATE, json=gen, timeout=60).json()
    out = requests.post(sidecar.url + GENERATE, json=gen, timeout=60).json()
    assert out["output_mode"] == "tokens"
    assert [c["token_ids"] for c in out["choices"]] == [c["token_ids"] for c in direct["choices"]]


def test_generate_request_errors_are_the_engines(proxied) -> None:
    sidecar, _ = proxied
    resp = requests.post(sidecar.url + GENERATE, json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 0}},
                         timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == 400


# -- headers on the legs -----------------------------------------------------------------------

def test_legs_share_the_request_id_and_get_the_trace_context(forcer, proxied) -> None:
    sidecar, proxies = proxied
    _clear(proxies)
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    resp = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=60, headers={
        "traceparent": traceparent, "tracestate": "vendor=1", "X-Request-Id": "trace-me",
        "x-prefiller-host-port": _host_port(proxies["prefill"].url), "Authorization": "Bearer secret"})
    assert resp.status_code == 200 and resp.json()["id"] == "chatcmpl-trace-me"
    assert resp.headers["X-Request-Id"] == "trace-me"
    legs = [c for p in proxies.values() for c in p.calls if c.path != "/health" and "capabilities" not in c.path]
    assert {c.path for c in legs} == {"/v1/chat/completions/render", GENERATE}
    assert len(legs) == 3
    engine_ids = set()
    for call in legs:
        headers = {k.lower(): v for k, v in call.headers.items()}
        if call.path == GENERATE:  # the engines get the request's own id, the client's as its prefix
            assert headers["x-request-id"].startswith("trace-me-") and len(headers["x-request-id"]) == 21
            engine_ids.add(headers["x-request-id"])
        else:
            assert headers["x-request-id"] == "trace-me"
        assert headers["traceparent"] == traceparent and headers["tracestate"] == "vendor=1"
        assert "x-prefiller-host-port" not in headers, "stripped before forwarding"
        assert "authorization" not in headers, "client credentials stay at the sidecar"
    assert len(engine_ids) == 1, "prefill and decode legs share one engine id"


def _trace_headers_ok(call, request_id: str, traceparent: str) -> bool:
    headers = {k.lower(): v for k, v in call.headers.items()}
    return headers.get("x-request-id") == request_id and headers.get("traceparent") == traceparent


def test_derender_and_abort_calls_get_the_trace_context(engine_set, forcer, proxied) -> None:
    """The legs that are not render/prefill/decode: the derender tier (completions logprobs
    are chained even inline) and the abort sent to the decode engine after a disconnect."""
    sidecar, proxies = proxied
    _clear(proxies)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    body = {"model": "tiny-qwen3", "prompt": "Trace me:", "max_tokens": 20, "logprobs": 1,
            "vllm_xargs": forcer.xargs("The capital of France is Paris.")}
    resp = requests.post(sidecar.url + "/v1/completions", json=body, timeout=60,
                         headers={"traceparent": traceparent, "X-Request-Id": "trace-derender"})
    assert resp.status_code == 200, resp.text
    (derender,) = [c for c in proxies["render"].calls if c.path == "/v1/completions/derender"]
    assert _trace_headers_ok(derender, "trace-derender", traceparent), derender.headers

    decode = engine_set.url("decode")
    assert wait_for(lambda: engine_metric(decode, "vllm:num_requests_running") == 0, timeout=30)
    text = "word" + " word" * 2998
    stream = requests.post(sidecar.url + "/v1/chat/completions", stream=True, timeout=120,
                           json=forcer.chat_body("plain", stream=True, vllm_xargs=forcer.xargs(text), max_tokens=3100),
                           headers={"traceparent": traceparent, "X-Request-Id": "trace-abort"})
    assert stream.status_code == 200
    lines = stream.iter_lines()
    assert list(sse_events(next(lines) for _ in range(6))), "the stream started"
    stream.close()  # the client goes away: the sidecar aborts the decode leg
    assert wait_for(lambda: proxies["decode"].count("/inference/v1/abort_requests") == 1, timeout=10)
    (abort,) = [c for c in proxies["decode"].calls if c.path == "/inference/v1/abort_requests"]
    (engine_id,) = [h["x-request-id"] for c in proxies["decode"].calls if c.path == GENERATE
                    for h in [{k.lower(): v for k, v in c.headers.items()}] if h["x-request-id"].startswith("trace-abort")]
    assert engine_id.startswith("trace-abort-") and len(engine_id) == len("trace-abort-") + 12, engine_id
    assert abort.body == {"request_ids": [engine_request_id(engine_id)]}
    assert _trace_headers_ok(abort, engine_id, traceparent), abort.headers
    assert wait_for(lambda: engine_metric(decode, "vllm:num_requests_running") == 0, timeout=10)


def test_invalid_traceparent_is_dropped(forcer, proxied) -> None:
    sidecar, proxies = proxied
    _clear(proxies)
    resp = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=60,
                         headers={"traceparent": "not-a-trace"})
    assert resp.status_code == 200
    assert all("traceparent" not in {k.lower() for k in c.headers} for p in proxies.values() for c in p.calls)


# -- x-prefiller-host-port -----------------------------------------------------------------------

def test_prefiller_header_selects_an_allowlisted_endpoint(forcer, proxied) -> None:
    sidecar, proxies = proxied
    for _ in range(3):
        _clear(proxies)
        resp = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=60,
                             headers={"x-prefiller-host-port": _host_port(proxies["prefill"].url)})
        assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "remote"
        assert proxies["prefill"].count(GENERATE) == 1


def _listening(family: socket.AddressFamily, host: str) -> socket.socket | None:
    """A non-blocking listening socket on ``host`` (None where that loopback does not exist)."""
    sock = socket.socket(family)
    try:
        sock.bind((host, 0))
    except OSError:
        sock.close()
        return None
    sock.listen(16)
    sock.setblocking(False)
    return sock


def test_rejected_prefiller_headers_cause_no_connection(engine_set, forcer, proxied) -> None:
    """Malformed, repeated or off-list targets: 400/403, and nothing is contacted at all
    (traps listen on the IPv4 loopback, and on the IPv6 one where the machine has it)."""
    sidecar, proxies = proxied
    trap = _listening(socket.AF_INET, "127.0.0.1")
    assert trap is not None
    trap6 = _listening(socket.AF_INET6, "::1")
    traps = [t for t in (trap, trap6) if t is not None]
    with ExitStack() as stack:
        for t in traps:
            stack.enter_context(t)
        port = trap.getsockname()[1]
        port6 = trap6.getsockname()[1] if trap6 is not None else port
        prefill = _host_port(proxies["prefill"].url)
        cases: list[tuple[list[str], int]] = [
            ([f"127.0.0.1:{port}"], 403),  # a listening port that is not a prefill endpoint
            ([f"localhost:{port}"], 403),
            ([f"localhost:{port6}"], 403),
            ([f"[::1]:{port6}"], 403),
            ([f"[0:0:0:0:0:0:0:1]:{port6}"], 403),
            ([f"http://[::1]:{port6}"], 400),
            ([f"169.254.169.254:{port}"], 403),
            ([f"http://127.0.0.1:{port}"], 400),
            ([f"127.0.0.1:{port}/v1"], 400),
            ([f"127.0.0.1:{port},{prefill}"], 400),
            ([f"{prefill},127.0.0.1:{port}"], 400),
            ([f"user@127.0.0.1:{port}"], 400),
            (["127.0.0.1"], 400),
            ([f"127.0.0.1:{port}:1"], 400),
            (["127.0.0.1:99999"], 400),
            ([prefill, f"127.0.0.1:{port}"], 400),  # repeated header
            ([prefill, prefill], 400),
        ]
        _clear(proxies)
        render_before = engine_set.servers["render"].log_path.read_text(errors="replace").count("/render")
        for values, status in cases:
            got, body = _post_with_headers(sidecar.url + "/v1/chat/completions", forcer.chat_body("plain"),
                                           [("x-prefiller-host-port", v) for v in values])
            assert got == status, (values, body)
            error = body["error"]
            assert error["code"] == status and error["param"] == "x-prefiller-host-port"
        for t in traps:
            with pytest.raises(BlockingIOError):
                t.accept()  # no trap ever saw a connection attempt
    legs = [c for p in proxies.values() for c in p.calls if c.path not in ("/health", "/disagg/v1/capabilities")]
    assert legs == [], "no leg was sent for a rejected request"
    assert engine_set.servers["render"].log_path.read_text(errors="replace").count("/render") == render_before


def test_short_prompts_skip_the_prefill_leg(engine_set, forcer) -> None:
    with recording_proxy(engine_set.url("prefill")) as prefill:
        config = sidecar_config(engine_set, prefill={"discovery": {"kind": "static", "urls": [prefill.url]},
                                                     "min_prompt_tokens": 100})
        with run_sidecar(config) as sidecar:
            short = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=60)
            assert short.status_code == 200 and short.headers["x-disagg-prefill"] == "skipped"
            assert prefill.count(GENERATE) == 0
            long = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("tool_call"), timeout=60)
            assert long.status_code == 200 and long.headers["x-disagg-prefill"] == "remote"  # tools: a long prompt
            assert prefill.count(GENERATE) == 1


def test_untrusted_prefiller_header_is_ignored(engine_set, forcer) -> None:
    config = sidecar_config(engine_set, prefill={"trust_prefiller_header": False})
    with run_sidecar(config) as sidecar:
        resp = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=60,
                             headers={"x-prefiller-host-port": "127.0.0.1:1"})
        assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "remote"


# -- limits and validation -----------------------------------------------------------------------

def test_request_validation(engine_set, forcer) -> None:
    with recording_proxy(engine_set.url("render")) as render:
        config = sidecar_config(engine_set, render={"url": render.url}, max_body_bytes=4096)
        with run_sidecar(config) as sidecar:
            url = sidecar.url + "/v1/chat/completions"
            big = forcer.chat_body("plain", messages=[{"role": "user", "content": "x" * 5000}])
            cases = [
                (requests.post(url, json=big, timeout=30), 413),
                (requests.post(url, data=b"{not json", headers={"Content-Type": "application/json"}, timeout=30), 400),
                (requests.post(url, data=b"[1, 2]", headers={"Content-Type": "application/json"}, timeout=30), 400),
                (requests.post(url, data=json.dumps(forcer.chat_body("plain")), headers={"Content-Type": "text/plain"},
                               timeout=30), 400),
                (requests.post(url, json=forcer.chat_body("plain"), headers={"X-Request-Id": "a b"}, timeout=30), 400),
                (requests.post(url, json=forcer.chat_body("plain", n=0), timeout=30), 400),
                (requests.post(sidecar.url + GENERATE, json={"token_ids": []}, timeout=30), 400),
            ]
            for resp, status in cases:
                assert resp.status_code == status, resp.text
                assert resp.json()["error"]["code"] == status
            assert render.count("/v1/chat/completions/render") == 0, "refused before any leg"
            # vLLM's own validation comes back as vLLM said it.
            resp = requests.post(url, json=forcer.chat_body("plain", messages=[]), timeout=30)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == 400


def test_max_concurrent_requests(engine_set, forcer) -> None:
    config = sidecar_config(engine_set, limits={"max_concurrent_requests": 1})
    with run_sidecar(config) as sidecar:
        body = forcer.chat_body("plain", stream=True,
                                vllm_xargs=forcer.xargs("word " * 300), max_tokens=400)
        first = requests.post(sidecar.url + "/v1/chat/completions", json=body, stream=True, timeout=60)
        try:
            assert wait_for(lambda: sidecar.app[STATE].in_flight == 1, timeout=10)
            resp = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=30)
            assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
            assert resp.json()["error"]["type"] == "ServiceUnavailableError"
            assert sidecar.metric("disagg_sidecar_rejected_requests_total", reason="concurrency") == 1
        finally:
            first.close()
        assert wait_for(lambda: sidecar.app[STATE].in_flight == 0, timeout=10)
        assert requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"),
                             timeout=60).status_code == 200


def _start_upload(url: str, data: bytes, sent: int) -> http.client.HTTPConnection:
    """A POST whose body is only partly sent (the rest with ``conn.send`` later)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.putrequest("POST", parts.path)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(data)))
    conn.endheaders()
    conn.send(data[:sent])
    return conn


def test_slow_uploads_hold_no_slot(engine_set, forcer) -> None:
    """A request takes its slot once its body is in: with as many uploads still sending their
    bodies as there are slots, another request is served at once; the uploads are served when
    they finish, and a request finding every slot taken is refused (503, Retry-After) before any leg."""
    limit = 2
    with recording_proxy(engine_set.url("render")) as render:
        config = sidecar_config(engine_set, render={"url": render.url}, limits={"max_concurrent_requests": limit})
        with run_sidecar(config) as sidecar:
            url = sidecar.url + "/v1/chat/completions"
            data = json.dumps(forcer.chat_body("plain")).encode()
            uploads = [_start_upload(url, data, len(data) // 2) for _ in range(limit)]
            try:
                assert wait_for(lambda: sidecar.app[STATE].reading == limit, timeout=10)
                assert sidecar.app[STATE].in_flight == 0
                resp = requests.post(url, json=forcer.chat_body("plain"), timeout=30)
                assert resp.status_code == 200, resp.text
                for conn in uploads:  # the uploads finish and are served normally
                    conn.send(data[len(data) // 2:])
                for conn in uploads:
                    answer = conn.getresponse()
                    assert answer.status == 200, answer.read()
                    assert json.loads(answer.read())["choices"][0]["message"]["content"]
            finally:
                for conn in uploads:
                    conn.close()
            assert wait_for(lambda: sidecar.app[STATE].in_flight == 0 and sidecar.app[STATE].reading == 0, timeout=10)
            assert render.count("/v1/chat/completions/render") == limit + 1
            assert sidecar.app[STATE].budget.used == 0, "every reservation given back"


def test_done_is_never_sent_to_derender(engine_set, forcer) -> None:
    """Chained streaming, one derender call per generate chunk (coalescing off): every chunk of
    the decode stream is sent (finish-only and usage-only ones too), ``[DONE]`` never."""
    body = forcer.chat_body("reasoning_tool_call", stream=True, n=2)
    want = chat_stream_view(list(sse_events(requests.post(engine_set.url("coupled") + "/v1/chat/completions",
                                                          json=body, stream=True, timeout=60).iter_lines())))
    with recording_proxy(engine_set.url("decode")) as decode, recording_proxy(engine_set.url("render")) as derender:
        config = sidecar_config(engine_set, decode={"url": decode.url, "capabilities": TOKENS_ONLY},
                                derender={"url": derender.url}, limits={"coalesce": False})
        with run_sidecar(config) as sidecar:
            resp = requests.post(sidecar.url + "/v1/chat/completions", json=body, stream=True, timeout=120)
            got = list(sse_events(resp.iter_lines()))
    assert got[-1] == "[DONE]" and chat_stream_view(got) == want
    (decode_leg,) = [c for c in decode.calls if c.path == GENERATE]
    events, done = sse.split_events(sse.SSEParser().feed(bytes(decode_leg.response)))
    assert done, "the decode stream ended with [DONE]"
    calls = derender.bodies("/v1/chat/completions/derender")
    assert all(isinstance(c, dict) and c["stream"] is True and isinstance(c["generate_chunk"], dict)
               for c in calls), "every derender call carries one generate chunk, [DONE] none"
    assert not any(b"[DONE]" in json.dumps(c).encode() for c in calls)
    sent = [c["generate_chunk"] for c in calls]
    assert len(sent) == len(events), (len(sent), len(events))
    # Per choice, the chunks in decode order (the stop token the engine ended on dropped).
    for index in (0, 1):
        ours = [(s["choices"][0]["token_ids"], s["choices"][0]["finish_reason"]) for s in sent
                if s["choices"] and s["choices"][0]["index"] == index]
        theirs = [(e["choices"][0]["token_ids"], e["choices"][0]["finish_reason"]) for e in events
                  if e["choices"] and e["choices"][0]["index"] == index]
        assert [f for _, f in ours] == [f for _, f in theirs] and theirs[-1][1] == "stop"
        assert [t for t, _ in ours[:-1]] == [t for t, _ in theirs[:-1]]
        assert ours[-1][0] == theirs[-1][0][:-1], "the EOS is dropped, the finish still sent"
    finish_only = [s for s in sent if s["choices"] and not s["choices"][0]["token_ids"]]
    assert all(s["choices"][0]["finish_reason"] == "stop" for s in finish_only)
    assert len(finish_only) == sum(1 for e in events if e["choices"] and len(e["choices"][0]["token_ids"]) == 1
                                   and e["choices"][0]["finish_reason"] == "stop")
    assert sent[-1]["choices"] == [] and sent[-1]["usage"] == events[-1]["usage"], "usage-only, last"
    assert calls[-1]["stream_state"] is None


# -- health, models, metrics -----------------------------------------------------------------------

def test_health_models_metrics(forcer, inline_sidecar) -> None:
    assert requests.post(inline_sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"),
                         timeout=60).status_code == 200
    assert requests.get(inline_sidecar.url + "/health", timeout=10).json() == {"status": "ready"}
    assert requests.get(inline_sidecar.url + "/health/live", timeout=10).status_code == 200
    models = requests.get(inline_sidecar.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny-qwen3"]
    text = requests.get(inline_sidecar.url + "/metrics", timeout=10).text
    for name in ("disagg_sidecar_requests_total", "disagg_sidecar_leg_seconds_bucket", "disagg_sidecar_prefill_total",
                 "disagg_sidecar_requests_in_flight"):
        assert name in text


def test_not_ready_without_a_reachable_render_tier(engine_set, forcer) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    config = sidecar_config(engine_set, render={"url": dead}, limits={"health_interval_seconds": 0.2})
    with run_sidecar(config) as sidecar:
        resp = requests.get(sidecar.url + "/health", timeout=10)
        assert resp.status_code == 503 and "render unreachable" in resp.json()["reasons"]
        resp = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=30)
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
        assert "render" in resp.json()["error"]["message"]


def test_decode_engine_down_is_503(engine_set, forcer) -> None:
    config = sidecar_config(engine_set, decode={"url": f"http://127.0.0.1:{free_port()}"})
    with run_sidecar(config) as sidecar:
        assert requests.get(sidecar.url + "/health", timeout=10).status_code == 503
        assert requests.get(sidecar.url + "/v1/models", timeout=10).status_code == 503
        resp = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=30)
        assert resp.status_code == 503 and "decode" in resp.json()["error"]["message"]


def test_chat_with_render_local_uses_the_decode_engine(engine_set, forcer) -> None:
    """``render: {mode: local}``: the decode engine renders and derenders (no render pool)."""
    config = sidecar_config(engine_set, render={"mode": "local"},
                            decode={"capabilities": {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}})
    del config["render"]["url"]
    with run_sidecar(config) as sidecar:
        body = forcer.chat_body("reasoning_tool_call")
        got = requests.post(sidecar.url + "/v1/chat/completions", json=body, timeout=60).json()
        want = requests.post(engine_set.url("coupled") + "/v1/chat/completions", json=body, timeout=60).json()
        assert chat_view(got) == chat_view(want)


# -- the inline relay: the decode engine writes the client's chunks --------------------------------

def _relayed(proxied: tuple[RunningSidecar, dict], path: str, body: dict, request_id: str) -> tuple[dict, list]:
    """A streamed request through the sidecar whose client stream is the decode engine's, byte for
    byte ([DONE] included), under the header its decode leg named: the leg and the client's events."""
    sidecar, proxies = proxied
    _clear(proxies)
    resp = requests.post(sidecar.url + path, json=body, timeout=120, headers={"X-Request-Id": request_id})
    assert resp.status_code == 200, resp.text
    (decode_call,) = [c for c in proxies["decode"].calls if c.path == GENERATE]
    (leg,) = proxies["decode"].bodies(GENERATE)
    client = leg["client_stream"]
    assert client["model"] == body["model"] and client["return_token_ids"] is bool(body.get("return_token_ids"))
    assert resp.content == bytes(decode_call.response) and resp.content.endswith(b"data: [DONE]\n\n")
    events = list(sse_events(resp.content.splitlines()))
    assert all(e["id"] == client["id"] and e["created"] == client["created"] for e in events[:-1])
    return leg, events


@pytest.mark.parametrize("name, options", [
    ("reasoning_tool_call", {}),
    ("multibyte", {"n": 2, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
], ids=["tool-call", "n2-logprobs-ids-usage"])
def test_an_inline_chat_stream_is_the_decode_engines_bytes(engine_set, forcer, proxied, name: str, options: dict) -> None:
    """With the engine extension, the decode leg asks for the client's own chunks
    (``client_stream``: the chat stream's id, created and model), and the client's stream is the
    engine's, byte for byte, usage chunk and [DONE] included; its deltas are coupled's."""
    chat = forcer.chat_body(name, stream=True, **options)
    leg, events = _relayed(proxied, "/v1/chat/completions", chat, f"bytes-{name}")
    assert leg["output_mode"] == "derender" and leg["client_stream"]["id"] == f"chatcmpl-bytes-{name}"
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
    coupled = requests.post(engine_set.url("coupled") + "/v1/chat/completions", json=chat, stream=True, timeout=60)
    assert chat_stream_view(events) == chat_stream_view(list(sse_events(coupled.iter_lines())))


def _forms(events: list) -> set:
    """Which fields each chunk and each of its choices carries (chunk boundaries aside)."""
    return {(tuple(e), tuple(tuple(c) for c in e["choices"])) for e in events if e != "[DONE]"}


@pytest.mark.parametrize("text, options", [
    (MULTIBYTE, {}),
    (OUTPUTS["plain"][0], {"n": 2, "return_token_ids": True, "stop": ["zzz", "is Par"],
                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
], ids=["multibyte", "n2-ids-stop-usage"])
def test_an_inline_completions_stream_is_the_decode_engines_bytes(engine_set, forcer, proxied, text: str,
                                                                    options: dict) -> None:
    """A streamed completions request of one prompt: the decode leg asks for the client's own
    ``text_completion`` chunks (``client_stream`` with ``api: completions`` on a ``text`` leg), and
    the client's stream is the engine's, byte for byte, usage chunk and [DONE] included; each
    choice's text, token ids, reasons and the usage are coupled's."""
    body = {"model": "tiny-qwen3", "prompt": "Complete this (bytes):", "max_tokens": 200, "stream": True,
            "vllm_xargs": forcer.xargs(text), **options}
    name = "n2" if options else "one"
    leg, events = _relayed(proxied, "/v1/completions", body, f"bytes-cmpl-{name}")
    assert leg["output_mode"] == "text" and leg["client_stream"]["api"] == "completions"
    assert leg["client_stream"]["id"] == f"cmpl-bytes-cmpl-{name}"
    assert {e["object"] for e in events[:-1]} == {"text_completion"}
    coupled = list(sse_events(requests.post(engine_set.url("coupled") + "/v1/completions", json=body, stream=True,
                                            timeout=60).iter_lines()))
    assert completion_stream_full_view(events) == completion_stream_full_view(coupled)
    assert _forms(events) == _forms(coupled)
    assert (events[-2].get("usage") is not None) is bool(options.get("stream_options"))


def test_several_prompts_and_echo_keep_their_completions_chunks_shaped(engine_set, forcer, proxied) -> None:
    """What the engine cannot write as the client's (several prompts' indices and summed usage, the
    prompt's text) is asked in the generate shape and shaped by the sidecar, as coupled writes it."""
    sidecar, proxies = proxied
    text = OUTPUTS["plain"][0]
    for extra in ({"prompt": ["First prompt here:", "A second prompt:"]}, {"prompt": "Echo me:", "echo": True}):
        body = {"model": "tiny-qwen3", "max_tokens": 200, "stream": True, "vllm_xargs": forcer.xargs(text),
                "stream_options": {"include_usage": True}, **extra}
        _clear(proxies)
        resp = requests.post(sidecar.url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert all("client_stream" not in leg for leg in proxies["decode"].bodies(GENERATE))
        coupled = requests.post(engine_set.url("coupled") + "/v1/completions", json=body, stream=True, timeout=60)
        assert completion_stream_full_view(list(sse_events(resp.content.splitlines()))) == \
            completion_stream_full_view(list(sse_events(coupled.iter_lines())))
