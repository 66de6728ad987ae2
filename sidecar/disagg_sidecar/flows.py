"""One request through the legs: render -> prefill -> decode (-> derender) -> the client.

The decisions come from ``plan`` (output mode, prefill route), the bodies from ``legs``, the
shapes from ``responses``; this module sequences them and owns the failure rules of issue 6:
- prefill: retried on another endpoint by ``upstream``; then ``fallback`` (decode prefills the
  prompt itself, header ``x-disagg-prefill: fallback``) or ``fail`` (503);
- decode: an error before the first byte is an OpenAI-shaped 4xx (the engine's own) or 502/503;
  after it, an SSE error event and ``[DONE]``;
- a decode engine that rejects or ignores the requested output mode gets the chained path;
- client disconnect: upstream streams are closed and the engines still working are told to abort.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from disagg_sidecar import chained, derender_fixes, legs, plan, responses, sessions, streaming, wire
from disagg_sidecar.config import Capabilities, SidecarConfig
from disagg_sidecar.connectors import KVConnector
from disagg_sidecar.errors import SidecarError, error_body
from disagg_sidecar.exchange import Context, Prefilled, SSEWriter, chunks, leg_failure, streamed_error, with_raw_field
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.upstream import LegError, Upstream
from disagg_sidecar.usage import add_usage, cached_tokens

log = logging.getLogger(__name__)


Shaper = Callable[[Mapping[str, Any]], Mapping[str, Any] | None]


class Flows:
    def __init__(self, config: SidecarConfig, upstream: Upstream, metrics: Metrics, connector: KVConnector | None,
                 capabilities: Callable[[], Capabilities], model_name: Callable[[], str | None]):
        self.config = config
        self.up = upstream
        self.metrics = metrics
        self.connector = connector
        self.capabilities = capabilities
        self.model_name = model_name

    # -- shared legs -------------------------------------------------------------------------------

    async def render(self, path: str, raw: bytes, ctx: Context) -> Any:
        try:
            reply = await self.up.call("render", self.up.render, path, raw, ctx.headers)
        except LegError as exc:
            raise leg_failure(exc) from exc
        if reply.status != 200:
            raise SidecarError.upstream(reply.status, reply.body, "render")
        return reply.json()

    async def prefill(self, gen: Mapping[str, Any], ctx: Context) -> Prefilled:
        """Run the prefill leg: the decode leg's ``kv_transfer_params`` and the prefill's cache hits."""
        route = plan.prefill_route(self.config.prefill.mode == "remote", len(gen[wire.TOKEN_IDS]),
                                   self.config.prefill.min_prompt_tokens)
        if route != "remote" or self.connector is None:
            ctx.prefill_outcomes.add(route)
            self.metrics.prefill.labels(route).inc()
            return Prefilled()
        body = streaming.dumps(legs.prefill_leg(gen, self.connector, tokens_only=self.config.prefill_tokens_only))
        try:
            reply = await self.up.call("prefill", self.up.prefill, wire.GENERATE, body, ctx.headers,
                                       first=ctx.prefill_target, inflight=ctx.inflight)
        except LegError as exc:
            if self.config.prefill.failure_policy == "fail":
                self.metrics.prefill.labels("failed").inc()
                log.warning("prefill failed (failure_policy fail): %s", exc)
                raise SidecarError(503, f"The prefill tier is unavailable ({exc.kind})",
                                   type_="ServiceUnavailableError",
                                   headers={"Retry-After": "1", wire.PREFILL_OUTCOME: "failed"}) from exc
            log.warning("prefill failed, decode prefills locally: %s", exc)
            ctx.prefill_outcomes.add("fallback")
            self.metrics.prefill.labels("fallback").inc()
            return Prefilled()
        if reply.status != 200:
            raise SidecarError.upstream(reply.status, reply.body, "prefill")
        ctx.prefill_outcomes.add("remote")
        self.metrics.prefill.labels("remote").inc()
        params = reply.json().get(wire.KV_TRANSFER_PARAMS)
        return Prefilled(self.connector.decode_params(params), cached_tokens(params))

    def _decode_body(self, gen: Mapping[str, Any], kv: dict[str, Any] | None, mode: wire.OutputMode,
                     context: plan.ContextForm | None, chat_raw: bytes | None) -> bytes:
        """The decode leg; with ``derender``, the client's request (spliced in as its own bytes) or
        render's ``parse_context`` as the parser context."""
        slim = {wire.PARSE_CONTEXT: gen.get(wire.PARSE_CONTEXT)} if context == "parse_context" else None
        body = streaming.dumps(legs.decode_leg(gen, kv, output_mode=mode, context=slim))
        if mode == "derender" and context == "chat_request" and chat_raw is not None:
            body = with_raw_field(body, wire.CHAT_REQUEST, chat_raw)
        return body

    async def _derender(self, body: bytes, ctx: Context, path: str, kind: str) -> Any:
        self.metrics.derender_calls.labels(kind).inc()
        try:
            reply = await self.up.call("derender", self.up.derender, path, body, ctx.headers)
        except LegError as exc:
            raise leg_failure(exc) from exc
        if reply.status != 200:
            raise SidecarError.upstream(reply.status, reply.body, "derender")
        return reply.json()

    def _tier(self, ctx: Context) -> chained.TierCall:
        """Calls to the render/derender tiers for the chained path's extra steps."""
        async def call(tier: str, path: str, body: bytes, kind: str) -> Any:
            if tier == "render":
                return await self.render(path, body, ctx)
            return await self._derender(body, ctx, path, kind)
        return call

    def _shape(self, body: Mapping[str, Any], gen: Mapping[str, Any], prefilled: Prefilled, created: int,
               response_id: str, index_offset: int = 0) -> responses.Shape:
        return responses.Shape(
            id=response_id, created=created, model=self.model_name() or body.get("model"),
            prompt_tokens=len(gen[wire.TOKEN_IDS]),
            cached_tokens=prefilled.cached_tokens,
            return_token_ids=bool(body.get("return_token_ids")), tool_choice=body.get("tool_choice"),
            derive_finish_reason=not self.config.engine.features.derender_finish_reason, index_offset=index_offset,
        )

    def _decode_5xx(self, status: int, raw: bytes) -> SidecarError:
        """A decode engine's 5xx before the first byte: counted, and a 502 for the client (no
        retry: the decode engine is this pod's own)."""
        self.metrics.leg_errors.labels("decode", "status").inc()
        return leg_failure(LegError("decode", "status", self.up.decode_url, status, raw))

    def _after_refusal(self, status: int, raw: bytes, mode: wire.OutputMode,
                       decode_plan: plan.DecodePlan) -> wire.OutputMode:
        """A non-200 decode answer: ``"tokens"`` when an engine refused the inline mode and the
        answer can be chained instead; otherwise the error for the client."""
        if status == 400 and mode != "tokens" and decode_plan.chain is not None:
            log.warning("decode engine rejected output_mode=%s, chaining instead: %s", mode, raw[:300])
            self.metrics.mode_fallbacks.labels(mode).inc()
            return "tokens"
        if status < 500:
            raise SidecarError.upstream(status, raw, "decode")
        raise self._decode_5xx(status, raw)

    # -- decode, batch -----------------------------------------------------------------------------

    async def _decode_batch(self, gen: Mapping[str, Any], kv: dict[str, Any] | None, decode_plan: plan.DecodePlan,
                            ctx: Context, chat_raw: bytes | None) -> tuple[bytes, Any]:
        """The decode answer (raw and parsed); a rejected output mode is retried as tokens."""
        mode = decode_plan.mode
        while True:
            self.metrics.output_modes.labels(mode).inc()
            try:
                async with self.up.decode(self._decode_body(gen, kv, mode, decode_plan.context, chat_raw),
                                          ctx.headers, ctx.inflight) as resp:
                    status, raw = resp.status, await resp.read()
            except LegError as exc:
                raise leg_failure(exc) from exc
            if status == 200:
                parsed = json.loads(raw)
                if (parsed.get(wire.OUTPUT_MODE) or "tokens") != mode:
                    self.metrics.mode_fallbacks.labels(mode).inc()
                return raw, parsed
            mode = self._after_refusal(status, raw, mode, decode_plan)

    # -- chat --------------------------------------------------------------------------------------

    async def chat(self, request: web.Request, raw: bytes, body: dict[str, Any], ctx: Context) -> web.StreamResponse:
        created = int(time.time())
        decode_plan = plan.decode_plan("chat", body, self.capabilities())
        gen = legs.rendered(await self.render(wire.CHAT_RENDER, raw, ctx))
        decode_plan = plan.fit_to_render(decode_plan, gen)
        prefilled = await self.prefill(gen, ctx)
        kv = prefilled.kv
        shape = self._shape(body, gen, prefilled, created, gen.get("request_id") or f"chatcmpl-{ctx.request_id}")
        derender = legs.DerenderLeg("chat", raw, gen[wire.TOKEN_IDS])
        opts = chained.Options.of(body, gen)
        if not body.get("stream"):
            out_raw, out = await self._decode_batch(gen, kv, decode_plan, ctx, raw)
            if (out.get(wire.OUTPUT_MODE) or "tokens") == "tokens":
                result = await chained.chat_batch(out, derender, opts, shape, self._tier(ctx))
            else:
                result = responses.chat_from_generate(out, shape, gen[wire.TOKEN_IDS])
            return web.json_response(result, headers=ctx.response_headers(), dumps=_dumps)
        writer = SSEWriter(request, ctx.response_headers())
        first: set[int] = set()

        async def run() -> None:
            stream_call = chained.ChatStream(derender, opts, self._tier(ctx), logprobs=bool(body.get("logprobs")))
            usage = await self._stream_prompt(gen, kv, decode_plan, ctx, stream_call, raw, writer,
                                              lambda chunk: responses.chat_chunk(chunk, shape, first=first))
            if usage is not None:
                await writer.send(responses.usage_chunk("chat.completion.chunk", shape, shape.usage(usage)))

        return await self._run_stream(writer, run)

    # -- completions -------------------------------------------------------------------------------

    async def completions(self, request: web.Request, raw: bytes, body: dict[str, Any],
                          ctx: Context) -> web.StreamResponse:
        created = int(time.time())
        decode_plan = plan.decode_plan("completions", body, self.capabilities())
        gens = [derender_fixes.with_candidate_headroom(legs.rendered(g))
                for g in await self.render(wire.COMPLETIONS_RENDER, raw, ctx)]
        n = int(body.get("n") or 1)
        response_id = f"cmpl-{ctx.request_id}"

        def shape(i: int, prefilled: Prefilled) -> responses.Shape:
            return self._shape(body, gens[i], prefilled, created, response_id, index_offset=i * n)

        async def one(i: int, gen: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Any]:
            prefilled = await self.prefill(gen, ctx)
            out_raw, out = await self._decode_batch(gen, prefilled.kv, decode_plan, ctx, None)
            if (out.get(wire.OUTPUT_MODE) or "tokens") != "text":
                derender = legs.DerenderLeg("completions", raw, gen[wire.TOKEN_IDS])
                out = await chained.completion_batch(out, derender, chained.Options.of(body, gen), self._tier(ctx))
            s = shape(i, prefilled)
            return responses.completion_choices(out, s, gen[wire.TOKEN_IDS]), s.usage(out.get("usage"))

        if not body.get("stream"):
            parts = await _gather(*(one(i, g) for i, g in enumerate(gens)))
            choices = [c for part, _ in parts for c in part]
            usage = None
            for _, u in parts:
                usage = add_usage(usage, u)
            result = responses.completion_response(choices, usage, shape(0, Prefilled()))
            return web.json_response(result, headers=ctx.response_headers(), dumps=_dumps)

        # Prefill every prompt before the first byte, so the response headers can say how.
        prefilled = await _gather(*(self.prefill(g, ctx) for g in gens))
        shapes = [shape(i, p) for i, p in enumerate(prefilled)]
        writer = SSEWriter(request, ctx.response_headers())

        async def stream_one(i: int, gen: Mapping[str, Any]) -> Any:
            derender = legs.DerenderLeg("completions", raw, gen[wire.TOKEN_IDS])
            stream_call = chained.CompletionStream(derender, chained.Options.of(body, gen), self._tier(ctx))
            usage = await self._stream_prompt(gen, prefilled[i].kv, decode_plan, ctx, stream_call, None, writer,
                                              lambda chunk: responses.completion_chunk(chunk, shapes[i]))
            return shapes[i].usage(usage) if usage is not None else None

        async def run() -> None:
            total = None
            for u in await _gather(*(stream_one(i, g) for i, g in enumerate(gens))):
                total = add_usage(total, u)
            if total is not None:
                await writer.send(responses.usage_chunk("text_completion", shapes[0], total))

        return await self._run_stream(writer, run)

    # -- streaming core ----------------------------------------------------------------------------

    async def _run_stream(self, writer: SSEWriter, run: Callable[[], Awaitable[None]]) -> web.StreamResponse:
        try:
            await run()
        except (SidecarError, LegError) as exc:
            err = exc if isinstance(exc, SidecarError) else leg_failure(exc)
            if not writer.started:
                raise err from exc
            log.warning("stream failed after the first byte: %s", err.message)
            await writer.fail(err.status, err.message)
            return writer.response
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            if not writer.started:
                raise
            log.exception("stream failed after the first byte")
            await writer.fail(500, "Internal sidecar error")
            return writer.response
        await writer.write(streaming.DONE_EVENT)
        return writer.response

    async def _stream_prompt(self, gen: Mapping[str, Any], kv: dict[str, Any] | None, decode_plan: plan.DecodePlan,
                             ctx: Context, stream_call: chained.StreamCall, chat_raw: bytes | None,
                             writer: SSEWriter, shaper: Shaper) -> Any:
        """Stream one prompt's decode leg to the client; returns its usage (sent by the caller)."""
        mode = decode_plan.mode
        while True:
            self.metrics.output_modes.labels(mode).inc()
            try:
                async with self.up.decode(self._decode_body(gen, kv, mode, decode_plan.context, chat_raw),
                                          ctx.headers, ctx.inflight) as resp:
                    if resp.status == 200:
                        return await self._relay(resp, mode, stream_call, writer, shaper)
                    status, raw = resp.status, await resp.read()
            except LegError as exc:
                raise leg_failure(exc) from exc
            mode = self._after_refusal(status, raw, mode, decode_plan)

    async def _relay(self, resp, mode: wire.OutputMode, stream_call: chained.StreamCall, writer: SSEWriter,
                     shaper: Shaper) -> Any:
        usage: list[Any] = []

        async def emit(chunk: Mapping[str, Any]) -> None:
            if not chunk.get("choices") and chunk.get("usage"):
                usage.append(chunk["usage"])  # one usage chunk for the whole response, sent last
                return
            out = shaper(chunk)
            if out is not None:
                await writer.send(out)

        def on_call(merged: int) -> None:
            if merged > 1:
                self.metrics.coalesced_chunks.inc(merged - 1)

        chain: streaming.ChainedDerender | sessions.SessionDerender | None = None
        parser = streaming.SSEParser()
        error: dict[str, Any] | None = None
        try:
            async for data in chunks(resp, self.up.decode_url):
                for payload in parser.feed(data):
                    if payload.strip() == wire.SSE_DONE:
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        error = event["error"]
                        continue
                    if (event.get(wire.OUTPUT_MODE) or "tokens") == "tokens":
                        if chain is None:
                            if mode != "tokens":
                                self.metrics.mode_fallbacks.labels(mode).inc()
                            chain = sessions.derender_chain(self.up, stream_call, emit, lambda out: (
                                streaming.ChainedDerender(stream_call, out, coalesce=self.config.limits.coalesce,
                                                          hold=stream_call.hold, on_call=on_call)))
                        chain.feed(event)
                    else:
                        await emit(event)
            if chain is not None:
                await chain.finish()
        finally:
            if chain is not None:
                await chain.cancel()
        if error is not None:
            raise streamed_error(error)
        return usage[-1] if usage else None

    # -- GenerateRequest clients -------------------------------------------------------------------

    async def generate(self, request: web.Request, body: dict[str, Any], ctx: Context) -> web.StreamResponse:
        """The client's own GenerateRequest: prefill leg rewritten, decode answer passed through."""
        kv = (await self.prefill(body, ctx)).kv
        mode = body.get(wire.OUTPUT_MODE) or "tokens"
        context = {k: body[k] for k in (wire.CHAT_REQUEST, wire.PARSE_CONTEXT) if body.get(k) is not None}
        decode_body = legs.decode_leg(body, kv, output_mode=mode, context=context)
        if mode != "derender":  # the client's context is the engine's to reject, as it would be direct
            decode_body.update(context)
        self.metrics.output_modes.labels(mode).inc()
        try:
            async with self.up.decode(streaming.dumps(decode_body), ctx.headers, ctx.inflight) as resp:
                if resp.status != 200 or not body.get("stream"):
                    raw = await resp.read()
                    if resp.status >= 500:
                        raise self._decode_5xx(resp.status, raw)
                    return web.Response(body=raw, status=resp.status, content_type="application/json",
                                        headers=ctx.response_headers())
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  **ctx.response_headers()})
                await out.prepare(request)
                try:
                    async for data in chunks(resp, self.up.decode_url):  # bytes as they come
                        await out.write(data)
                except LegError as exc:
                    log.warning("generate stream failed after the first byte: %s", exc)
                    await out.write(streaming.sse_json(error_body(502, f"The decode engine failed: {exc.kind}")))
                    await out.write(streaming.DONE_EVENT)
                return out
        except LegError as exc:
            raise leg_failure(exc) from exc


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


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
