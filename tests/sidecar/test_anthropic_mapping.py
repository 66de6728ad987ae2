"""``derender.anthropic`` against the vLLM code it maps like (the venv's vLLM, no server): the
request as ``AnthropicServingMessages.to_chat_completion_request`` makes it, a chat answer as
``messages_full_converter`` and a chat stream as ``message_stream_converter`` turn it into
Anthropic's, table by table. Thinking signatures are random on both sides and left out."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from disagg_engine.testing.lanes import ALL_LANES
from disagg_sidecar.derender import anthropic
from disagg_sidecar.plan import anthropic_request
from tests.harness.lane_code import run_in_lane


@pytest.fixture(scope="module")
def vllm_messages():
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    return AnthropicServingMessages


TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {"properties": {"city": {"type": "string"}}}}
BASE = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
REQUESTS: dict[str, dict[str, Any]] = {
    "plain": BASE,
    "stream_and_sampling": {**BASE, "stream": True, "temperature": 0.5, "top_p": 0.9, "top_k": 3,
                            "stop_sequences": ["x"], "vllm_xargs": {"a": 1}, "cache_salt": "salt",
                            "chat_template_kwargs": {"enable_thinking": False}},
    "system_string": {**BASE, "system": "be brief"},
    "system_blocks_billing_header": {**BASE, "system": [{"type": "text", "text": "x-anthropic-billing-header: 1"},
                                                        {"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
    "inline_system": {**BASE, "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"},
                                           {"role": "user", "content": [{"type": "text", "text": "b"}]}]},
    "tools_auto": {**BASE, "tools": [TOOL]},
    "tool_choice_any_no_parallel": {**BASE, "tools": [TOOL],
                                    "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
    "tool_choice_named": {**BASE, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}},
    "tool_choice_none": {**BASE, "tools": [TOOL], "tool_choice": {"type": "none"}},
    "thinking_enabled": {**BASE, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024}},
    "thinking_disabled": {**BASE, "thinking": {"type": "disabled"}},
    "output_config": {**BASE, "output_config": {"effort": "low", "format": {"type": "json_schema",
                                                                           "schema": {"type": "object"}}}},
    "multi_turn_tools": {**BASE, "tools": [TOOL], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Köln"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18"},
                                                                          {"type": "text", "text": "C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            {"type": "text", "text": "and?"}]},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "odd"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}]},
    "tool_changes": {**BASE, "tools": [TOOL, {**TOOL, "name": "other", "defer_loading": True}], "messages": [
        {"role": "system", "content": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}},
                                       {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "other"}},
                                       {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {
                                           "name": "new", "input_schema": {"type": "object"}}}}]},
        {"role": "user", "content": "go"}]},
    "count_tokens_shape": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
                           "chat_template_kwargs": {"x": 1}},
}


def _vllm_chat_request(cls, body: dict[str, Any], merge: bool, effort: str) -> dict[str, Any]:
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest

    model = AnthropicMessagesRequest if "max_tokens" in body else AnthropicCountTokensRequest
    req = cls.to_chat_completion_request(model.model_validate(body), merge_inline_system=merge,
                                         disabled_thinking_effort=effort)
    return req.model_dump(mode="json", exclude_unset=True, exclude_none=True)


def _ours_validated(body: dict[str, Any], merge: bool, effort: str, min_tokens: int = 0) -> dict[str, Any]:
    """Ours, read by vLLM's ChatCompletionRequest as the derender tier reads it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    ours = anthropic_request.chat_request(body, merge_inline_system=merge, disabled_thinking_effort=effort,
                                          min_tokens=min_tokens)
    return ChatCompletionRequest.model_validate(ours).model_dump(mode="json", exclude_unset=True, exclude_none=True)


@pytest.mark.parametrize("merge", [False, True], ids=["inline", "merged"])
@pytest.mark.parametrize("case", list(REQUESTS))
def test_the_chat_request_is_vllms(vllm_messages, case: str, merge: bool) -> None:
    body = json.loads(json.dumps(REQUESTS[case]))
    want = _vllm_chat_request(vllm_messages, json.loads(json.dumps(body)), merge, "low")
    got = _ours_validated(body, merge, "low")
    for side in (want, got):  # vLLM names a tool_use block without id call_<time>: none here lack one
        side.pop("kv_transfer_params", None)  # never forwarded (only the connector sets them)
    assert got == want


# Fields of newer releases only: an older release's model ignores them (and refuses a new
# ``thinking`` type), on the coupled server and render alike.
NEWER: dict[str, dict[str, Any]] = {
    "thinking_between_tools": {**BASE, "thinking": {"type": "between_tools"}},  # 0.34
    "min_tokens": {**BASE, "min_tokens": 3, "stop_sequences": ["a"]},  # 0.34
}
REFUSED_BEFORE = {"thinking_between_tools": "0.34"}  # case -> the first lane whose vLLM accepts it
HONOURED_FROM = {"min_tokens": "0.34"}  # case -> the first lane whose vLLM reads its field
_TO_CHAT = """
import json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
out = {}
for name, (body, merge) in json.loads(sys.argv[1]).items():
    model = AnthropicMessagesRequest if "max_tokens" in body else AnthropicCountTokensRequest
    try:
        request = model.model_validate(body)
    except ValueError:
        out[name] = None
        continue
    chat = AnthropicServingMessages.to_chat_completion_request(request, merge_inline_system=merge,
                                                               disabled_thinking_effort="low")
    out[name] = chat.model_dump(mode="json", exclude_unset=True, exclude_none=True)
print("CHAT " + json.dumps(out))
"""


@pytest.mark.parity
@pytest.mark.parametrize("lane", ALL_LANES)
def test_the_chat_request_is_each_lanes_vllms(lane: str) -> None:
    """The mapping against ``to_chat_completion_request`` of each lane's vLLM (``run_in_lane``), with the fields only newer releases have: one that a lane's vLLM ignores changes
    nothing there, one it honours is vLLM's mapping. ``min_tokens`` comes from render's answer
    (``chat_request_as_rendered``): here the lane's vLLM says what render applies."""
    cases = {f"{name}-{merge}": (body, merge) for name, body in {**REQUESTS, **NEWER}.items()
             for merge in (False, True)}
    want_all = run_in_lane(lane, _TO_CHAT, cases, "CHAT")
    order = list(ALL_LANES)
    for key, (body, merge) in cases.items():
        name = key.rsplit("-", 1)[0]
        want = want_all[key]
        first = REFUSED_BEFORE.get(name)
        assert (want is None) == (first is not None and order.index(lane) < order.index(first)), key
        if want is None:
            continue
        since = HONOURED_FROM.get(name)
        applied = want.get("min_tokens", 0)
        assert (applied != 0) == (since is not None and order.index(lane) >= order.index(since)), key
        got = _ours_validated(json.loads(json.dumps(body)), merge, "low", min_tokens=applied)
        for side in (want, got):
            side.pop("kv_transfer_params", None)
            if side.get("min_tokens") == 0:  # 0.34 sets the default explicitly: the same request
                del side["min_tokens"]
        assert got == want, key


def _chat_response(message: dict[str, Any], finish: str, stop: Any = None, details: Any = None) -> dict[str, Any]:
    usage = {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27}
    if details is not None:
        usage["prompt_tokens_details"] = details
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "usage": usage,
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish,
                         "stop_reason": stop, "logprobs": None}]}


CALL = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}}
ANSWERS: dict[str, dict[str, Any]] = {
    "text": _chat_response({"content": "Hello"}, "stop"),
    "empty": _chat_response({"content": None}, "stop"),
    "reasoning_and_text": _chat_response({"content": "Hi", "reasoning": "think"}, "stop"),
    "tool_calls": _chat_response({"content": None, "reasoning": "r", "tool_calls": [CALL, {**CALL, "id": "c2"}]},
                                 "tool_calls"),
    "named_tool_stop": _chat_response({"content": None, "tool_calls": [CALL]}, "stop"),
    "length": _chat_response({"content": "cut"}, "length"),
    "stop_sequence": _chat_response({"content": "The"}, "stop", stop="France"),
    "stop_token": _chat_response({"content": "The"}, "stop", stop=151645),
    "cached": _chat_response({"content": "x"}, "stop", details={"cached_tokens": 16}),
}


def _without_signatures(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_signatures(v) for k, v in value.items() if k != "signature"}
    if isinstance(value, (list, tuple)):
        return [_without_signatures(v) for v in value]
    return value


@pytest.mark.parametrize("case", list(ANSWERS))
def test_the_batch_message_is_vllms(vllm_messages, case: str) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    chat = ANSWERS[case]
    want = vllm_messages.messages_full_converter(None, ChatCompletionResponse.model_validate(chat))
    got = anthropic.message(chat)
    assert _without_signatures(got) == _without_signatures(want.model_dump(mode="json", exclude_none=True))
    assert [b.get("signature") is not None for b in got["content"]] == [b["type"] == "thinking" for b in got["content"]]


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, stop: Any = None, usage: Any = None,
           choices: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                           "choices": []}
    if choices:
        choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        out["choices"] = [choice]
    if usage is not None:
        out["usage"] = usage
    return out


def _u(completion: int) -> dict[str, int]:
    return {"prompt_tokens": 20, "completion_tokens": completion, "total_tokens": 20 + completion}


def _call(index: int, id_: str | None = None, name: str | None = None, args: str | None = None) -> dict[str, Any]:
    fn = {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}
    return {"index": index, **({"id": id_, "type": "function"} if id_ else {}), "function": fn}


ROLE = _chunk({"role": "assistant", "content": ""}, usage=_u(0))
STREAMS: dict[str, list[dict[str, Any]]] = {
    "text": [ROLE, _chunk({"content": "Hel"}, usage=_u(1)), _chunk({"content": "lo"}, "stop", usage=_u(2)),
             _chunk(None, usage=_u(2), choices=False)],
    "reasoning_text_tools": [
        ROLE, _chunk({"reasoning": "th"}, usage=_u(1)), _chunk({"reasoning": "ink"}, usage=_u(2)),
        _chunk({"content": "\n\n"}, usage=_u(3)),
        _chunk({"tool_calls": [_call(0, "c1", "get_weather", '{"city":')]}, usage=_u(4)),
        _chunk({"content": "stray"}, usage=_u(5)),
        _chunk({"tool_calls": [_call(0, args=' "P"}')]}, usage=_u(6)),
        _chunk({"tool_calls": [_call(1, "c2", "get_time", "")]}, usage=_u(7)),
        _chunk({"tool_calls": [_call(1, args='{"tz": "X"}')]}, "tool_calls", usage=_u(8)),
        _chunk(None, usage=_u(8), choices=False)],
    "cut_inside_a_call": [ROLE, _chunk({"tool_calls": [_call(0, "c1", "get_weather", '{"ci')]}, "length", usage=_u(3)),
                          _chunk(None, usage=_u(3), choices=False)],
    "stop_sequence_cuts_a_call": [ROLE, _chunk({"tool_calls": [_call(0, "c1", "get_weather", '{"ci')]}, "stop",
                                               stop="ty", usage=_u(3)), _chunk(None, usage=_u(3), choices=False)],
    "stop_sequence": [ROLE, _chunk({"content": "The"}, "stop", stop="France", usage=_u(1)),
                      _chunk(None, usage=_u(1), choices=False)],
    "cached_usage": [{**ROLE, "usage": {**_u(0), "prompt_tokens_details": {"cached_tokens": 8}}},
                     _chunk({"content": "x"}, "stop", usage=_u(1)),
                     _chunk(None, usage={**_u(1), "prompt_tokens_details": {"cached_tokens": 8}}, choices=False)],
    "nothing": [ROLE, _chunk({"content": ""}, "stop", usage=_u(1)), _chunk(None, usage=_u(1), choices=False)],
}


def _parse(sse: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in sse.strip().split("\n\n"):
        lines = block.split("\n")
        events.append((lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))))
    return events


@pytest.mark.parametrize("case", list(STREAMS))
def test_the_stream_events_are_vllms(vllm_messages, case: str) -> None:
    chunks = STREAMS[case]

    async def vllm_events() -> str:
        async def chat():
            for c in chunks:
                yield "data: " + json.dumps(c) + "\n\n"
            yield "data: [DONE]\n\n"
        return "".join([e async for e in vllm_messages.message_stream_converter(None, chat())])

    want = _parse(asyncio.run(vllm_events()))
    converter = anthropic.MessageStream()
    events = [e for c in chunks for e in converter.feed(c)] + converter.finish()
    got = _parse(b"".join(anthropic.sse_event(e) for e in events).decode())
    assert _without_signatures(got) == _without_signatures(want)
    signatures = [d["delta"]["signature"] for _, d in got if d.get("delta", {}).get("type") == "signature_delta"]
    assert all(len(s) == 32 for s in signatures)


def test_openai_errors_become_anthropics_object_as_vllm_translates_them() -> None:
    from vllm.entrypoints.anthropic.api_router import translate_error_response
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    body = {"error": {"message": "bad 'x'", "type": "BadRequestError", "param": "x", "code": 400}}
    want = json.loads(translate_error_response(ErrorResponse(error=ErrorInfo(**body["error"]))).body)
    assert json.loads(anthropic.error_from_bytes(json.dumps(body).encode(), 400)) == want
    # not JSON (an aiohttp page): the text is the message, the type the status's
    assert json.loads(anthropic.error_from_bytes(b"Not Found", 404)) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "Not Found"}}
    # already Anthropic's: kept
    mine = json.dumps(want).encode()
    assert anthropic.error_from_bytes(mine, 400) == mine


@pytest.mark.parametrize("body, gen, min_tokens, effort", [
    # vLLM 0.34's render applied the client's min_tokens: the derender tier must see it too
    ({**BASE, "min_tokens": 3}, {"sampling_params": {"min_tokens": 3}}, 3, None),
    # an older render ignored it (not in its model): so does the parser context
    ({**BASE, "min_tokens": 3}, {"sampling_params": {"max_tokens": 50}}, None, None),
    ({**BASE, "thinking": {"type": "disabled"}},
     {"sampling_params": {}, "reasoning_parser_kwargs": {"chat_template_kwargs": {"reasoning_effort": "low"}}},
     None, "low"),
    ({**BASE, "thinking": {"type": "between_tools"}}, {"sampling_params": None}, None, "none"),
])
def test_the_chat_request_takes_what_render_applied(body, gen, min_tokens, effort) -> None:
    chat = anthropic_request.chat_request_as_rendered(body, gen)
    assert chat.get("min_tokens") == min_tokens and chat.get("reasoning_effort") == effort
