"""Client answers in the exact shape of the coupled endpoints, from whatever the legs returned.

Three producers feed them: the derender tier (chat/completion objects with derender's ids and
vLLM 0.32's batch quirks), the decode engine's inline ``derender`` mode (generate objects with
``message``/``delta`` choices) and inline ``text`` mode (generate objects with ``text``). All end
up as ``chat.completion``/``chat.completion.chunk``/``text_completion`` with the id the coupled
server would have used (``chatcmpl-<X-Request-Id>``, ``cmpl-...``), one ``created`` per request,
``usage`` from ``usage.fix_usage`` and these normalisations:
- vLLM 0.32's derender quirks (stop token decoded as text, ``finish_reason``, tool-call ids) are
  fixed with ``fixes``;
- fields only a generate client asked for (``token_ids``, ``prompt_token_ids``) are dropped unless
  the client set ``return_token_ids``, and stream deltas carry no null keys, as coupled ones.
Pure functions over dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_sidecar.derender.fixes import chat_finish_reason, tool_call_id
from disagg_sidecar import wire
from disagg_sidecar.sse import dumps
from disagg_sidecar.derender.usage import fix_usage


@dataclass(frozen=True)
class Shape:
    """What every answer of one request shares."""

    id: str
    created: int
    model: str | None
    prompt_tokens: int
    cached_tokens: int | None = None
    return_token_ids: bool = False
    tool_choice: Any = None  # the chat request's, for the finish_reason rule
    derive_finish_reason: bool = True  # the derender tier's finish_reason is not coupled's (vLLM 0.32)
    index_offset: int = 0  # completions with several prompts: prompt i's choices start at i * n
    # The decode engine's release leaves out message.annotations and usage.prompt_tokens_details when
    # they are None (vLLM 0.34, ``vllm_releases``), as its coupled server does; older ones write null.
    omits_none: bool = False

    def usage(self, usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
        return self.usage_shape(fix_usage(usage, prompt_tokens=self.prompt_tokens, cached=self.cached_tokens))

    def usage_shape(self, usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
        if usage is None:
            return None
        return _without_none(usage, _OMITTED_USAGE) if self.omits_none else dict(usage)

    def client_stream(self, api: wire.ClientStreamApi = "chat") -> dict[str, Any] | None:
        """What the decode engine needs to write this request's chat (completions) chunks as the
        client's own (the decode leg's ``client_stream``); None without a model name to write, or
        with several prompts' choice indices (completions: only the first prompt's start at 0)."""
        if self.model is None or self.index_offset:
            return None
        return {"api": api, "id": self.id, "created": self.created, "model": self.model,
                "return_token_ids": self.return_token_ids, "cached_tokens": self.cached_tokens}

    def client_prefix(self, api: wire.ClientStreamApi = "chat") -> bytes:
        """How each of this request's chat (completions) chunks starts, as the coupled endpoint
        writes it: a decode event that starts so is the client's chunk already (``client_stream``)."""
        return (b'{"id":' + dumps(self.id) + b',"object":' + _CLIENT_OBJECTS[api] + b',"created":'
                + str(self.created).encode() + b',"model":' + dumps(self.model) + b',"choices":[')


_CLIENT_OBJECTS = {"chat": b'"chat.completion.chunk"', "completions": b'"text_completion"'}
_OMITTED_USAGE = ("prompt_tokens_details",)
_OMITTED_MESSAGE = ("annotations",)


def _without_none(obj: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if not (v is None and k in keys)}


def _message(message: Mapping[str, Any], shape: Shape) -> dict[str, Any]:
    out = _without_none(message, _OMITTED_MESSAGE) if shape.omits_none else dict(message)
    if out.get("tool_calls"):
        out["tool_calls"] = [{**tc, "id": tool_call_id(tc.get("id"))} for tc in out["tool_calls"]]
    return out


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def _delta(delta: Mapping[str, Any] | None) -> dict[str, Any]:
    out = _strip_none(dict(delta or {}))
    if out.get("tool_calls"):
        out["tool_calls"] = [{**tc, "id": tool_call_id(tc["id"])} if "id" in tc else tc for tc in out["tool_calls"]]
    return out


# -- chat --------------------------------------------------------------------------------------

def chat_response(choices: list[dict[str, Any]], usage: Mapping[str, Any] | None, shape: Shape, *,
                  prompt_logprobs: Any = None, prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    return {
        "id": shape.id,
        "object": "chat.completion",
        "created": shape.created,
        "model": shape.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": shape.usage(usage),
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_ids": prompt_token_ids if shape.return_token_ids else None,
        "kv_transfer_params": None,
    }


def _chat_choice(c: Mapping[str, Any], message: Mapping[str, Any], shape: Shape, derive: bool) -> dict[str, Any]:
    msg = _message(message, shape)
    finish = c.get("finish_reason")
    return {
        "index": c.get("index", 0),
        "message": msg,
        "logprobs": c.get("logprobs"),
        "finish_reason": chat_finish_reason(finish, bool(msg.get("tool_calls")), shape.tool_choice) if derive else finish,
        "stop_reason": c.get("stop_reason"),
        "token_ids": c.get("token_ids") if shape.return_token_ids else None,
    }


def chat_from_derender(resp: Mapping[str, Any], shape: Shape, generate: Mapping[str, Any]) -> dict[str, Any]:
    """A batch ``/v1/chat/completions/derender`` answer for the tokens of ``generate``.

    Usage and token ids are the engine's: derender was sent the ids without the stop token.
    """
    gen_choices = {c.get("index", 0): c for c in generate.get("choices", [])}
    choices = []
    for c in resp.get("choices", []):
        choice = _chat_choice(c, c["message"], shape, shape.derive_finish_reason)
        if shape.return_token_ids and c.get("token_ids") is not None:  # None: hidden (include_reasoning)
            choice["token_ids"] = gen_choices.get(choice["index"], {}).get("token_ids")
        choices.append(choice)
    return chat_response(choices, generate.get("usage") or resp.get("usage"), shape,
                         prompt_logprobs=resp.get("prompt_logprobs"), prompt_token_ids=resp.get("prompt_token_ids"))


def chat_from_generate(resp: Mapping[str, Any], shape: Shape, prompt_token_ids: list[int]) -> dict[str, Any]:
    """An inline ``derender`` (``message``: vLLM's own chat generator made it, finish_reason
    included) or ``text`` generate answer."""
    choices = []
    for c in resp.get("choices", []):
        message = c.get("message") or text_message(c.get("text") or "")
        choices.append(_chat_choice(c, message, shape, derive=c.get("message") is None and shape.derive_finish_reason))
    return chat_response(choices, resp.get("usage"), shape, prompt_logprobs=resp.get("prompt_logprobs"),
                         prompt_token_ids=prompt_token_ids)


def text_message(text: str) -> dict[str, Any]:
    """What the chat endpoint returns for plain text on a server without parsers."""
    return {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": [], "reasoning": None}


def chat_chunk(chunk: Mapping[str, Any], shape: Shape, *, first: set[int]) -> dict[str, Any] | None:
    """One client chunk from a derender-tier chunk or an inline ``derender``/``text`` chunk.

    ``first`` holds the choice indices that already had a chunk (text mode adds the role
    there). Returns None for a chunk with nothing a coupled stream would carry.
    """
    choices = []
    for c in chunk.get("choices", []):
        index = c.get("index", 0)
        if "delta" in c:
            delta = _delta(c.get("delta"))
        else:  # text mode
            delta = {"content": c.get("text") or ""}
            if index not in first:
                delta = {"role": "assistant", **delta}
        first.add(index)
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": c.get("logprobs"),
                                  "finish_reason": c.get("finish_reason")}
        if c.get("finish_reason") is not None:
            choice["stop_reason"] = c.get("stop_reason")
        if shape.return_token_ids:
            choice["token_ids"] = c.get("token_ids")
        elif not delta and choice["finish_reason"] is None and choice["logprobs"] is None:
            continue  # inline derender sends token-only chunks for token_ids; coupled skips them
        choices.append(choice)
    usage = chunk.get("usage")
    if not choices and not usage:
        return None
    out: dict[str, Any] = {"id": shape.id, "object": "chat.completion.chunk", "created": shape.created,
                           "model": shape.model, "choices": choices}
    if usage:
        out["usage"] = shape.usage(usage)
    if shape.return_token_ids and chunk.get("prompt_token_ids") is not None:
        out["prompt_token_ids"] = chunk["prompt_token_ids"]
    return out


def role_apart(chunk: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A client chat chunk whose choice opens with its role and already carries more (vLLM 0.34's
    stock derender stream and inline ``text`` mode send the role with the first token) as the
    coupled endpoint sends it: the role alone first (``content: ""``, with the chunk's prompt token
    ids, and usage without completion tokens where usage is streamed), then the rest."""
    choices = chunk.get("choices") or []
    if len(choices) != 1 or "role" not in (choices[0].get("delta") or {}):
        return [chunk]  # every chunk but a choice's first: no copy on the relay's path
    choice = choices[0]
    delta = dict(choice["delta"])
    role = delta.pop("role")
    if not delta.get("content") and len(delta) <= 1 and not choice.get("token_ids") \
            and choice.get("logprobs") is None and choice.get("finish_reason") is None:
        return [chunk]  # the role alone already
    head: dict[str, Any] = {k: v for k, v in chunk.items() if k not in ("choices", "usage")}
    head["choices"] = [{"index": choice["index"], "delta": {"role": role, "content": ""}, "logprobs": None,
                        "finish_reason": None}]
    if (usage := chunk.get("usage")) is not None:
        head["usage"] = {**usage, "completion_tokens": 0, "total_tokens": usage.get("prompt_tokens")}
        if isinstance(details := usage.get("completion_tokens_details"), Mapping):
            head["usage"]["completion_tokens_details"] = {k: 0 for k in details}
    rest = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
    rest["choices"] = [{**choice, "delta": delta}]
    return [head, rest]


# -- completions -------------------------------------------------------------------------------

def completion_response(choices: list[dict[str, Any]], usage: Mapping[str, Any] | None, shape: Shape) -> dict[str, Any]:
    return {
        "id": shape.id,
        "object": "text_completion",
        "created": shape.created,
        "model": shape.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": shape.usage_shape(usage),
        "kv_transfer_params": None,
    }


def _completion_choice(c: Mapping[str, Any], shape: Shape, prompt_token_ids: list[int] | None,
                       prompt_logprobs: Any = None) -> dict[str, Any]:
    return {
        "index": c.get("index", 0) + shape.index_offset,
        "text": c.get("text") or "",
        "logprobs": c.get("logprobs"),
        "finish_reason": c.get("finish_reason"),
        "stop_reason": c.get("stop_reason"),
        "token_ids": c.get("token_ids") if shape.return_token_ids else None,
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_ids": prompt_token_ids if shape.return_token_ids else None,
    }


def completion_choices(resp: Mapping[str, Any], shape: Shape, prompt_token_ids: list[int],
                       prompt_logprobs: Any = None) -> list[dict[str, Any]]:
    """Choices of one prompt from a ``text`` generate answer or a ``/v1/completions/derender`` answer;
    each carries the prompt's logprobs (the decode answer's), as coupled's do."""
    return [_completion_choice(c, shape, prompt_token_ids, prompt_logprobs) for c in resp.get("choices", [])]


def completion_chunk(chunk: Mapping[str, Any], shape: Shape) -> dict[str, Any] | None:
    """A client chunk (choices only; usage is summed over prompts and sent last by the caller)."""
    choices = []
    for c in chunk.get("choices", []):
        choices.append({
            "index": c.get("index", 0) + shape.index_offset,
            "text": c.get("text") or "",
            "logprobs": c.get("logprobs"),
            "finish_reason": c.get("finish_reason"),
            "stop_reason": c.get("stop_reason"),
            "prompt_token_ids": None,
            "token_ids": c.get("token_ids") if shape.return_token_ids else None,
        })
    if not choices:
        return None
    return {"id": shape.id, "object": "text_completion", "created": shape.created, "model": shape.model,
            "choices": choices}


def usage_chunk(obj: str, shape: Shape, usage: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": shape.id, "object": obj, "created": shape.created, "model": shape.model, "choices": [],
            "usage": shape.usage_shape(usage)}
