"""A streaming derender call answered by a render pod that keeps the decode window under another key.

During a rolling upgrade the render pods of two vLLM releases sit behind one Service, and a
chained stream's successive derender calls may reach either (kube-proxy picks a pod per
connection). Plain streams (completions, chat without parsers) carry incremental
detokenization's window in ``stream_state``: vLLM 0.32/0.33 as token strings (``prev_tokens``),
0.34 as ids (``prev_token_ids``); a pod ignores the other key and decodes without the window
(``vllm_releases.window_lost``). Strings cannot be made from ids without the tokenizer, so the
window is not translated: the choice is derendered from its start instead, in two calls that carry
no state, so that a pod of either release answers both exactly:
- ``before``: the ids already streamed, whose text ``T0`` the client has;
- ``through``: those ids and the new ones (``T``; the earlier ids' logprob entries are
  placeholders, their answers dropped).
The new text is ``T[len(T0):]`` (incremental detokenization emits the same text whether it
resumes from a state or starts over), the new logprob entries are the last ones, and the state is
``through``'s, in its release's own form. A ``T`` that does not start with ``T0`` is a 502, never
streamed. Parser streams carry every output id instead of a window: no release loses anything there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from disagg_sidecar import vllm_releases
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.plan import legs

# (tier, path, body, metrics kind) -> the tier's JSON answer; raises the sidecar's errors.
TierCall = Callable[[str, str, bytes, str], Awaitable[Any]]

_COMPLETION_LOGPROBS = ("text_offset", "token_logprobs", "tokens", "top_logprobs")


def sent_ids(ready: Mapping[str, Any]) -> list[int]:
    """The token ids a streaming derender chunk carries (its one choice's; none for usage)."""
    choices = ready.get("choices") or []
    return list(choices[0].get("token_ids") or []) if choices else []


def sent_entries(ready: Mapping[str, Any]) -> int:
    """The logprob entries a chunk carries: one per id, and one more for a stop token its ids left
    out (``stops.generate_for_derender``: coupled streams its entry)."""
    choices = ready.get("choices") or []
    logprobs = choices[0].get("logprobs") if choices else None
    if isinstance(logprobs, Mapping) and isinstance(logprobs.get("content"), list):
        return len(logprobs["content"])
    return len(sent_ids(ready))


def _placeholders(ids: Sequence[int]) -> list[dict[str, Any]]:
    return [{"token_id": t, "logprob": 0.0, "top_logprobs": []} for t in ids]


def replay_chunks(ready: Mapping[str, Any], earlier: Sequence[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``before`` and ``through``: the chunk ``ready`` (one choice) derendered from the choice's start."""
    [choice] = ready["choices"]
    head = {k: v for k, v in choice.items() if k != "logprobs"}
    before = {**ready, "usage": None, "choices": [{**head, "token_ids": list(earlier), "finish_reason": None,
                                                   "stop_reason": None}]}
    through_choice = {**choice, "token_ids": [*earlier, *(choice.get("token_ids") or [])]}
    if isinstance(choice.get("logprobs"), Mapping):
        entries = choice["logprobs"].get("content") or []
        through_choice["logprobs"] = {**choice["logprobs"], "content": [*_placeholders(earlier), *entries]}
    return before, {**ready, "choices": [through_choice]}


def _text(choice: Mapping[str, Any]) -> str:
    if isinstance(choice.get("delta"), Mapping):
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _last(values: Any, count: int, total: int) -> list[Any]:
    if not isinstance(values, list) or len(values) != total:
        raise ValueError(f"{total} logprob entries expected, got {len(values) if isinstance(values, list) else values!r}")
    return values[total - count:]


def spliced(through: Mapping[str, Any], before: Mapping[str, Any], new: int, earlier: int,
            role_sent: bool) -> dict[str, Any]:
    """``through``'s answer as the continuing call's: the text, and the last ``new`` logprob entries
    after the ``earlier`` ids' placeholders, no second role. ValueError when the answers do not line up."""
    chunk = dict(through["chunk"])
    choices = chunk.get("choices") or []
    before_choices = before["chunk"].get("choices") or []
    if len(choices) != 1 or len(before_choices) != 1:
        raise ValueError("one choice expected in each replayed answer")
    choice, known = dict(choices[0]), _text(before_choices[0])
    text = _text(choice)
    if not text.startswith(known):
        raise ValueError("the replayed text does not continue the streamed one")
    logprobs = choice.get("logprobs")
    if isinstance(choice.get("delta"), Mapping):
        delta = {**choice["delta"], "content": text[len(known):] or None}
        if role_sent and "role" in delta:
            delta["role"] = None
        choice["delta"] = delta
        if isinstance(logprobs, Mapping) and logprobs.get("content") is not None:
            choice["logprobs"] = {**logprobs, "content": _last(logprobs["content"], new, earlier + new)}
    else:
        choice["text"] = text[len(known):]
        if isinstance(logprobs, Mapping):
            choice["logprobs"] = {**logprobs, **{k: _last(logprobs.get(k), new, earlier + new)
                                                 for k in _COMPLETION_LOGPROBS if k in logprobs}}
    chunk["choices"] = [choice]
    return {**through, "chunk": chunk}


def _answered_state(data: Any) -> Any:
    return data.get("stream_state") if isinstance(data, dict) else None


async def stream_derender(tier: TierCall, leg: legs.DerenderLeg, ready: Mapping[str, Any], state: Any,
                          earlier: Sequence[int]) -> Any:
    """One streaming derender call (``earlier``: the choice's ids streamed before ``ready``'s,
    with ``state``); an answer that ignored ``state``'s window is replaced by a replay."""
    data = await tier("derender", leg.path, leg.stream(ready, state), "stream")
    if not vllm_releases.window_lost(state, _answered_state(data)):
        return data
    before, through = replay_chunks(ready, earlier)
    prefix, whole = await asyncio.gather(tier("derender", leg.path, leg.stream(before, None), "replay"),
                                         tier("derender", leg.path, leg.stream(through, None), "replay"))
    try:
        return spliced(whole, prefix, sent_entries(ready), len(earlier),
                       bool(isinstance(state, dict) and state.get("role_sent")))
    except (ValueError, KeyError, TypeError) as exc:
        raise SidecarError(502, f"the derender tier's replay of a stream read by another vLLM release does not "
                                f"line up ({exc})", type_="BadGatewayError") from exc
