"""An Anthropic Messages request as the chat request vLLM derives from it (pure).

A coupled vLLM turns ``POST /v1/messages`` into a chat completion request
(``vllm/entrypoints/anthropic/serving.py``: ``to_chat_completion_request``). The prompt is the
render tier's (``/v1/messages/render`` runs that conversion and the template itself), so
``chat_request`` here is only the parser context the decode and derender steps read (tools, tool
choice, reasoning settings, the roles and earlier tool calls of the conversation); the answer
goes back through ``derender.anthropic``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from disagg_sidecar import wire
from disagg_sidecar.plan import options

BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request hash: vLLM drops it


def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b["text"] for b in content if b.get("type") == "text" and b.get("text")
             and not b["text"].startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _tool_result(block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    """A user's ``tool_result``: a ``tool`` message (and a user message with its images)."""
    content = block.get("content")
    text, images, references = "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image" and (url := _image_url(item.get("source", {}))):
                images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})


def _message(msg: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    role, content = msg["role"], msg["content"]
    chat: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        chat["content"] = content
    else:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content:
            kind = block.get("type")
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and block.get("source"):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
            elif kind == "thinking" and block.get("thinking") is not None:
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                calls.append({"id": block.get("id") or f"call_{int(time.time())}", "type": "function",
                              "function": {"name": block.get("name") or "",
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result":
                if role == "user":
                    _tool_result(block, out)
                else:
                    text = str(block.get("content")) if block.get("content") else ""
                    parts.append({"type": "text", "text": f"Tool result: {text}"})
        if reasoning:
            chat["reasoning"] = "".join(reasoning)
        if calls:
            chat["tool_calls"] = calls
        if parts:
            chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if not (role == "user" and "content" not in chat):
        out.append(chat)


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools in effect at the end of the conversation (``tool_addition``/``tool_removal``)."""
    changes = [b for m in body["messages"] if not isinstance(m["content"], str) for b in m["content"]
               if b.get("type") in ("tool_addition", "tool_removal")]
    if not changes:
        return body.get("tools")
    tools = {t["name"]: t for t in body.get("tools") or []}
    removed: set[str] = set()
    for block in changes:
        change = block["tool"]
        if change.get("type") == "tool_definition":
            name = change["definition"]["name"]
            tools[name] = change["definition"]
        else:
            name = change["name"]
            if block["type"] == "tool_addition" and name in tools:
                tools[name] = {**tools[name], "defer_loading": None}
        (removed.add if block["type"] == "tool_removal" else removed.discard)(name)
    return [t for name, t in tools.items() if name not in removed]


def _function(tool: Mapping[str, Any]) -> dict[str, Any]:
    schema = dict(tool["input_schema"])
    schema.setdefault("type", "object")  # AnthropicTool's validator
    fn = {"name": tool["name"], "description": tool.get("description"), "parameters": schema,
          "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading")}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
# Sampling fields carried over as they are (kv_transfer_params never: only the connector sets them).
_BASE = ("temperature", "top_p", "top_k", "watermarking", "cache_salt", "vllm_xargs", "chat_template_kwargs")


def chat_request(body: Mapping[str, Any], *, disabled_thinking_effort: str = "none",
                 merge_inline_system: bool = False, min_tokens: int = 0) -> dict[str, Any]:
    """vLLM's ``to_chat_completion_request`` of a Messages request render has accepted.

    ``disabled_thinking_effort`` is what ``thinking: {"type": "disabled"}`` becomes (render's
    answer says which: ``chat_effort``); ``merge_inline_system`` moves inline system messages
    into the leading one as vLLM does for system-first templates (only message order differs,
    which the parsers do not read); ``min_tokens`` is what render applied (``chat_request_as_rendered``)."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    parts: list[str] = []
    if system:  # a string is kept whole; of blocks, the texts but the billing header
        parts = [system] if isinstance(system, str) else [
            b["text"] for b in system if b.get("type") == "text" and b.get("text")
            and not b["text"].startswith(BILLING_HEADER)]
    if merge_inline_system:
        parts += [t for m in body["messages"] if m["role"] == "system" and (t := _system_text(m["content"]))]
    if parts:
        messages.append({"role": "system", "content": "".join(parts)})
    for msg in body["messages"]:
        if msg["role"] == "system":
            if not merge_inline_system and (text := _system_text(msg["content"])):
                messages.append({"role": "system", "content": text})
            continue
        _message(msg, messages)

    req: dict[str, Any] = {"model": body["model"], "messages": messages}
    if "max_tokens" in body:  # count_tokens requests have none
        req["max_tokens"] = req["max_completion_tokens"] = body["max_tokens"]
        if body.get("stop_sequences") is not None:
            req["stop"] = body["stop_sequences"]
        req.update({k: body[k] for k in _BASE if body.get(k) is not None})
        if min_tokens:
            req["min_tokens"] = min_tokens
        if body.get("stream"):
            req["stream"] = True
            req["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    elif body.get("chat_template_kwargs") is not None:
        req["chat_template_kwargs"] = body["chat_template_kwargs"]
    output = body.get("output_config") or {}
    fmt = output.get("format") or {}
    if fmt.get("schema"):
        kind = fmt.get("type", "json_schema")
        req["response_format"] = {"type": kind, "json_schema": {"name": kind, "schema": fmt["schema"]}}
    if output.get("effort") is not None:
        req["reasoning_effort"] = output["effort"]
    thinking = body.get("thinking") or {}
    if thinking.get("type") in ("disabled", "between_tools"):  # between_tools: vLLM 0.34, thinking off up front
        req["reasoning_effort"] = disabled_thinking_effort
    elif thinking.get("type") == "enabled":
        req["thinking_token_budget"] = thinking["budget_tokens"]
    choice = body.get("tool_choice")
    if choice is not None:
        req["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
        kind = choice["type"]
        req["tool_choice"] = (_TOOL_CHOICE[kind] if kind in _TOOL_CHOICE
                              else {"type": "function", "function": {"name": choice["name"]}})
    tools = _tools(body)
    if tools is not None:
        req.setdefault("tool_choice", "auto")
        req["tools"] = [_function(t) for t in tools]
    return req


def chat_request_as_rendered(body: Mapping[str, Any], gen: Mapping[str, Any]) -> dict[str, Any]:
    """``chat_request`` with what render's answer ``gen`` says vLLM made of the request: the
    disabled-thinking effort, and ``min_tokens`` (a Messages field from vLLM 0.34 on; an older
    release ignores a client's). A derender tier reads ``min_tokens`` from the chat request: with
    the stop token of a stop string, it cuts the text where the string matched after the first
    ``min_tokens`` tokens."""
    sampling = gen.get(wire.SAMPLING_PARAMS)
    min_tokens = sampling.get("min_tokens") if isinstance(sampling, Mapping) else None
    return chat_request(body, disabled_thinking_effort=chat_effort(gen),
                        min_tokens=min_tokens if type(min_tokens) is int else 0)


def chat_effort(rendered: Mapping[str, Any]) -> str:
    """The ``reasoning_effort`` render gave ``thinking: disabled`` (vLLM probes the template:
    ``none``, or ``low`` for models that cannot stop thinking), read from its parser kwargs."""
    kwargs = ((rendered.get("reasoning_parser_kwargs") or {}).get("chat_template_kwargs") or {})
    effort = kwargs.get("reasoning_effort")
    return effort if isinstance(effort, str) else "none"


def count_render_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A ``count_tokens`` request as a Messages request render accepts: only the fields vLLM's
    ``AnthropicCountTokensRequest`` reads (``options.CARRIED``), one output token, and
    ``do_remote_decode`` so that render skips the thinking-budget-below-max_tokens rule (which
    counts nothing)."""
    out = {k: body[k] for k in options.CARRIED["count_tokens"] if k in body}
    out.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return out
