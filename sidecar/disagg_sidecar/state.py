"""What the sidecar knows about itself and its upstreams between requests (no I/O here).

Readiness (``GET /health``): the local decode engine answers its health check and serves, and
every remote tier the config names has at least one endpoint that is known and answers; not while
draining. A decode engine can answer ``/health`` with 200 while every request gets a 5xx (vLLM's
output handler dead): decode 5xx answers with no success since the last probe make the next probe
send the engine one real request (``serving_check``), and readiness stays off until one succeeds.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from disagg_sidecar.budget import MemoryBudget
from disagg_sidecar.config import Capabilities, SidecarConfig
from disagg_sidecar import vllm_releases
from disagg_sidecar.pipeline.decoding import DecodeAnswers
from disagg_sidecar.plan import capabilities

UNHEALTHY_AFTER = 2  # consecutive failed probes


@dataclass
class SidecarState:
    config: SidecarConfig
    served_capabilities: dict[str, Any] | str | None = None  # see capabilities.effective
    served_model: str | None = None
    decode_version: str | None = None  # what the decode engine's GET /version answered (None: not yet)
    healthy: dict[str, bool] = field(default_factory=dict)  # tier -> reachable
    _failures: dict[str, int] = field(default_factory=dict)
    draining: bool = False
    decode_serving: bool = True  # false: its one real request got a 5xx (see module docstring)
    answers: DecodeAnswers = field(default_factory=DecodeAnswers)  # counted as they come (app, decoding)
    decode_answers: DecodeAnswers = field(default_factory=DecodeAnswers)  # as of the last probe
    in_flight: int = 0  # requests holding a slot (their body read and checked)
    reading: int = 0  # requests still receiving their body (no slot: memory budget and deadline bound them)
    budget: MemoryBudget = field(init=False)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # SIGTERM came (``draining`` is set)
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # nothing in flight any more: vLLM may stop
    drained_waiters: Counter[str] = field(default_factory=Counter)  # per address: waiting on /health/drained
    # (the probe's answer it was computed from, the version, the capabilities): ``capabilities``
    _capabilities: tuple[Any, str | None, Capabilities] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.budget = MemoryBudget(self.config.limits.memory_budget_bytes)
        self._idle.set()

    def record_probe(self, tier: str, ok: bool, refused: bool = False) -> None:
        """A tier that was up goes down after two failed probes in a row (one slow answer is no
        outage), or at once when nothing listens (``refused``: the process is gone); a tier never
        seen up is down from its first failure."""
        self._failures[tier] = 0 if ok else self._failures.get(tier, 0) + 1
        if ok or refused or not self.healthy.get(tier) or self._failures[tier] >= UNHEALTHY_AFTER:
            self.healthy[tier] = ok

    def needs_serving_check(self, answers: DecodeAnswers) -> bool:
        """Whether this probe sends decode a real request (and remembers ``answers`` for the next)."""
        suspect = answers.suspect_since(self.decode_answers)
        self.decode_answers = answers
        return suspect or not self.decode_serving

    def serving_check_due(self) -> bool:
        """``needs_serving_check`` for the answers counted until now."""
        return self.needs_serving_check(dataclasses.replace(self.answers))

    def capabilities(self) -> Capabilities:
        """What the decode engine may be asked for now: computed again only when a probe brought a
        new answer or version (every request reads it; the probes' answers change rarely)."""
        memo = self._capabilities
        if memo is None or memo[0] is not self.served_capabilities or memo[1] != self.decode_version:
            memo = (self.served_capabilities, self.decode_version,
                    capabilities.current(self.config, self.served_capabilities, self.decode_release()))
            self._capabilities = memo
        return memo[2]

    def decode_release(self) -> vllm_releases.Release | None:
        """The decode engine's row of the release table, from the version the engine itself reports
        (``UNTESTED`` outside the table: nothing assumed); None until it reported one."""
        return None if self.decode_version is None else vllm_releases.release(self.decode_version)

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
        """Why the sidecar is not ready (empty: ready). An unreachable prefill pool under
        ``failure_policy: fallback`` only degrades it (decode prefills), so it stays ready."""
        reasons = [f"{t} unreachable" for t in self.tiers() if not self.healthy.get(t) and t not in self._optional()]
        if self.healthy.get("decode") and not self.decode_serving:
            reasons.append("decode failing (5xx)")
        if self.draining:
            reasons.append("draining")
        return reasons

    def degraded(self) -> list[str]:
        """Tiers that are down without making the sidecar unready."""
        return [f"{t} unreachable" for t in self._optional() if t in self.tiers() and not self.healthy.get(t)]

    def _optional(self) -> tuple[str, ...]:
        """Tiers a request can do without: prefill under ``failure_policy: fallback`` (decode
        prefills), render and derender under ``render.failure_policy: decode`` (decode answers)."""
        return (*(("prefill",) if self.config.prefill.failure_policy == "fallback" else ()),
                *(("render", "derender") if self.config.render.failure_policy == "decode" else ()))

    def tiers_up(self) -> bool:
        """The render and derender tiers answer their probes (or are the decode engine itself)."""
        return all(self.healthy.get(t, True) for t in ("render", "derender") if t in self.tiers())

    def start_draining(self) -> None:
        self.draining = True
        self.stopping.set()

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
