"""Forced outputs: the continuations tests make the real engine emit.

``Forcer.ids(text)`` tokenizes with the model's own tokenizer and appends EOS, and
``Forcer.xargs(text)`` is the ``vllm_xargs`` a request carries to select it.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


def tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


# Text that the byte-level BPE splits inside characters (checked in tests/test_harness.py).
MULTIBYTE = "Grüße 🦙🧬 鬱蒼とした森 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓"

# Qwen3 thinks by default: vLLM's qwen3 parser reads an answer without </think> as reasoning.
# Plain answers therefore turn thinking off, as a client of a real Qwen3 would.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WITH_TOOLS = {"tools": TOOLS}

# Named continuations used across the suite: name -> (text the model emits, extra request fields)
OUTPUTS: dict[str, tuple[str, dict]] = {
    "plain": ("The capital of France is Paris.", NO_THINKING),
    "reasoning": ("<think>\nThe user greets me; answer briefly.\n</think>\n\nHello! How can I help?", {}),
    "tool_call": (tool_call("get_weather", {"city": "Paris", "unit": "c"}), WITH_TOOLS),
    "two_tool_calls": (
        tool_call("get_weather", {"city": "Paris"}) + "\n" + tool_call("get_time", {"tz": "Europe/Paris"}),
        WITH_TOOLS,
    ),
    "reasoning_tool_call": (
        "<think>\nI should look the weather up.\n</think>\n\n" + tool_call("get_weather", {"city": "東京"}),
        WITH_TOOLS,
    ),
    "multibyte": (MULTIBYTE, NO_THINKING),
}


class Forcer:
    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    def ids(self, text: str, eos: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids + [self.tokenizer.eos_token_id] if eos else ids

    def xargs(self, text: str, eos: bool = True) -> dict:
        return {"forced_token_ids": self.ids(text, eos)}

    def chat_body(self, name: str, stream: bool = False, **extra) -> dict:
        """A chat request that makes the engine emit ``OUTPUTS[name]``."""
        text, fields = OUTPUTS[name]
        body = {
            "model": "tiny-qwen3",
            "messages": [{"role": "user", "content": f"Please answer ({name})."}],
            "max_tokens": 256,
            "vllm_xargs": self.xargs(text),
            "stream": stream,
        }
        body.update(fields)
        if stream:
            body["stream_options"] = {"include_usage": True}
        body.update(extra)
        return body
