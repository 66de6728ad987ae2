"""The Anthropic Messages API as a mapping onto chat (pure functions over dicts).

A coupled vLLM serves ``POST /v1/messages`` by turning the Anthropic request into a chat
completion request, running chat, and turning the chat answer (or stream) back
(``vllm/entrypoints/anthropic/serving.py``: ``to_chat_completion_request``,
``messages_full_converter``, ``message_stream_converter``). Disagg does the same around its own
chat legs, with no parser of its own:
- the prompt is the render tier's (``/v1/messages/render`` runs vLLM's own conversion and
  template), so ``chat_request`` here is only the parser context the derender step reads (tools,
  tool choice, reasoning settings, the roles and earlier tool calls of the conversation);
- the chat answer is vLLM's parsers' (inline derender or the derender tier), and ``message`` /
  ``MessageStream`` map it field by field to what vLLM's converter makes of it;
- errors are Anthropic's object, ``{"type": "error", "error": {"type", "message"}}``, with the
  type and message of the OpenAI error vLLM would have translated (``translate_error_response``).
Ids and thinking signatures are random on both sides (vLLM draws a uuid4 per thinking block).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from disagg_sidecar import wire

BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request hash: vLLM drops it
StopReason = tuple[str | None, str | None]
Event = tuple[str, dict[str, Any]]  # (SSE event name, payload)


# -- request -------------------------------------------------------------------------------------

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
                 merge_inline_system: bool = False) -> dict[str, Any]:
    """vLLM's ``to_chat_completion_request`` of a Messages request render has accepted.

    ``disabled_thinking_effort`` is what ``thinking: {"type": "disabled"}`` becomes (render's
    answer says which: ``chat_effort``); ``merge_inline_system`` moves inline system messages
    into the leading one as vLLM does for system-first templates (only message order differs,
    which the parsers do not read)."""
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
    if thinking.get("type") == "disabled":
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


def chat_effort(rendered: Mapping[str, Any]) -> str:
    """The ``reasoning_effort`` render gave ``thinking: disabled`` (vLLM probes the template:
    ``none``, or ``low`` for models that cannot stop thinking), read from its parser kwargs."""
    kwargs = ((rendered.get("reasoning_parser_kwargs") or {}).get("chat_template_kwargs") or {})
    effort = kwargs.get("reasoning_effort")
    return effort if isinstance(effort, str) else "none"


COUNT_FIELDS = ("model", "messages", "output_config", "system", "thinking", "tool_choice", "tools",
                "chat_template_kwargs")


def count_render_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A ``count_tokens`` request as a Messages request render accepts: only the fields vLLM's
    ``AnthropicCountTokensRequest`` reads, one output token, and ``do_remote_decode`` so that
    render skips the thinking-budget-below-max_tokens rule (which counts nothing)."""
    out = {k: body[k] for k in COUNT_FIELDS if k in body}
    out.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return out


def count_tokens(input_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "context_management": {"original_input_tokens": input_tokens}}


# -- answer --------------------------------------------------------------------------------------

def usage(chat_usage: Mapping[str, Any] | None) -> dict[str, int]:
    """vLLM's ``_build_anthropic_usage``: input excludes cache reads and writes."""
    if chat_usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    out: dict[str, int] = {}
    input_tokens = int(chat_usage.get("prompt_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details")
    extra: dict[str, int] = {}
    if isinstance(details, Mapping):
        if (created := details.get("created_cache_tokens")) is not None:
            input_tokens -= created
            extra["cache_creation_input_tokens"] = created
        if (read := details.get("cached_tokens")) is not None:
            input_tokens -= read
            extra["cache_read_input_tokens"] = read
    out["input_tokens"] = max(0, input_tokens)
    out["output_tokens"] = int(chat_usage.get("completion_tokens") or 0)
    return {**out, **extra}


def stop_reason(finish_reason: str | None, stop: Any, tool_used: bool, tool_complete: bool) -> StopReason:
    """vLLM's ``_to_anthropic_stop_reason``: (stop_reason, stop_sequence)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _signature() -> str:
    return uuid.uuid4().hex


def message(chat: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``messages_full_converter`` of a chat completion (``exclude_none``)."""
    choice = chat["choices"][0]
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls), bool(calls))
    content: list[dict[str, Any]] = []
    if msg.get("reasoning"):
        content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": _signature()})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in calls:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    if not content:
        content.append({"type": "text", "text": ""})
    out = {"id": chat["id"], "type": "message", "role": "assistant", "content": content, "model": chat["model"],
           "stop_reason": reason, "stop_sequence": sequence, "usage": usage(chat.get("usage"))}
    return {k: v for k, v in out.items() if v is not None}


def error(openai_error: Mapping[str, Any] | None, status: int) -> dict[str, Any]:
    """An OpenAI error body (``{"error": {...}}``) as vLLM's ``translate_error_response`` makes it."""
    err = (openai_error or {}).get("error")
    if not isinstance(err, Mapping):
        err = {}
    return {"type": "error", "error": {"type": str(err.get("type") or _default_type(status)),
                                       "message": str(err.get("message") or "")}}


def error_from_bytes(body: bytes, status: int) -> bytes:
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and parsed.get("type") == "error":
        return body
    mapped = error(parsed if isinstance(parsed, dict) else None, status)
    if not mapped["error"]["message"]:
        mapped["error"]["message"] = body.decode(errors="replace")[:2000]
    return json.dumps(mapped, ensure_ascii=False).encode()


def in_api_shape(path: str, status: int, openai_body: bytes) -> bytes:
    """An error body in the shape of the API ``path`` belongs to: Anthropic's object on the
    Messages paths, OpenAI's (as given) everywhere else."""
    if path == wire.MESSAGES or path.startswith(wire.MESSAGES + "/"):
        return error_from_bytes(openai_body, status)
    return openai_body


def _default_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "api_error"


# -- stream --------------------------------------------------------------------------------------

class MessageStream:
    """vLLM's ``message_stream_converter``: chat chunks in, Anthropic events out.

    Fed the chunks a coupled chat stream has (the client's Messages request asks for usage on
    each, ``continuous_usage_stats``), in order, then ``finish()`` at the chat stream's end. The
    first chunk opens the message; coupled's first chunk is the role chunk, whose deltas are
    empty and whose usage counts no output yet, so its deltas are read as any other's and its
    output count taken as 0 (a first chunk with text, from a derender call over several tokens,
    loses none)."""

    def __init__(self, start_usage: Mapping[str, Any] | None = None):
        self.started = False
        self.start_usage = start_usage  # when the first chunk has no usage
        self.index = 0  # the next block's index
        self.block: str | None = None  # the open block's type
        self.block_index: int | None = None
        self.signature: str | None = None
        self.tool_use_id: str | None = None
        self.pending: list[str] = []  # text that came while a tool_use block was open
        self.finish_reason: str | None = None
        self.stop: Any = None
        self.tool_used = False
        self.last_tool_args: list[str] = []
        self.ids: dict[int, str] = {}  # tool call index -> id

    # blocks
    def _start(self, block: dict[str, Any]) -> Event:
        event = ("content_block_start", {"type": "content_block_start", "content_block": block, "index": self.index})
        self.block, self.block_index = block["type"], self.index
        self.signature = _signature() if block["type"] == "thinking" else None
        self.tool_use_id = block.get("id") if block["type"] == "tool_use" else None
        return event

    def _stop(self) -> list[Event]:
        if self.block is None:
            return []
        events: list[Event] = []
        if self.block == "thinking" and self.signature is not None:
            events.append(self._delta({"type": "signature_delta", "signature": self.signature}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self.block_index}))
        self.block = self.block_index = self.signature = self.tool_use_id = None
        self.pending = []
        self.index += 1
        return events

    def _stop_and_flush(self) -> list[Event]:
        buffered, self.pending = "".join(self.pending), []
        events = self._stop()
        if buffered:
            events.append(self._start({"type": "text", "text": ""}))
            events.append(self._delta({"type": "text_delta", "text": buffered}))
            events += self._stop()
        return events

    def _delta(self, delta: dict[str, Any]) -> Event:
        index = self.block_index if self.block_index is not None else self.index
        return ("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": index})

    # chunks
    def feed(self, chunk: Mapping[str, Any]) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            self.started = True
            start = {"id": chunk.get("id"), "type": "message", "role": "assistant", "content": [],
                     "model": chunk.get("model"), "stop_reason": None, "stop_sequence": None,
                     "usage": usage(_opening(chunk.get("usage")) or self.start_usage)}
            events.append(("message_start", {"type": "message_start", "message": start}))
        choices = chunk.get("choices") or []
        if not choices:
            if chunk.get("usage") is None:
                return events
            events += self._stop_and_flush()
            calls_done = self.tool_used and _is_json("".join(self.last_tool_args))
            reason, sequence = stop_reason(self.finish_reason or "stop", self.stop, self.tool_used, calls_done)
            events.append(("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                             "usage": usage(chunk["usage"])}))
            return events
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason, self.stop = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        if reasoning := delta.get("reasoning"):
            if self.block != "thinking":
                events += self._stop_and_flush()
                events.append(self._start({"type": "thinking", "thinking": ""}))
            events.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if text := delta.get("content"):
            if self.block == "tool_use":
                self.pending.append(text)
            else:
                if self.block != "text":
                    events += self._stop_and_flush()
                    events.append(self._start({"type": "text", "text": ""}))
                events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            if call.get("id") is not None:
                self.ids[call.get("index", 0)] = call["id"]
                if self.tool_use_id != call["id"] and fn.get("name") is not None:
                    events += self._stop_and_flush()
                    self.tool_used = True
                    self.last_tool_args = []
                    events.append(self._start({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}))
                if args and self.tool_use_id == call["id"]:
                    self.last_tool_args.append(args)
                    events.append(self._delta({"type": "input_json_delta", "partial_json": args}))
            else:
                known = self.ids.get(call.get("index", 0))
                if known is not None and args and self.tool_use_id == known:
                    self.last_tool_args.append(args)
                    events.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return events

    def finish(self) -> list[Event]:
        """The chat stream's end (``[DONE]``): the open block closed, ``message_stop``."""
        return [*self._stop_and_flush(), ("message_stop", {"type": "message_stop"})]


def _opening(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The usage of a coupled stream's first chunk, the role chunk, which no token is counted
    on yet: a first chunk that carries tokens too (a derender call over several) counts them."""
    return {**chat_usage, "completion_tokens": 0} if chat_usage else None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def sse_event(event: Event) -> bytes:
    name, payload = event
    return (b"event: " + name.encode() + b"\ndata: "
            + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


def error_event(status: int, message_: str, type_: str | None = None) -> bytes:
    return sse_event(("error", {"type": "error", "error": {"type": type_ or _default_type(status),
                                                          "message": message_}}))
