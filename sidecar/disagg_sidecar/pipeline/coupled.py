"""The decode engine answers a client's request itself, as a coupled server would
(``render.failure_policy: decode``): the render or derender tier is down, and the engine in this
pod has the tokenizer, the chat template and the parsers. The request goes to the engine's own
route (``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``, its ``count_tokens``)
without a prefill leg, the client's ``kv_transfer_params`` taken out (``legs.client_context``).

Its answer is untrusted like every other (docs/security.md, "Upstream answers"): read up to
``limits.decode_answer_bytes``, checked for the shape the API has (``answers.coupled``); a stream
is passed on as its events complete, each checked, and its end (``[DONE]``, or the Messages API's
``message_stop``) goes out only once the stream is known to be whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from disagg_sidecar import sse, wire
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.derender import anthropic
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.pipeline.clientstream import SSEWriter
from disagg_sidecar.pipeline.context import Context
from disagg_sidecar.pipeline.decoding import ERROR_BYTES, Decoder, StreamEnd
from disagg_sidecar.pipeline.failures import invalid_answer, leg_failure
from disagg_sidecar.plan import answers, legs, requestlimits
from disagg_sidecar.plan.request import RequestPlan
from disagg_sidecar.upstream.client import LegError, Upstream, chunks, read_bounded

log = logging.getLogger(__name__)

ROUTES = {"chat": wire.CHAT, "completions": wire.COMPLETIONS, "messages": wire.MESSAGES,
          "count_tokens": wire.MESSAGES_COUNT_TOKENS}
MESSAGE_STOP = "message_stop"


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
        api = plan.api
        n = plan.n * (requestlimits.rendered_prompts(body) if api == "completions" else 1)
        # No prefill leg was the answer's (one may have run before a derender leg failed).
        headers = {wire.REQUEST_ID: ctx.request_id, wire.RENDER_OUTCOME: "decode"}
        url = self.up.decode_url
        try:
            async with self.up.decode(legs.client_context(raw, body), ctx.headers, ctx.inflight,
                                      stream=plan.stream, path=ROUTES[api]) as resp:
                if resp.status != 200:
                    raise self.decoder.error(resp.status, await read_bounded(resp, "decode", url, ERROR_BYTES))
                if plan.stream:
                    return await self._relay(request, resp, api, n, headers, ctx)
                answer = await self.decoder.read(resp, ctx)
                try:
                    answers.coupled(answers.parse(answer), api, n)
                except answers.InvalidAnswer as exc:
                    raise invalid_answer("decode", exc, url) from exc
                return web.Response(body=answer, content_type="application/json", headers=headers)
        except LegError as exc:
            raise leg_failure(exc) from exc

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, api: str, n: int,
                     headers: dict[str, str], ctx: Context) -> web.StreamResponse:
        url = self.up.decode_url
        writer = SSEWriter(request, headers)
        await writer.start()
        messages = api == "messages"
        parser = sse.SSEParser(self.config.limits.upstream_event_bytes)
        ended = Ended(n, messages)
        try:
            async for data in chunks(resp, "decode", url, ctx.reservation):  # events as they complete
                out = [framed for payload in parser.feed(data) if (framed := ended.see(payload, api)) is not None]
                if out:
                    await writer.write(b"".join(out))
            await writer.write(ended.check(parser))
        except LegError as exc:  # the engine went away: an error event, then the API's own end
            log.warning("decode's own stream failed after the first byte: %s", exc)
            await self._fail(writer, messages, leg_failure(exc))
        except ValueError as exc:  # InvalidAnswer, EventTooLarge: no end, the answer is not whole
            await self._fail(writer, messages, invalid_answer("decode", exc, url))
        finally:
            parser.discard()
        return writer.response

    @staticmethod
    async def _fail(writer: SSEWriter, messages: bool, err: SidecarError) -> None:
        if messages:
            await writer.write(anthropic.error_event(err.status, err.message))
        else:
            await writer.fail(err.status, err.message, done=err.done)


class Ended:
    """Whether the decode engine's own stream ended as vLLM ends one: OpenAI's every choice
    finished, then ``[DONE]`` (``StreamEnd``); the Messages API's ``message_stop`` last. The end
    is held back (``check`` gives it) until the stream is known to be whole."""

    def __init__(self, n: int, messages: bool) -> None:
        self.openai = None if messages else StreamEnd(n)
        self.n, self.stopped, self.errors = n, False, False
        self.stop: bytes = b""  # the message_stop event, held back

    def see(self, payload: bytes, api: str) -> bytes | None:
        """The event framed for the client (None: held back); raises ``InvalidAnswer``."""
        if self.openai is not None:
            event = self.openai.see(payload)
            if event is None:
                return None
            answers.coupled_event(event, api, self.n)
            return sse.sse(payload)
        if self.stopped:
            raise answers.InvalidAnswer(f"the decode stream went on after {MESSAGE_STOP}")
        event = answers.coupled_event(answers.parse(payload), api, self.n)
        kind = "error" if "error" in event and not isinstance(event.get("type"), str) else event["type"]
        self.errors = self.errors or kind == "error"
        framed = b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"
        if kind == MESSAGE_STOP:
            self.stopped, self.stop = True, framed
            return None
        return framed

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
            raise answers.InvalidAnswer(f"the decode stream ended without {MESSAGE_STOP}")
        return self.stop
