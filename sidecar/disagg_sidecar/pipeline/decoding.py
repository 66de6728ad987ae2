"""The decode leg, to the engine in this pod.

An OpenAI request's, batch or streamed, goes through one call (``Decoder.call``): the engine is
asked for the planned output mode; one that refuses it (400) is asked again for tokens when the
plan can chain the answer, and an answer in another mode than asked (an engine that ignores the
field) is chained as well. An error before the first byte is an OpenAI-shaped 4xx (the engine's
own) or a 502/503; in the stream, an error event after it is raised for ``clientstream``.
A ``GenerateRequest`` client's is passed through in the mode it asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from disagg_sidecar.derender import chained
from disagg_sidecar.plan import answers
from disagg_sidecar.plan import legs
from disagg_sidecar.plan import decisions
from disagg_sidecar.plan.request import RequestPlan
from disagg_sidecar.derender import sessions, shapes
from disagg_sidecar import sse
from disagg_sidecar.derender import stream
from disagg_sidecar import wire
from disagg_sidecar.pipeline.clientstream import SSEWriter
from disagg_sidecar.budget import Charge
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.pipeline.context import Context
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.pipeline.failures import invalid_answer, leg_failure, streamed_error
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.upstream.client import Upstream
from disagg_sidecar.upstream.reading import LegError, chunks, read_bounded

log = logging.getLogger(__name__)

T = TypeVar("T")
ERROR_BYTES = 1 << 20  # of a decode engine's error answer (summarised, never passed on)


@dataclass
class DecodeAnswers:
    """Counts of decode answers, kept by the sidecar itself: 5xx answers (``Decoder.error``) and
    requests answered 200 (``app``); readiness's serving check compares them between probes."""

    errors: float = 0
    successes: float = 0

    def suspect_since(self, before: DecodeAnswers) -> bool:
        """New 5xx answers and no success since ``before``: the engine may be failing everything."""
        return self.errors > before.errors and self.successes == before.successes


@dataclass
class Modes:
    """A decode call's output modes: the plan's, the one asked for (``tokens`` after a refusal)
    and the one the answer came in (set by the reader once it knows)."""

    planned: wire.OutputMode
    asked: wire.OutputMode
    answered: wire.OutputMode | None = None

    @property
    def fell_back(self) -> bool:
        """The engine refused the planned mode or answered in another one."""
        return self.asked != self.planned or self.answered not in (None, self.planned)


# The engine's 200 answer, still open, and the call's modes -> what the caller wants.
Read = Callable[[aiohttp.ClientResponse, Modes], Awaitable[T]]
# A decode (or derender) chunk -> the client's chunk, None when it carries nothing for the client.
Shaper = Callable[[Mapping[str, Any]], Mapping[str, Any] | None]


@dataclass
class Decoder:
    config: SidecarConfig
    up: Upstream
    metrics: Metrics
    answers: DecodeAnswers = field(default_factory=DecodeAnswers)

    async def call(self, gen: Mapping[str, Any], kv: dict[str, Any] | None, plan: RequestPlan,
                   ctx: Context, chat_raw: bytes | None, read: Read[T], client: Mapping[str, Any] | None = None) -> T:
        """The decode leg, asked again for tokens when the engine refuses the planned mode; what
        ``read`` returned. A fallback (refused, or answered in another mode) is counted here.
        ``client``: the derender leg's ``client_stream`` (``legs.decode_body``)."""
        modes = Modes(plan.decode.mode, plan.decode.mode)
        try:
            return await self._call(gen, kv, plan, ctx, chat_raw, read, modes, client)
        finally:
            if modes.fell_back:
                self.metrics.mode_fallbacks.labels(modes.planned).inc()

    async def _call(self, gen: Mapping[str, Any], kv: dict[str, Any] | None, plan: RequestPlan,
                    ctx: Context, chat_raw: bytes | None, read: Read[T], modes: Modes,
                    client: Mapping[str, Any] | None) -> T:
        while True:
            self.metrics.output_modes.labels(modes.asked).inc()
            try:
                body = legs.decode_body(gen, kv, modes.asked, plan.decode.context, chat_raw, plan.stream_interval,
                                        client)
                async with self.up.decode(body, ctx.headers, ctx.inflight, stream=bool(gen.get("stream"))) as resp:
                    if resp.status == 200:
                        return await read(resp, modes)
                    status, raw = resp.status, await read_bounded(resp, "decode", self.up.decode_url, ERROR_BYTES)
            except LegError as exc:
                raise leg_failure(exc) from exc
            if not decisions.retry_as_tokens(status, modes.asked, plan.decode):
                raise self.error(status, raw)
            log.warning("decode engine rejected output_mode=%s, chaining instead: %s", modes.asked, raw[:300])
            modes.asked = "tokens"

    def error(self, status: int, raw: bytes) -> SidecarError:
        """A decode engine's non-200 answer before the first byte: its 4xx as it said it; a 5xx
        counted, and a 502 for the client (no retry: the decode engine is this pod's own)."""
        if status < 500:
            return SidecarError.upstream(status, raw, "decode")
        self.metrics.leg_errors.labels("decode", "status").inc()
        self.answers.errors += 1
        return leg_failure(LegError("decode", "status", self.up.decode_url, status, raw))

    async def prompt_logprobs(self, gen: Mapping[str, Any], ctx: Context) -> Any:
        """The prompt's logprobs from the decode engine, for a streamed request (``legs.prompt_logprobs_leg``)."""
        try:
            async with self.up.decode(sse.dumps(legs.prompt_logprobs_leg(gen)), ctx.headers, ctx.inflight) as resp:
                status, raw = resp.status, await self.read(resp, ctx)
        except LegError as exc:
            raise leg_failure(exc) from exc
        if status != 200:
            raise self.error(status, raw)
        return self._checked(raw, 1).get("prompt_logprobs")

    async def batch(self, gen: Mapping[str, Any], kv: dict[str, Any] | None, plan: RequestPlan,
                    ctx: Context, chat_raw: bytes | None) -> Any:
        """The decode answer, parsed and checked (``answers``: a 502 otherwise)."""
        async def read(resp: aiohttp.ClientResponse, modes: Modes) -> Any:
            answer = self._checked(await self.read(resp, ctx), choices_of(gen))
            modes.answered = decisions.answered_mode(answer)
            return answer
        return await self.call(gen, kv, plan, ctx, chat_raw, read)

    async def read(self, resp: aiohttp.ClientResponse, ctx: Context) -> bytes:
        """A batch answer, charged to the request's memory budget (held until the request ends)."""
        charge = Charge(ctx.reservation) if ctx.reservation is not None else None
        return await read_bounded(resp, "decode", self.up.decode_url, self.config.limits.decode_answer_bytes, charge)

    def _checked(self, raw: bytes, n: int) -> Any:
        try:
            return answers.generated(answers.parse(raw), n)
        except answers.InvalidAnswer as exc:
            raise invalid_answer("decode", exc, self.up.decode_url) from exc

    async def stream(self, gen: Mapping[str, Any], kv: dict[str, Any] | None, plan: RequestPlan,
                     ctx: Context, stream_call: chained.StreamCall, chat_raw: bytes | None,
                     writer: SSEWriter, shaper: Shaper, client: shapes.Shape | None = None) -> Any:
        """Stream one prompt's decode leg to the client; returns its usage (sent by the caller).
        With ``client`` (``DecodePlan.client_chunks``), the engine is asked to write the client's
        own chunks (chat's or completions', as the plan's chain names the API), and each event that
        is one goes to the client as the engine wrote it."""
        min_tokens = decisions.tokens_per_derender_call(max_tokens_of(gen), choices_of(gen), stream_call.call_bytes,
                                                        self.config.limits.derender_stream_bytes)
        api = plan.decode.chain or "chat"  # the API whose chunks these are
        header = client.client_stream(api) if client is not None else None
        prefix = client.client_prefix(api) if client is not None and header is not None else None

        async def read(resp: aiohttp.ClientResponse, modes: Modes) -> Any:
            return await self._relay(resp, plan, modes, stream_call, writer, shaper, choices_of(gen), ctx, min_tokens,
                                     prefix if modes.asked == modes.planned else None)
        return await self.call(gen, kv, plan, ctx, chat_raw, read, header)

    async def passthrough(self, request: web.Request, body: Mapping[str, Any], plan: RequestPlan,
                          kv: dict[str, Any] | None, ctx: Context) -> web.StreamResponse:
        """A ``GenerateRequest`` client's decode leg, in the mode it asked for, its answer passed
        through (the bytes as they come when streamed)."""
        self.metrics.output_modes.labels(plan.decode.mode).inc()
        try:
            async with self.up.decode(sse.dumps(legs.client_decode_leg(body, kv)), ctx.headers,
                                      ctx.inflight, stream=plan.stream) as resp:
                if resp.status != 200:
                    raise self.error(resp.status, await read_bounded(resp, "decode", self.up.decode_url, ERROR_BYTES))
                n = choices_of(body)
                if not plan.stream:
                    raw = await self.read(resp, ctx)
                    self._checked(raw, n)
                    return web.Response(body=raw, status=resp.status, content_type="application/json",
                                        headers=ctx.response_headers())
                writer = SSEWriter(request, ctx.response_headers())
                await writer.start()
                ended = StreamEnd(n)
                parser = sse.SSEParser(self.config.limits.upstream_event_bytes)
                try:
                    async for data in chunks(resp, "decode", self.up.decode_url, ctx.reservation):  # as they complete
                        out = []
                        for payload in parser.feed(data):
                            event = ended.see(payload)
                            if event is None:
                                continue  # [DONE] goes out once the stream is known to be whole
                            if "error" not in event:
                                answers.generated(event, n, "a decode stream event")
                            out.append(sse.sse(payload))
                        if out:
                            await writer.write(b"".join(out))
                    if not ended.errors:
                        ended.check(parser)
                    await writer.write(sse.DONE_EVENT)
                except LegError as exc:
                    log.warning("generate stream failed after the first byte: %s", exc)
                    err = leg_failure(exc)
                    await writer.fail(err.status, err.message)
                except ValueError as exc:  # InvalidAnswer, EventTooLarge
                    err = invalid_answer("decode", exc, self.up.decode_url)
                    await writer.fail(err.status, err.message, done=False)
                finally:
                    parser.discard()
                return writer.response
        except LegError as exc:
            raise leg_failure(exc) from exc

    async def _relay(self, resp: aiohttp.ClientResponse, plan: RequestPlan, modes: Modes,
                     stream_call: chained.StreamCall, writer: SSEWriter, shaper: Shaper, n: int, ctx: Context,
                     min_tokens: int, prefix: bytes | None = None) -> Any:
        """The decode stream to the client: inline chunks shaped, tokens chunks chained, and events
        that start with ``prefix`` (the client's chunk, ``shapes.Shape.client_prefix``) relayed as
        the engine wrote them, usage included. Each event is checked (``answers``); a stream that
        ends without its end is an error, not a short answer."""
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

        chain: stream.ChainedDerender | sessions.SessionDerender | None = None
        parser = sse.SSEParser(self.config.limits.upstream_event_bytes)
        ended = StreamEnd(n)
        error: dict[str, Any] | None = None
        relayed: list[bytes] = []  # the client's own chunks of one read, written together
        try:
            async for data in chunks(resp, "decode", self.up.decode_url, ctx.reservation):
                for payload in parser.feed(data):
                    event = ended.see(payload)
                    if event is None:
                        continue
                    if prefix is not None and payload.startswith(prefix):
                        answers.generated(event, n, "a decode stream event")
                        modes.answered = modes.answered or modes.asked
                        relayed.append(sse.sse(payload))
                        continue
                    if relayed:
                        await writer.write(b"".join(relayed))
                        relayed.clear()
                    if "error" in event:
                        error = event["error"] if isinstance(event["error"], dict) else {}
                        continue
                    event = answers.generated(event, n, "a decode stream event")
                    answered = decisions.answered_mode(event)
                    modes.answered = modes.answered or answered
                    if plan.chains(answered):
                        if chain is None:
                            chain = sessions.derender_chain(self.up, stream_call, emit, plan.sessions, lambda out: (
                                stream.ChainedDerender(stream_call, out, coalesce=plan.coalesce, hold=stream_call.hold,
                                                       min_tokens=min_tokens, on_call=on_call)), writer.write)
                        chain.feed(event)
                    else:
                        await emit(event)
                if relayed:
                    await writer.write(b"".join(relayed))
                    relayed.clear()
            if error is None:
                ended.check(parser)
            if chain is not None:
                await chain.finish()
        except ValueError as exc:  # InvalidAnswer, EventTooLarge: the stream is not the client's answer
            raise invalid_answer("decode", exc, self.up.decode_url) from exc
        finally:
            parser.discard()
            if chain is not None:
                await chain.cancel()
        if error is not None:
            raise streamed_error(error)
        return usage[-1] if usage else None


def max_tokens_of(gen: Mapping[str, Any]) -> int:
    """The tokens a generate request may answer per choice (``legs.rendered`` makes it explicit)."""
    sampling = gen.get(wire.SAMPLING_PARAMS)
    m = sampling.get("max_tokens") if isinstance(sampling, Mapping) else None
    return m if type(m) is int and m > 0 else legs.SAMPLING_DEFAULT_MAX_TOKENS


def choices_of(gen: Mapping[str, Any]) -> int:
    """The choices a generate request asks for (``sampling_params.n``, checked by then)."""
    sampling = gen.get(wire.SAMPLING_PARAMS)
    n = sampling.get("n") if isinstance(sampling, Mapping) else None
    return n if type(n) is int and n > 0 else 1


class StreamEnd:
    """Whether a generate stream ended as vLLM ends one: every choice with its finish reason, then
    ``[DONE]``, nothing after it."""

    def __init__(self, n: int) -> None:
        self.n, self.done, self.finished = n, False, set[int]()
        self.errors = False  # an error event came: vLLM ends such a stream without finish reasons

    def see(self, payload: bytes) -> dict[str, Any] | None:
        """The event of ``payload`` (None for ``[DONE]``); raises ``InvalidAnswer``."""
        if self.done:
            raise answers.InvalidAnswer("the decode stream went on after [DONE]")
        if payload.strip() == wire.SSE_DONE:
            self.done = True
            return None
        event = answers.parse(payload)
        if not isinstance(event, dict):
            raise answers.InvalidAnswer("a decode stream event is not a JSON object")
        self.errors = self.errors or "error" in event
        for c in event.get("choices") or () if isinstance(event.get("choices"), list) else ():
            if isinstance(c, dict) and c.get("finish_reason") is not None:
                self.finished.add(c.get("index", 0))
        return event

    def check(self, parser: sse.SSEParser) -> None:
        if parser.pending:
            raise answers.InvalidAnswer("the decode stream ended inside an event")
        if not self.done:
            raise answers.InvalidAnswer("the decode stream ended without [DONE]")
        if len(self.finished) < self.n:
            raise answers.InvalidAnswer("the decode stream ended without a finish reason")
