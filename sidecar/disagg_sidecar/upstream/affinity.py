"""Prefix affinity for the prefill pool: send a prompt where its leading KV blocks were sent before.

vLLM's prefix cache keys each full block of a prompt by a hash chained over every earlier block, so
an engine can reuse its cache only for the longest run of leading full blocks it already computed.
The sidecar mirrors that: it
hashes a prompt's full blocks as a chain and remembers, per endpoint, the chain hashes of the
prompts it sent there (bounded, least recently used first out), and which block followed which.
A block that several prompts continue differently is a shared prefix (a system prompt, a
common preamble): holding it says nothing about where a conversation lives, since every engine
soon holds it. So a prompt goes to the endpoint that holds the longest run of its blocks beyond
the last such branching point (the previous turn of its conversation); a prompt no endpoint holds
beyond that (a new conversation), or that several hold equally, goes to the one of them that took
the fewest recent legs (ties broken by rendezvous hashing of its deepest block, the same in every
sidecar). Load bounds all of it, twice:
- the request share (``RecentShare``): of the last ``window`` legs (all of them while fewer were
  sent), no endpoint takes more than ``ceil(bound_percent/100 * legs / endpoints)``, whatever the
  arrival order; an endpoint at that cap is not a candidate at all, so a conversation moves only
  when its home is at the cap (the pool counts only legs sent while every endpoint was up);
- the legs in flight: an endpoint more than ``max_imbalance`` legs above the least loaded candidate
  is not chosen for affinity (a slow or hot engine); the pool then falls back to least-requests.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence

from disagg_sidecar.config import DEFAULT_LOAD_BOUND_PERCENT, DEFAULT_SHARE_WINDOW

DEFAULT_BLOCK_TOKENS = 16
DEFAULT_CAPACITY_BLOCKS = 32_768  # per endpoint; ~100 bytes each, so a few MiB at most
DEFAULT_MAX_IMBALANCE = 4


def block_chain(tokens: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[bytes]:
    """One hash per full block, each covering every token up to that block's end (a partial tail block
    is never cached by the engine, so it is left out)."""
    chain: list[bytes] = []
    previous = b""
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        block = array("q", tokens[end - block_tokens:end]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        chain.append(previous)
    return chain


def rendezvous(key: bytes, candidates: Sequence[str]) -> str:
    """The candidate with the highest hash of (key, candidate): stable while candidates come and go."""
    return max(candidates, key=lambda url: hashlib.blake2b(key + url.encode(), digest_size=8).digest())


class PrefixIndex:
    """Per endpoint, the block-chain hashes of the prompts this sidecar sent there."""

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS, max_imbalance: int = DEFAULT_MAX_IMBALANCE):
        self.capacity_blocks = capacity_blocks
        self.max_imbalance = max_imbalance
        self._held: dict[str, OrderedDict[bytes, None]] = {}
        # Per block, the blocks seen after it (three are enough to find two besides a prompt's own).
        self._next: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()

    def matched_blocks(self, url: str, chain: Sequence[bytes]) -> int:
        """How many leading blocks of ``chain`` were sent to ``url`` (scanned from the deepest: a new
        turn of a conversation matches a few blocks below its end)."""
        held = self._held.get(url)
        if not held:
            return 0
        for depth in range(len(chain), 0, -1):
            if chain[depth - 1] in held:
                return depth
        return 0

    def shared_depth(self, chain: Sequence[bytes]) -> int:
        """How many leading blocks of ``chain`` other prompts share: up to its deepest block that
        prompts seen before continued in two ways other than this one. One other way is no proof:
        a conversation's next turn also leaves its previous prompt where the chat template renders
        the last assistant turn differently in history."""
        for depth in range(len(chain) - 1, 0, -1):
            after = self._next.get(chain[depth - 1], ())
            if sum(1 for key in after if key != chain[depth]) >= 2:
                return depth
        return 0

    def choose(self, candidates: Sequence[str], chain: Sequence[bytes], outstanding: Callable[[str], int],
               recent: Callable[[str], int] = lambda url: 0) -> str | None:
        """The affinity choice among ``candidates``, or None to let the caller balance by load.
        ``recent``: legs each endpoint took lately (where a new conversation goes)."""
        if not candidates or not chain:
            return None
        least = min(outstanding(u) for u in candidates)
        allowed = [u for u in candidates if outstanding(u) <= least + self.max_imbalance]
        matched = {u: self.matched_blocks(u, chain) for u in allowed}
        best = max(matched.values())
        if best > self.shared_depth(chain):  # this conversation's own blocks: its home
            allowed = [u for u in allowed if matched[u] == best]
        # A new conversation, or homes that hold it equally: even shares, not a hash's random split.
        fewest = min(recent(u) for u in allowed)
        return rendezvous(chain[-1], [u for u in allowed if recent(u) == fewest])

    def record(self, url: str, chain: Sequence[bytes]) -> None:
        held = self._held.setdefault(url, OrderedDict())
        for key in chain:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)
        for key, after in zip(chain, chain[1:]):
            seen = self._next.pop(key, ())
            self._next[key] = seen if after in seen or len(seen) > 2 else (*seen, after)
        while len(self._next) > self.capacity_blocks:
            self._next.popitem(last=False)

    def forget(self, keep: Sequence[str]) -> None:
        """Drop endpoints that left the pool (their engines' caches went with them)."""
        for url in set(self._held) - set(keep):
            del self._held[url]


class RecentShare:
    """Which endpoints took the last ``window`` legs, and the cap that bounds each one's share.

    The cap for the next leg is ``ceil(bound_percent * n / (100 * N))`` with ``n`` the legs in the
    window including it and ``N`` the candidates. Some candidate is always below it (the others'
    ``n - 1`` legs cannot fill ``N`` caps of at least ``n / N``), and since an endpoint's count in a
    window only drops until its next leg, every window of the last ``window`` legs (and every
    start of the sidecar's life) stays within the cap for an unchanged set of endpoints."""

    def __init__(self, window: int = DEFAULT_SHARE_WINDOW, bound_percent: int = DEFAULT_LOAD_BOUND_PERCENT):
        if window < 2 or bound_percent < 100:
            raise ValueError("the share window needs 2 legs or more and the bound 100% or more")
        self.window, self.bound_percent = window, bound_percent
        self._recent: deque[str] = deque()  # the last window - 1 legs: with the next one, a window
        self._counts: Counter[str] = Counter()

    def count(self, url: str) -> int:
        return self._counts[url]

    def cap(self, endpoints: int) -> int:
        """The most legs one of ``endpoints`` may hold in the window that the next leg completes."""
        legs = len(self._recent) + 1
        return -(-self.bound_percent * legs // (100 * endpoints))

    def allowed(self, candidates: Sequence[str]) -> list[str]:
        cap = self.cap(len(candidates))
        return [u for u in candidates if self._counts[u] < cap]

    def record(self, url: str) -> None:
        self._recent.append(url)
        self._counts[url] += 1
        if len(self._recent) >= self.window:
            old = self._recent.popleft()
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]  # pods come and go: keep no key for each one ever seen
