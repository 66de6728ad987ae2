"""The Anthropic Messages API through the legs, against the coupled server's ``/v1/messages`` on
the same engines: every content block and event, batch and streamed, on the inline path (decode
with the engine extension) and the chained path (decode answering tokens, the derender tier making
the answer). Ids, tool-use ids and thinking signatures are random on both sides: they are checked
for shape, not value. A stream's deltas are compared per block (merged while consecutive), as the
chained path may carry several tokens in one delta.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import requests

from disagg_engine.testing.lanes import PARITY_LANES
from tests.harness.forced import OUTPUTS, Forcer
from tests.harness.overlap import in_background
from tests.sidecar.support import (GENERATED, SERVED, check_engine_stopped, engine_metric, long_body, named_events,
                                   post_named, wait_for)

pytestmark = [pytest.mark.engine, pytest.mark.parity,
              pytest.mark.parametrize("lane_set", PARITY_LANES, indirect=True)]

MESSAGES = "/v1/messages"
SIGNATURE = re.compile(r"^[0-9a-f]{32}$")
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in OUTPUTS["tool_call"][1]["tools"]]


def messages_body(forcer: Forcer, name: str, stream: bool, **extra: Any) -> dict[str, Any]:
    """A Messages request that makes the engine emit ``OUTPUTS[name]``."""
    text, fields = OUTPUTS[name]
    body: dict[str, Any] = {"model": SERVED, "max_tokens": 256, "stream": stream,
                            "messages": [{"role": "user", "content": f"Please answer ({name})."}],
                            "vllm_xargs": forcer.xargs(text)}
    if "tools" in fields:
        body["tools"] = ANTHROPIC_TOOLS
    if "chat_template_kwargs" in fields:
        body["chat_template_kwargs"] = fields["chat_template_kwargs"]
    body.update(extra)
    return body


TOOL_TURNS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I look it up.", "signature": "abc"},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 C, sunny"},
                                 {"type": "text", "text": "And now Tokyo?"}]},
]

Case = Callable[[Forcer, bool], dict[str, Any]]


def _case(name: str, **extra: Any) -> Case:
    return lambda f, stream: messages_body(f, name, stream, **extra)


CASES: dict[str, Case] = {
    "plain": _case("plain"),
    "reasoning": _case("reasoning"),
    "one_tool_call": _case("tool_call"),
    "several_tool_calls": _case("two_tool_calls"),
    "reasoning_tool_call": _case("reasoning_tool_call"),
    "multibyte": _case("multibyte"),
    "system_prompt": _case("plain", system=[{"type": "text", "text": "You are terse."}]),
    "thinking_disabled": _case("plain", chat_template_kwargs=None, thinking={"type": "disabled"}),
    "stop_sequence": _case("plain", stop_sequences=["France"]),
    "stop_sequence_inside_a_second_tool_call": _case("two_tool_calls", stop_sequences=["Europe"]),
    "max_tokens_inside_a_tool_call": _case("tool_call", max_tokens=16),
    "max_tokens_in_reasoning": _case("reasoning", max_tokens=5),
    "tool_choice_any": _case("tool_call", tool_choice={"type": "any"}),
    "tool_choice_named": _case("tool_call", tool_choice={"type": "tool", "name": "get_weather"}),
    "no_parallel_tool_use": _case("tool_call", tool_choice={"type": "auto", "disable_parallel_tool_use": True}),
    "multi_turn_with_a_tool_result": lambda f, stream: {
        **messages_body(f, "reasoning_tool_call", stream), "messages": TOOL_TURNS},
    "metadata": _case("plain", metadata={"user_id": "client-1"}),  # vLLM reads nothing of it
}


def post(url: str, body: dict[str, Any], request_id: str) -> Any:
    return post_named(url + MESSAGES, body, request_id)


def _blocks_view(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for block in content:
        block = dict(block)
        if block["type"] == "thinking":
            assert SIGNATURE.match(block.pop("signature", "")), block
        if block["type"] == "tool_use":
            assert isinstance(block.pop("id"), str)
        out.append(block)
    return out


def message_view(resp: dict[str, Any]) -> dict[str, Any]:
    """A batch answer without its random parts (checked for shape)."""
    view = dict(resp)
    assert isinstance(view.pop("id"), str) and view["type"] == "message" and view["role"] == "assistant"
    view["content"] = _blocks_view(view["content"])
    return view


def stream_view(events: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """The events without random parts, consecutive deltas of one kind in one block merged."""
    out: list[Any] = []
    for name, data in events:
        data = json.loads(json.dumps(data))
        if name == "message_start":
            assert isinstance(data["message"].pop("id"), str)
        elif name == "content_block_start" and data["content_block"]["type"] == "tool_use":
            assert isinstance(data["content_block"].pop("id"), str)
        elif name == "content_block_delta" and data["delta"]["type"] == "signature_delta":
            assert SIGNATURE.match(data["delta"].pop("signature"))
        if name == "content_block_delta" and out and out[-1][0] == name:
            last = out[-1][1]
            kind = data["delta"]["type"]
            if last["index"] == data["index"] and last["delta"]["type"] == kind and kind != "signature_delta":
                field = next(k for k in data["delta"] if k != "type")
                last["delta"][field] += data["delta"][field]
                continue
        out.append((name, data))
    return out


def check_tool_ids_match(events: list[tuple[str, dict[str, Any]]]) -> None:
    ids = [d["content_block"]["id"] for n, d in events if n == "content_block_start"
           and d["content_block"]["type"] == "tool_use"]
    assert len(set(ids)) == len(ids) and all(ids)


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_messages_matrix(lane_set, forcer, lane_inline_sidecar, lane_chained_sidecar, case: str, stream: bool) -> None:
    body = CASES[case](forcer, stream)
    request_id = f"messages-{case}-{int(stream)}"
    reference = in_background(lambda: post(lane_set.url("coupled"), body, request_id))
    got = {path: post(sidecar.url, body, request_id)
           for path, sidecar in (("inline", lane_inline_sidecar), ("chained", lane_chained_sidecar))}
    view = stream_view if stream else message_view
    want = view(reference.result())
    for path, answer in got.items():
        assert view(answer) == want, path
        if stream:
            check_tool_ids_match(answer)


# Fields only newer releases have (plan/options.py places them): vLLM 0.34's ``min_tokens`` (the
# stop sequence in "The capital" is unchecked for the first three tokens) and ``thinking:
# between_tools`` (thinking off up front). An older release ignores the one and refuses the other,
# coupled and render alike.
NEWER: dict[str, Case] = {
    "min_tokens": _case("plain", stop_sequences=["a"], min_tokens=3),
    "thinking_between_tools": _case("plain", chat_template_kwargs=None, thinking={"type": "between_tools"}),
}


def _answer(url: str, body: dict[str, Any], request_id: str) -> tuple[int, Any]:
    """(status, the answer's view, or the error's message when refused)."""
    resp = requests.post(url + MESSAGES, json=body, headers={"X-Request-Id": request_id},
                         stream=bool(body.get("stream")), timeout=120)
    if resp.status_code != 200:  # coupled's in OpenAI's or Anthropic's shape, the sidecar's Anthropic's
        return resp.status_code, resp.json()["error"]["message"]
    if not body.get("stream"):
        return 200, message_view(resp.json())
    return 200, stream_view(list(named_events(resp.iter_lines())))


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
@pytest.mark.parametrize("case", list(NEWER))
def test_fields_of_newer_releases_are_answered_as_coupled(lane_set, forcer, lane_inline_sidecar,
                                                          lane_chained_sidecar, case: str, stream: bool) -> None:
    body = NEWER[case](forcer, stream)
    request_id = f"newer-{case}-{int(stream)}"
    want = _answer(lane_set.url("coupled"), body, request_id)
    honoured = tuple(int(x) for x in lane_set.vllm_lane.split(".")) >= (0, 34)
    if case == "thinking_between_tools":
        assert (want[0] == 200) is honoured, want
    else:  # the row exercises the field where vLLM has it: the answer runs past the early stop
        without = _answer(lane_set.url("coupled"), {k: v for k, v in body.items() if k != "min_tokens"}, request_id)
        assert want[0] == without[0] == 200 and (want != without) is honoured
    for path, sidecar in (("inline", lane_inline_sidecar), ("chained", lane_chained_sidecar)):
        assert _answer(sidecar.url, body, request_id) == want, path


def test_the_matrix_covers_every_stop_reason_and_block(lane_set, forcer, lane_inline_sidecar) -> None:
    """The cases above reach each of vLLM's stop reasons and block kinds (so the matrix can fail
    on each): checked on the coupled answers."""
    seen_reasons, seen_blocks = set(), set()
    for case in CASES:
        answer = post(lane_set.url("coupled"), CASES[case](forcer, False), f"cover-{case}")
        seen_reasons.add(answer["stop_reason"])
        seen_blocks |= {b["type"] for b in answer["content"]}
    assert seen_reasons == {"end_turn", "tool_use", "max_tokens", "stop_sequence"}
    assert seen_blocks == {"text", "thinking", "tool_use"}



COUNT_CASES: dict[str, dict[str, Any]] = {
    "plain": {"model": SERVED, "messages": [{"role": "user", "content": "How many tokens is this?"}]},
    "tools_system_and_turns": {"model": SERVED, "system": "Be brief.", "tools": ANTHROPIC_TOOLS,
                               "tool_choice": {"type": "any"}, "messages": TOOL_TURNS},
    # vLLM's rule budget < max_tokens is not one count_tokens has (it has no max_tokens)
    "thinking_enabled": {"model": SERVED, "thinking": {"type": "enabled", "budget_tokens": 2048},
                         "messages": [{"role": "user", "content": "Think."}]},
    "thinking_disabled": {"model": SERVED, "thinking": {"type": "disabled"},
                          "messages": [{"role": "user", "content": "Do not think."}]},
}


@pytest.mark.parametrize("case", list(COUNT_CASES))
def test_count_tokens_is_coupleds(lane_set, lane_inline_sidecar, case: str) -> None:
    body = COUNT_CASES[case]
    want = requests.post(lane_set.url("coupled") + "/v1/messages/count_tokens", json=body, timeout=60)
    got = requests.post(lane_inline_sidecar.url + "/v1/messages/count_tokens", json=body, timeout=60)
    assert want.status_code == 200, want.text
    assert (got.status_code, got.json()) == (200, want.json())


REFUSALS: dict[str, Callable[[Forcer], dict[str, Any]]] = {
    "no_max_tokens": lambda f: {k: v for k, v in messages_body(f, "plain", False).items() if k != "max_tokens"},
    "unknown_role": lambda f: {**messages_body(f, "plain", False), "messages": [{"role": "tool", "content": "x"}]},
    "budget_not_below_max_tokens": lambda f: {**messages_body(f, "plain", False),
                                              "thinking": {"type": "enabled", "budget_tokens": 4096}},
    "tool_choice_without_name": lambda f: {**messages_body(f, "tool_call", False), "tool_choice": {"type": "tool"}},
    "unknown_model": lambda f: {**messages_body(f, "plain", False), "model": "no-such-model"},
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_coupleds_in_anthropics_object(lane_set, forcer, lane_inline_sidecar, case: str) -> None:
    """What coupled refuses is refused with its status and message; the sidecar's is always
    Anthropic's object (coupled answers its request validation in OpenAI's shape)."""
    body = REFUSALS[case](forcer)
    want = requests.post(lane_set.url("coupled") + MESSAGES, json=body, timeout=60)
    got = requests.post(lane_inline_sidecar.url + MESSAGES, json=body, timeout=60)
    assert 400 <= want.status_code < 500, want.text
    assert got.status_code == want.status_code, got.text
    error = got.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    coupled = want.json()
    coupled_message = coupled["error"]["message"]
    assert error["error"]["message"] == coupled_message


def test_the_anthropic_sdk(lane_set, forcer, lane_inline_sidecar, lane_chained_sidecar) -> None:
    """The real client's ``messages.create`` and ``messages.stream`` read what coupled's give them."""
    import anthropic

    body = messages_body(forcer, "reasoning_tool_call", False)
    kwargs = {"model": body["model"], "max_tokens": body["max_tokens"], "messages": body["messages"],
              "tools": body["tools"], "extra_body": {"vllm_xargs": body["vllm_xargs"]}}

    def create(url: str) -> Any:
        return anthropic.Anthropic(base_url=url, api_key="unused").messages.create(**kwargs)

    def stream(url: str) -> tuple[list[str], Any]:
        with anthropic.Anthropic(base_url=url, api_key="unused").messages.stream(**kwargs) as s:
            kinds = [event.type for event in s]
            return kinds, s.get_final_message()

    def content(message: Any) -> list[Any]:
        return [(b.type, getattr(b, "text", None), getattr(b, "thinking", None), getattr(b, "name", None),
                 getattr(b, "input", None)) for b in message.content]

    want, (want_kinds, want_final) = create(lane_set.url("coupled")), stream(lane_set.url("coupled"))
    assert [b.type for b in want.content] == ["thinking", "tool_use"]
    for sidecar in (lane_inline_sidecar, lane_chained_sidecar):
        got = create(sidecar.url)
        assert content(got) == content(want) and got.stop_reason == want.stop_reason == "tool_use"
        assert got.usage == want.usage
        kinds, final = stream(sidecar.url)
        assert content(final) == content(want_final) and final.stop_reason == "tool_use"
        assert final.usage == want_final.usage
        assert set(kinds) == set(want_kinds)


RUNNING = "vllm:num_requests_running"


@pytest.mark.parametrize("path", ["inline", "chained"])
def test_a_client_that_goes_away_stops_the_engine(lane_set, forcer, request, path: str) -> None:
    """Abort on disconnect, as for chat: the decode engine stops, the answer unfinished."""
    sidecar = request.getfixturevalue(f"lane_{path}_sidecar")
    decode = lane_set.url("decode")
    assert wait_for(lambda: engine_metric(decode, RUNNING) == 0, timeout=30), "decode busy before the test"
    chat_body = long_body(forcer, 8000)
    body = {**messages_body(forcer, "plain", True), "vllm_xargs": chat_body["vllm_xargs"],
            "max_tokens": chat_body["max_tokens"]}
    resp = requests.post(sidecar.url + MESSAGES, json=body, stream=True, timeout=120)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    assert [line for line in (next(lines) for _ in range(12)) if line.startswith(b"event: content_block_delta")]
    assert engine_metric(decode, RUNNING) == 1
    aborts, generated = sidecar.metric("disagg_sidecar_aborts_total"), engine_metric(decode, GENERATED)
    resp.close()
    check_engine_stopped(decode, generated, 8000)
    assert wait_for(lambda: sidecar.metric("disagg_sidecar_aborts_total") == aborts + 1, timeout=5)


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
@pytest.mark.parametrize("case", ["reasoning_tool_call", "stop_sequence", "multi_turn_with_a_tool_result"])
def test_messages_on_a_stock_decode_engine(lane_set, forcer, lane_stock_sidecar, case: str, stream: bool) -> None:
    """A decode engine without the extension (the coupled server as decode): the sidecar chains."""
    body = CASES[case](forcer, stream)
    view = stream_view if stream else message_view
    want = view(post(lane_set.url("coupled"), body, f"stock-{case}"))
    assert view(post(lane_stock_sidecar.url, body, f"stock-{case}")) == want
