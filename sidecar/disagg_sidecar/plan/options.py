"""Which request options the disaggregated path honours (pure): every field vLLM's request models
accept (``ChatCompletionRequest``, ``CompletionRequest``, ``AnthropicMessagesRequest``,
``AnthropicCountTokensRequest``, ``ResponsesRequest``) is either carried to the leg that honours it (``CARRIED``) or
refused with a 400 naming it (``REFUSED``; on the Messages paths in Anthropic's error object,
``anthropic.in_api_shape``); none is dropped silently. ``tests/sidecar/test_options.py`` checks
both lists against vLLM's own request models on every lane, so a field a new vLLM release adds
fails that test until it is placed here. An API is one more key of both dicts.

Where a field is honoured:
- ``render``: the chat template, tokenization and render's ``sampling_params``, which the
  prefill and decode legs apply (``legs``);
- ``decode``: the decode leg itself (stream, logprobs, token ids); for Responses, the decode
  engine's own Responses code, which gets the client's request;
- ``parser``: the decode engine's inline derender, else the derender tier (``derender/``);
- ``sidecar``: the answer's shape (``derender/shapes``, ``derender/chained``, ``derender/fixes``);
- ``ignored``: coupled vLLM reads nothing of it into the answer either (a scheduling hint, or
  a field only render's own answer carries).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from disagg_sidecar.errors import bad_request

Api = Literal["chat", "completions", "messages", "count_tokens", "responses"]
Leg = Literal["render", "decode", "parser", "sidecar", "ignored"]

_SAMPLING: dict[str, Leg] = {
    name: "render" for name in (
        "frequency_penalty", "presence_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
        "seed", "logit_bias", "allowed_token_ids", "bad_words", "stop", "stop_token_ids", "ignore_eos",
        "min_tokens", "max_tokens", "n", "include_stop_str_in_output", "skip_special_tokens",
        "spaces_between_special_tokens", "structured_outputs", "response_format", "vllm_xargs",
        "repetition_detection", "thinking_token_budget", "stream_interval", "watermarking",
        "length_penalty",  # beam search only, which is refused
        "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "cache_salt", "priority", "model",
    )
}
_COMMON: dict[str, Leg] = {
    **_SAMPLING,
    "stream": "decode",
    "stream_options": "sidecar",
    "logprobs": "decode",
    "return_token_ids": "sidecar",
    "request_id": "sidecar",  # the response id (cmpl-/chatcmpl-<id>)
    "user": "ignored",
    "session_id": "ignored",  # an engine scheduling hint: no field of the answer depends on it
    "return_token_offsets": "ignored",  # only render's own answer carries token offsets
    # The decode engine computes them (vLLM reads no transferred KV for such a request:
    # ``skip_reading_prefix_cache``), with its detokenizer on for their ``decoded_token`` (``legs``).
    "prompt_logprobs": "decode",
}

CARRIED: dict[Api, dict[str, Leg]] = {
    "chat": {
        **_COMMON,
        "messages": "render",
        "max_completion_tokens": "render",
        "top_logprobs": "decode",
        "tools": "parser",
        "tool_choice": "parser",
        "parallel_tool_calls": "sidecar",
        "reasoning_effort": "render",
        "include_reasoning": "parser",
        "add_generation_prompt": "render",
        "continue_final_message": "render",
        "documents": "render",
        "chat_template": "render",
        "chat_template_kwargs": "render",
        "media_io_kwargs": "render",
        "mm_processor_kwargs": "render",
        "return_tokens_as_token_ids": "sidecar",  # derender.fixes.chat_tokens_as_ids on the chained path
    },
    "completions": {
        **_COMMON,
        "prompt": "render",
        "suffix": "render",
        "echo": "sidecar",  # derender.echo, from the prompt text and the decode engine's prompt logprobs
    },
    # vLLM answers Messages as the chat request ``to_chat_completion_request`` makes of it, which
    # render makes too (``/v1/messages/render`` gets the client's body as received); the parsers
    # read ``plan.anthropic_request.chat_request``'s mapping of the same fields.
    "messages": {
        **{name: "render" for name in (
            "model", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "system", "cache_salt",
            "watermarking", "vllm_xargs", "chat_template_kwargs",
            "min_tokens",  # vLLM 0.34
        )},
        "messages": "render",  # and the parsers' context (earlier turns' tool calls and roles)
        "output_config": "render",  # format: structured outputs; effort: the template and the parsers
        "thinking": "render",  # the budget in sampling_params; disabled/between_tools: the template's effort
        "tools": "parser",
        "tool_choice": "parser",  # and disable_parallel_tool_use: chat's parallel_tool_calls
        "stream": "decode",
        "metadata": "ignored",  # vLLM reads nothing of it
    },
    # The rendered prompt's length: render alone (``anthropic_request.count_render_body``).
    "count_tokens": {name: "render" for name in (
        "model", "messages", "output_config", "system", "thinking", "tool_choice", "tools", "chat_template_kwargs")},
    # The decode engine's own Responses code answers the client's request as it came (``Flows.responses``;
    # render renders the same fields for the prefill leg's tokens, which the decode engine renders again).
    "responses": {name: "decode" for name in (
        "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_tool_calls",
        "max_output_tokens", "reasoning", "include", "include_reasoning", "text", "top_logprobs", "stream",
        "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "structured_outputs", "skip_special_tokens",
        "spaces_between_special_tokens", "include_stop_str_in_output", "thinking_token_budget", "vllm_xargs",
        "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "cache_salt", "priority", "watermarking",
        "request_id", "user", "metadata", "service_tier", "truncation", "prompt", "prompt_cache_key",
        "prompt_cache_options", "prompt_cache_retention", "safety_identifier", "session_id", "enable_response_messages",
        "previous_input_messages",
        # vLLM's response store: the decode engine alone answers these (``decisions.responses_route``)
        "store", "background", "previous_response_id",
    )},
}

# field -> the values that ask for nothing (accepted as they are); any other value is refused.
_OFF = (None, False)
_REFUSED_LEGS: dict[str, tuple[Any, ...]] = {
    "kv_transfer_params": (None,),  # the KV connector decides them: a client's name hosts engines connect to
    "ec_transfer_params": (None,),
    "mm_payload": (None, "tensors"),  # "none" empties render's features, which the decode leg reads
    "return_mm_kwargs": (None, True),
}
_REFUSED_COMMON: dict[str, tuple[Any, ...]] = {
    **_REFUSED_LEGS,
    "use_beam_search": _OFF,  # the generate endpoint samples; beam search is the serving layer's
    "logprob_token_ids": (None, []),  # coupled returns every listed id beside the top k; the chain cuts to k
    "routed_experts_prompt_start": (None, 0),
    "return_weight_versions": _OFF,  # vLLM 0.33: the engines' weight version is not in a leg's answer
}
REFUSED: dict[Api, dict[str, tuple[Any, ...]]] = {
    "chat": {
        **_REFUSED_COMMON,
        "echo": _OFF,  # the derender tier never sees the conversation's text (legs.parser_context)
        "return_prompt_text": _OFF,  # the template's output is render's, not in the answer
    },
    "completions": {
        **_REFUSED_COMMON,
        "prompt_embeds": (None,),  # a GenerateRequest carries token ids, not embeddings
        # completions logprobs come from /v1/completions/derender, which writes token text
        "return_tokens_as_token_ids": _OFF,
    },
    "messages": dict(_REFUSED_LEGS),
    "count_tokens": {},
    "responses": dict(_REFUSED_LEGS),  # mm_payload "none": the prefill leg's features would be empty
}


def decode_reads_transferred_kv(sampling_params: Any) -> bool:
    """Whether the decode engine would use a prefill leg's KV: vLLM reads no cached or transferred
    KV for a request whose ``SamplingParams.skip_reading_prefix_cache`` is set (render sets it with
    ``prompt_logprobs``, which need the whole prompt computed where they are asked), so a remote
    prefill for it would be work thrown away."""
    return not (isinstance(sampling_params, Mapping) and sampling_params.get("skip_reading_prefix_cache") is True)


def refused(api: str, body: Mapping[str, Any]) -> str | None:
    """The first field of ``body`` the disaggregated path refuses for ``api``, if any."""
    for name, off in REFUSED.get(api, {}).items():
        if name in body and not any(body[name] == value and type(body[name]) is type(value) for value in off):
            return name
    return None


def check(api: str, body: Mapping[str, Any]) -> None:
    """A 400 in vLLM's shape naming the first refused field."""
    if (name := refused(api, body)) is not None:
        raise bad_request(f"{name} is not supported on the disaggregated serving path (requested: "
                          f"{str(body[name])[:100]})", name)
