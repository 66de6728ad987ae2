"""The per-leg rewrite table (docs/protocol.md §4), pure: what the prefill and decode legs get for the
GenerateRequest that render produced from a chat or completions request, or that a generate
client sent, across stream/not, n, min_tokens, stop, logprobs and stream_options."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from disagg_sidecar.plan import legs
from disagg_sidecar.connectors import ExampleConnector, NixlConnector, PrefilledAt, get_connector

NIXL_PREFILL = NixlConnector().prefill_params()
NIXL_REPLY = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
              "remote_engine_id": "e1", "remote_request_id": "r1", "remote_host": "10.0.0.5", "remote_port": 5600,
              "tp_size": 1, "remote_prefill_cached_tokens": 16}
CHAT_REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
PARSE_CONTEXT = {"tools": None, "tool_choice": "none", "include_reasoning": True}


def gen(**over: Any) -> dict[str, Any]:
    """A GenerateRequest as /render returns it (0.32: client kv params left in extra_args)."""
    sampling = {"max_tokens": 256, "temperature": 1.0, "stop": [], "stop_token_ids": [], "output_kind": 2,
                "extra_args": {"forced_token_ids": [1, 2]}}
    sampling.update(over.pop("sampling", {}))
    body = {"request_id": "chatcmpl-x", "token_ids": [5, 6, 7], "sampling_params": sampling, "model": "m",
            "output_mode": "tokens", "stream": False, "stream_options": None, "cache_salt": None, "priority": 0,
            "kv_transfer_params": None}
    body.update(over)
    return body


STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False},
          "sampling": {"output_kind": 1}}

# case -> (GenerateRequest in, connector, tokens_only,
#          expected prefill: {key: value} and keys absent, expected decode sampling_params changes)
CASES: dict[str, tuple[dict[str, Any], str, bool]] = {
    "chat": (gen(), "ExampleConnector", True),
    "chat-stream": (gen(**copy.deepcopy(STREAM)), "ExampleConnector", True),
    "chat-0.33-parse-context": (gen(parse_context=PARSE_CONTEXT), "ExampleConnector", True),
    "chat-n2": (gen(sampling={"n": 2}), "ExampleConnector", True),
    "chat-min-tokens": (gen(sampling={"min_tokens": 5}), "ExampleConnector", True),
    "chat-stop": (gen(sampling={"stop": ["STOP"], "include_stop_str_in_output": False}), "ExampleConnector", True),
    "chat-stop-prefill-with-tokenizer": (gen(sampling={"stop": ["STOP"]}), "ExampleConnector", False),
    "chat-logprobs": (gen(sampling={"logprobs": 5, "prompt_logprobs": 1}), "ExampleConnector", True),
    "chat-structured": (gen(sampling={"structured_outputs": {"json": {}}, "bad_words": ["x"]}), "ExampleConnector", True),
    "chat-nixl": (gen(), "NixlConnector", True),
    "chat-client-kv": (gen(kv_transfer_params={"remote_host": "evil"},
                           sampling={"extra_args": {"kv_transfer_params": {"remote_host": "evil"}}}),
                       "NixlConnector", True),
    "completions": (gen(request_id="cmpl-x-0"), "ExampleConnector", True),
    "completions-stream-n2-logprobs": (gen(request_id="cmpl-x", **{**copy.deepcopy(STREAM),
                                           "sampling": {"output_kind": 1, "n": 2, "logprobs": 3}}),
                                       "NixlConnector", True),
    "generate-text": (gen(output_mode="text"), "ExampleConnector", True),
    "generate-derender-chat-request": (gen(output_mode="derender", chat_request=CHAT_REQUEST, **copy.deepcopy(STREAM)),
                                       "NixlConnector", True),
    "generate-derender-parse-context": (gen(output_mode="derender", parse_context=PARSE_CONTEXT), "ExampleConnector", True),
    "generate-no-sampling-keys": (gen(sampling={}), "ExampleConnector", True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_leg(name: str) -> None:
    body, connector_name, tokens_only = CASES[name]
    before = copy.deepcopy(body)
    connector = get_connector(connector_name)
    p = legs.prefill_leg(body, connector, tokens_only=tokens_only)
    assert body == before, "the client's request is not mutated"
    sp = p["sampling_params"]
    # One token, one sequence, tokens mode, not streamed: only the KV cache matters.
    assert sp["max_tokens"] == 1 and sp["n"] == 1
    assert p["stream"] is False and "stream_options" not in p
    assert p["output_mode"] == "tokens"
    for key in ("chat_request", "parse_context", "return_token_ids"):
        assert key not in p
    for key in ("min_tokens", "logprobs", "prompt_logprobs"):
        assert key not in sp
    if tokens_only:
        for key in ("stop", "bad_words", "structured_outputs"):
            assert key not in sp, key
    else:
        assert sp.get("stop") == body["sampling_params"].get("stop")
    # KV params are the connector's, never the client's.
    assert p["kv_transfer_params"] == (NIXL_PREFILL if connector_name == "NixlConnector" else None)
    assert "kv_transfer_params" not in sp.get("extra_args", {})
    # Everything else reaches prefill unchanged (prompt, salt, priority, forced ids, temperature).
    for key in ("token_ids", "model", "cache_salt", "priority", "request_id"):
        assert p[key] == body[key]
    for key in ("temperature", "stop_token_ids"):
        if key in body["sampling_params"]:
            assert sp[key] == body["sampling_params"][key]
    assert sp.get("extra_args", {}).get("forced_token_ids") == body["sampling_params"].get("extra_args", {}).get(
        "forced_token_ids")


@pytest.mark.parametrize("name", list(CASES))
def test_decode_leg(name: str) -> None:
    body, connector_name, _ = CASES[name]
    before = copy.deepcopy(body)
    connector = get_connector(connector_name)
    reply = NIXL_REPLY if connector_name == "NixlConnector" else None
    kv = connector.decode_params(reply, PrefilledAt("10.0.0.5", (5600,)))
    mode = body["output_mode"]
    context = {k: body[k] for k in ("chat_request", "parse_context") if k in body}
    d = legs.decode_leg(body, kv, output_mode=mode, context=context)
    assert body == before
    # The prefill's reply verbatim (NIXL), nothing for ExampleConnector.
    assert d["kv_transfer_params"] == (NIXL_REPLY if connector_name == "NixlConnector" else None)
    # The client's fields come back: stream, stream_options, n, min_tokens, stop, logprobs, limits.
    expected_sp = {k: v for k, v in body["sampling_params"].items()}
    extra = {k: v for k, v in expected_sp.get("extra_args", {}).items() if k != "kv_transfer_params"}
    if extra:
        expected_sp["extra_args"] = extra
    else:
        expected_sp.pop("extra_args", None)
    assert d["sampling_params"] == expected_sp
    for key in ("stream", "stream_options", "token_ids", "request_id", "cache_salt", "priority"):
        assert d[key] == body[key]
    assert d["output_mode"] == mode
    # The parser context reaches decode only with output_mode=derender.
    for key in ("chat_request", "parse_context"):
        assert d.get(key) == (body.get(key) if mode == "derender" else None)


def test_decode_leg_with_the_sidecar_chosen_mode() -> None:
    d = legs.decode_leg(gen(), None, output_mode="derender", context={"chat_request": CHAT_REQUEST})
    assert d["output_mode"] == "derender" and d["chat_request"] == CHAT_REQUEST
    d = legs.decode_leg(gen(), None, output_mode="tokens", context={"chat_request": CHAT_REQUEST})
    assert d["output_mode"] == "tokens" and "chat_request" not in d


@pytest.mark.parametrize("mode", [None, "tokens", "text", "derender"])
def test_a_generate_clients_decode_leg_keeps_its_mode_and_context(mode) -> None:
    body = {**gen(), "chat_request": CHAT_REQUEST, "sampling_params": {"max_tokens": 3, "extra_args": {
        "kv_transfer_params": {"remote_host": "attacker"}}}}
    body.pop("output_mode")
    if mode is not None:
        body["output_mode"] = mode
    d = legs.client_decode_leg(body, {"remote_block_ids": [1]})
    assert d["output_mode"] == (mode or "tokens")
    assert d["chat_request"] == CHAT_REQUEST  # the engine's to use or to reject, as sent directly
    assert d["kv_transfer_params"] == {"remote_block_ids": [1]} and d["sampling_params"] == {"max_tokens": 3}


@pytest.mark.parametrize("mode, context, expected_context", [
    ("derender", "chat_request", {"chat_request": {"model": "m", "messages": [{"role": "user", "content": "h\u00e9"}]}}),
    ("derender", "parse_context", {"parse_context": {"tools": None}}),
    ("tokens", "chat_request", {}),  # a chained answer needs no parser context on decode
    ("text", None, {}),
])
def test_decode_body(mode, context, expected_context) -> None:
    client = b'{"model": "m",  "messages": [{"role": "user", "content": "h\\u00e9"}]}'
    rendered = {**gen(), "parse_context": {"tools": None}}
    body = legs.decode_body(rendered, {"remote_block_ids": [1]}, mode, context, client)
    parsed = json.loads(body)
    assert parsed["output_mode"] == mode and parsed["kv_transfer_params"] == {"remote_block_ids": [1]}
    assert {k: parsed[k] for k in ("chat_request", "parse_context") if k in parsed} == expected_context
    if context == "chat_request" and mode == "derender":
        assert body.endswith(b',"chat_request":' + client + b"}")  # the client's bytes, not re-serialised


@pytest.mark.parametrize("mode, stop, detokenize, prompt_logprobs", [
    ("tokens", None, False, None), ("tokens", [], False, None),  # the derender tier makes the text
    ("tokens", ["\n\n"], None, None),  # the engine's stop strings need its detokenizer
    ("tokens", None, None, 0),  # prompt logprobs' decoded_token is the engine detokenizer's
    ("text", None, None, None), ("derender", None, None, None),
])
def test_a_tokens_decode_leg_is_not_detokenized_unless_stop_strings_need_it(mode, stop, detokenize,
                                                                            prompt_logprobs) -> None:
    rendered = gen()
    if stop is not None:
        rendered["sampling_params"] = {**rendered["sampling_params"], "stop": stop}
    if prompt_logprobs is not None:
        rendered["sampling_params"] = {**rendered["sampling_params"], "prompt_logprobs": prompt_logprobs}
    body = json.loads(legs.decode_body(rendered, None, mode, None, None))
    assert body["sampling_params"].get("detokenize") == detokenize
    assert "detokenize" not in rendered["sampling_params"]  # render's answer is left as it was


def test_connectors_by_name() -> None:
    assert isinstance(get_connector("NixlConnector"), NixlConnector)
    assert isinstance(get_connector("ExampleConnector"), ExampleConnector)
    with pytest.raises(ValueError, match="unknown KV connector"):
        get_connector("Nope")


def test_engine_request_id() -> None:
    assert legs.engine_request_id("abc") == "generate-tokens-abc"


@pytest.mark.parametrize("chain", ["chat", "completions"])
def test_derender_bodies_are_spliced_not_reserialised(chain: str) -> None:
    client = b'{"model": "m",  "messages": [{"role": "user", "content": "h\\u00e9"}], "stream": true}'
    leg = legs.DerenderLeg(chain, client, [1, 2, 3])
    generate_response = b'{"request_id": "g", "choices": [{"index": 0, "token_ids": [9]}]}'
    batch = leg.batch(generate_response)
    assert generate_response in batch  # verbatim bytes
    parsed = json.loads(batch)
    context_key = "chat_request" if chain == "chat" else "completion_request"
    context = json.loads(legs.parser_context(client, chain))
    assert parsed[context_key] == context
    if chain == "chat":
        assert parsed["generate_response"] == json.loads(generate_response)
        assert parsed["prompt_tokens"] == 3 and parsed["prompt_token_ids"] == [1, 2, 3]
    else:
        assert parsed["generate_responses"] == [json.loads(generate_response)]
        assert parsed["prompt_tokens"] == [3] and parsed["prompt_token_ids"] == [[1, 2, 3]]
    chunk = {"request_id": "g", "choices": [{"index": 0, "token_ids": [9]}]}
    stream = json.loads(leg.stream(chunk, None))
    assert stream == {"stream": True, "generate_chunk": chunk, "stream_state": None, "prompt_tokens": 3,
                      "prompt_token_ids": [1, 2, 3], context_key: context}
    assert json.loads(leg.stream(chunk, {"role_sent": True}))["stream_state"] == {"role_sent": True}
    assert leg.path.endswith("/derender") and leg.path.startswith("/v1/chat" if chain == "chat" else "/v1/completions")


def test_rendered_makes_the_default_max_tokens_explicit() -> None:
    # render leaves max_tokens out when it equals SamplingParams' default (16); a generate server
    # without it would use the whole context
    body = gen()
    del body["sampling_params"]["max_tokens"]
    fixed = legs.rendered(body)
    assert fixed["sampling_params"]["max_tokens"] == 16 and "max_tokens" not in body["sampling_params"]
    assert legs.rendered(gen())["sampling_params"]["max_tokens"] == 256


def test_derender_context_leaves_out_what_derender_never_reads() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "system", "content": "long system text " * 100},
                {"role": "user", "content": [{"type": "text", "text": "a question"}], "name": "u"},
                {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "why"},
                {"role": "tool", "content": "tool output", "tool_call_id": "c1"}]
    raw = json.dumps({"model": "m", "messages": messages, "tools": tools, "stop": ["x"],
                      "include_stop_str_in_output": True, "include_reasoning": False}).encode()
    sent = json.loads(legs.DerenderLeg("chat", raw, [1, 2]).stream({"choices": []}, None))["chat_request"]
    # stop strings: the engine applies them, the sidecar cuts (vLLM 0.33's streaming derender rejects them)
    assert "stop" not in sent and sent["include_stop_str_in_output"] is True
    # the parser's inputs stay; the conversation's text does not travel with every call
    assert sent["tools"] == tools and sent["include_reasoning"] is False and sent["model"] == "m"
    assert sent["messages"] == [{"role": "system", "content": ""}, {"role": "user", "name": "u", "content": ""},
                                {"role": "assistant", "tool_calls": [call], "content": ""},
                                {"role": "tool", "tool_call_id": "c1", "content": ""}]
    assert b"question" not in legs.parser_context(raw, "chat") and b"long system" not in legs.parser_context(raw, "chat")
    # continue_final_message repeats the last message: the text stays
    cont = json.loads(legs.parser_context(json.dumps({"messages": messages, "continue_final_message": True}).encode(),
                                          "chat"))
    assert cont["messages"] == messages
    completion = json.dumps({"model": "m", "prompt": "a long prompt", "logprobs": 2}).encode()
    assert json.loads(legs.parser_context(completion, "completions")) == {"model": "m", "prompt": "-", "logprobs": 2}
    # the sidecar echoes the prompt itself (derender.echo): neither the text nor echo goes along
    echoed = json.dumps({"prompt": "a long prompt", "echo": True}).encode()
    assert json.loads(legs.parser_context(echoed, "completions")) == {"prompt": "-"}


def test_the_prompt_logprobs_leg_asks_for_one_detokenized_token_without_kv() -> None:
    rendered = gen(sampling={"max_tokens": 50, "n": 2, "logprobs": 3, "prompt_logprobs": 3, "stop": ["x"],
                             "extra_args": {"kv_transfer_params": {"remote_host": "evil"}}})
    leg = legs.prompt_logprobs_leg({**rendered, "stream": True, "kv_transfer_params": {"remote_host": "evil"}})
    sp = leg["sampling_params"]
    assert (sp["max_tokens"], sp["n"], sp["detokenize"], sp["prompt_logprobs"]) == (1, 1, True, 3)
    assert "logprobs" not in sp and "stop" not in sp and "extra_args" not in sp
    assert leg["stream"] is False and leg["output_mode"] == "tokens" and leg["kv_transfer_params"] is None

@pytest.mark.parametrize("mode, stream, client, interval, want", [
    ("tokens", True, None, 4, 4), ("tokens", True, 8, 4, 8),  # a client's own interval is kept when larger
    ("tokens", True, None, 1, None), ("tokens", False, None, 4, None),  # a batch leg has no chunks
    ("derender", True, None, 4, None), ("text", True, 2, 4, 2),  # only a leg a session will split again
])
def test_a_streamed_tokens_leg_asks_for_the_session_stream_interval(mode, stream, client, interval, want) -> None:
    rendered = {**gen(), "stream": stream}
    if client is not None:
        rendered["sampling_params"] = {**rendered["sampling_params"], "stream_interval": client}
    body = json.loads(legs.decode_body(rendered, None, mode, None, None, stream_interval=interval))
    assert body["sampling_params"].get("stream_interval") == want


CHAT_CLIENT = {"api": "chat", "id": "chatcmpl-1", "created": 7, "model": "m", "return_token_ids": False,
               "cached_tokens": None}
COMPLETIONS_CLIENT = {**CHAT_CLIENT, "api": "completions", "id": "cmpl-1"}


@pytest.mark.parametrize("mode, stream, client, sent", [
    ("derender", True, CHAT_CLIENT, True),
    ("text", True, COMPLETIONS_CLIENT, True),
    ("derender", True, {k: v for k, v in CHAT_CLIENT.items() if k != "api"}, True),  # chat when unnamed
    ("derender", False, CHAT_CLIENT, False),  # a batch leg has no chunks
    ("text", False, COMPLETIONS_CLIENT, False),
    ("tokens", True, CHAT_CLIENT, False),  # asked again for tokens: chained, no client chunks
    ("tokens", True, COMPLETIONS_CLIENT, False),
    ("text", True, CHAT_CLIENT, False),  # chat's chunks only come from a derender stream
    ("derender", True, COMPLETIONS_CLIENT, False),  # completions' only from a text stream
])
def test_the_client_stream_goes_with_the_mode_that_writes_its_apis_chunks(mode, stream, client, sent) -> None:
    body = json.loads(legs.decode_body({**gen(), "stream": stream}, None, mode, None, None, client=client))
    assert body.get("client_stream") == (client if sent else None)
