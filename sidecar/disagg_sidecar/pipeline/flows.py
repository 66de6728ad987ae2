"""One request through the legs: render -> prefill -> decode (-> derender) -> the client.

The decisions come from the request's plan (``plan.request``: output mode, what needs the chain,
derender strategy, logprobs) and ``decisions`` (prefill route), the bodies from ``legs``, the
shapes from ``shapes``; the legs are called by ``poollegs`` (render, derender, prefill) and
``decoding`` (decode, with its refusal rule), and a stream's failure after the first byte is
``clientstream``'s. This module sequences them:
- a decode answer in ``tokens`` (planned, or an engine that refused or ignored the inline mode)
  gets the chained path; any other answer is shaped as it is;
- a ``GenerateRequest`` client gets its prefill leg rewritten and the decode answer passed
  through (``Decoder.passthrough``);
- client disconnect: upstream streams are closed and ``handlers`` has the engines still working
  on the request abort it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from disagg_sidecar.derender import chained
from disagg_sidecar.plan import legs
from disagg_sidecar.plan import decisions
from disagg_sidecar.plan.request import RequestPlan
from disagg_sidecar.derender import shapes
from disagg_sidecar import sse
from disagg_sidecar import wire
from disagg_sidecar.pipeline.clientstream import SSEWriter, run_stream
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.pipeline.context import Context
from disagg_sidecar.pipeline.decoding import Decoder
from disagg_sidecar.pipeline.poollegs import PoolLegs, Prefilled
from disagg_sidecar.derender.usage import total_usage


@dataclass
class Flows:
    config: SidecarConfig
    pools: PoolLegs
    decoder: Decoder
    model_name: Callable[[], str | None]

    def _shape(self, plan: RequestPlan, gen: Mapping[str, Any], prefilled: Prefilled, created: int,
               response_id: str, index_offset: int = 0) -> shapes.Shape:
        answer = plan.answer
        return shapes.Shape(
            id=response_id, created=created, model=self.model_name() or answer.model,
            prompt_tokens=len(gen[wire.TOKEN_IDS]),
            cached_tokens=prefilled.cached_tokens,
            return_token_ids=answer.return_token_ids, tool_choice=answer.tool_choice,
            derive_finish_reason=plan.derive_finish_reason, index_offset=index_offset,
        )

    # -- chat --------------------------------------------------------------------------------------

    async def chat(self, request: web.Request, raw: bytes, plan: RequestPlan, ctx: Context) -> web.StreamResponse:
        created = int(time.time())
        gen = plan.prompt_leg(await self.pools.call("render", wire.CHAT_RENDER, raw, ctx))
        plan = plan.fitted(gen)
        prefilled = await self.pools.prefill(gen, ctx)
        kv = prefilled.kv
        shape = self._shape(plan, gen, prefilled, created, gen.get("request_id") or f"chatcmpl-{ctx.request_id}")
        derender = legs.DerenderLeg("chat", raw, gen[wire.TOKEN_IDS])
        opts = chained.Options.planned(plan.answer, gen)
        tier = self.pools.tier(ctx)
        if not plan.stream:
            out = await self.decoder.batch(gen, kv, plan, ctx, raw)
            if plan.chains(decisions.answered_mode(out)):
                result = await chained.chat_batch(out, derender, opts, shape, tier)
            else:
                result = shapes.chat_from_generate(out, shape, gen[wire.TOKEN_IDS])
            return web.json_response(result, headers=ctx.response_headers(), dumps=sse.dumps_text)
        writer = SSEWriter(request, ctx.response_headers())
        first: set[int] = set()

        async def run() -> None:
            stream_call = chained.ChatStream(derender, opts, tier, logprobs=plan.answer.stream_logprobs)
            usage = await self.decoder.stream(gen, kv, plan, ctx, stream_call, raw, writer,
                                              lambda chunk: shapes.chat_chunk(chunk, shape, first=first))
            if usage is not None:
                await writer.send(shapes.usage_chunk("chat.completion.chunk", shape, shape.usage(usage)))

        return await run_stream(writer, run)

    # -- completions -------------------------------------------------------------------------------

    async def completions(self, request: web.Request, raw: bytes, plan: RequestPlan,
                          ctx: Context) -> web.StreamResponse:
        created = int(time.time())
        gens = [plan.prompt_leg(g) for g in await self.pools.call("render", wire.COMPLETIONS_RENDER, raw, ctx)]
        response_id = f"cmpl-{ctx.request_id}"
        tier = self.pools.tier(ctx)

        def shape(i: int, prefilled: Prefilled) -> shapes.Shape:
            return self._shape(plan, gens[i], prefilled, created, response_id, index_offset=i * plan.n)

        def derender(gen: Mapping[str, Any]) -> legs.DerenderLeg:
            return legs.DerenderLeg("completions", raw, gen[wire.TOKEN_IDS])

        async def one(i: int, gen: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Any]:
            prefilled = await self.pools.prefill(gen, ctx)
            out = await self.decoder.batch(gen, prefilled.kv, plan, ctx, None)
            if plan.chains(decisions.answered_mode(out)):
                out = await chained.completion_batch(out, derender(gen), chained.Options.planned(plan.answer, gen), tier)
            s = shape(i, prefilled)
            return shapes.completion_choices(out, s, gen[wire.TOKEN_IDS]), s.usage(out.get("usage"))

        if not plan.stream:
            parts = await _gather(*(one(i, g) for i, g in enumerate(gens)))
            choices = [c for part, _ in parts for c in part]
            result = shapes.completion_response(choices, total_usage(u for _, u in parts), shape(0, Prefilled()))
            return web.json_response(result, headers=ctx.response_headers(), dumps=sse.dumps_text)

        # Prefill every prompt before the first byte, so the response headers can say how.
        prefilled = await _gather(*(self.pools.prefill(g, ctx) for g in gens))
        prompt_shapes = [shape(i, p) for i, p in enumerate(prefilled)]
        writer = SSEWriter(request, ctx.response_headers())

        async def stream_one(i: int, gen: Mapping[str, Any]) -> Any:
            stream_call = chained.CompletionStream(derender(gen), chained.Options.planned(plan.answer, gen), tier)
            usage = await self.decoder.stream(gen, prefilled[i].kv, plan, ctx, stream_call, None, writer,
                                              lambda chunk: shapes.completion_chunk(chunk, prompt_shapes[i]))
            return prompt_shapes[i].usage(usage) if usage is not None else None

        async def run() -> None:
            total = total_usage(await _gather(*(stream_one(i, g) for i, g in enumerate(gens))))
            if total is not None:
                await writer.send(shapes.usage_chunk("text_completion", prompt_shapes[0], total))

        return await run_stream(writer, run)

    # -- GenerateRequest clients -------------------------------------------------------------------

    async def generate(self, request: web.Request, body: dict[str, Any], plan: RequestPlan,
                       ctx: Context) -> web.StreamResponse:
        """The client's own GenerateRequest: prefill leg rewritten, decode answer passed through."""
        body = plan.prompt_leg(body)
        return await self.decoder.passthrough(request, body, plan, (await self.pools.prefill(body, ctx)).kv, ctx)


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
