"""``/inference/v1/generate`` with ``output_mode`` tokens | text | derender, batch and streaming.

``tokens`` and ``text`` are vLLM's own code paths. ``derender`` feeds the engine's live
``RequestOutput`` stream into vLLM's own ``/v1/chat/completions`` generators, so the message and
the deltas are exactly what the coupled endpoint returns for the same tokens: one parser per
choice, created when the request starts and dropped when it ends or is aborted; no replay, no
client-carried state. Only the shape is changed (``shapes.py``): the generate schema, or, with
``client_stream``, the client's own chunk under the header it names. vLLM's ``serve_tokens`` runs
such a request as ``text`` (``DisaggGenerateRequest.for_extension``): vLLM 0.33 refuses a streamed
``derender`` itself. What vLLM does itself stays vLLM's (``vllm_compat``): a batch ``derender``
with ``parse_context`` from 0.33 on, a streamed one from 0.34 on; the extension keeps the
``chat_request`` form, ``client_stream`` and, before 0.34, the streamed ``parse_context`` one.
A streamed ``text`` request with ``client_stream`` (``api='completions'``) feeds vLLM's own
``/v1/completions`` stream generator instead of the generate one: each chunk is then the client's
``text_completion`` chunk as the coupled endpoint writes it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from disagg_engine import shapes
from disagg_engine.per_token import PerToken, per_token_outputs
from disagg_engine.protocol import DisaggGenerateRequest
from disagg_engine.vllm_compat import (
    NATIVE_DERENDER,
    STOCK_STREAMING_DERENDER,
    ChatCompletionResponse,
    ErrorResponse,
    OpenAIServingChat,
    OpenAIServingCompletion,
    ServingTokens,
    chat_parser_configured,
    chat_with_history,
    effective_chat_template_kwargs,
    make_chat_parser,
)


class DisaggServingTokens(ServingTokens):
    """vLLM's ``ServingTokens`` with the ``derender`` level added (see ``vllm_compat``)."""

    chat: OpenAIServingChat | None = None
    completion: OpenAIServingCompletion | None = None
    live_derender_requests: int = 0

    async def serve_tokens(self, request: DisaggGenerateRequest, raw_request=None):
        client = request.client_stream
        if client is not None and client.api == "completions" and self.completion is None:
            return self.create_error_response(
                "client_stream with api='completions' needs the completions endpoint on this server")
        if request.output_mode != "derender" or not self.has_tokenizer:
            return await super().serve_tokens(request, raw_request)  # vLLM's checks name the mode
        if (error := self._check_derender(request)) is not None:
            return error
        if self._stock_derender(request):
            return await super().serve_tokens(request, raw_request)  # vLLM's own derender
        return await super().serve_tokens(request.for_extension(), raw_request)

    @staticmethod
    def _stock_derender(request: DisaggGenerateRequest) -> bool:
        """vLLM derenders this request itself: no ``chat_request`` nor ``client_stream``, and batch
        from 0.33 on or streamed from 0.34 on."""
        if request.chat_request is not None or request.client_stream is not None:
            return False
        return STOCK_STREAMING_DERENDER if request.stream else NATIVE_DERENDER

    def _check_derender(self, request: DisaggGenerateRequest) -> ErrorResponse | None:
        if self.chat is None:
            return self.create_error_response(
                "output_mode='derender' needs the chat endpoint on this server (a generate model); "
                "use output_mode='text' or 'tokens'."
            )
        if chat_parser_configured(self.chat) and request.chat_request is None and request.parse_context is None:
            return self.create_error_response(
                "output_mode='derender' requires chat_request (or parse_context) on a server with a "
                "tool or reasoning parser, because plain detokenization would leak parser markup "
                "into content. Send the client's chat request as chat_request, or the "
                "parse_context returned by /render."
            )
        return None

    async def _tracked(self, outputs: AsyncGenerator) -> AsyncGenerator:
        """Count live derender requests; the count drops however the request ends. ``outputs`` is
        closed with this generator, so vLLM aborts the request at once, not when it is collected."""
        self.live_derender_requests += 1
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    yield out
        finally:
            self.live_derender_requests -= 1

    def _chat_setup(self, request: DisaggGenerateRequest) -> tuple[Any, dict[str, Any]]:
        ctx = request.chat_context()
        return ctx, effective_chat_template_kwargs(self.chat, ctx)

    async def serve_tokens_full_generator(self, request, result_generator, request_id, model_name, request_metadata,
                                          **kwargs):
        if not request._derender:
            return await super().serve_tokens_full_generator(
                request, result_generator, request_id, model_name, request_metadata, **kwargs)
        ctx, template_kwargs = self._chat_setup(request)
        parser = make_chat_parser(self.chat, ctx, template_kwargs, request.history_tool_calls())
        result = await self.chat.chat_completion_full_generator(
            ctx, self._tracked(result_generator), request_id, model_name, [],
            self.chat.renderer.tokenizer, request_metadata, parser=parser,
        )
        if isinstance(result, ErrorResponse):
            return result
        assert isinstance(result, ChatCompletionResponse)
        return shapes.derender_response(result.model_dump(), request_id)

    async def serve_tokens_stream_generator(self, request, result_generator, request_id, model_name, request_metadata,
                                            **kwargs):
        # kwargs: what vLLM passes beside (0.34: `processors`, None for our `text` copy); forwarded as is.
        if request.client_stream is not None and request.client_stream.api == "completions":
            async for event in self._client_completions(request, result_generator, request_metadata):
                yield event
            return
        if not request._derender:
            async for event in super().serve_tokens_stream_generator(
                    request, result_generator, request_id, model_name, request_metadata, **kwargs):
                yield event
            return
        ctx, template_kwargs = self._chat_setup(request)
        chat = chat_with_history(self.chat, request.history_tool_calls())
        tokenizer = self.chat.renderer.tokenizer
        splitter = PerToken(tokenizer, request_id, list(request.token_ids), request.sampling_params)
        chat_stream = chat.chat_completion_stream_generator(
            ctx, self._tracked(per_token_outputs(result_generator, splitter)), request_id, model_name, [],
            tokenizer, request_metadata, chat_template_kwargs=template_kwargs,
        )
        client = request.client_stream
        async for event in chat_stream:
            payload = event[len("data: "):].strip() if event.startswith("data: ") else ""
            if payload == "[DONE]" or not payload:
                yield event
            elif client is not None:  # the client's own chunk (``ClientStream``)
                chunk = shapes.client_stream_event(payload, client.id, client.created, client.model, client.cached_tokens)
                yield f"data: {chunk}\n\n"
            else:
                yield f"data: {shapes.derender_stream_event(payload, request_id)}\n\n"

    async def _client_completions(self, request: DisaggGenerateRequest, result_generator: AsyncGenerator,
                                  request_metadata) -> AsyncGenerator[str, None]:
        """The client's ``text_completion`` chunks (``ClientStream``, ``api='completions'``): vLLM's
        completions stream generator under the client's header, fed the engine's outputs as the
        coupled endpoint feeds it one prompt's; only the prompt's cached tokens are patched in."""
        client = request.client_stream
        assert client is not None and self.completion is not None
        outputs = _one_prompt(result_generator)
        events = self.completion.completion_stream_generator(
            request.completion_context(), [{"prompt_token_ids": list(request.token_ids)}], outputs, client.id,
            client.created, client.model, 1, self.completion.renderer.tokenizer, request_metadata)
        async with aclosing(outputs), aclosing(events):  # closed with this one: vLLM aborts at once
            async for event in events:
                if client.cached_tokens is not None and event.startswith("data: {"):
                    event = f"data: {shapes.with_cached_tokens(event[6:].strip(), client.cached_tokens)}\n\n"
                yield event


async def _one_prompt(outputs: AsyncGenerator) -> AsyncIterator[tuple[int, Any]]:
    """The engine's outputs as the completions generator takes a request's: (prompt index, output),
    without the KV connector's parameters (a coupled server has no connector: 0.33 on writes them
    into the last chunk)."""
    async with aclosing(outputs):
        async for out in outputs:
            out.kv_transfer_params = None
            yield 0, out
