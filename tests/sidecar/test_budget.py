"""The memory budget's accounting (``budget``): reservations, upstream answers' charges, stream holds."""

from __future__ import annotations

import pytest

from disagg_sidecar.budget import ANSWER_VALUE_COST, Charge, MemoryBudget, Reservation, answer_values_cost


def test_charges_come_out_of_their_requests_reservation_and_go_back() -> None:
    budget = MemoryBudget(100)
    r = Reservation(budget)
    assert r.grow_to(40)  # the body
    charge = Charge(r)
    assert charge.take(50) and budget.used == 90 and r.held == 90
    assert not charge.take(20), "past the limit"
    assert budget.used == 90 and charge.taken == 50
    charge.give_back()
    assert budget.used == 40 and r.held == 40 and charge.taken == 0


def test_a_charge_given_back_after_the_request_released_gives_nothing_twice() -> None:
    budget = MemoryBudget(100)
    r = Reservation(budget)
    charge = Charge(r)
    assert charge.take(60)
    r.release()
    charge.give_back()
    assert budget.used == 0 and r.held == 0


@pytest.mark.parametrize("steps, used", [
    ([30, 50, 10], 10),  # a stream's hold follows what it holds now
    ([30, 90, 20], 30),  # 90 does not fit: refused, the 30 still held
])
def test_hold_moves_to_what_is_held_now(steps: list[int], used: int) -> None:
    budget = MemoryBudget(80)
    charge = Charge(Reservation(budget))
    results = [charge.hold(n) for n in steps[:2]]
    if all(results):
        assert charge.hold(steps[2])
    assert budget.used == used


@pytest.mark.parametrize("raw, values", [
    (b"{}", 2), (b"[1,2,3]", 4), (b'{"a":[1,2],"b":{}}', 6), (b'"x,y"', 2),
])
def test_values_cost_counts_commas_brackets_and_braces(raw: bytes, values: int) -> None:
    assert answer_values_cost(raw) == ANSWER_VALUE_COST * values
