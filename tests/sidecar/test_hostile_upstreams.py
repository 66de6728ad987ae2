"""Hostile upstreams against the real sidecar app (docs/security.md, "Upstream answers"): render,
prefill, decode and derender engines that redirect, name other hosts, answer wrong shapes or end
streams early. Each case asserts the client's answer (an API-shaped error, or the correct answer),
that nothing reached a host that is no endpoint (the bystander), and that the sidecar is healthy
after. Deadlines, sizes, probes and client-side limits: ``test_upstream_limits``.
"""

from __future__ import annotations

import ast
import gzip
import json
from pathlib import Path

import pytest
import requests

from tests.sidecar import upstreams as fake
from tests.sidecar.support import run_sidecar, wait_for
from tests.sidecar.upstreams import (  # noqa: F401 (fixtures)
    CHAT, COMPLETION, Upstreams, assert_clean, assert_healthy, module_ups, openai_error, post, read_stream,
    stream_error, ups,
)

from disagg_sidecar.keys import STATE

SIDECAR_PACKAGE = Path(__file__).resolve().parents[2] / "sidecar" / "disagg_sidecar"


# -- 1. redirects ------------------------------------------------------------------------------------

@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("leg", ["render", "prefill", "decode", "decode-stream", "models", "generate"])
def test_no_redirect_is_followed(ups: Upstreams, leg: str, status: int) -> None:
    """A 3xx from any engine is a 502 in OpenAI's shape that says so; the host it names gets nothing."""
    tier = {"render": ups.render, "prefill": ups.prefill}.get(leg, ups.decode)
    path = {"render": "/v1/chat/completions/render", "models": "/v1/models"}.get(leg, "/inference/v1/generate")
    with run_sidecar(fake.config(ups)) as sidecar:
        tier.routes[path] = fake.redirect(ups.bystander.url, status)
        if leg == "models":
            resp = requests.get(sidecar.url + "/v1/models", timeout=30)
        elif leg == "generate":
            resp = post(sidecar.url, "/inference/v1/generate", {"token_ids": fake.PROMPT_IDS,
                                                                 "sampling_params": {"max_tokens": 2}})
        else:
            resp = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": leg == "decode-stream"})
        assert resp.status_code == 502, resp.text
        error = openai_error(resp)
        assert error["type"] == "BadGatewayError"
        assert "redirect" in error["message"] or "status 3" in error["message"], error
        assert_clean(resp, ups)
        tier.routes.clear()
        assert_healthy(sidecar, ups)


def assert_decode_prefilled_itself(resp, ups: Upstreams) -> None:
    """failure_policy fallback: the right answer, from a decode leg without KV parameters."""
    assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "fallback", resp.text
    assert resp.json()["choices"][0]["message"]["content"] == fake.ANSWER
    (leg,) = ups.decode.posts("/inference/v1/generate")
    assert leg.body["kv_transfer_params"] is None
    assert_clean(resp, ups)


def test_a_redirecting_prefill_engine_falls_back_to_decode(ups: Upstreams) -> None:
    """failure_policy fallback: decode prefills the prompt itself; the answer is the right one."""
    ups.prefill.routes["/inference/v1/generate"] = fake.redirect(ups.bystander.url)
    with run_sidecar(fake.config(ups, prefill={"failure_policy": "fallback"})) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert_decode_prefilled_itself(resp, ups)


def test_every_upstream_call_refuses_redirects() -> None:
    """Each ``session.get``/``post`` in the sidecar passes ``allow_redirects=False`` (directly or
    as ``**NO_REDIRECTS``): the per-leg tests above cover today's calls, this one the next."""
    missing = []
    for path in SIDECAR_PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("get", "post", "request", "put", "delete")):
                continue
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name != "session":
                continue
            kws = {k.arg: k.value for k in node.keywords}
            ok = (isinstance(kws.get("allow_redirects"), ast.Constant) and kws["allow_redirects"].value is False) \
                or any(k.arg is None and getattr(k.value, "id", "") == "NO_REDIRECTS" for k in node.keywords)
            if not ok:
                missing.append(f"{path.relative_to(SIDECAR_PACKAGE)}:{node.lineno}")
    assert not missing, missing



# -- 2. kv_transfer_params ---------------------------------------------------------------------------

def nixl_params(**over) -> dict:
    """What vLLM's NixlConnector returns from a prefill engine at 127.0.0.1 (side channel 5600)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
            "remote_engine_id": "engine-a", "remote_request_id": "r1", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1, **over}


HOSTILE_KV = {
    "another host": nixl_params(remote_host="10.66.66.66", remote_port=22),
    "another port": nixl_params(remote_port=22),
    "a name for the host": nixl_params(remote_host="localhost"),
    "a port as text": nixl_params(remote_port="5600"),
    "not an object": [nixl_params()],
    "no engine id": {k: v for k, v in nixl_params().items() if k != "remote_engine_id"},
    "block ids as text": nixl_params(remote_block_ids="1,2"),
    "a nested object": nixl_params(extra={"remote_host": "10.66.66.66"}),
    "decode asked to send": nixl_params(do_remote_decode=True),
}


def nixl_config(ups: Upstreams, **prefill) -> dict:
    return fake.config(ups, kv_connector="NixlConnector", prefill=prefill)


def prefill_answering(params) -> fake.Handler:
    return fake.answer_json({"request_id": "p", "kv_transfer_params": params,
                             "choices": [{"index": 0, "token_ids": [21], "finish_reason": "length"}]})


@pytest.mark.parametrize("case", list(HOSTILE_KV))
def test_kv_params_naming_anything_but_the_prefilled_endpoint_never_reach_decode(ups: Upstreams, case: str) -> None:
    ups.prefill.routes["/inference/v1/generate"] = prefill_answering(HOSTILE_KV[case])
    with run_sidecar(nixl_config(ups)) as sidecar:  # failure_policy fail: a 502 that says why
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 502 and resp.headers["x-disagg-prefill"] == "failed", resp.text
        assert openai_error(resp)["message"].startswith("The prefill tier answered with an invalid answer (")
        assert not ups.decode.posts("/inference/v1/generate"), "nothing reached decode"
        assert_clean(resp, ups)
    ups.decode.calls.clear()
    with run_sidecar(nixl_config(ups, failure_policy="fallback")) as sidecar:  # decode prefills itself
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert_decode_prefilled_itself(resp, ups)


def test_kv_params_of_the_prefilled_endpoint_reach_decode_as_they_are(ups: Upstreams) -> None:
    for ports, port in (((5600,), 5600), ((5700, 5701), 5701)):
        ups.reset()
        params = nixl_params(remote_port=port, remote_block_ids=[[1, 2], [3]], remote_prefill_cached_tokens=4)
        ups.prefill.routes["/inference/v1/generate"] = prefill_answering(params)
        with run_sidecar(nixl_config(ups, side_channel_ports=list(ports))) as sidecar:
            resp = post(sidecar.url, "/v1/chat/completions", CHAT)
            assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "remote", resp.text
        (leg,) = ups.decode.posts("/inference/v1/generate")
        assert leg.body["kv_transfer_params"] == params


def test_a_clients_kv_params_in_its_chat_request_never_reach_decode(ups: Upstreams) -> None:
    """A client's kv_transfer_params at the top level are refused (``plan/options``: only the
    connector decides them); inside vllm_xargs they are taken out of the decode leg's parser
    context, the rest stays as the client sent it."""
    inline = {"output_modes": ["derender"], "streaming_output_modes": ["derender"],
              "derender_context_forms": ["chat_request"]}
    hostile = {"remote_host": "10.66.66.66", "remote_port": 22, "do_remote_prefill": True}
    nested = {**CHAT, "vllm_xargs": {"kv_transfer_params": hostile, "keep": 1}}
    with run_sidecar(fake.config(ups, decode={"capabilities": inline})) as sidecar:
        for stream in (False, True):
            ups.decode.calls.clear()
            ups.render.calls.clear()
            resp = post(sidecar.url, "/v1/chat/completions", {**CHAT, "kv_transfer_params": hostile, "stream": stream})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params", resp.text
            assert not ups.decode.posts() and not ups.render.posts()
            resp = post(sidecar.url, "/v1/chat/completions", {**nested, "stream": stream})
            assert resp.status_code == 200, resp.text
            (leg,) = ups.decode.posts("/inference/v1/generate")
            assert leg.body["output_mode"] == "derender" and leg.body["kv_transfer_params"] is None
            assert leg.body["chat_request"] == {**CHAT, "stream": stream, "vllm_xargs": {"keep": 1}}
            assert b"10.66.66.66" not in json.dumps(leg.body).encode()


# -- 3. wrong shapes ---------------------------------------------------------------------------------

def gzipped(obj) -> bytes:
    return gzip.compress(json.dumps(obj).encode())


GZIP = {"Content-Encoding": "gzip"}
BAD_RENDER = {
    "not JSON": fake.answer_raw(b"<html>10.66.66.66</html>"),
    "a list": fake.answer_json([fake.rendered()]),
    "token_ids as text": fake.answer_json({**fake.rendered(), "token_ids": "11 12"}),
    "no token_ids": fake.answer_json({k: v for k, v in fake.rendered().items() if k != "token_ids"}),
    "empty token_ids": fake.answer_json({**fake.rendered(), "token_ids": []}),
    "a token id of 2^63": fake.answer_json({**fake.rendered(), "token_ids": [2**63] * 20}),
    "a negative token id": fake.answer_json({**fake.rendered(), "token_ids": [-1]}),
    "sampling_params a list": fake.answer_json({**fake.rendered(), "sampling_params": []}),
    "n of 128 for 1": fake.answer_json({**fake.rendered(), "sampling_params": {"max_tokens": 4, "n": 128}}),
    "NaN": fake.answer_raw(b'{"token_ids": [1], "sampling_params": {"temperature": NaN}}'),
    "gzip": fake.answer_raw(gzipped(fake.rendered()), headers=GZIP),
    "request_id a number": fake.answer_json({**fake.rendered(), "request_id": 7}),
}


@pytest.mark.parametrize("case", list(BAD_RENDER))
def test_a_render_answer_of_the_wrong_shape_is_a_502(ups: Upstreams, case: str) -> None:
    ups.render.routes["/v1/chat/completions/render"] = BAD_RENDER[case]
    with run_sidecar(fake.config(ups)) as sidecar:
        for stream in (False, True):
            resp = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": stream})
            assert resp.status_code == 502, resp.text
            assert openai_error(resp)["message"].startswith("The render tier answered with an invalid answer (")
        assert not ups.prefill.posts() and not ups.decode.posts(), "nothing went on"
        assert_clean(resp, ups)
        ups.render.routes.clear()
        assert_healthy(sidecar, ups)


def test_render_answering_more_requests_than_prompts_sends_no_leg(ups: Upstreams) -> None:
    """300 requests for one prompt: ``max_legs`` counts what would be sent, so none is."""
    ups.render.routes["/v1/completions/render"] = fake.answer_json([fake.rendered("cmpl-x")] * 300)
    with run_sidecar(fake.config(ups)) as sidecar:
        resp = post(sidecar.url, "/v1/completions", COMPLETION)
        assert resp.status_code == 502 and "render answered 300 requests for 1 prompt" in openai_error(resp)["message"]
        assert not ups.prefill.posts() and not ups.decode.posts()
        ups.render.routes.clear()
        two = post(sidecar.url, "/v1/completions", {**COMPLETION, "prompt": ["a", "b"]})
        assert two.status_code == 200 and [c["index"] for c in two.json()["choices"]] == [0, 1], two.text


BAD_DECODE = {
    "not JSON": fake.answer_raw(b"Internal error at pod decode-7f9c 10.66.66.66"),
    "a list": fake.answer_json([fake.text_answer(None)]),
    "an error with 200": fake.answer_json({"error": {"message": "engine dead at 10.66.66.66", "code": 500}}),
    "choices an object": fake.answer_json({**fake.text_answer(None), "choices": {"0": {}}}),
    "a choice index of 5 for n = 1": fake.answer_json(
        {**fake.text_answer(None), "choices": [{"index": 5, "text": "x", "finish_reason": "stop"}]}),
    "3000 choices for n = 1": fake.answer_json(
        {**fake.text_answer(None), "choices": [{"index": i, "text": "x"} for i in range(3000)]}),
    "token ids as text": fake.answer_json(
        {**fake.text_answer(None), "choices": [{"index": 0, "text": "x", "token_ids": ["a"]}]}),
    "text a number": fake.answer_json({**fake.text_answer(None), "choices": [{"index": 0, "text": 5}]}),
    "usage a list": fake.answer_json({**fake.text_answer(None), "usage": [1]}),
    "gzip": fake.answer_raw(gzipped(fake.text_answer(None)), headers=GZIP),
}


@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_a_decode_answer_of_the_wrong_shape_is_a_502(ups: Upstreams, case: str) -> None:
    ups.decode.routes["/inference/v1/generate"] = BAD_DECODE[case]
    with run_sidecar(fake.config(ups)) as sidecar:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                           ("/inference/v1/generate", {"token_ids": fake.PROMPT_IDS, "sampling_params": {"max_tokens": 2}})):
            resp = post(sidecar.url, path, body)
            assert resp.status_code == 502, (path, resp.text)
            assert openai_error(resp)["message"].startswith("The decode engine answered with an invalid answer (")
            assert "Content-Encoding" not in resp.headers
            assert_clean(resp, ups)
        ups.decode.routes.clear()
        assert_healthy(sidecar, ups)


def test_upstream_error_bodies_are_summarised_and_an_engine_key_refusal_is_a_502(ups: Upstreams) -> None:
    leak = b"<html>403 at decode-7f9c-xk2 (10.66.66.66)</html>"
    with run_sidecar(fake.config(ups)) as sidecar:
        for status, want in ((404, 404), (422, 422), (401, 502), (403, 502)):
            for tier, path in ((ups.render, "/v1/chat/completions/render"), (ups.decode, "/inference/v1/generate")):
                ups.reset()
                tier.routes[path] = fake.answer_raw(leak, status=status)
                resp = post(sidecar.url, "/v1/chat/completions", CHAT)
                assert resp.status_code == want, resp.text
                error = openai_error(resp)
                assert b"decode-7f9c" not in resp.content and b"html" not in resp.content, error
                if want == 502:
                    assert "engine key" in error["message"] and error["type"] == "BadGatewayError"
                else:
                    assert error["message"].endswith(f"refused the request (status {status})")
                assert_clean(resp, ups)
        ups.reset()
        ups.render.routes["/v1/chat/completions/render"] = fake.answer_json(
            {"error": {"message": "This model's maximum context length is 8 tokens", "type": "BadRequestError",
                       "param": "messages", "code": 400, "extra": "dropped"}}, status=400)
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 400 and openai_error(resp) == {
            "message": "This model's maximum context length is 8 tokens", "type": "BadRequestError",
            "param": "messages", "code": 400}, "an engine's own OpenAI error passes, rebuilt from its fields"


# -- 4. streams without their end ----------------------------------------------------------------------

EVENTS = fake.text_events()
BAD_STREAMS = {
    "no [DONE]": fake.sse_bytes(EVENTS, done=False),
    "no finish reason": fake.sse_bytes(EVENTS[:1]),
    "cut inside an event": fake.sse_bytes(EVENTS, done=False) + b'data: {"choices": [',
    "no data lines": b"event: x\n\n: comment\n\nid: 1\n\n",
    "an event that is not JSON": fake.sse_bytes([EVENTS[0], b"<html>10.66.66.66</html>", EVENTS[1]]),
    "an event that is a list": fake.sse_bytes([EVENTS[0], b"[1, 2]", EVENTS[1]]),
    "a choice index beyond n": fake.sse_bytes([EVENTS[0], {**EVENTS[1], "choices": [{"index": 9, "text": "x"}]}]),
    "events after [DONE]": fake.sse_bytes(EVENTS) + fake.sse_bytes(EVENTS),
    "2 MiB without a separator": fake.sse_bytes(EVENTS[:1], done=False) + b"data: " + b"x" * (2 << 20),
}


@pytest.mark.parametrize("case", list(BAD_STREAMS))
def test_a_decode_stream_without_its_proper_end_is_an_error_the_client_sees(ups: Upstreams, case: str) -> None:
    ups.decode.routes["/inference/v1/generate"] = fake.stream_raw(BAD_STREAMS[case])
    with run_sidecar(fake.config(ups, limits={"upstream_event_bytes": 1 << 20})) as sidecar:
        for path, body in (("/v1/chat/completions", {**CHAT, "stream": True}),
                           ("/v1/completions", {**COMPLETION, "stream": True}),
                           ("/inference/v1/generate", {"token_ids": fake.PROMPT_IDS, "stream": True,
                                                       "sampling_params": {"max_tokens": 2}})):
            resp = post(sidecar.url, path, body)
            error = stream_error(resp)
            assert error["code"] == 502 and error["message"].startswith(
                "The decode engine answered with an invalid answer ("), (path, error)
            assert_clean(resp, ups)
        ups.decode.routes.clear()
        assert_healthy(sidecar, ups)


def test_a_proper_stream_still_ends_with_done(ups: Upstreams) -> None:
    with run_sidecar(fake.config(ups)) as sidecar:
        for path, body in (("/v1/chat/completions", {**CHAT, "stream": True, "n": 2}),
                           ("/inference/v1/generate", {"token_ids": fake.PROMPT_IDS, "stream": True,
                                                       "sampling_params": {"max_tokens": 2, "n": 2}})):
            events = read_stream(post(sidecar.url, path, body))
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
            finished = {c["index"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")}
            assert finished == {0, 1}


# -- 4b. the client's own chunks (``client_stream``) --------------------------------------------------

CLIENT_DECODE = {"output_modes": ["derender", "text"], "streaming_output_modes": ["derender", "text"],
                 "derender_context_forms": ["chat_request"], "client_streams": ["chat", "completions"]}
OBJECTS = {"chat": "chat.completion.chunk", "completions": "text_completion"}


def client_chunks(client: dict, pieces: list[dict]) -> list[bytes]:
    """``pieces`` (choices, or a usage) as the client's chunks, written as the engine extension
    writes them under the header the decode leg named (``client_stream``)."""
    head = {"id": client["id"], "object": OBJECTS[client["api"]], "created": client["created"],
            "model": client["model"]}
    return [json.dumps({**head, **piece}, separators=(",", ":"), ensure_ascii=False).encode() for piece in pieces]


def _text(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                         "prompt_token_ids": None, "token_ids": None}]}


# Per API: the client's request, its decode leg's mode and the pieces of a proper stream.
APIS = {
    "chat": ("/v1/chat/completions", {**CHAT, "stream": True}, "derender", [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "héllo"}, "logprobs": None, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": " there"}, "logprobs": None, "finish_reason": "stop",
                      "stop_reason": None}]}]),
    "completions": ("/v1/completions", {**COMPLETION, "stream": True}, "text", [
        _text("héllo"), _text(" the"), _text("re", "stop")]),
}


def _bad_index(c: dict, pieces: list[dict]) -> bytes:
    last = pieces[2]["choices"][0]
    return fake.sse_bytes(client_chunks(c, [pieces[0], {"choices": [{**last, "index": 3}]}]))


BAD_CLIENT_STREAMS = {  # the events after the header the sidecar named, or the whole stream
    "not JSON after the header": lambda c, p: fake.sse_bytes(client_chunks(c, p[:1]) + [
        client_chunks(c, p[1:2])[0][:-20] + b"<html>10.66.66.66</html>"]),
    "a choice index beyond n": _bad_index,
    "no finish reason": lambda c, p: fake.sse_bytes(client_chunks(c, p[:2])),
    "no [DONE]": lambda c, p: fake.sse_bytes(client_chunks(c, p), done=False),
}


def answering_client_chunks(make) -> fake.Handler:
    async def handle(request, body):
        return await fake.stream_raw(make(body["client_stream"]))(request, body)
    return handle


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize("case", list(BAD_CLIENT_STREAMS))
def test_the_clients_own_chunks_are_checked_as_any_decode_event(ups: Upstreams, case: str, api: str) -> None:
    """Events that start as the client's chunk are relayed as written, but only once checked: a bad
    one ends the client's stream with an error event, and its bytes never reach the client."""
    path, body, mode, pieces = APIS[api]
    ups.decode.routes["/inference/v1/generate"] = answering_client_chunks(lambda c: BAD_CLIENT_STREAMS[case](c, pieces))
    with run_sidecar(fake.config(ups, decode={"capabilities": CLIENT_DECODE})) as sidecar:
        resp = post(sidecar.url, path, body)
        error = stream_error(resp)
        assert error["code"] == 502 and error["message"].startswith(
            "The decode engine answered with an invalid answer ("), error
        assert b"<html>" not in resp.content and b'"index":3' not in resp.content
        assert_clean(resp, ups)
        (leg,) = [c.body for c in ups.decode.posts("/inference/v1/generate")]
        client = leg["client_stream"]
        assert client["api"] == api and leg["output_mode"] == mode
        assert client["id"] == "chatcmpl-fake" if api == "chat" else client["id"].startswith("cmpl-")


@pytest.mark.parametrize("api", list(APIS))
def test_an_engine_error_after_the_clients_chunks_is_the_sidecars_own(ups: Upstreams, api: str) -> None:
    """An error event after relayed chunks ends the client's stream as any decode failure does (an
    error in the API's shape, then [DONE], as vLLM ends a failed stream), the engine's words kept out."""
    path, body, mode, pieces = APIS[api]
    ups.decode.routes["/inference/v1/generate"] = answering_client_chunks(lambda c: fake.sse_bytes(
        client_chunks(c, pieces[:1])
        + [{"error": {"message": "engine fell over at 10.66.66.66", "type": "InternalServerError", "code": 500}}]))
    with run_sidecar(fake.config(ups, decode={"capabilities": CLIENT_DECODE})) as sidecar:
        resp = post(sidecar.url, path, body)
    events = read_stream(resp)
    assert [e["choices"] for e in events[:-2]] == [pieces[0]["choices"]] and events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "The decode engine failed during the stream", "type": "BadGatewayError",
                                    "param": None, "code": 502}}
    assert b"10.66.66.66" not in resp.content
    assert_clean(resp, ups)


@pytest.mark.parametrize("api", list(APIS))
def test_an_engine_that_ignores_client_stream_gets_its_chunks_shaped(ups: Upstreams, api: str) -> None:
    """The same answer from an engine that writes the client's chunks and from one that does not know
    the field (generate chunks in the leg's mode): the client gets the same stream."""
    path, body, mode, pieces = APIS[api]

    def generate_chunks(client: dict) -> bytes:
        return fake.sse_bytes([{"request_id": "gen-fake", "output_mode": mode, **piece} for piece in pieces])

    streams = []
    for make in (lambda c: fake.sse_bytes(client_chunks(c, pieces)), generate_chunks):
        ups.decode.routes["/inference/v1/generate"] = answering_client_chunks(make)
        with run_sidecar(fake.config(ups, decode={"capabilities": CLIENT_DECODE})) as sidecar:
            events = read_stream(post(sidecar.url, path, body))
        assert events[-1] == "[DONE]" and [e["choices"] for e in events[:-1]] == [p["choices"] for p in pieces]
        assert {e["object"] for e in events[:-1]} == {OBJECTS[api]}
        streams.append([{k: v for k, v in e.items() if k not in ("created", "id")} for e in events[:-1]])
    assert streams[0] == streams[1]


@pytest.mark.parametrize("served", [True, ["chat"]])
def test_an_engine_that_writes_chat_chunks_alone_keeps_completions_shaped(ups: Upstreams, served) -> None:
    """An engine of the first version (``client_streams: true``) or one that names chat alone is never
    sent a completions ``client_stream``: its text chunks are shaped as before."""
    path, body, mode, pieces = APIS["completions"]
    ups.decode.routes["/inference/v1/generate"] = fake.stream_raw(fake.sse_bytes(
        [{"request_id": "gen-fake", "output_mode": "text", **piece} for piece in pieces]))
    ups.decode.routes["/disagg/v1/capabilities"] = fake.answer_json({**CLIENT_DECODE, "client_streams": served})
    decode = {"url": ups.decode.url, "capabilities": CLIENT_DECODE, "probe_capabilities": True}
    with run_sidecar(fake.config(ups, decode=decode)) as sidecar:
        assert wait_for(lambda: sidecar.app[STATE].served_capabilities is not None, 30)
        events = read_stream(post(sidecar.url, path, body))
    assert events[-1] == "[DONE]" and [e["choices"] for e in events[:-1]] == [p["choices"] for p in pieces]
    (leg,) = [c.body for c in ups.decode.posts("/inference/v1/generate")]
    assert leg["output_mode"] == "text" and "client_stream" not in leg


TOKENS_DECODE = {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}


def chained_config(ups: Upstreams) -> dict:
    """Decode answers tokens; the render tier derenders them (the chained path)."""
    return fake.config(ups, decode={"capabilities": TOKENS_DECODE}, engine={"extension": False,
                                                                           "derender_sessions": False})


def tokens_decode(request, body):
    stream = bool(body.get("stream"))
    if stream:
        return fake.stream_raw(fake.sse_bytes(fake.tokens_answer(True)))(request, body)
    return fake.answer_json(fake.tokens_answer(False))(request, body)


BAD_DERENDER = {  # case -> (answer, for the batch call, for the streamed calls)
    "not JSON": (fake.answer_raw(b"<html>10.66.66.66</html>"), True, True),
    "a list": (fake.answer_json([]), True, True),
    "a choice without message or text": (fake.answer_json({"choices": [{"index": 0}]}), True, False),
    "a choice index beyond n": (fake.answer_json({"choices": [{"index": 300, "message": {}}],
                                                  "chunk": {"choices": [{"index": 300}]}, "stream_state": {}}), True, True),
    "no stream_state": (fake.answer_json({"chunk": {"choices": []}}), False, True),
    "chunk a list": (fake.answer_json({"chunk": [], "stream_state": {}}), False, True),
}


@pytest.mark.parametrize("case", list(BAD_DERENDER))
def test_a_derender_answer_of_the_wrong_shape_is_an_error(ups: Upstreams, case: str) -> None:
    ups.decode.routes["/inference/v1/generate"] = tokens_decode
    answer, batch, streamed = BAD_DERENDER[case]
    with run_sidecar(chained_config(ups)) as sidecar:
        good = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] == fake.ANSWER, good.text
        good = read_stream(post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True}))
        assert good[-1] == "[DONE]" and "".join(e["choices"][0]["delta"].get("content") or ""
                                                for e in good[:-1] if e["choices"]) == fake.ANSWER, good
        ups.render.routes["/v1/chat/completions/derender"] = answer
        for stream in [s for s, bad in ((False, batch), (True, streamed)) if bad]:
            resp = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": stream})
            error = stream_error(resp) if stream else openai_error(resp)
            assert resp.status_code in (200, 502) and error["message"].startswith(
                "The derender tier answered with an invalid answer ("), (stream, error)
            assert_clean(resp, ups)
