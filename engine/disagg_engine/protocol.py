"""Wire model of ``/inference/v1/generate`` with the engine extension: vLLM's ``GenerateRequest``
plus ``output_mode="derender"`` and its parser context, in both forms:

- ``chat_request``: the client's ``ChatCompletionRequest`` (the RFC's proposal; what batch
  ``/v1/chat/completions/derender`` takes), sent once per request;
- ``parse_context``: the slim context vLLM 0.33's ``/render`` emits.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from disagg_engine.vllm_compat import ChatCompletionRequest, GenerateRequest

OutputMode = Literal["tokens", "text", "derender"]


class ParseContext(BaseModel):
    """vLLM 0.33's ``ParseContext``; unknown keys are kept so they can be rejected at ``derender``."""

    model_config = ConfigDict(extra="allow")

    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    history_tool_call_cnt: int = Field(default=0, ge=0)


class DisaggGenerateRequest(GenerateRequest):
    output_mode: OutputMode = Field(
        default="tokens",
        description=(
            "'tokens': token ids only. 'text': also the detokenized text (delta per chunk when "
            "streaming). 'derender': an assistant message (batch) or delta chunks (stream) parsed "
            "by the server's reasoning/tool parsers, identical to /v1/chat/completions."
        ),
    )
    chat_request: ChatCompletionRequest | None = None
    parse_context: ParseContext | None = None

    @model_validator(mode="after")
    def _check_parser_context(self) -> DisaggGenerateRequest:
        if self.chat_request is not None and self.parse_context is not None:
            raise ValueError(
                "send either chat_request or parse_context, not both: they are two forms of the "
                "same parser context"
            )
        given = "chat_request" if self.chat_request is not None else "parse_context" if self.parse_context is not None else None
        if given and self.output_mode != "derender":
            raise ValueError(
                f"{given} is only read with output_mode='derender' (got {self.output_mode!r}); "
                f"drop {given} or set output_mode='derender'"
            )
        if self.output_mode == "derender" and self.parse_context is not None and self.parse_context.model_extra:
            unknown = sorted(self.parse_context.model_extra)
            raise ValueError(
                f"Unknown parse_context fields {unknown}; the render server is newer than this "
                "generate server. Upgrade the generate server or send chat_request instead."
            )
        return self

    def chat_context(self) -> ChatCompletionRequest | None:
        """The parser context as the ``ChatCompletionRequest`` vLLM's chat generators read.

        Sampling-dependent fields follow ``sampling_params`` (what the engine actually does), so
        a context that disagrees on ``n`` or logprobs cannot desynchronise the output.
        """
        sp = self.sampling_params
        if self.chat_request is not None:
            base = self.chat_request
        elif self.parse_context is not None:
            pc = self.parse_context
            base = ChatCompletionRequest.model_validate({
                "messages": [{"role": "user", "content": ""}],
                "tools": pc.tools,
                "tool_choice": pc.tool_choice,
                "parallel_tool_calls": pc.parallel_tool_calls,
                "include_reasoning": pc.include_reasoning,
                "chat_template_kwargs": pc.chat_template_kwargs,
            })
        else:
            base = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": ""}]})
        return base.model_copy(update={
            "n": sp.n,
            "stream": bool(self.stream),
            "stream_options": self.stream_options if self.stream else None,
            "logprobs": sp.logprobs is not None,
            "top_logprobs": sp.logprobs if sp.logprobs is not None else None,
            "return_token_ids": True,  # generate choices always carry token_ids
            "echo": False,
        })
