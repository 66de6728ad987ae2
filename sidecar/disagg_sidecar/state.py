"""What the sidecar knows about itself and its upstreams between requests (no I/O here).

Readiness (``GET /health``): the local decode engine answers its health check, and every remote
tier the config names has at least one endpoint that is known and answers; not while draining.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from disagg_sidecar.budget import MemoryBudget
from disagg_sidecar.config import Capabilities, SidecarConfig
from disagg_sidecar.plan import effective_capabilities

UNHEALTHY_AFTER = 2  # consecutive failed probes


@dataclass
class SidecarState:
    config: SidecarConfig
    served_capabilities: dict[str, Any] | str | None = None  # see plan.effective_capabilities
    served_model: str | None = None
    healthy: dict[str, bool] = field(default_factory=dict)  # tier -> reachable
    _failures: dict[str, int] = field(default_factory=dict)
    draining: bool = False
    in_flight: int = 0  # requests holding a slot (their body read and checked)
    reading: int = 0  # requests still receiving their body (no slot: memory budget and deadline bound them)
    budget: MemoryBudget = field(init=False)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.budget = MemoryBudget(self.config.limits.memory_budget_bytes)
        self._idle.set()

    def record_probe(self, tier: str, ok: bool) -> None:
        """A tier that was up goes down after two failed probes in a row (one slow answer is no
        outage); a tier never seen up is down from its first failure."""
        self._failures[tier] = 0 if ok else self._failures.get(tier, 0) + 1
        if ok or not self.healthy.get(tier) or self._failures[tier] >= UNHEALTHY_AFTER:
            self.healthy[tier] = ok

    def capabilities(self) -> Capabilities:
        served = self.served_capabilities if self.config.decode.probe_capabilities else None
        return effective_capabilities(self.config.configured_capabilities, served, self.config.stock_capabilities)

    def model_name(self) -> str | None:
        return self.config.served_model_name or self.served_model

    def tiers(self) -> tuple[str, ...]:
        """The tiers readiness depends on."""
        c = self.config
        tiers = ["decode"]
        if c.render.mode == "remote":
            tiers.append("render")
        if (c.derender or c.render).mode == "remote":
            tiers.append("derender")
        if c.prefill.mode == "remote":
            tiers.append("prefill")
        return tuple(tiers)

    def not_ready(self) -> list[str]:
        """Why the sidecar is not ready (empty: ready)."""
        reasons = [f"{t} unreachable" for t in self.tiers() if not self.healthy.get(t)]
        if self.draining:
            reasons.append("draining")
        return reasons

    def full(self) -> bool:
        return self.in_flight >= self.config.limits.max_concurrent_requests

    def try_reserve(self) -> bool:
        """Take a request slot if one is free (synchronous: check and take are one step)."""
        if self.full():
            return False
        self.in_flight += 1
        self._idle.clear()
        return True

    def release(self) -> None:
        self.in_flight -= 1
        self._maybe_idle()

    def start_reading(self) -> None:
        self.reading += 1
        self._idle.clear()

    def done_reading(self) -> None:
        self.reading -= 1
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if self.in_flight == 0 and self.reading == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
