"""The shapes the legs' answers must have before anything reads them (pure).

The engines behind the sidecar are not trusted (docs/security.md, "Upstream answers"): an answer
that is not JSON, not the object or list the leg returns, with a field of the wrong type, a
choice index beyond what was asked, or token ids no vocabulary has, is an ``InvalidAnswer``,
which the pipeline turns into a 502 in the client's API shape. Only what the sidecar itself reads
is checked; the rest is the client's to read, as the coupled server would have sent it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from disagg_sidecar import sse, wire

# vLLM's token ids are int32 (its tensors): larger ones are no vocabulary's, and past 2^63 they
# would not fit the prefix-affinity hash's signed 64-bit words.
MAX_TOKEN_ID = 2**31 - 1
OUTPUT_MODES = set(wire.OUTPUT_MODES)


class InvalidAnswer(ValueError):
    """An upstream answer the sidecar does not use; the message names what is wrong, never its content."""


def parse(raw: bytes) -> Any:
    """JSON, strictly (``sse.loads``): not UTF-8, not JSON, ``NaN``/``Infinity``, lone surrogates
    or nesting past 1,024 levels are invalid answers."""
    try:
        return sse.loads(raw)
    except ValueError:
        raise InvalidAnswer("not JSON") from None


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidAnswer(f"{what} is not a JSON object")
    return value


def is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value)


def _token_ids(value: Any, what: str, *, empty: bool = True) -> None:
    if not is_token_ids(value) or (not empty and not value):
        raise InvalidAnswer(f"{what} is not a list of token ids")


def _optional(obj: Mapping[str, Any], key: str, types: type | tuple[type, ...], what: str) -> None:
    if obj.get(key) is not None and not isinstance(obj[key], types):
        raise InvalidAnswer(f"{what}.{key} has the wrong type")


def rendered(answer: Any, n: int) -> dict[str, Any]:
    """A render answer (one ``GenerateRequest``) for a request of ``n`` choices."""
    gen = _object(answer, "the rendered request")
    _token_ids(gen.get(wire.TOKEN_IDS), "token_ids", empty=False)
    _optional(gen, "request_id", str, "the rendered request")
    sampling = gen.get(wire.SAMPLING_PARAMS)
    if sampling is not None:
        _object(sampling, "sampling_params")
        asked = sampling.get("n")
        if asked is not None and (type(asked) is not int or asked != n):
            raise InvalidAnswer("sampling_params.n is not the client's n")
    for key in (wire.PARSE_CONTEXT, wire.KV_TRANSFER_PARAMS):
        _optional(gen, key, dict, "the rendered request")
    return gen


def rendered_prompts(answer: Any, prompts: int, n: int) -> list[dict[str, Any]]:
    """A completions render answer: one ``GenerateRequest`` per prompt of the client's, no more
    (each costs a prefill and ``n`` decode sequences: ``limits.max_legs`` counts the client's)."""
    if not isinstance(answer, list):
        raise InvalidAnswer("the rendered prompts are not a JSON list")
    if len(answer) != prompts:
        raise InvalidAnswer(f"render answered {len(answer)} requests for {prompts} prompt(s)")
    return [rendered(g, n) for g in answer]


def _choices(obj: Mapping[str, Any], n: int, what: str) -> list[dict[str, Any]]:
    choices = obj.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list) or len(choices) > n:
        raise InvalidAnswer(f"{what}.choices is not a list of at most {n}")
    for c in choices:
        _object(c, f"a choice of {what}")
        index = c.get("index", 0)
        if type(index) is not int or not 0 <= index < n:
            raise InvalidAnswer(f"a choice index of {what} is outside 0..{n - 1}")
        if c.get("token_ids") is not None:
            _token_ids(c["token_ids"], f"a choice's token_ids in {what}")
        _optional(c, "text", str, "a choice")
        _optional(c, "message", dict, "a choice")
        _optional(c, "delta", dict, "a choice")
        _optional(c, "finish_reason", str, "a choice")
        _optional(c, "logprobs", dict, "a choice")
    return choices


def generated(answer: Any, n: int, what: str = "the generate answer") -> dict[str, Any]:
    """A generate answer (batch) or one event of a generate stream, for ``n`` choices. A 200 that
    carries ``error`` is no answer."""
    out = _object(answer, what)
    if "error" in out:
        raise InvalidAnswer(f"{what} is an error")
    if out.get(wire.OUTPUT_MODE) is not None and out[wire.OUTPUT_MODE] not in OUTPUT_MODES:
        raise InvalidAnswer(f"{what} has an unknown output_mode")
    _choices(out, n, what)
    _optional(out, "usage", dict, what)
    if out.get("prompt_token_ids") is not None:
        _token_ids(out["prompt_token_ids"], f"{what}.prompt_token_ids")
    return out


def detokenized(answer: Any) -> str:
    """The render tier's ``/detokenize`` answer: the text of the token ids it was sent."""
    prompt = _object(answer, "the detokenize answer").get("prompt")
    if not isinstance(prompt, str):
        raise InvalidAnswer("the detokenize answer has no prompt text")
    return prompt


def derendered(answer: Any, n: int) -> dict[str, Any]:
    """A batch derender answer (chat or completions) for ``n`` choices."""
    out = _object(answer, "the derender answer")
    choices = _choices(out, n, "the derender answer")
    if any(c.get("message") is None and c.get("text") is None for c in choices):
        raise InvalidAnswer("a choice of the derender answer has neither message nor text")
    _optional(out, "usage", dict, "the derender answer")
    return out


def derendered_chunk(answer: Any, n: int) -> dict[str, Any]:
    """A streaming derender answer: ``chunk`` (a client chunk) and the ``stream_state`` to send back."""
    out = _object(answer, "the derender answer")
    if "stream_state" not in out:
        raise InvalidAnswer("the derender answer has no stream_state")
    _choices(_object(out.get("chunk"), "the derender answer's chunk"), n, "the derender chunk")
    return out


def tokenized(answer: Any, texts: int) -> list[dict[str, Any]]:
    """The render tier used as the tokenizer: one request per text, each with its token ids."""
    if not isinstance(answer, list) or len(answer) != texts:
        raise InvalidAnswer(f"the tokenizer's answer is not a list of {texts}")
    for gen in answer:
        _token_ids(_object(gen, "a tokenized text").get(wire.TOKEN_IDS), "a tokenized text's token_ids")
    return answer


def coupled(answer: Any, api: str, n: int) -> dict[str, Any]:
    """The decode engine's own answer on its OpenAI (or Anthropic) route, batch, for a request of
    ``api`` with ``n`` choices in all (``render.failure_policy: decode``)."""
    what = "the decode engine's answer"
    out = _object(answer, what)
    if "error" in out:
        raise InvalidAnswer(f"{what} is an error")
    if api in ("chat", "completions"):
        if not isinstance(out.get("choices"), list) or not out["choices"]:
            raise InvalidAnswer(f"{what} has no choices")
        _choices(out, n, what)
        _optional(out, "usage", dict, what)
    elif api == "messages" and (out.get("type") != "message" or not isinstance(out.get("content"), list)):
        raise InvalidAnswer(f"{what} is not a message")
    elif api == "responses" and (out.get("object") != "response" or not isinstance(out.get("output"), list)):
        raise InvalidAnswer(f"{what} is not a response")
    elif api == "count_tokens" and type(out.get("input_tokens")) is not int:
        raise InvalidAnswer(f"{what} has no input_tokens")
    return out


_EVENT_TYPE = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+)*")


def coupled_event(event: Any, api: str, n: int) -> dict[str, Any]:
    """One event of the decode engine's own stream (an OpenAI chunk, or a Messages or Responses
    event with its ``type``); an error event is vLLM's own and passes as it is."""
    what = "a decode stream event"
    out = _object(event, what)
    if "error" in out:
        return out
    if api in ("messages", "responses"):  # named events: the type names the SSE event
        if not isinstance(out.get("type"), str) or not _EVENT_TYPE.fullmatch(out["type"]):
            raise InvalidAnswer(f"{what} has no type")
        return out
    _choices(out, n, what)
    _optional(out, "usage", dict, what)
    return out
