"""The agentic APIs through their real clients: one forced reasoning + tool-call answer asked with
the ``openai`` SDK's ``responses.create`` / ``responses.stream`` and the ``anthropic`` SDK's
``messages.create`` / ``messages.stream``, as comparable views (ids left out: random on every
server). A deployment's views equal the coupled reference's on the same forced tokens."""
from __future__ import annotations

from typing import Any

import anthropic
import openai

from tests.harness.forced import OUTPUTS, Forcer

NAME = "reasoning_tool_call"
TOOLS = OUTPUTS["tool_call"][1]["tools"]
# Instructions long enough that the prompt is several KV blocks (the prefill leg computes them).
INSTRUCTIONS = "You answer questions about the weather and the time, briefly and exactly. " * 10
QUESTION = "What is the weather in Tokyo?"


def _responses_view(response: Any) -> list[Any]:
    return [(i.type, getattr(i, "name", None), getattr(i, "arguments", None),
             [c.text for c in (getattr(i, "content", None) or [])]) for i in response.output] + [
        response.status, response.usage.output_tokens, response.usage.output_tokens_details.reasoning_tokens]


def _message_view(message: Any) -> list[Any]:
    return [(b.type, getattr(b, "text", None), getattr(b, "thinking", None), getattr(b, "name", None),
             getattr(b, "input", None)) for b in message.content] + [message.stop_reason, message.usage.output_tokens]


def responses_views(url: str, forcer: Forcer, model: str = "tiny-qwen3", note: str = "") -> dict[str, Any]:
    """The Responses answers (batch and streamed) of the server at ``url``; ``note`` starts the prompt
    so that no engine has seen any block of it (its KV is then the prefill engine's)."""
    responses = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300).responses
    tools = [{"type": "function", **{k: t["function"][k] for k in ("name", "description", "parameters")}} for t in TOOLS]
    asked = {"model": model, "input": QUESTION, "instructions": f"{note}{INSTRUCTIONS}", "tools": tools,
             "max_output_tokens": 256, "extra_body": {"vllm_xargs": forcer.xargs(OUTPUTS[NAME][0])}}
    with responses.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    return {"responses": _responses_view(responses.create(**asked)),
            "responses stream": (_responses_view(streamed), kinds[0], kinds[-1], sorted(set(kinds)))}


def messages_views(url: str, forcer: Forcer, model: str = "tiny-qwen3", note: str = "") -> dict[str, Any]:
    """The Messages answers (batch and streamed) of the server at ``url``; ``note`` as above."""
    messages = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300).messages
    anthropic_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"]} for t in TOOLS]
    said = {"model": model, "max_tokens": 256, "system": f"{note}{INSTRUCTIONS}", "tools": anthropic_tools,
            "messages": [{"role": "user", "content": QUESTION}],
            "extra_body": {"vllm_xargs": forcer.xargs(OUTPUTS[NAME][0])}}
    with messages.stream(**said) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    return {"messages": _message_view(messages.create(**said)),
            "messages stream": (_message_view(final), sorted(set(events)))}


def agent_views(url: str, forcer: Forcer, model: str = "tiny-qwen3", note: str = "") -> dict[str, Any]:
    """Both APIs' views (``responses_views``, ``messages_views``)."""
    return {**responses_views(url, forcer, model, note), **messages_views(url, forcer, model, note)}
