"""Pure reshaping of vLLM's chat output into the generate format for ``output_mode="derender"``.

docs/protocol.md §2: one response schema for ``/inference/v1/generate``:
generate-only fields keep their place and a choice gains ``message`` (batch) or ``delta``
(stream), the same objects ``/v1/chat/completions`` returns for the same tokens. No vLLM import.
"""

from __future__ import annotations

import json
import re
from typing import Any

_CHOICE_FIELDS = ("index", "finish_reason", "stop_reason", "token_ids")
_CHOICES = ',"choices":['
# The cached-token count of a serialized usage (vLLM's ``prompt_tokens_details``); the pattern's
# unescaped quotes cannot occur inside a JSON string, so it only matches the key itself.
_CACHED = re.compile(r'("prompt_tokens_details":\{"cached_tokens":)(?:\d+|null)')


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


def client_stream_event(payload: str, id: str, created: int, model: str, cached_tokens: int | None) -> str:
    """A serialized ``chat.completion.chunk`` as the client's endpoint writes it: its header
    (``id``, ``created``, ``model``) swapped as ``derender_stream_event`` swaps it, and the prompt's
    ``cached_tokens`` where the engine reports them and the caller knows them (``ClientStream``);
    everything else is vLLM's own bytes. Error events pass unchanged."""
    choices = payload.find(_CHOICES)
    if not (payload.startswith('{"id":') and choices > 0):
        chunk = json.loads(payload)
        if "error" in chunk:
            return payload
        head = {"id": id, "object": chunk.get("object"), "created": created, "model": model}
        payload = json.dumps({**head, **{k: v for k, v in chunk.items() if k not in head}},
                             ensure_ascii=False, separators=(",", ":"))
        choices = payload.find(_CHOICES)
    head = ('{"id":' + json.dumps(id, ensure_ascii=False) + ',"object":"chat.completion.chunk","created":'
            + str(created) + ',"model":' + json.dumps(model, ensure_ascii=False))
    out = head + payload[choices:]
    return with_cached_tokens(out, cached_tokens) if cached_tokens is not None else out


def with_cached_tokens(payload: str, cached_tokens: int) -> str:
    """A serialized chunk with its usage's ``prompt_tokens_details.cached_tokens`` (where vLLM
    reports details) set to ``cached_tokens``; every other byte as it was."""
    return _CACHED.sub(lambda m: m.group(1) + str(cached_tokens), payload)


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
