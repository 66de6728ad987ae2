"""The Anthropic Messages API as a mapping onto chat (pure functions over dicts).

A coupled vLLM serves ``POST /v1/messages`` by turning the Anthropic request into a chat
completion request, running chat, and turning the chat answer (or stream) back
(``vllm/entrypoints/anthropic/serving.py``: ``to_chat_completion_request``,
``messages_full_converter``, ``message_stream_converter``). Disagg does the same around its own
chat legs, with no parser of its own:
- the prompt is the render tier's (``/v1/messages/render`` runs vLLM's own conversion and
  template); the chat request the parsers read is ``plan.anthropic_request``'s;
- the chat answer is vLLM's parsers' (inline derender or the derender tier), and ``message`` /
  ``MessageStream`` map it field by field to what vLLM's converter makes of it;
- errors are Anthropic's object, ``{"type": "error", "error": {"type", "message"}}``, with the
  type and message of the OpenAI error vLLM would have translated (``translate_error_response``).
Ids and thinking signatures are random on both sides (vLLM draws a uuid4 per thinking block).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from disagg_sidecar import sse, wire

StopReason = tuple[str | None, str | None]
Event = tuple[str, dict[str, Any]]  # (SSE event name, payload)


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
    return b"event: " + name.encode() + b"\ndata: " + sse.dumps(payload) + b"\n\n"


def error_event(status: int, message_: str, type_: str | None = None) -> bytes:
    return sse_event(("error", {"type": "error", "error": {"type": type_ or _default_type(status),
                                                          "message": message_}}))
