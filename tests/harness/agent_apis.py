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


def _responses_view(response: Any) -> list[Any]:
    return [(i.type, getattr(i, "name", None), getattr(i, "arguments", None),
             [c.text for c in (getattr(i, "content", None) or [])]) for i in response.output] + [
        response.status, response.usage.output_tokens, response.usage.output_tokens_details.reasoning_tokens]


def _message_view(message: Any) -> list[Any]:
    return [(b.type, getattr(b, "text", None), getattr(b, "thinking", None), getattr(b, "name", None),
             getattr(b, "input", None)) for b in message.content] + [message.stop_reason, message.usage.output_tokens]


def agent_views(url: str, forcer: Forcer, model: str = "tiny-qwen3", note: str = "") -> dict[str, Any]:
    """The Responses and Messages answers (batch and streamed) of the server at ``url``; ``note``
    makes the prompt one no engine has seen (its KV is then the prefill engine's)."""
    xargs = {"vllm_xargs": forcer.xargs(OUTPUTS[NAME][0])}
    question = f"{note}What is the weather in Tokyo?"
    responses = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300).responses
    tools = [{"type": "function", **{k: t["function"][k] for k in ("name", "description", "parameters")}} for t in TOOLS]
    asked = {"model": model, "input": question, "instructions": INSTRUCTIONS, "tools": tools,
             "max_output_tokens": 256, "extra_body": xargs}
    with responses.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    messages = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300).messages
    anthropic_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"]} for t in TOOLS]
    said = {"model": model, "max_tokens": 256, "system": INSTRUCTIONS, "tools": anthropic_tools,
            "messages": [{"role": "user", "content": question}], "extra_body": xargs}
    with messages.stream(**said) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    return {
        "responses": _responses_view(responses.create(**asked)),
        "responses stream": (_responses_view(streamed), kinds[0], kinds[-1], sorted(set(kinds))),
        "messages": _message_view(messages.create(**said)),
        "messages stream": (_message_view(final), sorted(set(events))),
    }
