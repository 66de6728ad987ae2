"""One request through the legs: render -> prefill -> decode (-> derender) -> the client.

The decisions come from the request's plan (``plan.request``: output mode, what needs the chain,
derender strategy, logprobs) and ``decisions`` (prefill route), the bodies from ``legs``, the
shapes from ``shapes``; the legs are called by ``poollegs`` (render, derender, prefill) and
``decoding`` (decode, with its refusal rule), and a stream's failure after the first byte is
``clientstream``'s. This module sequences them:
- a decode answer in ``tokens`` (planned, or an engine that refused or ignored the inline mode)
  gets the chained path; any other answer is shaped as it is;
- an Anthropic Messages request runs the chat legs with the chat request vLLM's mapping derives
  from it, planned as chat (``request.derived_chat``);
- a ``GenerateRequest`` client gets its prefill leg rewritten and the decode answer passed
  through (``Decoder.passthrough``);
- an OpenAI Responses request is rendered and prefilled like chat, and the decode engine answers
  it on its own ``/v1/responses`` (``coupled``: vLLM's Responses code makes the answer); one that
  reads vLLM's response store goes to the decode engine alone (``decisions.responses_route``);
- the render or derender tier down under ``render.failure_policy: decode``: the decode engine
  answers the client's request itself (``coupled``);
- client disconnect: upstream streams are closed and ``handlers`` has the engines still working
  on the request abort it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from disagg_sidecar.derender import anthropic
from disagg_sidecar.derender import chained
from disagg_sidecar.derender import echo as echoes
from disagg_sidecar.plan import anthropic_request, answers, legs
from disagg_sidecar.plan import decisions
from disagg_sidecar.plan import requestlimits
from disagg_sidecar.plan.request import RequestPlan, derived_chat
from disagg_sidecar.derender import shapes
from disagg_sidecar import sse
from disagg_sidecar import vllm_releases, wire
from disagg_sidecar.pipeline.clientstream import SSEWriter, json_answer, run_stream
from disagg_sidecar.config import Capabilities, SidecarConfig
from disagg_sidecar.pipeline.context import Context
from disagg_sidecar.pipeline.coupled import DecodeAlone
from disagg_sidecar.pipeline.decoding import Decoder
from disagg_sidecar.pipeline.poollegs import PoolLegs, Prefilled
from disagg_sidecar.derender.usage import total_usage
from disagg_sidecar.errors import SidecarError


log = logging.getLogger(__name__)

Send = Callable[[Mapping[str, Any]], Awaitable[None]]
# Render's answer -> the chat request the parsers read, its bytes and its plan.
AsChat = Callable[[dict[str, Any]], tuple[dict[str, Any], bytes, RequestPlan]]


@dataclass(frozen=True)
class _ChatLegs:
    """A chat-shaped request rendered and prefilled: what its decode leg needs."""

    raw: bytes  # the chat request's bytes (the decode leg's and the derender tier's parser context)
    gen: dict[str, Any]
    plan: RequestPlan  # the chat request's, fitted to render's answer
    prefilled: Prefilled
    shape: shapes.Shape


class _Sending:
    """The decode relay's writer, its chat chunks going to ``send`` (another API's mapping), each
    choice's role in a chunk of its own, as coupled sends it (``shapes.role_apart``)."""

    def __init__(self, writer: SSEWriter, send: Send):
        self.writer, self._send = writer, send

    async def send(self, obj: Mapping[str, Any]) -> None:
        for piece in shapes.role_apart(obj):
            await self._send(piece)

    async def write(self, data: bytes) -> None:
        """Events that are the client's already (``DecodePlan.client_chunks``)."""
        await self.writer.write(data)


@dataclass
class Flows:
    config: SidecarConfig
    pools: PoolLegs
    decoder: Decoder
    capabilities: Callable[[], Capabilities]  # what the decode engine may be asked for now (derived plans)
    model_name: Callable[[], str | None]
    alone: DecodeAlone  # the decode engine answering on its own route (Responses; render.failure_policy decode)
    decode_release: Callable[[], vllm_releases.Release | None] = lambda: None  # as the engine reported it
    tiers_up: Callable[[], bool] = lambda: True  # the render and derender tiers answer their probes

    async def serve(self, request: web.Request, raw: bytes, body: dict[str, Any], plan: RequestPlan,
                    ctx: Context) -> web.StreamResponse:
        """A request of an API that needs the render tier: through the tiers, or, under
        ``render.failure_policy: decode``, answered by the decode engine itself while the render or
        derender tier is down (known from the probes, or found by a leg before the first byte)."""
        policy = self.config.render.failure_policy
        if decisions.render_route(plan.api, policy, self.tiers_up()) == "decode":
            return await self.alone.answer(request, raw, body, plan, ctx, "tier down")
        if plan.api == "responses" and decisions.responses_route(body) == "decode":
            return await self.alone.answer(request, raw, body, plan, ctx, "stored response")
        try:
            return await self._through_tiers(request, raw, body, plan, ctx)
        except SidecarError as exc:
            if not decisions.decode_answers_instead(plan.api, policy, exc.leg, exc.unavailable):
                raise
            log.warning("the %s leg failed (%s): the decode engine answers itself", exc.leg, exc.message)
            return await self.alone.answer(request, raw, body, plan, ctx, "leg failed")

    async def _through_tiers(self, request: web.Request, raw: bytes, body: dict[str, Any], plan: RequestPlan,
                             ctx: Context) -> web.StreamResponse:
        if plan.api == "chat":
            return await self.chat(request, raw, body, plan, ctx)
        if plan.api == "completions":
            return await self.completions(request, raw, body, plan, ctx)
        if plan.api == "messages":
            return await self.messages(request, raw, body, plan, ctx)
        if plan.api == "responses":
            return await self.responses(request, raw, body, plan, ctx)
        return await self.count_tokens(raw, body, ctx)

    def _shape(self, plan: RequestPlan, gen: Mapping[str, Any], prefilled: Prefilled, created: int,
               response_id: str, index_offset: int = 0) -> shapes.Shape:
        answer = plan.answer
        return shapes.Shape(
            id=response_id, created=created, model=self.model_name() or answer.model,
            prompt_tokens=len(gen[wire.TOKEN_IDS]),
            cached_tokens=prefilled.cached_tokens,
            return_token_ids=answer.return_token_ids, tool_choice=answer.tool_choice,
            derive_finish_reason=plan.derive_finish_reason, index_offset=index_offset,
            omits_none=bool((release := self.decode_release()) and release.omits_none_shapes),
        )

    # -- chat ------------------------------------------------------------------------------------

    async def _chat_legs(self, render_path: str, render_raw: bytes, ctx: Context, n: int,
                         as_chat: AsChat) -> _ChatLegs:
        """Render (``render_path``: chat's, or an API vLLM renders as chat) and prefill; ``as_chat``
        gives the chat request (its bytes, its plan) the decode and derender steps parse with."""
        created = int(time.time())
        rendered = await self.pools.render_chat(render_raw, ctx, n, render_path)
        body, raw, plan = as_chat(rendered)
        gen = plan.prompt_leg(rendered)
        raw = legs.client_context(raw, body)  # without a client's kv_transfer_params
        release = self.decode_release()
        plan = plan.fitted(gen, release)
        if plan.decode.context == "parse_context" and release is not None:  # as that engine reads it
            gen = {**gen, wire.PARSE_CONTEXT: vllm_releases.strip_parse_context(gen[wire.PARSE_CONTEXT], release)}
        prefilled = await self.pools.prefill(gen, ctx)
        shape = self._shape(plan, gen, prefilled, created, gen.get("request_id") or f"chatcmpl-{ctx.request_id}")
        return _ChatLegs(raw, gen, plan, prefilled, shape)

    async def _chat_batch(self, c: _ChatLegs, ctx: Context) -> dict[str, Any]:
        out = await self.decoder.batch(c.gen, c.prefilled.kv, c.plan, ctx, c.raw)
        if c.plan.chains(decisions.answered_mode(out)):
            derender = legs.DerenderLeg("chat", c.raw, c.gen[wire.TOKEN_IDS])
            return await chained.chat_batch(out, derender, chained.Options.planned(c.plan.answer, c.gen), c.shape,
                                            self.pools.tier(ctx))
        return shapes.chat_from_generate(out, c.shape, c.gen[wire.TOKEN_IDS])

    async def _chat_stream(self, c: _ChatLegs, ctx: Context, writer: SSEWriter, send: Send,
                           send_usage: Send | None = None) -> None:
        """The chat chunks, each to ``send``, the closing usage chunk to ``send_usage`` (the same by
        default); ``writer`` only starts the client's stream."""
        derender = legs.DerenderLeg("chat", c.raw, c.gen[wire.TOKEN_IDS])
        stream_call = chained.ChatStream(derender, chained.Options.planned(c.plan.answer, c.gen), self.pools.tier(ctx),
                                         logprobs=c.plan.answer.stream_logprobs,
                                         client=c.shape if c.plan.session_chunks else None)
        first: set[int] = set()
        usage = await self.decoder.stream(c.gen, c.prefilled.kv, c.plan, ctx, stream_call, c.raw,
                                          _Sending(writer, send), lambda chunk: shapes.chat_chunk(chunk, c.shape, first=first),
                                          c.shape if c.plan.decode.client_chunks else None)
        if usage is not None:
            await (send_usage or send)(shapes.usage_chunk("chat.completion.chunk", c.shape, c.shape.usage(usage)))

    async def chat(self, request: web.Request, raw: bytes, body: dict[str, Any], plan: RequestPlan,
                   ctx: Context) -> web.StreamResponse:
        c = await self._chat_legs(wire.CHAT_RENDER, raw, ctx, plan.n, lambda gen: (body, raw, plan))
        if not plan.stream:
            return json_answer(await self._chat_batch(c, ctx), ctx.response_headers())
        writer = SSEWriter(request, ctx.response_headers())
        return await run_stream(writer, lambda: self._chat_stream(c, ctx, writer, writer.send))

    # -- Anthropic Messages: chat legs, vLLM's mapping around them (derender.anthropic) --------------

    async def messages(self, request: web.Request, raw: bytes, body: dict[str, Any], plan: RequestPlan,
                       ctx: Context) -> web.StreamResponse:
        def as_chat(gen: dict[str, Any]) -> tuple[dict[str, Any], bytes, RequestPlan]:
            chat = anthropic_request.chat_request_as_rendered(body, gen)
            return chat, sse.dumps(chat), derived_chat(chat, self.capabilities(), self.config)

        c = await self._chat_legs(wire.MESSAGES_RENDER, raw, ctx, plan.n, as_chat)
        if not plan.stream:
            answer = anthropic.message(await self._chat_batch(c, ctx))
            return json_answer(answer, ctx.response_headers())
        writer = SSEWriter(request, ctx.response_headers())
        converter = anthropic.MessageStream(c.shape.usage({"prompt_tokens": c.shape.prompt_tokens,
                                                           "completion_tokens": 0}))

        async def convert(chunk: Mapping[str, Any]) -> None:
            for event in converter.feed(chunk):
                await writer.write(anthropic.sse_event(event))

        async def send(chunk: Mapping[str, Any]) -> None:
            # Only the closing chunk has no choices in a coupled stream (vLLM's converter reads it
            # as the end); a chunk that had only token ids for the client had its usage only.
            if chunk.get("choices"):
                await convert(chunk)

        async def end() -> None:
            await writer.write(b"".join(anthropic.sse_event(e) for e in converter.finish()))

        async def fail(status: int, message: str) -> None:
            await writer.write(anthropic.error_event(status, message))

        return await run_stream(writer, lambda: self._chat_stream(c, ctx, writer, send, convert), end=end, fail=fail)

    async def count_tokens(self, raw: bytes, body: dict[str, Any], ctx: Context) -> web.StreamResponse:
        """The rendered prompt's length: the render tier only, as coupled renders it."""
        render_body = sse.dumps(anthropic_request.count_render_body(body))
        gen = await self.pools.render_chat(render_body, ctx, 1, wire.MESSAGES_RENDER)
        return json_answer(anthropic.count_tokens(len(gen[wire.TOKEN_IDS])), ctx.response_headers())

    # -- OpenAI Responses: render and prefill here, the decode engine's own route answers ------------

    async def responses(self, request: web.Request, raw: bytes, body: dict[str, Any], plan: RequestPlan,
                        ctx: Context) -> web.StreamResponse:
        """Render (``/v1/responses/render``: the prompt the decode engine renders again, the same
        tokens, so it finds their KV) and prefill; the decode engine answers on ``/v1/responses``."""
        rendered = await self.pools.render_chat(legs.client_context(raw, body), ctx, 1, wire.RESPONSES_RENDER)
        prefilled = await self.pools.prefill(plan.prompt_leg(rendered), ctx)
        return await self.alone.prefilled(request, raw, body, plan, ctx, prefilled.kv, prefilled.cached_tokens)

    # -- completions -------------------------------------------------------------------------------

    async def completions(self, request: web.Request, raw: bytes, body: dict[str, Any], plan: RequestPlan,
                          ctx: Context) -> web.StreamResponse:
        created = int(time.time())
        n, answer = plan.n, plan.answer
        rendered = await self.pools.render_prompts(raw, ctx, requestlimits.rendered_prompts(body), n)
        gens = [plan.prompt_leg(g) for g in rendered]
        response_id = f"cmpl-{ctx.request_id}"
        tier = self.pools.tier(ctx)

        def shape(i: int, prefilled: Prefilled) -> shapes.Shape:
            return self._shape(plan, gens[i], prefilled, created, response_id, index_offset=i * n)

        context: list[bytes] = []  # the parser context, parsed out of the body once for every prompt

        def derender(gen: Mapping[str, Any]) -> legs.DerenderLeg:
            if not context:
                context.append(legs.parser_context(raw, "completions"))
            return legs.DerenderLeg("completions", raw, gen[wire.TOKEN_IDS], context=context[0])

        texts = echoes.prompt_texts(body.get("prompt"), len(gens))
        with_logprobs = answer.completion_logprobs is not None

        async def echo(i: int, gen: Mapping[str, Any], prompt_logprobs: Any) -> echoes.Echo:
            ids = gen[wire.TOKEN_IDS]
            if with_logprobs and not prompt_logprobs:
                raise SidecarError(502, "The decode engine answered without the prompt's logprobs",
                                   type_="BadGatewayError")
            text = texts[i] if i < len(texts) and texts[i] is not None else await self._detokenize(ids, plan, ctx)
            first = await self._detokenize(ids[:1], plan, ctx) if with_logprobs else None
            return echoes.make(body, text, ids, prompt_logprobs, first)

        async def one(i: int, gen: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Any]:
            prefilled = await self.pools.prefill(gen, ctx)
            out = await self.decoder.batch(gen, prefilled.kv, plan, ctx, None)
            prompt_logprobs = out.get("prompt_logprobs")  # the decode engine's, for every choice
            if plan.chains(decisions.answered_mode(out)):
                out = await chained.completion_batch(out, derender(gen), chained.Options.planned(answer, gen), tier)
            s = shape(i, prefilled)
            choices = shapes.completion_choices(out, s, gen[wire.TOKEN_IDS], prompt_logprobs)
            if answer.echo:
                e = await echo(i, gen, prompt_logprobs)
                choices = [echoes.choice(c, e) for c in choices]
            return choices, s.usage(out.get("usage"))

        if not plan.stream:
            parts = await _gather(*(one(i, g) for i, g in enumerate(gens)))
            choices = [c for part, _ in parts for c in part]
            result = shapes.completion_response(choices, total_usage(u for _, u in parts), shape(0, Prefilled()))
            return json_answer(result, ctx.response_headers())

        # Prefill every prompt before the first byte, so the response headers can say how.
        prefilled = await _gather(*(self.pools.prefill(g, ctx) for g in gens))
        prompt_shapes = [shape(i, p) for i, p in enumerate(prefilled)]
        firsts = [echoes.FirstChunks(list(g[wire.TOKEN_IDS]), return_token_ids=answer.return_token_ids)
                  for g in gens]
        if answer.echo:  # a generate stream carries no prompt logprobs: a batch leg asks for them
            plps = await _gather(*(self.decoder.prompt_logprobs(g, ctx) if with_logprobs else _none() for g in gens))
            for first, e in zip(firsts, await _gather(*(echo(i, g, plps[i]) for i, g in enumerate(gens)))):
                first.echo = e
        writer = SSEWriter(request, ctx.response_headers())

        async def stream_one(i: int, gen: Mapping[str, Any]) -> Any:
            stream_call = chained.CompletionStream(derender(gen), chained.Options.planned(answer, gen), tier,
                                                   client=prompt_shapes[i] if plan.session_chunks else None)
            usage = await self.decoder.stream(gen, prefilled[i].kv, plan, ctx, stream_call, None, writer,
                                              lambda chunk: firsts[i](shapes.completion_chunk(chunk, prompt_shapes[i])),
                                              prompt_shapes[i] if plan.decode.client_chunks else None)
            return prompt_shapes[i].usage(usage) if usage is not None else None

        async def run() -> None:
            total = total_usage(await _gather(*(stream_one(i, g) for i, g in enumerate(gens))))
            if total is not None:
                await writer.send(shapes.usage_chunk("text_completion", prompt_shapes[0], total))

        return await run_stream(writer, run)

    async def _detokenize(self, ids: list[int], plan: RequestPlan, ctx: Context) -> str:
        """The render tier's text of ``ids``: vLLM's renderer decodes a token prompt so (``echo``)."""
        model = plan.answer.model
        request = {"tokens": ids, **({"model": model} if isinstance(model, str) else {})}
        return await self.pools.call("render", wire.DETOKENIZE, sse.dumps(request), ctx, answers.detokenized)

    # -- GenerateRequest clients -------------------------------------------------------------------

    async def generate(self, request: web.Request, body: dict[str, Any], plan: RequestPlan,
                       ctx: Context) -> web.StreamResponse:
        """The client's own GenerateRequest: prefill leg rewritten, decode answer passed through."""
        body = plan.prompt_leg(body)
        return await self.decoder.passthrough(request, body, plan, (await self.pools.prefill(body, ctx)).kv, ctx)


async def _none() -> None:
    return None


async def _gather(*aws: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather`` that cancels the siblings when one fails."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
