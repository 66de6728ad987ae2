"""``render.failure_policy`` against the real sidecar app and scripted upstreams (``upstreams``):
with the render tier down, ``fail`` answers a 503 that says so, ``decode`` has the decode engine
answer the client's request itself on its own route (no render, prefill or derender leg), its
answer checked like every upstream answer (docs/security.md, "Upstream answers"). Against real
vLLM servers, a killed render under a stream of requests: test_render_outage.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests
from aiohttp import web

from disagg_engine.servers import free_port
from disagg_sidecar.keys import STATE
from tests.sidecar import upstreams as fake
from tests.sidecar.support import SERVED, run_sidecar, wait_for
from tests.sidecar.upstreams import (  # noqa: F401 (fixtures)
    CHAT, COMPLETION, Upstreams, assert_clean, module_ups, openai_error, post, read_stream, ups,
)

MESSAGES = {"model": SERVED, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
CHAT_ANSWER = {"id": "chatcmpl-own", "object": "chat.completion", "model": SERVED, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "from decode"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}
CHAT_EVENTS = [{"id": "c", "object": "chat.completion.chunk", "choices": [
                   {"index": 0, "delta": {"role": "assistant", "content": "from"}, "finish_reason": None}]},
               {"id": "c", "object": "chat.completion.chunk", "choices": [
                   {"index": 0, "delta": {"content": " decode"}, "finish_reason": "stop"}]}]
COMPLETION_ANSWER = {"id": "cmpl-own", "object": "text_completion", "model": SERVED, "choices": [
    {"index": 0, "text": "from decode", "finish_reason": "length"}]}
MESSAGE_ANSWER = {"id": "msg-own", "type": "message", "role": "assistant", "model": SERVED,
                  "content": [{"type": "text", "text": "from decode"}], "stop_reason": "end_turn",
                  "usage": {"input_tokens": 9, "output_tokens": 2}}
MESSAGE_EVENTS = [("message_start", {"type": "message_start", "message": {"id": "m", "type": "message", "content": []}}),
                  ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": "from decode"}}),
                  ("message_stop", {"type": "message_stop"})]


def anthropic_sse(events: list[tuple[str, dict]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


def decoding_itself(ups: Upstreams) -> None:
    """The decode fake's own routes, answering as vLLM's OpenAI and Anthropic servers."""
    async def chat(request: web.Request, body: Any) -> web.StreamResponse:
        if body.get("stream"):
            return await fake.stream_raw(fake.sse_bytes(CHAT_EVENTS))(request, body)
        return web.json_response(CHAT_ANSWER)

    async def messages(request: web.Request, body: Any) -> web.StreamResponse:
        if body.get("stream"):
            return await fake.stream_raw(anthropic_sse(MESSAGE_EVENTS))(request, body)
        return web.json_response(MESSAGE_ANSWER)

    ups.decode.routes.update({"/v1/chat/completions": chat, "/v1/completions": fake.answer_json(COMPLETION_ANSWER),
                              "/v1/messages": messages,
                              "/v1/messages/count_tokens": fake.answer_json({"input_tokens": 9})})


def down(ups: Upstreams, policy: str, **limits: Any) -> dict[str, Any]:
    """A sidecar whose render tier is a port nothing listens on."""
    return fake.config(ups, render={"url": f"http://127.0.0.1:{free_port()}", "failure_policy": policy},
                       limits={"health_interval_seconds": 0.1, **limits})


def no_tier_leg(ups: Upstreams) -> None:
    assert not ups.render.posts() and not ups.prefill.posts(), "no render or prefill leg"
    assert not ups.decode.posts("/inference/v1/generate"), "no generate leg"
    assert not ups.bystander.calls


def test_fail_answers_a_503_that_says_why(ups: Upstreams) -> None:
    with run_sidecar(down(ups, "fail")) as sidecar:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {**COMPLETION, "stream": True})):
            resp = post(sidecar.url, path, body)
            assert resp.status_code == 503 and resp.headers["Retry-After"] == "1", resp.text
            assert openai_error(resp) == {"message": "The render tier is unavailable (connect)",
                                          "type": "ServiceUnavailableError", "param": None, "code": 503}
        resp = post(sidecar.url, "/v1/messages", MESSAGES)
        assert resp.status_code == 503 and resp.json()["type"] == "error", resp.text
        assert resp.json()["error"]["message"] == "The render tier is unavailable (connect)"
        assert not ups.decode.posts() and not ups.prefill.posts()
        # The render tier is what it needs: not ready.
        assert wait_for(lambda: "render unreachable" in requests.get(sidecar.url + "/health", timeout=5).json()
                        .get("reasons", []), timeout=10)


@pytest.mark.parametrize("path, body, want", [
    ("/v1/chat/completions", CHAT, CHAT_ANSWER),
    ("/v1/completions", COMPLETION, COMPLETION_ANSWER),
    ("/v1/messages", MESSAGES, MESSAGE_ANSWER),
    ("/v1/messages/count_tokens", {k: v for k, v in MESSAGES.items() if k != "max_tokens"}, {"input_tokens": 9}),
])
def test_decode_answers_the_request_itself(ups: Upstreams, path: str, body: dict, want: dict) -> None:
    decoding_itself(ups)
    with run_sidecar(down(ups, "decode")) as sidecar:
        sent = {**body, "vllm_xargs": {"kv_transfer_params": {"remote_host": "10.66.66.66", "remote_port": 22}}}
        resp = post(sidecar.url, path, sent)
        assert resp.status_code == 200, resp.text
        assert resp.json() == want
        assert resp.headers["x-disagg-render"] == "decode" and "x-disagg-prefill" not in resp.headers
        [call] = ups.decode.posts(path)
        assert call.body == {**body, "vllm_xargs": {}}, "the client's request, its kv_transfer_params taken out"
        no_tier_leg(ups)
        assert sidecar.metric("disagg_sidecar_decode_answered_total", reason="leg failed") \
            + sidecar.metric("disagg_sidecar_decode_answered_total", reason="tier down") == 1


def test_decode_streams_the_request_itself(ups: Upstreams) -> None:
    decoding_itself(ups)
    with run_sidecar(down(ups, "decode")) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True})
        assert resp.status_code == 200 and resp.headers["x-disagg-render"] == "decode"
        assert read_stream(resp) == [*CHAT_EVENTS, "[DONE]"]
        resp = post(sidecar.url, "/v1/messages", {**MESSAGES, "stream": True})
        assert resp.status_code == 200
        assert resp.content == anthropic_sse(MESSAGE_EVENTS), "vLLM's events, their names kept"
        no_tier_leg(ups)


def test_a_render_down_by_its_probes_is_not_tried(ups: Upstreams) -> None:
    """Known down (its probes): straight to decode, and the sidecar stays ready, degraded."""
    decoding_itself(ups)
    with run_sidecar(down(ups, "decode")) as sidecar:
        assert wait_for(lambda: not sidecar.app[STATE].tiers_up(), timeout=10)
        health = requests.get(sidecar.url + "/health", timeout=5)
        assert health.status_code == 200 and "render unreachable" in health.json()["degraded"], health.text
        assert post(sidecar.url, "/v1/chat/completions", CHAT).json() == CHAT_ANSWER
        assert sidecar.metric("disagg_sidecar_decode_answered_total", reason="tier down") == 1
        assert sidecar.metric("disagg_sidecar_leg_errors_total", leg="render", kind="connect") == 0


def test_a_derender_tier_failing_before_the_first_byte_is_answered_by_decode(ups: Upstreams) -> None:
    """A chained answer (decode in tokens) whose derender leg finds its tier failing (5xx)."""
    decoding_itself(ups)
    ups.render.routes["/v1/chat/completions/derender"] = fake.answer_raw(b"boom", status=500)
    tokens = {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}

    async def generate(request: web.Request, body: Any) -> web.StreamResponse:
        return web.json_response(fake.tokens_answer(False))
    ups.decode.routes["/inference/v1/generate"] = generate
    config = fake.config(ups, render={"failure_policy": "decode"}, decode={"capabilities": tokens},
                         prefill={"mode": "local"}, kv_connector=None, limits={"health_interval_seconds": 60})
    with run_sidecar(config) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 200 and resp.json() == CHAT_ANSWER, resp.text
        assert len(ups.render.posts("/v1/chat/completions/derender")) == 1
        assert sidecar.metric("disagg_sidecar_decode_answered_total", reason="leg failed") == 1


def test_a_bad_render_answer_is_a_502_under_either_policy(ups: Upstreams) -> None:
    """Only an unavailable tier is answered by decode: a render that answers wrongly is a bad gateway."""
    decoding_itself(ups)
    ups.render.routes["/v1/chat/completions/render"] = fake.answer_json([1, 2])
    with run_sidecar(fake.config(ups, render={"failure_policy": "decode"})) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 502 and "invalid answer" in openai_error(resp)["message"], resp.text
        assert not ups.decode.posts("/v1/chat/completions")


@pytest.mark.parametrize("case", ["no [DONE]", "no finish reason", "cut in an event", "not JSON", "too many choices"])
def test_decodes_own_stream_without_its_end_is_an_error_the_client_sees(ups: Upstreams, case: str) -> None:
    events: list[Any] = list(CHAT_EVENTS)
    data = {"no [DONE]": fake.sse_bytes(events, done=False),
            "no finish reason": fake.sse_bytes(events[:1]),
            "cut in an event": fake.sse_bytes(events[:1], done=False) + b'data: {"id": "c", "obj',
            "not JSON": fake.sse_bytes([events[0], b"<html>"]),
            "too many choices": fake.sse_bytes([{**events[1], "choices": [{**events[1]["choices"][0], "index": 3}]}]),
            }[case]
    ups.decode.routes["/v1/chat/completions"] = fake.stream_raw(data)
    with run_sidecar(down(ups, "decode")) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True})
        events_seen = read_stream(resp)
        assert "[DONE]" not in events_seen, "never taken for a whole answer"
        error = events_seen[-1]["error"] if resp.status_code == 200 else openai_error(resp)
        assert error["code"] == 502 and error["message"].startswith("The decode engine answered with an invalid answer")
        assert_clean(resp, ups)


def test_decodes_own_messages_stream_without_message_stop_is_an_error(ups: Upstreams) -> None:
    ups.decode.routes["/v1/messages"] = fake.stream_raw(anthropic_sse(MESSAGE_EVENTS[:2]))
    with run_sidecar(down(ups, "decode")) as sidecar:
        resp = post(sidecar.url, "/v1/messages", {**MESSAGES, "stream": True})
        assert resp.status_code == 200
        assert b"event: message_stop" not in resp.content
        last = resp.content.rstrip(b"\n").split(b"\n\n")[-1]
        assert last.startswith(b"event: error\ndata: ")
        assert json.loads(last.split(b"data: ", 1)[1])["error"]["message"] == \
            "The decode engine answered with an invalid answer (the decode stream ended without message_stop)"


@pytest.mark.parametrize("answer", [
    fake.answer_json({"error": {"message": "x"}}), fake.answer_json({"choices": []}), fake.answer_raw(b"<html>"),
    fake.answer_json({**CHAT_ANSWER, "padding": "x" * (1 << 18)}), fake.redirect("http://10.66.66.66:1"),
])
def test_decodes_own_wrong_answer_is_a_502(ups: Upstreams, answer) -> None:
    ups.decode.routes["/v1/chat/completions"] = answer
    with run_sidecar(down(ups, "decode", decode_answer_bytes=1 << 17)) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 502, resp.text
        assert openai_error(resp)["message"].startswith("The decode engine answered with")
        assert_clean(resp, ups)


def test_decodes_own_4xx_is_the_clients(ups: Upstreams) -> None:
    """vLLM's own refusal of the request (as coupled's): its status and message, nothing else."""
    refusal = {"error": {"message": "max_tokens is too large", "type": "BadRequestError", "param": None, "code": 400}}
    ups.decode.routes["/v1/chat/completions"] = fake.answer_json(refusal, status=400)
    with run_sidecar(down(ups, "decode")) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 400 and openai_error(resp) == refusal["error"]
