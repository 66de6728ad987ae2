"""Response shaping (pure): ids, usage, vLLM 0.32's derender quirks, chunk filtering."""

from __future__ import annotations

import pytest

from disagg_sidecar.derender import shapes
from disagg_sidecar.derender.fixes import chat_finish_reason, chat_tokens_as_ids, generate_for_derender, tool_call_id
from disagg_sidecar.derender.usage import add_usage, cached_tokens, fix_usage, total_usage

SHAPE = shapes.Shape(id="chatcmpl-r1", created=123, model="m", prompt_tokens=10)
NIXL_KV = {"remote_engine_id": "e", "remote_prefill_cached_tokens": 8}


def test_usage_prompt_tokens_from_render_and_cached_tokens_from_prefill() -> None:
    usage = {"prompt_tokens": 99, "completion_tokens": 5, "total_tokens": 104,
             "prompt_tokens_details": {"cached_tokens": 0}}
    assert fix_usage(usage, prompt_tokens=10, cached=cached_tokens(NIXL_KV)) == {
        "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 8}}
    # No details reported (no --enable-prompt-tokens-details): none invented, as coupled.
    assert fix_usage({"completion_tokens": 5, "prompt_tokens_details": None}, prompt_tokens=10, cached=8)[
        "prompt_tokens_details"] is None
    assert cached_tokens(None) is None and cached_tokens({"remote_prefill_cached_tokens": "x"}) is None
    assert fix_usage(None, prompt_tokens=1) is None


def test_add_usage() -> None:
    a = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 1}}
    b = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2}}
    assert add_usage(a, b) == {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13,
                               "prompt_tokens_details": {"cached_tokens": 3}}
    assert add_usage(None, b) == b and add_usage(None, None) is None
    assert total_usage([a, None, b]) == add_usage(a, b) and total_usage([None, None]) is None
    assert total_usage(iter([b])) == b


@pytest.mark.parametrize("finish, calls, tool_choice, expected", [
    ("stop", True, None, "tool_calls"),
    ("stop", True, "auto", "tool_calls"),
    ("stop", False, "required", "tool_calls"),
    ("stop", True, {"type": "function", "function": {"name": "f"}}, "stop"),  # named: coupled says stop
    ("stop", False, None, "stop"),
    ("length", True, None, "tool_calls"),  # a max_tokens cut after a complete call (coupled batch)
    ("length", False, None, "length"),
    ("length", False, "required", "length"),
    ("length", True, {"type": "function", "function": {"name": "f"}}, "length"),
])
def test_chat_finish_reason(finish, calls, tool_choice, expected) -> None:
    assert chat_finish_reason(finish, calls, tool_choice) == expected


def test_tool_call_ids_get_the_coupled_prefix() -> None:
    assert tool_call_id("90980b82a4aa8573") == "chatcmpl-tool-90980b82a4aa8573"
    assert tool_call_id("chatcmpl-tool-90980b82a4aa8573") == "chatcmpl-tool-90980b82a4aa8573"
    assert tool_call_id(None) is None


def test_stop_token_is_not_sent_to_derender() -> None:
    gen = {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": [1, 2, 99],
                        "logprobs": {"content": [{"t": 1}, {"t": 2}, {"t": 99}]}}]}
    fixed = generate_for_derender(gen)
    # The stop token's logprob entry stays: coupled reports it (derender resolves entries on their own).
    assert fixed["choices"][0]["token_ids"] == [1, 2] and len(fixed["choices"][0]["logprobs"]["content"]) == 3
    assert gen["choices"][0]["token_ids"] == [1, 2, 99], "not mutated"
    assert generate_for_derender(gen, include_stop_str_in_output=True) == gen
    stop_string = {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "STOP", "token_ids": [1, 2]}]}
    assert generate_for_derender(stop_string) == stop_string  # a stop string is text, not a token
    length = {"choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [1, 2]}]}
    assert generate_for_derender(length) == length


def test_chat_from_derender_normalises_and_uses_the_engine_usage() -> None:
    derendered = {"id": "generate-tokens-r1", "choices": [{
        "index": 0, "finish_reason": "stop", "stop_reason": None, "logprobs": None,
        "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "90980b82a4aa8573", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 31, "total_tokens": 41}}
    generate = {"choices": [{"index": 0, "token_ids": [1] * 32}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 32, "total_tokens": 42}}
    out = shapes.chat_from_derender(derendered, SHAPE, generate)
    assert out["id"] == "chatcmpl-r1" and out["object"] == "chat.completion" and out["created"] == 123
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert out["usage"]["completion_tokens"] == 32 and out["usage"]["total_tokens"] == 42
    assert choice["token_ids"] is None and out["kv_transfer_params"] is None


def test_chat_from_inline_generate() -> None:
    gen = {"output_mode": "derender", "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
           "kv_transfer_params": {"secret": 1},
           "choices": [{"index": 1, "finish_reason": "stop", "stop_reason": None, "token_ids": [5, 6],
                        "message": {"role": "assistant", "content": "hi"}, "logprobs": None}]}
    out = shapes.chat_from_generate(gen, SHAPE, [1, 2, 3])
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert out["choices"][0]["token_ids"] is None and out["prompt_token_ids"] is None
    assert out["kv_transfer_params"] is None, "engine KV handles are not the client's business"
    with_ids = shapes.Shape(**{**SHAPE.__dict__, "return_token_ids": True})
    out = shapes.chat_from_generate(gen, with_ids, [1, 2, 3])
    assert out["choices"][0]["token_ids"] == [5, 6] and out["prompt_token_ids"] == [1, 2, 3]
    text = shapes.chat_from_generate({"choices": [{"index": 0, "text": "plain", "finish_reason": "length"}]},
                                        SHAPE, [1])
    assert text["choices"][0]["message"]["content"] == "plain" and text["choices"][0]["message"]["tool_calls"] == []


@pytest.mark.parametrize("omits_none", [False, True])
def test_a_release_that_omits_none_fields_gets_them_omitted(omits_none: bool) -> None:
    """vLLM 0.34's coupled server leaves out message.annotations and usage.prompt_tokens_details when
    None; 0.32/0.33's write null. Set values stay either way."""
    shape = shapes.Shape(**{**SHAPE.__dict__, "omits_none": omits_none})
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "prompt_tokens_details": None}
    text = shapes.chat_from_generate({"usage": usage, "choices": [
        {"index": 0, "text": "plain", "finish_reason": "length"}]}, shape, [1])
    message = text["choices"][0]["message"]
    assert ("annotations" in message, "prompt_tokens_details" in text["usage"]) == (not omits_none, not omits_none)
    assert message["refusal"] is None and text["usage"]["completion_tokens"] == 1  # other nulls and values stay
    kept = shapes.chat_from_generate({"usage": {**usage, "prompt_tokens_details": {"cached_tokens": 0}},
                                         "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                             "role": "assistant", "content": "x", "annotations": [{"type": "u"}]}}]},
                                        shape, [1])
    assert kept["choices"][0]["message"]["annotations"] == [{"type": "u"}]
    assert kept["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    chunk = shapes.usage_chunk("text_completion", shape, usage)
    assert ("prompt_tokens_details" in chunk["usage"]) is not omits_none


def test_chat_chunks() -> None:
    first: set[int] = set()
    derender_chunk = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None, "reasoning": None},
                                   "finish_reason": None, "logprobs": None, "token_ids": None}],
                      "usage": None, "prompt_token_ids": None}
    out = shapes.chat_chunk(derender_chunk, SHAPE, first=first)
    assert out == {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 123, "model": "m",
                   "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}]}
    # Inline derender sends chunks that only carry token ids; coupled has none of them.
    token_only = {"choices": [{"index": 0, "delta": {}, "token_ids": [7], "finish_reason": None, "logprobs": None}],
                  "prompt_token_ids": [1, 2]}
    assert shapes.chat_chunk(token_only, SHAPE, first=first) is None
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls", "stop_reason": None}]}
    assert shapes.chat_chunk(finish, SHAPE, first=first)["choices"][0]["finish_reason"] == "tool_calls"
    call = {"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "abcdef0123456789", "index": 0,
                                                               "function": {"name": "f", "arguments": None}}]}}]}
    delta = shapes.chat_chunk(call, SHAPE, first=first)["choices"][0]["delta"]
    assert delta == {"tool_calls": [{"id": "chatcmpl-tool-abcdef0123456789", "index": 0, "function": {"name": "f"}}]}
    # Text mode: the role goes on each choice's first chunk.
    text = [shapes.chat_chunk({"choices": [{"index": i, "text": t, "finish_reason": None}]}, SHAPE, first=set())
            for i, t in ((0, "a"), (1, "b"))]
    assert [c["choices"][0]["delta"] for c in text] == [{"role": "assistant", "content": "a"},
                                                        {"role": "assistant", "content": "b"}]


def test_the_role_goes_apart_as_coupled_sends_it() -> None:
    """vLLM 0.34's stock derender stream opens a choice with its role and first token in one chunk;
    coupled sends the role alone first (content "", the prompt's ids, usage with no completion)."""
    usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10,
             "completion_tokens_details": {"reasoning_tokens": 1}}
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 1, "delta": {"role": "assistant", "reasoning": "I"}, "token_ids": [7],
                          "logprobs": {"content": [{"token": "I"}]}, "finish_reason": None}], "usage": usage}
    head, rest = shapes.role_apart(chunk)
    assert head == {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
                    "choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}],
                    "usage": {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9,
                              "completion_tokens_details": {"reasoning_tokens": 0}}}
    assert "prompt_token_ids" not in rest and rest["usage"] == usage
    assert rest["choices"] == [{**chunk["choices"][0], "delta": {"reasoning": "I"}}]
    # a role chunk alone, a chunk without a role, a usage chunk: as they are
    for alone in ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {"content": "x"}}]}, {"choices": [], "usage": usage}):
        assert shapes.role_apart(alone) == [alone]
    # inline text mode: the role with the first text
    text = shapes.chat_chunk({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}, SHAPE, first=set())
    assert [c["choices"][0]["delta"] for c in shapes.role_apart(text)] == [{"role": "assistant", "content": ""},
                                                                           {"content": "a"}]


def test_completion_shapes_reindex_prompts() -> None:
    shape = shapes.Shape(id="cmpl-r1", created=1, model="m", prompt_tokens=4, index_offset=2)
    chunk = shapes.completion_chunk({"choices": [{"index": 1, "text": "x", "finish_reason": None}]}, shape)
    assert chunk["choices"][0]["index"] == 3 and chunk["object"] == "text_completion"
    assert shapes.completion_chunk({"choices": [], "usage": {}}, shape) is None
    choices = shapes.completion_choices({"choices": [{"index": 0, "text": "t", "finish_reason": "stop"}]},
                                           shape, [1, 2])
    assert choices[0]["index"] == 2 and choices[0]["prompt_token_ids"] is None and choices[0]["prompt_logprobs"] is None
    plp = [None, {"7": {"logprob": -1.0, "rank": 1, "decoded_token": "a"}}]
    choices = shapes.completion_choices({"choices": [{"index": 0, "text": "t"}, {"index": 1, "text": "u"}]},
                                        shape, [1, 2], plp)
    assert [c["prompt_logprobs"] for c in choices] == [plp, plp]  # every choice carries its prompt's


def test_chat_tokens_as_ids_writes_coupled_placeholders() -> None:
    """The sampled token keeps the bytes of its text (vLLM's ``_create_chat_logprobs``); a candidate
    gets the placeholder's own bytes (``_get_top_logprobs``)."""
    resolved = {"content": [{"token": "é", "logprob": -1.0, "bytes": [195, 169], "top_logprobs": [
        {"token": "é", "logprob": -1.0, "bytes": [195, 169]}, {"token": "x", "logprob": -2.0, "bytes": [120]}]}]}
    entries = [{"token_id": 12, "logprob": -1.0, "top_logprobs": [{"token_id": 12}, {"token_id": 7}]}]
    out = chat_tokens_as_ids(resolved, entries)
    (entry,) = out["content"]
    assert (entry["token"], entry["bytes"], entry["logprob"]) == ("token_id:12", [195, 169], -1.0)
    assert entry["top_logprobs"] == [{"token": "token_id:12", "logprob": -1.0, "bytes": list(b"token_id:12")},
                                     {"token": "token_id:7", "logprob": -2.0, "bytes": list(b"token_id:7")}]
    assert chat_tokens_as_ids(None, entries) is None and chat_tokens_as_ids(resolved, None) == resolved
