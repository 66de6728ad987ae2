"""A derender session that writes the client's own chat (completions) chunks (``client_streams``), against the real
sidecar app and scripted upstreams (``upstreams``): a decode engine answering tokens, a render tier
whose session answers are scripted. The sidecar relays a session's client chunks as written once
checked; a render that does not offer them is never asked; a session answer that fails its checks
never reaches the client (the stream goes on statelessly, or fails with a 502 where it cannot be
continued exactly). The real render's sessions: tests/sidecar/test_sessions.py, tests/engine/test_sessions.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import requests
from aiohttp import web

from tests.sidecar import upstreams as fake
from tests.sidecar.support import run_sidecar
from tests.sidecar.upstreams import (  # noqa: F401 (fixtures)
    CHAT, COMPLETION, Upstreams, assert_clean, module_ups, post, read_stream, stream_error, ups,
)

SESSION = "/disagg/v1/derender/sessions/chat"
CMPL_SESSION = "/disagg/v1/derender/sessions/completions"
TOKENS_DECODE = {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}
CAPABILITIES = "/disagg/v1/capabilities"


def config(ups: Upstreams) -> dict[str, Any]:
    """A tokens-only decode engine; the derender tier (the render's URL) runs sessions."""
    return fake.config(ups, decode={"capabilities": TOKENS_DECODE}, engine={"extension": False,
                                                                           "derender_sessions": True})


async def tokens_decode(request: web.Request, body: Any) -> web.StreamResponse:
    """The decode engine's tokens, one a chunk ([21], then [22] with the end): two session lines."""
    if body.get("stream"):
        return await fake.stream_raw(fake.sse_bytes(fake.tokens_answer(True)))(request, body)
    return await fake.answer_json(fake.tokens_answer(False))(request, body)


def offers(client_streams: tuple[str, ...] | None) -> fake.Handler:
    sessions: dict[str, Any] = {"chat_path": SESSION, "completions_path": CMPL_SESSION}
    if client_streams is not None:
        sessions["client_streams"] = list(client_streams)
    return fake.answer_json({"role": "render", "derender_sessions": sessions})


def head(client: dict[str, Any]) -> dict[str, Any]:
    obj = "text_completion" if client.get("api") == "completions" else "chat.completion.chunk"
    return {"id": client["id"], "object": obj, "created": client["created"], "model": client["model"]}


ROLE = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
HELLO = {"index": 0, "delta": {"content": "hello"}, "logprobs": None, "finish_reason": None}
THERE = {"index": 0, "delta": {"content": " there"}, "logprobs": None, "finish_reason": "length", "stop_reason": None}
GOOD = [(1, ROLE), (1, HELLO), (2, THERE)]  # (fed, choice): the fed count is what the choice had consumed


def chunk(client: dict[str, Any], choice: dict[str, Any]) -> bytes:
    return json.dumps({**head(client), "choices": [choice]}, separators=(",", ":"), ensure_ascii=False).encode()


def client_events(client: dict[str, Any], script: list[tuple[int | None, dict[str, Any] | bytes]]) -> bytes:
    """Session events as the engine extension writes them for ``client_stream``: ``fed:`` beside the data."""
    out = b""
    for fed, choice in script:
        data = choice if isinstance(choice, bytes) else chunk(client, choice)
        out += (b"fed: %d\n" % fed if fed is not None else b"") + b"data: " + data + b"\n\n"
    return out


Script = Callable[[dict[str, Any] | None], bytes]


def session(script: Script, opened: list[dict[str, Any]]) -> fake.Handler:
    """A session endpoint: records the open line, answers ``script(client_stream)`` and [DONE]."""
    async def handle(request: web.Request, body: Any) -> web.StreamResponse:
        first = json.loads(bytes(body).split(b"\n", 1)[0])
        opened.append(first)
        return await fake.stream_raw(script(first.get("client_stream")) + b"data: [DONE]\n\n")(request, body)
    return handle


def good(client: dict[str, Any] | None) -> bytes:
    return client_events(client, GOOD)  # type: ignore[arg-type]


def old_form(client: dict[str, Any] | None) -> bytes:
    """What a render without ``client_streams`` answers: inline-derender events with ``fed`` inside."""
    events = [{"fed": fed, "request_id": "r", "output_mode": "derender", "choices": [choice]} for fed, choice in GOOD]
    return fake.sse_bytes(events, done=False)


def scripted(ups: Upstreams, script: Script, client_streams: tuple[str, ...] | None = ("chat",)) -> list[dict[str, Any]]:
    ups.decode.routes["/inference/v1/generate"] = tokens_decode
    ups.render.routes[CAPABILITIES] = offers(client_streams)
    opened: list[dict[str, Any]] = []
    ups.render.routes[SESSION] = ups.render.routes[CMPL_SESSION] = session(script, opened)
    ups.render.routes["/v1/completions/derender"] = completions_derender
    return opened


async def completions_derender(request: web.Request, body: Any) -> web.StreamResponse:
    """The stateless completions derender (a failed session's fallback): one chunk and its state per call."""
    gen = body["generate_chunk"]["choices"][0]
    text = "".join({21: "hello", 22: " there"}[t] for t in gen["token_ids"])
    return web.json_response({"chunk": {"id": "x", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.get("finish_reason"), "stop_reason": None}]},
        "stream_state": {"seen": len(gen["token_ids"])}})


def session_failures(sidecar) -> float:
    return sidecar.metric("disagg_sidecar_leg_errors_total", leg="derender", kind="session")


def stateless_calls(sidecar) -> float:
    return sidecar.metric("disagg_sidecar_derender_calls_total", kind="stream")


def test_the_sessions_client_chunks_are_the_clients_bytes(ups: Upstreams) -> None:
    """A render that offers client chunks is asked for them (the open line's ``client_stream``: the
    chat stream's id, created and model), and the client's stream is the session's data, byte for
    byte, ``fed`` left out; no stateless call."""
    resp, first = relayed_by_session(ups, scripted(ups, good), "/v1/chat/completions", CHAT)
    client = first["client_stream"]
    assert client["id"] == "chatcmpl-fake" and client["model"] == CHAT["model"] and client["return_token_ids"] is False
    assert resp.content == client_bytes(client, GOOD)
    assert_clean(resp, ups)


def relayed_by_session(ups: Upstreams, opened: list[dict[str, Any]], path: str,
                       body: dict[str, Any]) -> tuple[requests.Response, dict[str, Any]]:
    """``body`` streamed through a sidecar whose render session answers: the client's answer (200,
    no stateless call, no failed session) and the session's open line."""
    with run_sidecar(config(ups)) as sidecar:
        resp = post(sidecar.url, path, {**body, "stream": True})
        assert resp.status_code == 200, resp.text
        assert stateless_calls(sidecar) == 0 and session_failures(sidecar) == 0
    (first,) = opened
    return resp, first


def client_bytes(client: dict[str, Any], choices: list[tuple[int, dict[str, Any]]]) -> bytes:
    """The client's stream: each choice's chunk under the stream's header, then ``[DONE]``."""
    return b"".join(b"data: " + chunk(client, choice) + b"\n\n" for _, choice in choices) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("client_streams", [None, ("completions",)], ids=["not-reported", "not-for-chat"])
def test_a_render_that_does_not_offer_client_chunks_is_never_asked(ups: Upstreams, client_streams) -> None:
    """A render pod without ``client_streams`` for chat (an older extension) gets no ``client_stream``
    and its events are shaped: the client's stream is the same as from one that writes them."""
    opened = scripted(ups, old_form, client_streams)
    with run_sidecar(config(ups)) as sidecar:
        shaped = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True})
    (first,) = opened
    assert "client_stream" not in first
    scripted(ups, good)
    with run_sidecar(config(ups)) as sidecar:
        relayed = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True})
    assert_same_stream(shaped, relayed)


def assert_same_stream(a, b, ignored: tuple[str, ...] = ("created",)) -> None:
    """The same events but for ``created`` (each stream's own second) and any other ``ignored`` key."""
    view = lambda resp: [e if e == "[DONE]" else {k: v for k, v in e.items() if k not in ignored}
                         for e in read_stream(resp)]
    assert view(a) == view(b) and read_stream(a)[-1] == "[DONE]"


def test_a_pod_that_answers_the_old_form_although_asked_gets_its_events_shaped(ups: Upstreams) -> None:
    """Behind one Service an older pod may answer a session the capabilities of a newer one promised:
    its events do not start as the client's chunk, so they are shaped, and the client sees no difference."""
    opened = scripted(ups, old_form)
    with run_sidecar(config(ups)) as sidecar:
        shaped = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True})
        assert session_failures(sidecar) == 0 and stateless_calls(sidecar) == 0
    assert "client_stream" in opened[0]
    scripted(ups, good)
    with run_sidecar(config(ups)) as sidecar:
        relayed = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True})
    assert_same_stream(shaped, relayed)


def _bad(script: list[tuple[int | None, dict[str, Any] | bytes]]) -> Script:
    return lambda client: client_events(client, script)  # type: ignore[arg-type]


NOT_JSON = b'{"id":"chatcmpl-fake","object":"chat.completion.chunk","created":0,"model":"m","choices":[<html>10.66.66.66'
BAD_SESSIONS: dict[str, Callable[[dict[str, Any]], bytes]] = {
    # the header is the client's (the relay's prefix) and the rest is not JSON
    "not JSON after the header": lambda c: client_events(c, [GOOD[0]]) + b"fed: 1\ndata: " + chunk(c, HELLO)[:60]
    + b"<html>10.66.66.66</html>\n\n",
    "a choice index beyond n": lambda c: client_events(c, [GOOD[0], (1, {**HELLO, "index": 3})]),
    "no fed count": lambda c: client_events(c, [GOOD[0], (None, HELLO)]),
    "a fed count beyond the lines sent": lambda c: client_events(c, [GOOD[0], (7, HELLO)]),
    "an error event": lambda c: client_events(c, [GOOD[0]]) + b'data: {"error":{"message":"10.66.66.66"}}\n\n',
    "no finish reason, a line left": lambda c: client_events(c, [GOOD[0], (1, HELLO)]),
}


@pytest.mark.parametrize("case", list(BAD_SESSIONS))
def test_a_bad_session_event_never_reaches_the_client_and_the_stream_goes_on_statelessly(
        ups: Upstreams, case: str) -> None:
    """A session event that starts as the client's chunk but fails its checks is a failed session:
    nothing of it is written, and the stream continues statelessly from what the client got (the
    role chunk, relayed: its ``fed`` is no line's output), so the client's stream is whole and right."""
    scripted(ups, lambda client: BAD_SESSIONS[case](client))
    with run_sidecar(config(ups)) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True})
        assert session_failures(sidecar) == 1 and stateless_calls(sidecar) > 0
    events = read_stream(resp)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""} and all("role" not in d for d in deltas[1:]), events
    assert "".join(d.get("content") or "" for d in deltas) == fake.ANSWER  # the stateless calls coalesce lines
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]].count("length") == 1
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert b"<html>" not in resp.content and b'"index":3' not in resp.content and b"fed" not in resp.content
    assert_clean(resp, ups)


def test_a_session_that_answered_every_line_without_finishing_is_a_502(ups: Upstreams) -> None:
    """A session that claims every line's output was in its chunks but never finished the choice:
    no stateless call can finish it exactly, so the stream ends with the derender tier's 502 (no [DONE])."""
    scripted(ups, _bad([GOOD[0], (1, HELLO), (2, {**THERE, "finish_reason": None})]))
    with run_sidecar(config(ups)) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": True})
    error = stream_error(resp)
    assert error["code"] == 502 and error["message"].startswith(
        "The derender tier answered with an invalid answer (a derender session answered every line"), error
    assert_clean(resp, ups)


# -- completions: one prompt, no echo --------------------------------------------------------------

# vLLM's completions generator sets both id fields of each choice (null unless the client asked for them)
HELLO_TEXT = {"index": 0, "text": "hello", "logprobs": None, "finish_reason": None, "stop_reason": None,
              "prompt_token_ids": None, "token_ids": None}
THERE_TEXT = {**HELLO_TEXT, "text": " there", "finish_reason": "length"}
GOOD_TEXT = [(1, HELLO_TEXT), (2, THERE_TEXT)]
COMPLETIONS_ONLY = ("completions",)


def good_text(client: dict[str, Any] | None) -> bytes:
    return client_events(client, GOOD_TEXT)  # type: ignore[arg-type]


def old_text(client: dict[str, Any] | None) -> bytes:
    """A render without completions ``client_streams``: vLLM's chunks under the session's header, ``fed`` inside."""
    return fake.sse_bytes([{"fed": fed, "id": "cmpl-r", "object": "text_completion", "created": 1, "model": "",
                            "choices": [choice]} for fed, choice in GOOD_TEXT], done=False)


def test_a_completions_sessions_client_chunks_are_the_clients_bytes(ups: Upstreams) -> None:
    """A one-prompt completions stream on a render that offers completions client chunks: the open line
    asks for them (``client_stream`` with ``api: completions`` on a ``text`` leg, the stream's header), and
    the client's stream is the session's data byte for byte, ``fed`` left out; no stateless call."""
    resp, first = relayed_by_session(ups, scripted(ups, good_text, COMPLETIONS_ONLY), "/v1/completions", COMPLETION)
    client = first["client_stream"]
    assert first["output_mode"] == "text" and "completion_request" in first and "chat_request" not in first
    assert client["api"] == "completions" and client["id"].startswith("cmpl-") and client["model"] == COMPLETION["model"]
    assert resp.content == client_bytes(client, GOOD_TEXT)
    assert_clean(resp, ups)


@pytest.mark.parametrize("client_streams", [None, ("chat",)], ids=["not-reported", "chat-only"])
def test_a_render_without_completions_client_chunks_is_never_asked_for_them(ups: Upstreams, client_streams) -> None:
    """A render that writes no completions chunks of the client's gets no ``client_stream``; its events
    are shaped, and the client's stream is the same as from one that writes them."""
    opened = scripted(ups, old_text, client_streams)
    with run_sidecar(config(ups)) as sidecar:
        shaped = post(sidecar.url, "/v1/completions", {**COMPLETION, "stream": True})
        assert session_failures(sidecar) == 0
    (first,) = opened
    assert "client_stream" not in first and "output_mode" not in first
    scripted(ups, good_text, COMPLETIONS_ONLY)
    with run_sidecar(config(ups)) as sidecar:
        relayed = post(sidecar.url, "/v1/completions", {**COMPLETION, "stream": True})
    assert_same_stream(shaped, relayed, ("created", "id"))  # a completions stream's id: the sidecar's, per request


@pytest.mark.parametrize("extra", [{"prompt": ["hi", "ho"]}, {"echo": True}], ids=["several-prompts", "echo"])
def test_several_prompts_or_echo_keep_their_sessions_shaped(ups: Upstreams, extra) -> None:
    """Several prompts (their indices and one usage over all are the sidecar's) or echo (the prompt's
    text is the render tier's): each session is asked for shaped events, however the render offers."""
    opened = scripted(ups, old_text, COMPLETIONS_ONLY)
    with run_sidecar(config(ups)) as sidecar:
        resp = post(sidecar.url, "/v1/completions", {**COMPLETION, "stream": True, **extra})
        assert resp.status_code == 200, resp.text
        assert session_failures(sidecar) == 0
    assert opened and all("client_stream" not in first for first in opened)
    events = read_stream(resp)
    assert events[-1] == "[DONE]" and len({e["id"] for e in events[:-1]}) == 1 and b"fed" not in resp.content
    assert events[0]["id"] != "cmpl-r" and "".join(e["choices"][0]["text"] for e in events[:-1]).endswith(fake.ANSWER)


BAD_TEXT_SESSIONS: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "not JSON after the header": lambda c: b"fed: 1\ndata: " + chunk(c, HELLO_TEXT)[:60] + b"<html>10.66.66.66</html>\n\n",
    "a choice index beyond n": lambda c: client_events(c, [(1, {**HELLO_TEXT, "index": 3})]),
    "no fed count": lambda c: client_events(c, [(None, HELLO_TEXT)]),
    "a fed count beyond the lines sent": lambda c: client_events(c, [(7, HELLO_TEXT)]),
    "an error event": lambda c: client_events(c, [(1, HELLO_TEXT)]) + b'data: {"error":{"message":"10.66.66.66"}}\n\n',
    "no finish reason, a line left": lambda c: client_events(c, [(1, HELLO_TEXT)]),
}


@pytest.mark.parametrize("case", list(BAD_TEXT_SESSIONS))
def test_a_bad_completions_session_event_never_reaches_the_client_and_the_stream_goes_on_statelessly(
        ups: Upstreams, case: str) -> None:
    """As for chat: a completions session event that starts as the client's chunk but fails its checks
    is a failed session; nothing of it is written, and the stream continues statelessly from the lines
    whose output the client got, so the client's text is whole and finished once."""
    opened = scripted(ups, lambda client: BAD_TEXT_SESSIONS[case](client), COMPLETIONS_ONLY)
    with run_sidecar(config(ups)) as sidecar:
        resp = post(sidecar.url, "/v1/completions", {**COMPLETION, "stream": True})
        assert session_failures(sidecar) == 1 and stateless_calls(sidecar) > 0
    assert opened[0]["client_stream"]["api"] == "completions"  # asked, and its answer failed the checks
    events = read_stream(resp)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == fake.ANSWER
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 2) + ["length"]
    assert b"<html>" not in resp.content and b'"index":3' not in resp.content and b"fed" not in resp.content
    assert_clean(resp, ups)
