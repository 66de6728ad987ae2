"""The memory budget: bytes reserved while a request's body is read and while its request is served
(what the sidecar holds for it: the body, what parsing it costs, and the upstream answers it reads)."""

from __future__ import annotations

from dataclasses import dataclass

# An upstream answer held: its bytes as read (twice while the buffer grows), their copy into one ``bytes``,
# and the strings decoded from them (at most as large again) ...
ANSWER_BYTE_COST = 4
# ... and per JSON value parsed out of it (an int, a str, a container and its slot): one per comma,
# bracket or brace at most. 2 M token ids from a render answer cost about 85 bytes each here.
ANSWER_VALUE_COST = 96
# An event of a stream while it is parsed: the parser's buffer (twice while it grows), the event split
# out of it, its data lines joined, the str decoded from them and the strings parsed out of that.
STREAM_BYTE_COST = 6


def answer_values_cost(raw: bytes) -> int:
    """What parsing ``raw`` may cost beyond ``ANSWER_BYTE_COST`` per byte (C-speed counts, no parse)."""
    return ANSWER_VALUE_COST * (raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1)


@dataclass
class MemoryBudget:
    limit: int
    used: int = 0

    def try_take(self, n: int) -> bool:
        """Reserve ``n`` more bytes if they fit (synchronous: check and take are one step)."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


@dataclass
class Reservation:
    """One request's share of the budget, grown as its body arrives and as its upstream answers are
    read, given back at its end."""

    budget: MemoryBudget
    held: int = 0

    def grow_to(self, n: int) -> bool:
        if n <= self.held:
            return True
        return self.take(n - self.held)

    def take(self, n: int) -> bool:
        if not self.budget.try_take(n):
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        n = min(n, self.held)  # a charge given back after the request's release gives nothing twice
        self.budget.give(n)
        self.held -= n

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0


@dataclass
class Charge:
    """One upstream answer's part of its request's reservation: taken as the answer is read, given
    back once it is no longer held (or with the request's)."""

    reservation: Reservation
    taken: int = 0

    def take(self, n: int) -> bool:
        if not self.reservation.take(n):
            return False
        self.taken += n
        return True

    def give_back(self) -> None:
        self.reservation.give(self.taken)
        self.taken = 0

    def hold(self, n: int) -> bool:
        """Hold exactly ``n`` now (a stream's bytes in hand: more or fewer than before)."""
        if n > self.taken:
            return self.take(n - self.taken)
        self.reservation.give(self.taken - n)
        self.taken = n
        return True
