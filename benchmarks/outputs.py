"""Forced answers of a chosen length and the chat requests that produce them.

The engines load ``disagg_engine.testing.forcing:ForcedOutput``: ``vllm_xargs.forced_token_ids``
decides which token each step emits; tokenization, detokenization, parsers and streaming stay
vLLM's own (tests/harness/forced.py)."""

from __future__ import annotations

import json
from typing import Any

from tests.harness.forced import NO_THINKING, TOOLS

SERVED = "tiny-qwen3"
WORDS = ("the", "weather", "city", "check", "first", "then", "answer", "user", "asks", "about")


def reasoning_tool_call_ids(tokens: int, tok) -> list[int]:
    """``tokens`` ids: reasoning of common one-token words, a short answer, one hermes tool call, EOS."""
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}})
    tail = tok.encode(f"\n</think>\n\nChecking the weather.\n<tool_call>\n{call}\n</tool_call>", add_special_tokens=False)
    head = tok.encode("<think>\n", add_special_tokens=False)
    word_ids = [tok.encode(" " + w, add_special_tokens=False)[0] for w in WORDS]
    body = [word_ids[i % len(word_ids)] for i in range(max(tokens - len(head) - len(tail) - 1, 0))]
    return head + body + tail + [tok.eos_token_id]


def plain_ids(tokens: int, tok) -> list[int]:
    """``tokens`` ids of plain text (one word per token), EOS last."""
    word_ids = [tok.encode(" " + w, add_special_tokens=False)[0] for w in WORDS]
    return [word_ids[i % len(word_ids)] for i in range(tokens - 1)] + [tok.eos_token_id]


def agent_chat(ids: list[int], stream: bool = True) -> dict[str, Any]:
    """A chat request with tools whose answer is ``ids`` (reasoning + tool call)."""
    body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                            "tools": TOOLS, "max_tokens": len(ids) + 8, "vllm_xargs": {"forced_token_ids": ids},
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def short_chat(ids: list[int], stream: bool, i: int = 0) -> dict[str, Any]:
    """A short plain chat (thinking off); ``i`` varies the prompt so no two requests are identical."""
    body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": f"Say something short ({i})."}],
                            "max_tokens": len(ids) + 8, "vllm_xargs": {"forced_token_ids": ids}, "stream": stream,
                            **NO_THINKING}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def short_message(ids: list[int], stream: bool, i: int = 0) -> dict[str, Any]:
    """``short_chat`` as an Anthropic Messages request (thinking off the same way)."""
    return {"model": SERVED, "messages": [{"role": "user", "content": f"Say something short ({i})."}],
            "max_tokens": len(ids) + 8, "vllm_xargs": {"forced_token_ids": ids}, "stream": stream, **NO_THINKING}


def short_response(ids: list[int], stream: bool, i: int = 0) -> dict[str, Any]:
    """``short_chat`` as an OpenAI Responses request (thinking off the same way)."""
    return {"model": SERVED, "input": f"Say something short ({i}).", "max_output_tokens": len(ids) + 8,
            "vllm_xargs": {"forced_token_ids": ids}, "stream": stream, **NO_THINKING}
