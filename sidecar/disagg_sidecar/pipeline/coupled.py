"""The decode engine answers on its own API route, as a coupled server would:

- the client's whole request, without a prefill leg (``DecodeAlone.answer``): the render or
  derender tier is down (``render.failure_policy: decode``), and the engine in this pod has the
  tokenizer, the chat template and the parsers; or a Responses request that reads vLLM's response
  store (``decisions.responses_route``);
- a Responses request after its prefill leg (``DecodeAlone.prefilled``): vLLM makes a Responses
  answer (output items, events, sequence numbers) in its own serving code, which the decode pod
  runs; the prompt's KV comes from the prefill pod like chat's.

The request goes to the engine's own route (``/v1/chat/completions``, ``/v1/completions``,
``/v1/messages``, its ``count_tokens``, ``/v1/responses``) with the client's
``kv_transfer_params`` taken out (``legs.client_context``) and the prefill's put in.

Its answer is untrusted like every other (docs/security.md, "Upstream answers"): read up to
``limits.decode_answer_bytes``, checked for the shape the API has (``answers.coupled``); a stream
is passed on as its events complete, each checked, and its end (``[DONE]``, the Messages API's
``message_stop``, a Responses ``response.completed``) goes out only once the stream is known to be
whole.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp
from aiohttp import web

from disagg_sidecar import sse, wire
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.derender import anthropic, responses
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.pipeline.clientstream import SSEWriter
from disagg_sidecar.pipeline.context import Context
from disagg_sidecar.pipeline.decoding import ERROR_BYTES, Decoder, StreamEnd
from disagg_sidecar.pipeline.failures import invalid_answer, leg_failure
from disagg_sidecar.plan import answers, legs, requestlimits
from disagg_sidecar.plan.request import RequestPlan
from disagg_sidecar.upstream.client import Upstream
from disagg_sidecar.upstream.reading import LegError, chunks, read_bounded

log = logging.getLogger(__name__)

ROUTES = {"chat": wire.CHAT, "completions": wire.COMPLETIONS, "messages": wire.MESSAGES,
          "count_tokens": wire.MESSAGES_COUNT_TOKENS, "responses": wire.RESPONSES}
# The APIs whose streams are named events, and the events that end them (held back until whole).
END_EVENTS = {"messages": ("message_stop",), "responses": responses.END_EVENTS}


@dataclass
class DecodeAlone:
    config: SidecarConfig
    up: Upstream
    metrics: Metrics
    decoder: Decoder  # its error rule (a 5xx counted for readiness's serving check)

    async def answer(self, request: web.Request, raw: bytes, body: dict[str, Any], plan: RequestPlan,
                     ctx: Context, reason: str) -> web.StreamResponse:
        """The client's request answered by the decode engine; ``reason``: why (the metric's label)."""
        self.metrics.decode_answered.labels(reason).inc()
        # No prefill leg was the answer's (one may have run before a derender leg failed).
        headers = {wire.REQUEST_ID: ctx.request_id, wire.RENDER_OUTCOME: "decode"}
        return await self._forward(request, legs.client_context(raw, body), body, plan, ctx, headers)

    async def prefilled(self, request: web.Request, raw: bytes, body: dict[str, Any], plan: RequestPlan,
                        ctx: Context, kv: Mapping[str, Any] | None, cached: int | None) -> web.StreamResponse:
        """A Responses request whose prompt the prefill leg computed: the decode engine's answer,
        with the prefill's ``kv_transfer_params`` and its cache hits (``derender.responses``)."""
        payload = legs.with_kv_transfer_params(raw, body, kv)
        return await self._forward(request, payload, body, plan, ctx, ctx.response_headers(), cached)

    async def stored(self, path: str, query: Mapping[str, str], ctx: Context) -> bytes:
        """A stored response's ``GET`` (with ``query``) or ``cancel`` (``POST``) at ``path``: the
        decode engine's answer, a 200 checked to be a response, a 4xx as it said it."""
        url, method = self.up.decode_url, "POST" if path.endswith("/cancel") else "GET"
        target = path + ("?" + urlencode(query) if query else "")
        try:
            async with self.up.decode(None, ctx.headers, path=target, method=method) as resp:
                if resp.status != 200:
                    raise self.decoder.error(resp.status, await read_bounded(resp, "decode", url, ERROR_BYTES))
                answer = await self.decoder.read(resp, ctx)
        except LegError as exc:
            raise leg_failure(exc) from exc
        try:
            answers.coupled(answers.parse(answer), "responses", 1)
        except answers.InvalidAnswer as exc:
            raise invalid_answer("decode", exc, url) from exc
        return answer

    async def _forward(self, request: web.Request, payload: bytes, body: Mapping[str, Any], plan: RequestPlan,
                       ctx: Context, headers: dict[str, str], cached: int | None = None) -> web.StreamResponse:
        api = plan.api
        n = plan.n * (requestlimits.rendered_prompts(body) if api == "completions" else 1)
        url = self.up.decode_url
        try:
            async with self.up.decode(payload, ctx.headers, ctx.inflight, stream=plan.stream, path=ROUTES[api]) as resp:
                if resp.status != 200:
                    raise self.decoder.error(resp.status, await read_bounded(resp, "decode", url, ERROR_BYTES))
                if plan.stream:
                    return await self._relay(request, resp, api, n, headers, ctx, cached)
                answer = await self.decoder.read(resp, ctx)
                try:
                    out = answers.coupled(answers.parse(answer), api, n)
                except answers.InvalidAnswer as exc:
                    raise invalid_answer("decode", exc, url) from exc
                if api == "responses" and (fixed := responses.with_cached_tokens(out, cached)) is not None:
                    answer = sse.dumps(fixed)
                return web.Response(body=answer, content_type="application/json", headers=headers)
        except LegError as exc:
            raise leg_failure(exc) from exc

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, api: str, n: int,
                     headers: dict[str, str], ctx: Context, cached: int | None) -> web.StreamResponse:
        url = self.up.decode_url
        writer = SSEWriter(request, headers)
        await writer.start()
        parser = sse.SSEParser(self.config.limits.upstream_event_bytes)
        ended = Ended(n, api, cached)
        try:
            async for data in chunks(resp, "decode", url, ctx.reservation):  # events as they complete
                out: list[bytes] = []
                try:
                    out.extend(framed for payload in parser.feed(data) if (framed := ended.see(payload)) is not None)
                finally:  # the events before a bad one go out before the error event
                    if out:
                        await writer.write(b"".join(out))
            await writer.write(ended.check(parser))
        except LegError as exc:  # the engine went away: an error event, then the API's own end
            log.warning("decode's own stream failed after the first byte: %s", exc)
            await self._fail(writer, ended, leg_failure(exc))
        except ValueError as exc:  # InvalidAnswer, EventTooLarge: no end, the answer is not whole
            await self._fail(writer, ended, invalid_answer("decode", exc, url))
        finally:
            parser.discard()
        return writer.response

    @staticmethod
    async def _fail(writer: SSEWriter, ended: Ended, err: SidecarError) -> None:
        if ended.api == "messages":
            await writer.write(anthropic.error_event(err.status, err.message))
        elif ended.api == "responses":
            await writer.write(named(responses.error_event(err.status, err.message, ended.sequence + 1)))
        else:
            await writer.fail(err.status, err.message, done=err.done)


def named(event: Mapping[str, Any]) -> bytes:
    """An event framed as vLLM frames the named-event APIs' streams."""
    return _framed(event["type"], sse.dumps(event))


def _framed(kind: str, payload: bytes) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


class Ended:
    """Whether the decode engine's own stream ended as vLLM ends one: OpenAI's every choice
    finished, then ``[DONE]`` (``StreamEnd``); the Messages API's ``message_stop`` last; a
    Responses stream's ``response.completed`` (or ``.incomplete``, ``.failed``) last. The end is
    held back (``check`` gives it) until the stream is known to be whole."""

    def __init__(self, n: int, api: str, cached: int | None = None) -> None:
        self.api, self.n, self.cached = api, n, cached
        self.ends = END_EVENTS.get(api)
        self.openai = StreamEnd(n) if self.ends is None else None
        self.stopped, self.errors = False, False
        self.stop, self.stop_kind = b"", ""  # the ending event, held back
        self.sequence = -1  # the last Responses sequence number passed on to the client

    def see(self, payload: bytes) -> bytes | None:
        """The event framed for the client (None: held back); raises ``InvalidAnswer``."""
        if self.openai is not None:
            event = self.openai.see(payload)
            if event is None:
                return None
            answers.coupled_event(event, self.api, self.n)
            return sse.sse(payload)
        if self.stopped:
            raise answers.InvalidAnswer(f"the decode stream went on after {self.stop_kind}")
        event = answers.coupled_event(answers.parse(payload), self.api, self.n)
        kind = "error" if "error" in event and not isinstance(event.get("type"), str) else event["type"]
        self.errors = self.errors or kind == "error"
        if self.api == "responses" and kind in self.ends and (fixed := self._cached(event)) is not None:
            payload = sse.dumps(fixed)
        framed = _framed(kind, payload)
        if kind in self.ends:
            self.stopped, self.stop, self.stop_kind = True, framed, kind
            return None
        if type(number := event.get("sequence_number")) is int:
            self.sequence = number
        return framed

    def _cached(self, event: Mapping[str, Any]) -> dict[str, Any] | None:
        response = event.get("response")
        fixed = responses.with_cached_tokens(response, self.cached) if isinstance(response, Mapping) else None
        return {**event, "response": fixed} if fixed is not None else None

    def check(self, parser: sse.SSEParser) -> bytes:
        """The end to send, once the upstream stream has closed; raises ``InvalidAnswer``."""
        if self.openai is not None:
            if self.openai.errors:  # vLLM ends a failed stream with its error event and [DONE]
                if parser.pending or not self.openai.done:
                    raise answers.InvalidAnswer("the decode stream ended without [DONE]")
            else:
                self.openai.check(parser)
            return sse.DONE_EVENT
        if parser.pending:
            raise answers.InvalidAnswer("the decode stream ended inside an event")
        if not self.stopped and not self.errors:
            raise answers.InvalidAnswer(f"the decode stream ended without {' or '.join(self.ends)}")
        return self.stop
