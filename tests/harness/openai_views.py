"""Comparable views of OpenAI chat/completions answers, batch and streamed.

Parity means: same content, reasoning, tool calls (name + parsed arguments), finish_reason and
token usage. Ids and timestamps differ by construction and are not compared; tool-call ids are
compared by shape only (as vLLM's own parity tests do).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

TOOL_CALL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16,}$|^call_[0-9A-Za-z]+$")


def sse_events(lines: Iterable[bytes | str]) -> Iterator[dict[str, Any] | str]:
    """Parse an SSE body into JSON payloads; ``[DONE]`` is yielded as the string."""
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        yield data if data == "[DONE]" else json.loads(data)


def _args(arguments: str | None) -> Any:
    """Parsed arguments; a call cut short (``max_tokens``) streams a JSON prefix, kept as text."""
    if not arguments:
        return None
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def chat_view(resp: dict[str, Any]) -> dict[str, Any]:
    choices = {}
    for c in resp["choices"]:
        msg = c["message"]
        choices[c["index"]] = {
            "content": msg.get("content") or "",
            "reasoning": msg.get("reasoning") or "",
            "tool_calls": [(t["function"]["name"], _args(t["function"]["arguments"])) for t in msg.get("tool_calls") or []],
            "finish_reason": c["finish_reason"],
        }
    return {"choices": choices, "usage": _usage(resp.get("usage"))}


def chat_stream_view(events: Iterable[dict[str, Any] | str]) -> dict[str, Any]:
    content: dict[int, str] = defaultdict(str)
    reasoning: dict[int, str] = defaultdict(str)
    calls: dict[int, dict[int, dict[str, str]]] = defaultdict(dict)
    finish: dict[int, str | None] = {}
    usage = None
    done = False
    for ev in events:
        if ev == "[DONE]":
            done = True
            continue
        assert not done, "data after [DONE]"
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices", []):
            i = c["index"]
            delta = c.get("delta") or {}
            content[i] += delta.get("content") or ""
            reasoning[i] += delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or []:
                slot = calls[i].setdefault(tc["index"], {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason"):
                finish[i] = c["finish_reason"]
    indices = sorted(set(content) | set(reasoning) | set(calls) | set(finish))
    choices = {
        i: {
            "content": content[i],
            "reasoning": reasoning[i],
            "tool_calls": [(calls[i][k]["name"], _args(calls[i][k]["arguments"])) for k in sorted(calls[i])],
            "finish_reason": finish.get(i),
        }
        for i in indices
    }
    return {"choices": choices, "usage": _usage(usage), "done": done}


def completion_view(resp: dict[str, Any]) -> dict[str, Any]:
    return {
        "choices": {c["index"]: {"text": c["text"], "finish_reason": c["finish_reason"]} for c in resp["choices"]},
        "usage": _usage(resp.get("usage")),
    }


def completion_stream_view(events: Iterable[dict[str, Any] | str]) -> dict[str, Any]:
    text: dict[int, str] = defaultdict(str)
    finish: dict[int, str | None] = {}
    usage = None
    done = False
    for ev in events:
        if ev == "[DONE]":
            done = True
            continue
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices", []):
            text[c["index"]] += c.get("text") or ""
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    return {
        "choices": {i: {"text": text[i], "finish_reason": finish.get(i)} for i in sorted(set(text) | set(finish))},
        "usage": _usage(usage),
        "done": done,
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, int] | None:
    if not usage:
        return None
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def tool_call_ids(resp: dict[str, Any]) -> list[str]:
    return [t["id"] for c in resp["choices"] for t in (c["message"].get("tool_calls") or [])]


# -- full views: every field a client can ask for (the parity matrix) ---------------------------

def _full_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    return {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def chat_full_view(resp: dict[str, Any]) -> dict[str, Any]:
    """``chat_view`` plus stop_reason, logprobs, token ids, prompt token ids and prompt logprobs."""
    view = chat_view(resp)
    for c in resp["choices"]:
        view["choices"][c["index"]].update(stop_reason=c.get("stop_reason"), logprobs=c.get("logprobs"),
                                           token_ids=c.get("token_ids"))
    view["prompt_token_ids"] = resp.get("prompt_token_ids")
    view["prompt_logprobs"] = resp.get("prompt_logprobs")
    view["usage"] = _full_usage(resp.get("usage"))
    return view


def chat_stream_full_view(events: Iterable[dict[str, Any] | str]) -> dict[str, Any]:
    """``chat_stream_view`` plus, per choice, stop_reason, the logprob entries and token ids in
    order (None when no chunk had them), and which chunks carried usage (continuous usage stats:
    the last count per choice)."""
    events = list(events)
    view = chat_stream_view(events)
    extra: dict[int, dict[str, Any]] = defaultdict(lambda: {"stop_reason": None, "logprobs": None,
                                                            "token_ids": None, "last_usage": None})
    prompt_token_ids = None
    for ev in events:
        if ev == "[DONE]":
            continue
        if ev.get("prompt_token_ids") is not None and prompt_token_ids is None:
            prompt_token_ids = ev["prompt_token_ids"]
        for c in ev.get("choices", []):
            slot = extra[c["index"]]
            if c.get("finish_reason"):
                slot["stop_reason"] = c.get("stop_reason")
            if c.get("logprobs") is not None:
                slot["logprobs"] = (slot["logprobs"] or []) + (c["logprobs"].get("content") or [])
            if c.get("token_ids") is not None:
                slot["token_ids"] = (slot["token_ids"] or []) + c["token_ids"]
            if ev.get("usage"):
                slot["last_usage"] = _full_usage(ev["usage"])
    for i, choice in view["choices"].items():
        choice.update(extra[i])
    view["prompt_token_ids"] = prompt_token_ids
    view["usage"] = _full_usage(next((ev["usage"] for ev in reversed(events)
                                      if ev != "[DONE]" and ev.get("usage") and not ev.get("choices")), None))
    return view


def completion_full_view(resp: dict[str, Any]) -> dict[str, Any]:
    view = completion_view(resp)
    for c in resp["choices"]:
        view["choices"][c["index"]].update(stop_reason=c.get("stop_reason"), logprobs=c.get("logprobs"),
                                           token_ids=c.get("token_ids"), prompt_logprobs=c.get("prompt_logprobs"),
                                           prompt_token_ids=c.get("prompt_token_ids"))
    view["usage"] = _full_usage(resp.get("usage"))
    return view


def completion_stream_full_view(events: Iterable[dict[str, Any] | str]) -> dict[str, Any]:
    events = list(events)
    view = completion_stream_view(events)
    extra: dict[int, dict[str, Any]] = defaultdict(lambda: {"stop_reason": None, "logprobs": None, "token_ids": None,
                                                            "prompt_token_ids": None})
    for ev in events:
        if ev == "[DONE]":
            continue
        for c in ev.get("choices", []):
            slot = extra[c["index"]]
            if slot["prompt_token_ids"] is None:  # coupled: with a choice's first chunk (echo, return_token_ids)
                slot["prompt_token_ids"] = c.get("prompt_token_ids")
            if c.get("finish_reason"):
                slot["stop_reason"] = c.get("stop_reason")
            lp = c.get("logprobs")
            if lp is not None:
                old = slot["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                slot["logprobs"] = {k: old[k] + (lp.get(k) or []) for k in old}
            if c.get("token_ids") is not None:
                slot["token_ids"] = (slot["token_ids"] or []) + c["token_ids"]
    for i, choice in view["choices"].items():
        choice.update(extra[i])
    view["usage"] = _full_usage(view["usage"]) if view["usage"] else None
    return view
