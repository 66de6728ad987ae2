"""The legs to endpoint pools: render and derender (one call for both), and prefill with its
failure policy. Retries on another endpoint happen in ``upstream``; what is left here is how the
answer, or the failure after the retries, reaches the flow:
- render, derender: a 200 answer's JSON; an engine's 4xx as it said it; else a 502/503;
- prefill: the decode leg's ``kv_transfer_params``; a failure makes decode prefill the prompt itself
  (``failure_policy: fallback``, header ``x-disagg-prefill: fallback``) or is a 503 (``fail``).
  The outcome, and the endpoint a successful leg used, go on the request's ``Context`` (its
  header and access line read them there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit
from dataclasses import dataclass
from typing import Any, Literal

from disagg_sidecar.derender import chained
from disagg_sidecar.plan import answers
from disagg_sidecar.plan import legs
from disagg_sidecar.plan import decisions
from disagg_sidecar.plan import options
from disagg_sidecar import sse
from disagg_sidecar import wire
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.connectors import InvalidKVParams, KVConnector, PrefilledAt
from disagg_sidecar.pipeline.context import Context
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.pipeline.failures import BAD_ANSWERS, invalid_answer, leg_failure
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.upstream.client import Reply, Upstream
from disagg_sidecar.upstream.reading import LegError
from disagg_sidecar.derender.usage import cached_tokens

log = logging.getLogger(__name__)

TierLeg = Literal["render", "derender"]  # the tiers the chained path calls too


@dataclass(frozen=True)
class Prefilled:
    kv: dict[str, Any] | None = None  # for the decode leg
    cached_tokens: int | None = None  # the prefill engine's cache hits (NIXL reports them)


@dataclass
class PoolLegs:
    config: SidecarConfig
    up: Upstream
    metrics: Metrics
    connector: KVConnector | None  # None: no prefill pool

    async def call(self, tier: TierLeg, path: str, body: bytes, ctx: Context,
                   check: Callable[[Any], Any] | None = None, keep: bool = True) -> Any:
        """A render or derender leg's JSON answer, ``check``ed (``answers``: a 502 otherwise). Its
        cost stays charged to the request's memory budget while the request runs (``keep``), or
        is given back once it is parsed (a stream's derender calls: one after the other)."""
        try:
            reply = await self.up.call(tier, path, body, ctx.headers, held=ctx.reservation)
        except LegError as exc:
            raise leg_failure(exc) from exc
        try:
            if reply.status != 200:
                raise SidecarError.upstream(reply.status, reply.body, tier)
            parsed = answers.parse(reply.body)
            return check(parsed) if check is not None else parsed
        except answers.InvalidAnswer as exc:
            raise invalid_answer(tier, exc, reply.url) from exc
        finally:
            if reply.charge is not None and (not keep or reply.status != 200):
                reply.charge.give_back()

    async def render_chat(self, raw: bytes, ctx: Context, n: int, path: str = wire.CHAT_RENDER) -> dict[str, Any]:
        """Render a chat request (or a request vLLM renders as chat, at ``path``): one GenerateRequest."""
        return await self.call("render", path, raw, ctx, lambda a: answers.rendered(a, n))

    async def render_prompts(self, raw: bytes, ctx: Context, prompts: int, n: int) -> list[dict[str, Any]]:
        return await self.call("render", wire.COMPLETIONS_RENDER, raw, ctx,
                               lambda a: answers.rendered_prompts(a, prompts, n))

    def tier(self, ctx: Context) -> chained.TierCall:
        """The chained path's calls to the render/derender tiers (derender calls counted by kind),
        each answer checked for the shape its kind has."""
        bound = 2 * self.config.limits.max_n  # a stop cut sends each choice twice (``chained.kept_texts``)

        async def call(tier: str, path: str, body: bytes, kind: str) -> Any:
            if tier == "render":
                return await self.call("render", path, body, ctx, _tokenized)
            self.metrics.derender_calls.labels(kind).inc()
            streamed = kind in ("stream", "replay")  # replay: derender.window
            check = (lambda a: answers.derendered_chunk(a, bound)) if streamed else \
                (lambda a: answers.derendered(a, bound))
            return await self.call("derender", path, body, ctx, check, keep=not streamed)
        return call

    async def prefill(self, gen: Mapping[str, Any], ctx: Context) -> Prefilled:
        """Run the prefill leg: the decode leg's ``kv_transfer_params`` and the prefill's cache hits."""
        route = decisions.prefill_route(self.config.prefill.mode == "remote", len(gen[wire.TOKEN_IDS]),
                                   self.config.prefill.min_prompt_tokens)
        if route == "remote" and not options.decode_reads_transferred_kv(gen.get(wire.SAMPLING_PARAMS)):
            route = "skipped"  # decode computes the prompt itself (prompt logprobs)
        if route != "remote" or self.connector is None:
            self._count(ctx, route)
            return Prefilled()
        body = sse.dumps(legs.prefill_leg(gen, self.connector, tokens_only=self.config.prefill_tokens_only))
        reply: Reply | None = None
        try:
            reply = await self.up.call("prefill", wire.GENERATE, body, ctx.headers, first=ctx.prefill_target,
                                       inflight=ctx.inflight, prompt=gen[wire.TOKEN_IDS], held=ctx.reservation)
            if reply.status != 200:
                raise SidecarError.upstream(reply.status, reply.body, "prefill")
            params, kv = self._kv(reply)
        except LegError as exc:
            if self.config.prefill.failure_policy == "fail":
                self._count(ctx, "failed")
                log.warning("prefill failed (failure_policy fail): %s", exc)
                if exc.kind in BAD_ANSWERS or exc.kind == "budget":
                    bad = leg_failure(exc)
                    bad.headers[wire.PREFILL_OUTCOME] = "failed"
                    raise bad from exc
                raise SidecarError(503, f"The prefill tier is unavailable ({exc.kind})",
                                   type_="ServiceUnavailableError",
                                   headers={"Retry-After": "1", wire.PREFILL_OUTCOME: "failed"}) from exc
            log.warning("prefill failed, decode prefills locally: %s", exc)
            self._count(ctx, "fallback")
            return Prefilled()
        finally:
            if reply is not None and reply.charge is not None:
                reply.charge.give_back()  # the answer is done with: its kv_transfer_params are read
        self._count(ctx, "remote", reply.url)
        return Prefilled(kv, cached_tokens(params))

    def _kv(self, reply: Reply) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The prefill answer's ``kv_transfer_params`` and what of them goes to decode: only what
        the connector accepts from the endpoint that was prefilled (``connectors``); anything else
        is a failed prefill leg (``invalid``), the endpoint marked failed."""
        assert self.connector is not None
        host = urlsplit(reply.url).hostname or ""
        try:
            answer = answers.parse(reply.body)
            params = answer.get(wire.KV_TRANSFER_PARAMS) if isinstance(answer, dict) else None
            if not isinstance(answer, dict):
                raise InvalidKVParams("the prefill answer is not a JSON object")
            kv = self.connector.decode_params(params, PrefilledAt(host, self.config.prefill.side_channel_ports))
        except ValueError as exc:  # InvalidKVParams, or not JSON
            self.up.pools["prefill"].mark_failed(reply.url)
            self.metrics.leg_errors.labels("prefill", "invalid").inc()
            raise LegError("prefill", "invalid", reply.url, detail=str(exc)[:200]) from exc
        return (params if isinstance(params, dict) else None), kv

    def _count(self, ctx: Context, outcome: wire.PrefillOutcome, endpoint: str | None = None) -> None:
        """The outcome on the request (its header, its access line) and the metric; ``endpoint``:
        the prefill endpoint the successful leg used (``Reply.url``, as discovery gave it)."""
        ctx.prefill_outcomes.add(outcome)
        if endpoint is not None and endpoint not in ctx.prefilled_at:
            ctx.prefilled_at.append(endpoint)
        self.metrics.prefill.labels(outcome).inc()


def _tokenized(answer: Any) -> Any:
    """The render tier as the tokenizer (``chained.cut_token_ids``): token ids for each text."""
    return answers.tokenized(answer, len(answer) if isinstance(answer, list) else -1)
