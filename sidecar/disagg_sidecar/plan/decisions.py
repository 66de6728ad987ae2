"""Per-request decisions, pure: which output mode the decode leg asks for, whether the derender
tier has to finish the job, and how the prompt gets prefilled.

The decode engine's capabilities (``capabilities``) decide the output mode:
- chat: inline ``derender`` when the engine has it (one hop, no replay); inline ``text`` when no
  parser is configured; otherwise ``tokens`` and the derender tier (batch, or per chunk);
- completions: inline ``text``, unless the client asked for logprobs (their completions shape
  only comes from ``/v1/completions/derender``), then ``tokens`` + derender;
- a chat or completions stream: the decode engine writes the client's own chunks where it can
  (``DecodePlan.client_chunks``);
- generate: whatever the client asked for; the answer passes through.
If the engine answers another mode than the one asked for (an older engine ignores the field),
the chain is the fallback, so every OpenAI plan names one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from disagg_sidecar import vllm_releases, wire
from disagg_sidecar.config import Capabilities
from disagg_sidecar.errors import bad_request
from disagg_sidecar.plan import options, requestlimits
from disagg_sidecar.plan.answers import MAX_TOKEN_ID, is_token_ids

Api = Literal["chat", "completions", "generate", "messages", "count_tokens", "responses"]
Chain = Literal["chat", "completions"]


@dataclass(frozen=True)
class DecodePlan:
    mode: wire.OutputMode
    chain: Chain | None  # derender path for a tokens answer; None: pass the answer through
    context: wire.ContextForm | None = None  # parser context sent with mode "derender"
    # The decode stream writes the client's own chunks (``client_stream``: chat's from a derender,
    # completions' from a text stream), relayed as bytes.
    client_chunks: bool = False

    @property
    def chained(self) -> bool:
        """The derender tier is planned (not only a fallback)."""
        return self.mode == "tokens" and self.chain is not None


def decode_plan(api: Api, request: Mapping[str, Any], caps: Capabilities) -> DecodePlan:
    stream = bool(request.get("stream"))
    modes = caps.streaming_output_modes if stream else caps.output_modes
    if api == "chat":
        if "derender" in modes:
            # The client's request is the exact context; render's parse_context (0.33) the slim one.
            for form in ("chat_request", "parse_context"):
                if form in caps.derender_context_forms:
                    return DecodePlan("derender", "chat", form, client_chunks=stream and "chat" in caps.client_streams)
        if "text" in modes and not caps.parser_configured:
            return DecodePlan("text", "chat")
        return DecodePlan("tokens", "chat")
    if api == "completions":
        if "text" in modes and request.get("logprobs") is None:
            return DecodePlan("text", "completions", client_chunks=stream and completion_client_chunks(request, caps))
        return DecodePlan("tokens", "completions")
    return DecodePlan(answered_mode(request), None)


def completion_client_chunks(request: Mapping[str, Any], caps: Capabilities) -> bool:
    """A completions stream the decode engine can write as the client's own chunks: one whose chunks
    may be the client's (``completion_chunks_are_one_streams``), on an engine that writes them."""
    return "completions" in caps.client_streams and completion_chunks_are_one_streams(request)


def completion_chunks_are_one_streams(request: Mapping[str, Any]) -> bool:
    """A completions request whose streamed chunks one engine stream can write as the client's own
    (the decode engine's or a derender session's): one prompt (the chunks of several carry indices
    and one usage over all, the sidecar's), no ``echo`` (the prompt's text is the render tier's)."""
    return not request.get("echo") and requestlimits.rendered_prompts(request) == 1


def answered_mode(generate: Mapping[str, Any]) -> wire.OutputMode:
    """The output mode of a generate answer or chunk (or the one a GenerateRequest asks for): an
    engine that ignores the field answers without it, in ``tokens``."""
    return generate.get(wire.OUTPUT_MODE) or "tokens"


def retry_as_tokens(status: int, asked: wire.OutputMode, decode_plan: DecodePlan) -> bool:
    """Whether a decode answer ``status`` to a request for ``asked`` is an engine refusing the
    inline mode, to be asked again for tokens (and the answer chained)."""
    return status == 400 and asked != "tokens" and decode_plan.chain is not None


def fit_to_render(decode_plan: DecodePlan, gen: Mapping[str, Any],
                  decode_release: vllm_releases.Release | None = None, tokens_as_ids: bool = False) -> DecodePlan:
    """An inline derender planned with render's ``parse_context`` needs render to have sent one
    (vLLM 0.33 does, 0.32 does not) that the decode engine's release (when it reported one) can
    honour (``vllm_releases.strip_parse_context``): otherwise chain. A client asking for
    ``return_tokens_as_token_ids`` is chained too (the chained path writes ``token_id:N`` as coupled
    does): 0.33's parse_context cannot carry it, and 0.34's stock derender writes each placeholder
    with ``bytes: null`` where coupled gives a sampled token its text's bytes."""
    if decode_plan.context != "parse_context":
        return decode_plan
    context = gen.get(wire.PARSE_CONTEXT)
    if context is None or (decode_release is not None and isinstance(context, dict)
                           and vllm_releases.strip_parse_context(context, decode_release) is None):
        return DecodePlan("tokens", decode_plan.chain)
    if tokens_as_ids:
        return DecodePlan("tokens", decode_plan.chain)
    return decode_plan


def tokens_per_derender_call(max_tokens: int, choices: int, call_bytes: int, stream_bytes: int) -> int:
    """The fewest tokens a stateless derender call of a chained stream carries, so that the calls of
    all ``choices`` together carry at most ``stream_bytes`` (``limits.derender_stream_bytes``) plus
    one call per choice: each call carries ``call_bytes`` that do not shrink (the parser context with
    the client's tools, the prompt's token ids). A usual request gets 1: a call per chunk."""
    return max(1, min(max_tokens, -(-max_tokens * choices * call_bytes // stream_bytes)))


PrefillRoute = Literal["remote", "local", "skipped"]


def prefill_route(remote: bool, prompt_tokens: int, min_prompt_tokens: int) -> PrefillRoute:
    if not remote:
        return "local"
    if prompt_tokens < min_prompt_tokens:
        return "skipped"
    return "remote"


# Who answers a request that needs the render tier: the tiers (render -> prefill -> decode ->
# derender), or the decode engine alone on its own OpenAI route (``render.failure_policy: decode``).
RenderRoute = Literal["tiers", "decode"]
DECODE_ANSWERS = ("chat", "completions", "messages", "count_tokens", "responses")  # the APIs decode then serves itself


def render_route(api: Api, policy: str, tiers_up: bool) -> RenderRoute:
    """``tiers_up``: the render and derender tiers answer their probes (or are the decode engine
    itself). While one is down, ``decode`` sends the request to the decode engine straight away
    (no connect timeouts first); ``fail`` still tries the tiers (a 503 when they fail)."""
    return "decode" if policy == "decode" and api in DECODE_ANSWERS and not tiers_up else "tiers"


def decode_answers_instead(api: Api, policy: str, leg: str | None, unavailable: bool) -> bool:
    """A request whose render or derender leg found its tier unavailable (not reachable, timed out,
    5xx: not a bad answer, which is a 502 under every policy) before the client's first byte."""
    return policy == "decode" and api in DECODE_ANSWERS and leg in ("render", "derender") and unavailable


def check_openai_request(api: Api, body: Any) -> int:
    """What the sidecar itself relies on; the render tier validates the rest like vLLM does.
    Returns the request's ``n``."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "stream" in body and not isinstance(body["stream"], (bool, type(None))):
        raise bad_request("stream must be a boolean", "stream")
    n = requestlimits.checked_n(api, body)
    if api == "completions" and not _prompt_ids_in_range(body.get("prompt")):
        raise bad_request(f"prompt token ids must be integers from 0 to {MAX_TOKEN_ID}", "prompt")
    options.check(api, body)
    return n


def check_messages_request(api: Literal["messages", "count_tokens"], body: Any) -> None:
    """What the sidecar relies on of an Anthropic Messages (or ``count_tokens``) request, and the
    options it refuses; render validates the rest (vLLM's ``AnthropicMessagesRequest``)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "stream" in body and not isinstance(body["stream"], (bool, type(None))):
        raise bad_request("stream must be a boolean", "stream")
    options.check(api, body)


# The Responses request fields that read vLLM's response store (``VLLM_ENABLE_RESPONSES_API_STORE``):
# such a request goes to the decode engine alone, which answers it as a coupled server with the same
# store does (Disagg's pods run without one: ``responses_route``).
STORED_RESPONSE_FIELDS = ("previous_response_id", "background")


def check_responses_request(body: Any) -> None:
    """What the sidecar relies on of an OpenAI Responses request; render and the decode engine
    validate the rest (vLLM's ``ResponsesRequest``)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "stream" in body and not isinstance(body["stream"], (bool, type(None))):
        raise bad_request("stream must be a boolean", "stream")
    options.check("responses", body)


ResponsesRoute = Literal["tiers", "decode"]


def responses_route(body: Mapping[str, Any]) -> ResponsesRoute:
    """A Responses request that names a stored response or asks for background work reads vLLM's
    response store, which lives in one decode engine's memory: it goes to the decode engine alone,
    so its answer is that engine's (with the store off, as Disagg runs it, coupled vLLM's refusal:
    404 for an unknown ``previous_response_id``, 400 for ``background``). Every other request runs
    through the tiers."""
    return "decode" if any(body.get(k) not in (None, False) for k in STORED_RESPONSE_FIELDS) else "tiers"


def check_generate_request(body: Any) -> int:
    """A GenerateRequest client's body; returns its ``sampling_params.n``."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    ids = body.get(wire.TOKEN_IDS)
    if not isinstance(ids, list) or not ids or not is_token_ids(ids):
        raise bad_request(f"token_ids must be a non-empty list of integers from 0 to {MAX_TOKEN_ID}", wire.TOKEN_IDS)
    sampling = body.get(wire.SAMPLING_PARAMS, {})
    if not isinstance(sampling, dict):
        raise bad_request("sampling_params must be an object", wire.SAMPLING_PARAMS)
    if sampling.get(wire.EXTRA_ARGS) is not None and not isinstance(sampling[wire.EXTRA_ARGS], dict):
        raise bad_request("sampling_params.extra_args must be an object", f"{wire.SAMPLING_PARAMS}.{wire.EXTRA_ARGS}")
    mode = body.get(wire.OUTPUT_MODE, "tokens")
    if mode not in wire.OUTPUT_MODES:
        raise bad_request(f"output_mode must be one of {list(wire.OUTPUT_MODES)}", wire.OUTPUT_MODE)
    return requestlimits.checked_n("generate", body)


def _prompt_ids_in_range(prompt: Any) -> bool:
    """A completions prompt's token ids (a list of ints, or of such lists) within a vocabulary's range
    (larger ones no tokenizer has, and past 2^63 no signed 64-bit word holds)."""
    if not isinstance(prompt, list):
        return True
    lists = [prompt] if any(type(p) is int for p in prompt) else [p for p in prompt if isinstance(p, list)]
    return all(is_token_ids([t for t in ids if type(t) is int]) for ids in lists)
