"""``shapes.derender_stream_event``: the per-token header swap gives the same chunk as parsing,
and ``shapes.client_stream_event`` the client's chunk byte for byte as vLLM serializes it, for
chunks serialized by vLLM's own stream response model (no server needed)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from disagg_engine.shapes import client_stream_event, derender_stream_chunk, derender_stream_event, with_cached_tokens
from disagg_sidecar.derender.shapes import Shape

RID = "generate-tokens-chatcmpl-0123456789abcdef"
NAMES = ["role", "reasoning_with_ids", "tool_call_finish", "usage_only", "usage_with_cached", "hostile_model_name"]
Made = Callable[..., dict[str, str]]


@pytest.fixture(scope="module")
def chunks(made: Made) -> dict[str, str]:
    return made()


@pytest.fixture(scope="module")
def made() -> Made:
    """The test chunks as vLLM serializes them, under a given header (``model``: each chunk's own
    by default) and cached-token count."""
    # vLLM is imported here, not at collection: importing it takes ~11 s of the suite's serial start.
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
        DeltaMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    def make(id: str = "chatcmpl-0123456789abcdef", created: int = 1795965796, model: str | None = None,
             cached: int = 0) -> dict[str, str]:
        def serialized(own_model: str, choices: list, **extra) -> str:
            # As vLLM's chat stream generator writes every chunk.
            chunk = ChatCompletionStreamResponse(id=id, object="chat.completion.chunk", created=created,
                                                 model=model or own_model, choices=choices, **extra)
            return chunk.model_dump_json(exclude_unset=True)

        table = {
            "role": serialized("tiny-qwen3", [ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None)]),
            "reasoning_with_ids": serialized("tiny-qwen3", [ChatCompletionResponseStreamChoice(
                index=1, delta=DeltaMessage(reasoning=" city"), logprobs=None, finish_reason=None,
                token_ids=[3283])]),
            "tool_call_finish": serialized("tiny-qwen3", [ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(tool_calls=[DeltaToolCall(
                    index=0, id="chatcmpl-tool-0123456789abcdef", type="function",
                    function=DeltaFunctionCall(name="get_weather", arguments='{"city": "東京"}'))]),
                logprobs=None, finish_reason="tool_calls", stop_reason=None)]),
            "usage_only": serialized("tiny-qwen3", [], usage=UsageInfo(prompt_tokens=12, completion_tokens=3,
                                                                        total_tokens=15)),
            "usage_with_cached": serialized("tiny-qwen3", [], usage=UsageInfo(
                prompt_tokens=12, completion_tokens=3, total_tokens=15,
                prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached))),
            "hostile_model_name": serialized('m,"choices":[{"x"', [ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(content="hi"), logprobs=None, finish_reason=None)]),
        }
        assert list(table) == NAMES
        return table
    return make


@pytest.mark.parametrize("name", NAMES)
def test_header_swap_equals_parsing(chunks, name):
    payload = chunks[name]
    fast = json.loads(derender_stream_event(payload, RID))
    parsed = derender_stream_chunk(json.loads(payload), RID)
    # Parsing fills every choice field and usage with null; the swap leaves unset ones out.
    assert set(fast) - {"usage", "prompt_token_ids"} == {"request_id", "output_mode", "choices"}
    assert fast["request_id"] == RID and fast["output_mode"] == "derender"
    assert fast.get("usage") == parsed["usage"]
    assert len(fast["choices"]) == len(parsed["choices"])
    for got, want in zip(fast["choices"], parsed["choices"]):
        assert {k: got.get(k) for k in want} == want


def test_other_layouts_are_parsed_and_errors_pass_unchanged():
    reordered = json.dumps({"choices": [{"index": 0, "delta": {"content": "a"}}], "id": "x", "model": "m"})
    assert json.loads(derender_stream_event(reordered, RID)) == {
        "request_id": RID, "usage": None, "output_mode": "derender",
        "choices": [{"index": 0, "finish_reason": None, "stop_reason": None, "token_ids": None,
                     "delta": {"content": "a"}, "logprobs": None}]}
    error = json.dumps({"error": {"message": "boom", "type": "InternalServerError", "code": 500}})
    assert derender_stream_event(error, RID) == error


@pytest.mark.parametrize("model", ["tiny-qwen3", "模型/東京", 'm,"choices":[{"x"'])
@pytest.mark.parametrize("name", NAMES)
def test_a_client_stream_event_is_the_clients_chunk_as_vllm_writes_it(made: Made, name: str, model: str) -> None:
    """The engine's chunk under the client's header (and the prefill's cached tokens, where vLLM
    reports details) is byte for byte what vLLM writes for the client's own chunk, and starts as the
    sidecar expects a client's chunk to (``Shape.client_prefix``), so the relay forwards it."""
    payload = made()[name]
    client = {"id": "chatcmpl-client-7", "created": 1795965801, "model": model}
    assert client_stream_event(payload, **client, cached_tokens=None) == made(**client)[name]
    patched = client_stream_event(payload, **client, cached_tokens=9)
    assert patched == made(**client, cached=9 if name == "usage_with_cached" else 0)[name]
    shape = Shape(id=client["id"], created=client["created"], model=model, prompt_tokens=12)
    assert patched.encode().startswith(shape.client_prefix())


def test_a_client_stream_passes_errors_unchanged() -> None:
    error = json.dumps({"error": {"message": "boom", "type": "InternalServerError", "code": 500}})
    assert client_stream_event(error, "chatcmpl-x", 1, "m", 3) == error


# -- completions: vLLM's own completions stream chunks, the cached tokens patched in --------------

COMPLETION_NAMES = ["text", "first_with_ids", "stop_string", "continuous_usage", "final_usage",
                    "final_usage_with_cached", "text_that_looks_like_usage"]


@pytest.fixture(scope="module")
def made_completions() -> Made:
    """Completions stream chunks as vLLM's completions stream generator serializes them for the
    client (its id, created, model), with a given cached-token count in the final usage."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    def make(id: str = "cmpl-bytes-1", created: int = 1795965796, model: str = "tiny-qwen3",
             cached: int = 0) -> dict[str, str]:
        def choice(text: str, usage: UsageInfo | None = None, **extra) -> str:
            # As the generator builds each chunk: every choice field given, usage set only when continuous.
            fields = {"index": 0, "finish_reason": None, "stop_reason": None, "prompt_token_ids": None,
                      "token_ids": None, **extra}
            chunk = CompletionStreamResponse(id=id, object="text_completion", created=created, model=model,
                                             choices=[CompletionResponseStreamChoice(text=text, logprobs=None,
                                                                                     **fields)])
            if usage is not None:
                chunk.usage = usage
            return chunk.model_dump_json(exclude_unset=True)

        def final(details: bool) -> str:
            usage = UsageInfo(prompt_tokens=12, completion_tokens=3, total_tokens=15)
            if details:
                usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached)
            chunk = CompletionStreamResponse(id=id, created=created, model=model, choices=[], usage=usage)
            return chunk.model_dump_json(exclude_unset=False, exclude_none=True)

        table = {
            "text": choice("Grüße 🦙"),
            "first_with_ids": choice("The", index=1, prompt_token_ids=[1, 2, 3], token_ids=[785]),
            "stop_string": choice(" is", finish_reason="stop", stop_reason="is Par"),
            "continuous_usage": choice(" Paris", usage=UsageInfo(prompt_tokens=12, completion_tokens=2,
                                                                  total_tokens=14)),
            "final_usage": final(details=False),
            "final_usage_with_cached": final(details=True),
            "text_that_looks_like_usage": choice('"prompt_tokens_details":{"cached_tokens":3}'),
        }
        assert list(table) == COMPLETION_NAMES
        return table
    return make


@pytest.mark.parametrize("name", COMPLETION_NAMES)
def test_a_completions_client_chunk_is_vllms_with_the_prefills_cached_tokens(made_completions: Made,
                                                                              name: str) -> None:
    """What the engine writes for a completions ``client_stream`` (vLLM's completions generator under
    the client's header, ``with_cached_tokens`` after) is byte for byte vLLM's chunk with the prefill's
    cached tokens where vLLM reports details, and nothing else changed; it starts as the sidecar
    expects a client's completions chunk to (``Shape.client_prefix``), so the relay forwards it."""
    payload = made_completions()[name]
    patched = with_cached_tokens(payload, 9)
    assert patched == made_completions(cached=9 if name == "final_usage_with_cached" else 0)[name]
    assert (patched != payload) is (name == "final_usage_with_cached")
    shape = Shape(id="cmpl-bytes-1", created=1795965796, model="tiny-qwen3", prompt_tokens=12)
    assert patched.encode().startswith(shape.client_prefix("completions"))
    assert not patched.encode().startswith(shape.client_prefix("chat"))
