"""Pure decisions: output mode per API and capabilities, the answer's mode and the refusal rule,
prefill route, request checks."""

from __future__ import annotations

import pytest

from disagg_sidecar.config import Capabilities
from disagg_sidecar.errors import SidecarError
from disagg_sidecar import vllm_releases
from disagg_sidecar.plan import decisions
from disagg_sidecar.plan.decisions import (
    DecodePlan,
    answered_mode,
    check_generate_request,
    check_openai_request,
    decode_plan,
    fit_to_render,
    prefill_route,
    retry_as_tokens,
)

ALL = ("tokens", "text", "derender")
EXT = Capabilities(output_modes=ALL, streaming_output_modes=ALL)
STOCK = Capabilities()  # tokens, text
BATCH_DERENDER_ONLY = Capabilities(output_modes=ALL, streaming_output_modes=("tokens", "text"))
NO_PARSER = Capabilities(parser_configured=False)
TOKENS_ONLY = Capabilities(output_modes=("tokens",), streaming_output_modes=("tokens",))
PARSE_CONTEXT_ONLY = Capabilities(output_modes=ALL, streaming_output_modes=ALL, derender_context_forms=("parse_context",))
STOCK_033 = Capabilities(output_modes=ALL, derender_context_forms=("parse_context",))


@pytest.mark.parametrize("api, request_, caps, expected", [
    ("chat", {}, EXT, DecodePlan("derender", "chat", "chat_request")),
    ("chat", {"stream": True}, EXT, DecodePlan("derender", "chat", "chat_request")),
    ("chat", {}, STOCK, DecodePlan("tokens", "chat")),
    ("chat", {"stream": True}, BATCH_DERENDER_ONLY, DecodePlan("tokens", "chat")),
    ("chat", {}, BATCH_DERENDER_ONLY, DecodePlan("derender", "chat", "chat_request")),
    ("chat", {}, NO_PARSER, DecodePlan("text", "chat")),
    ("chat", {"stream": True}, NO_PARSER, DecodePlan("text", "chat")),
    ("chat", {}, PARSE_CONTEXT_ONLY, DecodePlan("derender", "chat", "parse_context")),  # stock 0.33
    ("chat", {"stream": True}, STOCK_033, DecodePlan("tokens", "chat")),  # 0.33 cannot stream derender
    ("chat", {}, STOCK_033, DecodePlan("derender", "chat", "parse_context")),
    ("chat", {}, TOKENS_ONLY, DecodePlan("tokens", "chat")),
    ("completions", {}, EXT, DecodePlan("text", "completions")),
    ("completions", {"stream": True}, STOCK, DecodePlan("text", "completions")),
    ("completions", {"logprobs": 2}, EXT, DecodePlan("tokens", "completions")),
    ("completions", {"logprobs": 0}, EXT, DecodePlan("tokens", "completions")),
    ("completions", {}, TOKENS_ONLY, DecodePlan("tokens", "completions")),
    ("generate", {}, EXT, DecodePlan("tokens", None)),
    ("generate", {"output_mode": "derender", "stream": True}, STOCK, DecodePlan("derender", None)),
    ("generate", {"output_mode": "text"}, TOKENS_ONLY, DecodePlan("text", None)),
])
def test_decode_plan(api, request_, caps, expected) -> None:
    assert decode_plan(api, request_, caps) == expected


CLIENT = EXT.model_copy(update={"client_streams": ("chat", "completions")})
CHAT_CLIENT = EXT.model_copy(update={"client_streams": ("chat",)})  # an extension of the first version
S = {"stream": True}


@pytest.mark.parametrize("api, request_, caps, expected", [
    ("chat", S, CLIENT, DecodePlan("derender", "chat", "chat_request", client_chunks=True)),
    ("chat", {}, CLIENT, DecodePlan("derender", "chat", "chat_request")),  # batch: no chunks
    ("chat", S, CLIENT.model_copy(update={"client_streams": ("completions",)}),
     DecodePlan("derender", "chat", "chat_request")),
    ("completions", {**S, "prompt": "hi"}, CLIENT, DecodePlan("text", "completions", client_chunks=True)),
    ("completions", {**S, "prompt": ["hi"]}, CLIENT, DecodePlan("text", "completions", client_chunks=True)),
    ("completions", {**S, "prompt": [1, 2, 3]}, CLIENT, DecodePlan("text", "completions", client_chunks=True)),
    ("completions", {**S, "prompt": "hi", "return_token_ids": True,
                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "n": 2}, CLIENT,
     DecodePlan("text", "completions", client_chunks=True)),
    ("completions", {"prompt": "hi"}, CLIENT, DecodePlan("text", "completions")),  # batch
    ("completions", {**S, "prompt": "hi"}, CHAT_CLIENT, DecodePlan("text", "completions")),
    ("completions", {**S, "prompt": ["a", "b"]}, CLIENT, DecodePlan("text", "completions")),  # several prompts
    ("completions", {**S, "prompt": [[1], [2]]}, CLIENT, DecodePlan("text", "completions")),
    ("completions", {**S, "prompt": "hi", "echo": True}, CLIENT, DecodePlan("text", "completions")),  # render's text
    ("completions", {**S, "prompt": "hi", "echo": False}, CLIENT, DecodePlan("text", "completions", client_chunks=True)),
    ("completions", {**S, "prompt": "hi", "logprobs": 1}, CLIENT, DecodePlan("tokens", "completions")),  # chained
    ("completions", {**S, "prompt": "hi"}, CLIENT.model_copy(update={"streaming_output_modes": ("tokens",)}),
     DecodePlan("tokens", "completions")),
])
def test_the_decode_engine_writes_the_clients_chunks_where_it_can(api, request_, caps, expected) -> None:
    assert decode_plan(api, request_, caps) == expected


def test_parse_context_needs_render_to_send_one() -> None:
    planned = DecodePlan("derender", "chat", "parse_context")
    assert fit_to_render(planned, {"parse_context": {"tools": None}}) == planned
    assert fit_to_render(planned, {"parse_context": None}) == DecodePlan("tokens", "chat")  # vLLM 0.32 render
    planned = DecodePlan("derender", "chat", "chat_request")
    assert fit_to_render(planned, {}) == planned


def test_parse_context_must_be_one_the_decode_release_honours() -> None:
    planned = DecodePlan("derender", "chat", "parse_context")
    ids = {"parse_context": {"tools": None, "return_tokens_as_token_ids": True}}
    assert fit_to_render(planned, ids, vllm_releases.release("0.34.0")) == planned
    assert fit_to_render(planned, ids, vllm_releases.release("0.33.0")) == DecodePlan("tokens", "chat")
    assert fit_to_render(planned, ids) == planned  # the engine has not said its version: the configured plan
    assert fit_to_render(planned, {"parse_context": {"tools": None}}, vllm_releases.release("0.33.0")) == planned
    # A client asking for token_id:N logprob tokens: the chain on every release (0.33's parse_context
    # cannot carry it; 0.34's stock derender writes bytes: null for a sampled token, coupled its bytes).
    context = {"parse_context": {"tools": None}}
    for release in (vllm_releases.release("0.34.0"), vllm_releases.release("0.33.0"), None):
        assert fit_to_render(planned, context, release, tokens_as_ids=True) == DecodePlan("tokens", "chat")
    assert fit_to_render(DecodePlan("derender", "chat", "chat_request"), {}, None, tokens_as_ids=True) \
        == DecodePlan("derender", "chat", "chat_request")  # the extension's chat generator writes them


def test_chained_means_tokens_and_a_chain() -> None:
    assert DecodePlan("tokens", "chat").chained
    assert not DecodePlan("derender", "chat").chained
    assert not DecodePlan("tokens", None).chained


@pytest.mark.parametrize("answer, expected", [
    ({"output_mode": "text", "choices": []}, "text"),
    ({"output_mode": "derender"}, "derender"),
    ({"choices": []}, "tokens"),  # an engine that ignores the field
    ({"output_mode": None}, "tokens"),
])
def test_answered_mode(answer, expected) -> None:
    assert answered_mode(answer) == expected


@pytest.mark.parametrize("status, asked, decode_plan, expected", [
    (400, "derender", DecodePlan("derender", "chat", "chat_request"), True),
    (400, "text", DecodePlan("text", "completions"), True),
    (400, "tokens", DecodePlan("tokens", "chat"), False),  # nothing left to fall back to
    (400, "derender", DecodePlan("derender", None), False),  # a generate client's own mode
    (422, "derender", DecodePlan("derender", "chat", "chat_request"), False),
    (500, "text", DecodePlan("text", "chat"), False),
])
def test_retry_as_tokens_only_for_a_refused_inline_mode_with_a_chain(status, asked, decode_plan, expected) -> None:
    assert retry_as_tokens(status, asked, decode_plan) is expected


@pytest.mark.parametrize("remote, prompt, threshold, expected", [
    (True, 100, 0, "remote"),
    (True, 10, 32, "skipped"),
    (True, 32, 32, "remote"),
    (False, 100, 0, "local"),
])
def test_prefill_route(remote, prompt, threshold, expected) -> None:
    assert prefill_route(remote, prompt, threshold) == expected


@pytest.mark.parametrize("api, body, status", [
    ("chat", [], 400),
    ("chat", {"messages": [], "stream": "yes"}, 400),
    ("chat", {"messages": [], "n": 0}, 400),
    ("chat", {"messages": [], "n": True}, 400),
    ("chat", {"messages": [], "echo": True}, 400),
    ("chat", {"messages": [], "use_beam_search": True}, 400),
])
def test_openai_request_checks(api, body, status) -> None:
    with pytest.raises(SidecarError) as err:
        check_openai_request(api, body)
    assert err.value.status == status


def test_openai_request_ok() -> None:
    check_openai_request("chat", {"messages": [], "n": 2, "stream": None})
    check_openai_request("completions", {"prompt": "x", "echo": False})
    check_openai_request("completions", {"prompt": "x", "echo": True})


@pytest.mark.parametrize("body", [
    {"sampling_params": {}},
    {"token_ids": [], "sampling_params": {}},
    {"token_ids": [1, "2"], "sampling_params": {}},
    {"token_ids": [1, True], "sampling_params": {}},
    {"token_ids": [1], "sampling_params": []},
    {"token_ids": [1], "sampling_params": {}, "output_mode": "html"},
    "not an object",
])
def test_generate_request_checks(body) -> None:
    with pytest.raises(SidecarError) as err:
        check_generate_request(body)
    assert err.value.status == 400


def test_generate_request_ok() -> None:
    check_generate_request({"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}, "output_mode": "derender"})


@pytest.mark.parametrize("max_tokens, choices, call_bytes, budget, tokens", [
    (256, 1, 2_000, 64 << 20, 1),  # a usual request: a call per chunk
    (8192, 1, 64 << 10, 64 << 20, 8),
    (256, 1, 15 << 20, 64 << 20, 60),  # 15 MiB of tools: 5 calls of 60 tokens, not 256
    (256, 2, 15 << 20, 64 << 20, 120),  # two choices share the budget
    (1, 1, 1 << 30, 64 << 20, 1),
])
def test_tokens_per_derender_call_bound_what_a_streams_calls_carry(max_tokens, choices, call_bytes, budget, tokens):
    got = decisions.tokens_per_derender_call(max_tokens, choices, call_bytes, budget)
    assert got == tokens
    calls = choices * -(-max_tokens // got)
    assert calls * call_bytes <= budget + choices * call_bytes  # the bound, one call per choice over it at most
