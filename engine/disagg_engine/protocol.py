"""Wire model of ``/inference/v1/generate`` with the engine extension: vLLM's ``GenerateRequest``
plus ``output_mode="derender"`` (batch and streaming) and its parser context, in both forms:

- ``chat_request``: the client's ``ChatCompletionRequest`` (docs/protocol.md §2; what batch
  ``/v1/chat/completions/derender`` takes), sent once per request;
- ``parse_context``: the slim context vLLM 0.33's ``/render`` emits. As in vLLM 0.33, it is read
  only at ``derender`` and ignored otherwise, so a rendered request can go to a prefill leg as is.

0.33's ``/render`` output always carries ``parse_context``, so a client that adds the chat request
to it sends both: ``chat_request`` (the whole request, which render derived ``parse_context`` from)
is then the one read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, PrivateAttr, model_validator

from disagg_engine.vllm_compat import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ParseContext,
    empty_chat_request,
)

OutputMode = Literal["tokens", "text", "derender"]


class ClientStream(BaseModel):
    """What a stream's chunks need to be the client's own: the client's API (``chat``: a streamed
    ``derender``; ``completions``: a streamed ``text``), the stream's header (``id``, ``created``,
    ``model`` as the client's endpoint names them), whether the client asked for token ids, and the
    prompt's cached tokens where the caller knows them better (a prefill engine's cache hits). With
    it, each chunk is written exactly as ``/v1/chat/completions`` (``/v1/completions``) writes it
    for the client, so a proxy can relay the bytes (docs/protocol.md §2)."""

    api: Literal["chat", "completions"] = "chat"  # absent: chat, the only API of the first version
    id: str
    created: int
    model: str
    return_token_ids: bool = False
    cached_tokens: int | None = None


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
    client_stream: ClientStream | None = None
    # Set on the copy handed to vLLM's `serve_tokens` as a `text` request (serving.py).
    _derender: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _check_parser_context(self) -> DisaggGenerateRequest:
        if self.chat_request is not None and self.output_mode != "derender":
            raise ValueError(
                f"chat_request is only read with output_mode='derender' (got {self.output_mode!r}); "
                "drop chat_request or set output_mode='derender'"
            )
        client = self.client_stream
        if client is not None and client.api == "chat" and (self.output_mode != "derender" or not self.stream):
            raise ValueError("client_stream is only read with output_mode='derender' and stream=true")
        if client is not None and client.api == "completions" and (self.output_mode != "text" or not self.stream):
            raise ValueError("client_stream with api='completions' is only read with output_mode='text' and "
                             "stream=true")
        return self

    @model_validator(mode="after")
    def _check_parse_context_fields(self) -> DisaggGenerateRequest:
        # Named as vLLM 0.33's own check, which it replaces: unknown fields fail only where the
        # parse_context is read (at derender, without a chat_request).
        if (self.output_mode == "derender" and self.chat_request is None and self.parse_context is not None
                and self.parse_context.model_extra):
            unknown = sorted(self.parse_context.model_extra)
            raise ValueError(
                f"Unknown parse_context fields {unknown}; the render server is newer than this "
                "generate server. Upgrade the generate server or send chat_request instead."
            )
        return self

    def for_extension(self) -> DisaggGenerateRequest:
        """This ``derender`` request as the ``text`` request vLLM's ``serve_tokens`` runs (the same
        engine request: detokenized, same sampling), marked so our generators derender it."""
        copy = self.model_copy(update={"output_mode": "text"})
        copy._derender = True
        return copy

    def history_tool_calls(self) -> int | None:
        """Tool calls earlier in the conversation when the parser cannot count them from messages."""
        return self.parse_context.history_tool_call_cnt if self.chat_request is None and self.parse_context else None

    def chat_context(self) -> ChatCompletionRequest:
        """The parser context as the ``ChatCompletionRequest`` vLLM's chat generators read.

        Sampling-dependent fields follow ``sampling_params`` (what the engine actually does), so
        a context that disagrees on ``n`` or logprobs cannot desynchronise the output.
        """
        sp = self.sampling_params
        if self.chat_request is not None:
            base = self.chat_request
        elif self.parse_context is not None:
            base = self.parse_context.to_chat_request()
        else:
            base = empty_chat_request()
        return base.model_copy(update={
            "n": sp.n,
            "stream": bool(self.stream),
            "stream_options": self.stream_options if self.stream else None,
            "logprobs": sp.logprobs is not None,
            "top_logprobs": sp.logprobs if sp.logprobs is not None else None,
            # generate choices always carry token_ids; a client's chunks as the client asked
            "return_token_ids": self.client_stream.return_token_ids if self.client_stream else True,
            "echo": False,
        })

    def completion_context(self) -> CompletionRequest:
        """The client's completions request as vLLM's completions stream generator reads it for
        one prompt (``client_stream`` with ``api='completions'``): ``n``, ``max_tokens``, logprobs and
        stream options as the engine runs them, token ids as the client asked, no echo (the prompt's
        text is not the engine's to write)."""
        sp = self.sampling_params
        return CompletionRequest.model_validate({
            "prompt": list(self.token_ids),
            "n": sp.n,
            "max_tokens": sp.max_tokens,
            "stream": True,
            "stream_options": self.stream_options.model_dump() if self.stream_options is not None else None,
            "return_token_ids": bool(self.client_stream and self.client_stream.return_token_ids),
            "echo": False,
            "logprobs": sp.logprobs,
        })
