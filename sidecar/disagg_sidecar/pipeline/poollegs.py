"""The legs to endpoint pools: render and derender (one call for both), and prefill with its
failure policy. Retries on another endpoint happen in ``upstream``; what is left here is how the
answer, or the failure after the retries, reaches the flow:
- render, derender: a 200 answer's JSON; an engine's 4xx as it said it; else a 502/503;
- prefill: the decode leg's ``kv_transfer_params``; a failure makes decode prefill the prompt itself
  (``failure_policy: fallback``, header ``x-disagg-prefill: fallback``) or is a 503 (``fail``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from disagg_sidecar.derender import chained
from disagg_sidecar.plan import legs
from disagg_sidecar.plan import decisions
from disagg_sidecar.plan import options
from disagg_sidecar import sse
from disagg_sidecar import wire
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.connectors import KVConnector
from disagg_sidecar.pipeline.context import Context
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.pipeline.failures import leg_failure
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.upstream.client import LegError, Upstream
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

    async def call(self, tier: TierLeg, path: str, body: bytes, ctx: Context) -> Any:
        """A render or derender leg's JSON answer."""
        try:
            reply = await self.up.call(tier, path, body, ctx.headers)
        except LegError as exc:
            raise leg_failure(exc) from exc
        if reply.status != 200:
            raise SidecarError.upstream(reply.status, reply.body, tier)
        return reply.json()

    def tier(self, ctx: Context) -> chained.TierCall:
        """The chained path's calls to the render/derender tiers (derender calls counted by kind)."""
        async def call(tier: str, path: str, body: bytes, kind: str) -> Any:
            if tier == "render":
                return await self.call("render", path, body, ctx)
            self.metrics.derender_calls.labels(kind).inc()
            return await self.call("derender", path, body, ctx)
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
        try:
            reply = await self.up.call("prefill", wire.GENERATE, body, ctx.headers,
                                       first=ctx.prefill_target, inflight=ctx.inflight, prompt=gen[wire.TOKEN_IDS])
        except LegError as exc:
            if self.config.prefill.failure_policy == "fail":
                self.metrics.prefill.labels("failed").inc()
                log.warning("prefill failed (failure_policy fail): %s", exc)
                raise SidecarError(503, f"The prefill tier is unavailable ({exc.kind})",
                                   type_="ServiceUnavailableError",
                                   headers={"Retry-After": "1", wire.PREFILL_OUTCOME: "failed"}) from exc
            log.warning("prefill failed, decode prefills locally: %s", exc)
            self._count(ctx, "fallback")
            return Prefilled()
        if reply.status != 200:
            raise SidecarError.upstream(reply.status, reply.body, "prefill")
        self._count(ctx, "remote")
        params = reply.json().get(wire.KV_TRANSFER_PARAMS)
        return Prefilled(self.connector.decode_params(params), cached_tokens(params))

    def _count(self, ctx: Context, outcome: wire.PrefillOutcome) -> None:
        ctx.prefill_outcomes.add(outcome)
        self.metrics.prefill.labels(outcome).inc()
