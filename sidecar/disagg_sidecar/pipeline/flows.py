"""One request through the legs: render -> prefill -> decode (-> derender) -> the client.

The decisions come from ``decisions`` (output mode, prefill route), the bodies from ``legs``, the
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
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from disagg_sidecar.derender import chained
from disagg_sidecar.derender import echo as echoes
from disagg_sidecar.derender import fixes
from disagg_sidecar.plan import legs
from disagg_sidecar.plan import decisions
from disagg_sidecar.plan import requestlimits
from disagg_sidecar.derender import shapes
from disagg_sidecar import wire
from disagg_sidecar.pipeline.clientstream import SSEWriter, run_stream
from disagg_sidecar.config import Capabilities, SidecarConfig
from disagg_sidecar.pipeline.context import Context
from disagg_sidecar.pipeline.decoding import Decoder
from disagg_sidecar.pipeline.poollegs import PoolLegs, Prefilled
from disagg_sidecar.derender.usage import total_usage
from disagg_sidecar.errors import SidecarError


@dataclass
class Flows:
    config: SidecarConfig
    pools: PoolLegs
    decoder: Decoder
    capabilities: Callable[[], Capabilities]  # what the decode engine may be asked for now
    model_name: Callable[[], str | None]

    def _shape(self, body: Mapping[str, Any], gen: Mapping[str, Any], prefilled: Prefilled, created: int,
               response_id: str, index_offset: int = 0) -> shapes.Shape:
        return shapes.Shape(
            id=response_id, created=created, model=self.model_name() or body.get("model"),
            prompt_tokens=len(gen[wire.TOKEN_IDS]),
            cached_tokens=prefilled.cached_tokens,
            return_token_ids=bool(body.get("return_token_ids")), tool_choice=body.get("tool_choice"),
            derive_finish_reason=not self.config.engine.features.derender_finish_reason, index_offset=index_offset,
        )

    def _checked(self, gen: dict[str, Any]) -> dict[str, Any]:
        """A GenerateRequest within the client's logprob limit (render does not check it; the engines
        would, but run with one candidate more)."""
        requestlimits.check_logprobs(gen.get(wire.SAMPLING_PARAMS), self.config.limits.max_logprobs)
        return gen

    # -- chat --------------------------------------------------------------------------------------

    async def chat(self, request: web.Request, raw: bytes, body: dict[str, Any], ctx: Context) -> web.StreamResponse:
        created = int(time.time())
        decode_plan = decisions.decode_plan("chat", body, self.capabilities())
        gen = self._checked(legs.rendered(await self.pools.call("render", wire.CHAT_RENDER, raw, ctx)))
        decode_plan = decisions.fit_to_render(decode_plan, gen)
        prefilled = await self.pools.prefill(gen, ctx)
        kv = prefilled.kv
        shape = self._shape(body, gen, prefilled, created, gen.get("request_id") or f"chatcmpl-{ctx.request_id}")
        derender = legs.DerenderLeg("chat", raw, gen[wire.TOKEN_IDS])
        opts = chained.Options.of(body, gen)
        tier = self.pools.tier(ctx)
        if not body.get("stream"):
            out = await self.decoder.batch(gen, kv, decode_plan, ctx, raw)
            if decisions.answered_mode(out) == "tokens":
                result = await chained.chat_batch(out, derender, opts, shape, tier)
            else:
                result = shapes.chat_from_generate(out, shape, gen[wire.TOKEN_IDS])
            return web.json_response(result, headers=ctx.response_headers(), dumps=_dumps)
        writer = SSEWriter(request, ctx.response_headers())
        first: set[int] = set()

        async def run() -> None:
            stream_call = chained.ChatStream(derender, opts, tier, logprobs=bool(body.get("logprobs")))
            usage = await self.decoder.stream(gen, kv, decode_plan, ctx, stream_call, raw, writer,
                                              lambda chunk: shapes.chat_chunk(chunk, shape, first=first))
            if usage is not None:
                await writer.send(shapes.usage_chunk("chat.completion.chunk", shape, shape.usage(usage)))

        return await run_stream(writer, run)

    # -- completions -------------------------------------------------------------------------------

    async def completions(self, request: web.Request, raw: bytes, body: dict[str, Any],
                          ctx: Context) -> web.StreamResponse:
        created = int(time.time())
        decode_plan = decisions.decode_plan("completions", body, self.capabilities())
        gens = [fixes.with_candidate_headroom(self._checked(legs.rendered(g)), self.config.engine.max_logprobs)
                for g in await self.pools.call("render", wire.COMPLETIONS_RENDER, raw, ctx)]
        n = int(body.get("n") or 1)
        response_id = f"cmpl-{ctx.request_id}"
        tier = self.pools.tier(ctx)

        def shape(i: int, prefilled: Prefilled) -> shapes.Shape:
            return self._shape(body, gens[i], prefilled, created, response_id, index_offset=i * n)

        def derender(gen: Mapping[str, Any]) -> legs.DerenderLeg:
            return legs.DerenderLeg("completions", raw, gen[wire.TOKEN_IDS])

        texts = echoes.prompt_texts(body.get("prompt"), len(gens))

        async def echo(i: int, gen: Mapping[str, Any], prompt_logprobs: Any) -> echoes.Echo:
            ids = gen[wire.TOKEN_IDS]
            if type(body.get("logprobs")) is int and not prompt_logprobs:
                raise SidecarError(502, "The decode engine answered without the prompt's logprobs",
                                   type_="BadGatewayError")
            text = texts[i] if i < len(texts) and texts[i] is not None else await self._detokenize(ids, body, ctx)
            first = await self._detokenize(ids[:1], body, ctx) if type(body.get("logprobs")) is int else None
            return echoes.make(body, text, ids, prompt_logprobs, first)

        async def one(i: int, gen: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Any]:
            prefilled = await self.pools.prefill(gen, ctx)
            out = await self.decoder.batch(gen, prefilled.kv, decode_plan, ctx, None)
            prompt_logprobs = out.get("prompt_logprobs")  # the decode engine's, for every choice
            if decisions.answered_mode(out) != "text":
                out = await chained.completion_batch(out, derender(gen), chained.Options.of(body, gen), tier)
            s = shape(i, prefilled)
            choices = shapes.completion_choices(out, s, gen[wire.TOKEN_IDS], prompt_logprobs)
            if body.get("echo"):
                e = await echo(i, gen, prompt_logprobs)
                choices = [echoes.choice(c, e) for c in choices]
            return choices, s.usage(out.get("usage"))

        if not body.get("stream"):
            parts = await _gather(*(one(i, g) for i, g in enumerate(gens)))
            choices = [c for part, _ in parts for c in part]
            result = shapes.completion_response(choices, total_usage(u for _, u in parts), shape(0, Prefilled()))
            return web.json_response(result, headers=ctx.response_headers(), dumps=_dumps)

        # Prefill every prompt before the first byte, so the response headers can say how.
        prefilled = await _gather(*(self.pools.prefill(g, ctx) for g in gens))
        prompt_shapes = [shape(i, p) for i, p in enumerate(prefilled)]
        firsts = [echoes.FirstChunks(list(g[wire.TOKEN_IDS]), return_token_ids=bool(body.get("return_token_ids")))
                  for g in gens]
        if body.get("echo"):  # a generate stream carries no prompt logprobs: a batch leg asks for them
            asked = type(body.get("logprobs")) is int
            plps = await _gather(*(self.decoder.prompt_logprobs(g, ctx) if asked else _none() for g in gens))
            for first, e in zip(firsts, await _gather(*(echo(i, g, plps[i]) for i, g in enumerate(gens)))):
                first.echo = e
        writer = SSEWriter(request, ctx.response_headers())

        async def stream_one(i: int, gen: Mapping[str, Any]) -> Any:
            stream_call = chained.CompletionStream(derender(gen), chained.Options.of(body, gen), tier)
            usage = await self.decoder.stream(gen, prefilled[i].kv, decode_plan, ctx, stream_call, None, writer,
                                              lambda chunk: firsts[i](shapes.completion_chunk(chunk, prompt_shapes[i])))
            return prompt_shapes[i].usage(usage) if usage is not None else None

        async def run() -> None:
            total = total_usage(await _gather(*(stream_one(i, g) for i, g in enumerate(gens))))
            if total is not None:
                await writer.send(shapes.usage_chunk("text_completion", prompt_shapes[0], total))

        return await run_stream(writer, run)

    async def _detokenize(self, ids: list[int], body: Mapping[str, Any], ctx: Context) -> str:
        """The render tier's text of ``ids``: vLLM's renderer decodes a token prompt so (``echo``)."""
        request = {"tokens": ids, **({"model": body["model"]} if isinstance(body.get("model"), str) else {})}
        return str((await self.pools.call("render", wire.DETOKENIZE, _dumps(request).encode(), ctx))["prompt"])

    # -- GenerateRequest clients -------------------------------------------------------------------

    async def generate(self, request: web.Request, body: dict[str, Any], ctx: Context) -> web.StreamResponse:
        """The client's own GenerateRequest: prefill leg rewritten, decode answer passed through."""
        self._checked(body)
        return await self.decoder.passthrough(request, body, (await self.pools.prefill(body, ctx)).kv, ctx)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


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
