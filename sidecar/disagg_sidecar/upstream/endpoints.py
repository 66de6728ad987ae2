"""A pool of equivalent upstream endpoints: selection and outstanding-request accounting.

Selection is local to this sidecar (each decode pod balances its own legs): ``least-requests``
picks the endpoint with the fewest legs this sidecar has in flight (ties broken round-robin),
which follows each endpoint's speed without any shared state; ``prefix-affinity`` sends a prompt
to the endpoint that already holds its leading KV blocks, bounded by load in flight and by the
share of recent legs (affinity.py), and is least-requests for legs without prompt tokens (within
the same share bound). Endpoints that just failed are
avoided for a short while, and a retry never goes to an endpoint already tried for that leg.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from disagg_sidecar.upstream.affinity import PrefixIndex, RecentShare, block_chain

Selection = Literal["round-robin", "random", "least-requests", "prefix-affinity"]
FAILURE_COOLDOWN_SECONDS = 5.0


class EndpointPool:
    def __init__(self, name: str, endpoints: Callable[[], tuple[str, ...]], selection: Selection = "least-requests",
                 clock: Callable[[], float] = time.monotonic, prefixes: PrefixIndex | None = None,
                 block_tokens: int = 16, share: RecentShare | None = None):
        self.name = name
        self._endpoints = endpoints
        self.selection = selection
        self._clock = clock
        self._outstanding: dict[str, int] = {}
        self._failed_at: dict[str, float] = {}
        self._turn = itertools.count()
        self.prefixes = prefixes or PrefixIndex()
        self.block_tokens = block_tokens
        self.share = share or RecentShare()

    def endpoints(self) -> tuple[str, ...]:
        return self._endpoints()

    def outstanding(self, url: str) -> int:
        return self._outstanding.get(url, 0)

    def pick(self, exclude: Collection[str] = (), prompt: Sequence[int] = ()) -> str | None:
        """An endpoint not in ``exclude``; recently failed ones only when nothing else is left.
        ``prompt`` (token ids) is what prefix affinity keys on."""
        everyone = self.endpoints()
        candidates = [u for u in everyone if u not in exclude]
        if not candidates:
            return None
        candidates = [u for u in self.available(everyone) if u not in exclude] or candidates
        turn = next(self._turn)
        if self.selection == "random":
            return random.choice(candidates)
        if self.selection == "round-robin":
            return candidates[turn % len(candidates)]
        if self.selection == "prefix-affinity":
            # A leg with some endpoint out (failed lately, or tried by this retry) had no free choice:
            # counted, it would send the returning endpoint every leg until the shares even out.
            home = self._prefix_affinity(self.share.allowed(candidates), everyone, prompt, turn)
            if len(candidates) == len(everyone):
                self.share.record(home)
            return home
        return self._least_requests(candidates, turn)

    def available(self, endpoints: Sequence[str] | None = None) -> list[str]:
        """The endpoints (of ``endpoints``, default all) that did not fail in the last ``FAILURE_COOLDOWN_SECONDS``."""
        now = self._clock()
        return [u for u in (self.endpoints() if endpoints is None else endpoints)
                if now - self._failed_at.get(u, -1e9) > FAILURE_COOLDOWN_SECONDS]

    def _least_requests(self, candidates: Sequence[str], turn: int) -> str:
        least = min(self.outstanding(u) for u in candidates)
        tied = [u for u in candidates if self.outstanding(u) == least]
        return tied[turn % len(tied)]

    def _prefix_affinity(self, candidates: Sequence[str], everyone: Sequence[str], prompt: Sequence[int],
                         turn: int) -> str:
        home = None
        if prompt:
            self.prefixes.forget(everyone)
            chain = block_chain(prompt, self.block_tokens)
            if home := self.prefixes.choose(candidates, chain, self.outstanding, self.share.count):
                self.prefixes.record(home, chain)
        return home or self._least_requests(candidates, turn)

    @contextmanager
    def lease(self, url: str) -> Iterator[str]:
        """Count one leg in flight on ``url`` for as long as the block runs."""
        self._outstanding[url] = self._outstanding.get(url, 0) + 1
        try:
            yield url
        finally:
            self._outstanding[url] -= 1

    def mark_failed(self, url: str) -> None:
        self._failed_at[url] = self._clock()

    def mark_ok(self, url: str) -> None:
        self._failed_at.pop(url, None)
