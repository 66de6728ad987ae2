"""The memory budget for request bodies: bytes reserved while a body is read and while its
request is served (what the sidecar holds for it: the body, and what parsing it costs)."""

from __future__ import annotations

from dataclasses import dataclass


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
    """One request's share of the budget, grown as its body arrives and given back at its end."""

    budget: MemoryBudget
    held: int = 0

    def grow_to(self, n: int) -> bool:
        if n <= self.held:
            return True
        if not self.budget.try_take(n - self.held):
            return False
        self.held = n
        return True

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0
