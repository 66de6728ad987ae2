"""The sidecar's session client (disagg_sidecar/derender/sessions.py): its pure pieces, no servers."""

from __future__ import annotations

import json

import pytest

from disagg_sidecar.derender import chained
from disagg_sidecar.plan import legs
from disagg_sidecar.derender import stream
from disagg_sidecar.derender import shapes
from disagg_sidecar.derender.sessions import (
    client_streams,
    event_fed,
    open_line,
    role_only,
    session_path,
    session_row,
    without_role,
)


def test_session_path_only_from_a_render_that_offers_it():
    caps = {"derender_sessions": {"chat_path": "/disagg/v1/derender/sessions/chat"}}
    assert session_path(caps, "chat") == "/disagg/v1/derender/sessions/chat"
    assert session_path(caps, "completions") is None  # a render with chat sessions only
    caps["derender_sessions"]["completions_path"] = "/c"
    assert session_path(caps, "completions") == "/c"
    for caps in (None, "absent", {}, {"derender_sessions": None}, {"derender_sessions": {"chat_path": "http://x/"}},
                 {"output_modes": ["tokens"]}):
        assert session_path(caps, "chat") is None


def test_open_line_is_the_decode_leg_with_the_parser_context():
    client = {"model": "m", "messages": [{"role": "user", "content": "secret question"}], "stop": ["x"],
              "stream": True, "stream_options": {"include_usage": True}, "tools": [{"type": "function"}]}
    gen = {"token_ids": [1, 2, 3], "sampling_params": {"stop": ["x"], "n": 2}}
    leg = legs.DerenderLeg("chat", json.dumps(client).encode(), gen["token_ids"])
    call = chained.ChatStream(leg, chained.Options.of(client, gen), tier=None, logprobs=False)
    line = open_line(call, "req-1")
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    body = json.loads(line)
    assert body["request_id"] == "req-1" and body["token_ids"] == [1, 2, 3] and body["stream"] is True
    assert body["sampling_params"] == gen["sampling_params"]  # the stop strings the engine applied
    assert body["stream_options"] == {"include_usage": True} and body["output_mode"] == "derender"
    # the parser context: no stop (the detokenizer applies the engine's), no conversation text
    assert "stop" not in body["chat_request"] and "secret" not in json.dumps(body["chat_request"])
    assert body["chat_request"]["tools"] == client["tools"]


@pytest.mark.parametrize("asked", [True, False])
def test_tokens_as_ids_are_the_sessions_and_the_sidecars_on_stateless_calls(asked: bool) -> None:
    """Stateless derender calls never carry return_tokens_as_token_ids (the sidecar writes the
    placeholders itself, with each sampled token's bytes); a session's chat generator does, as coupled."""
    client = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True, "logprobs": True,
              "return_tokens_as_token_ids": asked}
    gen = {"token_ids": [1, 2, 3], "sampling_params": {"n": 1, "logprobs": 0}}
    leg = legs.DerenderLeg("chat", json.dumps(client).encode(), gen["token_ids"])
    assert "return_tokens_as_token_ids" not in json.loads(leg.stream({"choices": []}, None))["chat_request"]
    call = chained.ChatStream(leg, chained.Options.of(client, gen), tier=None, logprobs=True)
    session_context = json.loads(open_line(call, "req-1"))["chat_request"]
    assert session_context.get("return_tokens_as_token_ids") is (True if asked else None)


def test_a_completions_open_line_carries_the_completions_request_without_its_prompt():
    client = {"model": "m", "prompt": "secret prompt", "stop": ["x"], "stream": True, "logprobs": 2,
              "stream_options": {"include_usage": True}}
    gen = {"token_ids": [1, 2, 3], "sampling_params": {"stop": ["x"], "n": 1, "logprobs": 2}}
    leg = legs.DerenderLeg("completions", json.dumps(client).encode(), gen["token_ids"])
    body = json.loads(open_line(chained.CompletionStream(leg, chained.Options.of(client, gen), tier=None), "r"))
    assert body["sampling_params"] == gen["sampling_params"] and body["token_ids"] == [1, 2, 3]
    assert "output_mode" not in body and "chat_request" not in body
    assert body["completion_request"]["logprobs"] == 2 and "stop" not in body["completion_request"]
    assert "secret" not in json.dumps(body)


def test_without_role_only_for_choices_the_client_already_started():
    chunk = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}},
                         {"index": 1, "delta": {"role": "assistant", "content": "b"}}]}
    out = without_role(chunk, {1})
    assert out["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert out["choices"][1]["delta"] == {"content": "b"}


def test_a_session_line_carries_the_choice_and_not_the_chunk_around_it():
    lp = {"content": [{"token_id": 5, "logprob": -0.5}]}
    chunk = {"request_id": "req-1", "prompt_token_ids": None, "kv_transfer_params": None,
             "choices": [{"index": 1, "token_ids": [5, 6], "finish_reason": None, "logprobs": None}]}
    assert session_row(chunk) == [1, [5, 6]]
    chunk["choices"][0].update(finish_reason="stop", stop_reason=7, logprobs=lp)
    assert session_row(chunk) == [1, [5, 6], "stop", 7, lp]
    chunk["choices"][0].update(stop_reason=None, logprobs=None)
    assert session_row(chunk) == [1, [5, 6], "stop"]  # a null between kept values stays


def test_a_chunk_of_several_tokens_becomes_one_line_per_token_and_merges_back():
    entries = [{"token_id": t, "logprob": -0.1 * t, "top_logprobs": []} for t in (5, 6, 7)]
    chunk = {"request_id": "r", "prompt_token_ids": [1, 2], "choices": [
        {"index": 1, "token_ids": [5, 6, 7], "finish_reason": "stop", "stop_reason": 9, "logprobs": {"content": entries}}]}
    pieces = stream.per_token(chunk)
    assert [session_row(p) for p in pieces] == [
        [1, [5], None, None, {"content": [entries[0]]}], [1, [6], None, None, {"content": [entries[1]]}],
        [1, [7], "stop", 9, {"content": [entries[2]]}]]
    assert stream.merge_chunks(pieces) == chunk
    one = {"choices": [{"index": 0, "token_ids": [5], "finish_reason": None}]}
    assert stream.per_token(one) == [one]
    plain = {"choices": [{"index": 0, "token_ids": [5, 6], "finish_reason": "length"}]}
    assert [session_row(p) for p in stream.per_token(plain)] == [[0, [5]], [0, [6], "length"]]


def test_client_chunks_only_from_a_render_that_offers_them_for_the_api():
    caps = {"derender_sessions": {"chat_path": "/s", "client_streams": ["chat"]}}
    assert client_streams(caps, "chat") and not client_streams(caps, "completions")
    for caps in (None, {}, {"derender_sessions": {"chat_path": "/s"}}, {"derender_sessions": {"client_streams": True}},
                 {"derender_sessions": {"client_streams": "chat"}}, {"client_streams": ["chat"]}):
        assert not client_streams(caps, "chat"), caps


def test_a_chat_open_line_asks_for_the_clients_chunks_under_the_clients_header():
    client = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True}
    gen = {"token_ids": [1, 2, 3], "sampling_params": {"n": 1}}
    leg = legs.DerenderLeg("chat", json.dumps(client).encode(), gen["token_ids"])
    shape = shapes.Shape(id="chatcmpl-r", created=7, model="served", prompt_tokens=3, cached_tokens=2,
                         return_token_ids=True)
    call = chained.ChatStream(leg, chained.Options.of(client, gen), tier=None, logprobs=False, client=shape)
    assert "client_stream" not in json.loads(open_line(call, "r"))
    body = json.loads(open_line(call, "r", shape.client_stream()))
    assert body["client_stream"] == shape.client_stream()
    assert {k: body["client_stream"][k] for k in ("id", "created", "model", "return_token_ids", "cached_tokens")} == {
        "id": "chatcmpl-r", "created": 7, "model": "served", "return_token_ids": True, "cached_tokens": 2}
    assert body["output_mode"] == "derender" and body["stream"] is True


def test_the_fed_count_of_a_client_chunk_is_its_field_and_of_an_old_event_its_key():
    event = {"choices": [{"index": 0}]}
    assert event_fed(b"fed: 12\ndata: {}", event, client=True) == 12 and event == {"choices": [{"index": 0}]}
    for raw in (b"data: {}", b"fed: -1\ndata: {}", b"fed: x\ndata: {}", b"fed: 1.5\ndata: {}", b"fed:\ndata: {}"):
        assert event_fed(raw, event, client=True) is None, raw
    old = {"fed": 3, "choices": [{"index": 0}]}
    assert event_fed(b"fed: 9\ndata: {}", old, client=False) == 3 and "fed" not in old  # the client never sees it


def test_only_a_chunk_with_the_role_alone_delivers_no_lines_output():
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    assert role_only(role) and role_only({"index": 0, "delta": {"role": "assistant"}})
    for other in ({**role, "delta": {"role": "assistant", "content": "a"}}, {**role, "finish_reason": "stop"},
                  {**role, "token_ids": [5]}, {**role, "logprobs": {"content": []}},
                  {**role, "delta": {"role": "assistant", "content": "", "reasoning": "r"}},
                  {**role, "delta": {"role": "assistant", "reasoning": "r"}},
                  {"index": 0, "delta": {"content": ""}}, {"index": 0, "text": "a"}):
        assert not role_only(other), other
