"""Pure reshaping of vLLM's chat output into the generate format for ``output_mode="derender"``.

docs/protocol.md §2: one response schema for ``/inference/v1/generate``:
generate-only fields keep their place and a choice gains ``message`` (batch) or ``delta``
(stream), the same objects ``/v1/chat/completions`` returns for the same tokens. No vLLM import.
"""

from __future__ import annotations

import json
from typing import Any

_CHOICE_FIELDS = ("index", "finish_reason", "stop_reason", "token_ids")
_CHOICES = ',"choices":['


def derender_stream_chunk(chat_chunk: dict[str, Any], request_id: str) -> dict[str, Any]:
    """A ``chat.completion.chunk`` as a generate stream chunk with ``delta`` choices."""
    choices = [
        {**{k: c.get(k) for k in _CHOICE_FIELDS}, "delta": c.get("delta") or {}, "logprobs": c.get("logprobs")}
        for c in chat_chunk.get("choices", [])
    ]
    out: dict[str, Any] = {"request_id": request_id, "usage": chat_chunk.get("usage"),
                           "output_mode": "derender", "choices": choices}
    if chat_chunk.get("prompt_token_ids") is not None:
        out["prompt_token_ids"] = chat_chunk["prompt_token_ids"]
    return out


def derender_stream_event(payload: str, request_id: str) -> str:
    """A serialized ``chat.completion.chunk`` as a serialized generate stream chunk.

    This runs once per token, so it swaps the chunk's header instead of parsing and re-encoding
    it (that round trip cost ~6% of the API process's CPU per token): vLLM writes ``id``,
    ``object``, ``created`` and ``model`` before ``choices``, and no JSON string can contain the
    unescaped ``,"choices":[``. Choices keep the chat chunk's own fields (``index``, ``delta``,
    ``logprobs``, ``finish_reason``; ``stop_reason``/``token_ids`` when set) and ``usage`` stays
    where vLLM put it. Any other layout takes the parsing path; error events pass unchanged.
    """
    choices = payload.find(_CHOICES)
    if payload.startswith('{"id":') and choices > 0:
        return '{"request_id":' + json.dumps(request_id) + ',"output_mode":"derender"' + payload[choices:]
    chunk = json.loads(payload)
    if "error" in chunk:
        return payload
    return json.dumps(derender_stream_chunk(chunk, request_id), separators=(",", ":"))


def derender_response(chat: dict[str, Any], request_id: str, created: int | None = None) -> dict[str, Any]:
    """A ``chat.completion`` as a generate response with ``message`` choices."""
    choices = [
        {**{k: c.get(k) for k in _CHOICE_FIELDS}, "message": c["message"], "logprobs": c.get("logprobs")}
        for c in chat.get("choices", [])
    ]
    return {
        "request_id": request_id,
        "model": chat.get("model"),
        "created": created if created is not None else chat.get("created"),
        "usage": chat.get("usage"),
        "prompt_logprobs": chat.get("prompt_logprobs"),
        "prompt_token_ids": None,
        "kv_transfer_params": chat.get("kv_transfer_params"),
        "ec_transfer_params": None,
        "output_mode": "derender",
        "choices": choices,
    }
