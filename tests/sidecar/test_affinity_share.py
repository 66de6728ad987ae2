"""Prefix affinity under the share bound (no HTTP): conversations keep their prefill endpoint unless
the bound forces a move, no arrival order takes an endpoint past the bound, and a shared system
prompt does not draw new conversations to one endpoint."""

from __future__ import annotations

import math
import random
from collections import Counter
from contextlib import ExitStack

import pytest

from disagg_sidecar.upstream.affinity import RecentShare
from disagg_sidecar.upstream.endpoints import EndpointPool

URLS = ("http://a:1", "http://b:1", "http://c:1", "http://d:1")
GENERATION_PROMPT = [7, 7, 7, 7, 7]  # what a chat template appends after the history, never part of it


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 150_000) for _ in range(n)]


def bound_holds(picks: list[str], urls: tuple[str, ...], window: int, percent: int) -> str | None:
    """The stated bound, checked from the picks alone: in the last min(legs, window) legs, no endpoint
    has more than ceil(percent/100 * legs / endpoints). What broke it, or None."""
    for end in range(1, len(picks) + 1):
        legs = min(end, window)
        cap = math.ceil(percent * legs / (100 * len(urls)))
        counts = Counter(picks[end - legs:end])
        if max(counts.values()) > cap:
            return f"after {end} legs: {counts} over the cap {cap} of {legs}"
    return None


def converse(pool: EndpointPool, rng: random.Random, conversations: int, turns: int,
             system: list[int]) -> tuple[list[list[str]], list[bool], list[str]]:
    """Turn by turn, every conversation once in a random order; per conversation the endpoints of its
    turns, per continued turn whether its home was below the cap (so affinity had to keep it), all picks."""
    history = [system + tokens(rng, rng.randint(40, 80)) for _ in range(conversations)]
    homes: list[list[str]] = [[] for _ in range(conversations)]
    free_to_stay: list[bool] = []
    picks: list[str] = []
    for turn in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            if turn:
                free_to_stay.append(homes[c][-1] in pool.share.allowed(pool.endpoints()))
            url = pool.pick(prompt=history[c] + GENERATION_PROMPT)
            homes[c].append(url)
            picks.append(url)
        for c in range(conversations):  # the answer and the next question join the history
            history[c] += tokens(rng, 24) + tokens(rng, rng.randint(40, 80))
    return homes, free_to_stay, picks


@pytest.mark.parametrize("seed", range(40))
def test_a_conversation_keeps_its_endpoint_unless_the_bound_moves_it(seed: int) -> None:
    rng = random.Random(seed)
    pool = EndpointPool("prefill", lambda: URLS[:2], "prefix-affinity", block_tokens=16)
    homes, free_to_stay, picks = converse(pool, rng, conversations=10, turns=8, system=tokens(rng, 300))
    stays = iter(free_to_stay)
    for conversation in homes:
        for before, after in zip(conversation, conversation[1:]):
            free = next(stays)
            assert after == before or not free, f"moved while its home was below the cap: {conversation}"
    moves = sum(a != b for c in homes for a, b in zip(c, c[1:]))
    assert moves <= 2, f"{moves} moves: new conversations should start evenly enough to stay put ({homes})"
    assert bound_holds(picks, URLS[:2], pool.share.window, pool.share.bound_percent) is None


@pytest.mark.parametrize("seed", range(60))
def test_no_arrival_order_takes_an_endpoint_past_the_share_bound(seed: int) -> None:
    rng = random.Random(seed)
    urls = URLS[:rng.choice((2, 3, 4))]
    window, percent = rng.choice((2, 5, 16, 64)), rng.choice((100, 110, 125, 200))
    pool = EndpointPool("prefill", lambda: urls, "prefix-affinity", block_tokens=16,
                        share=RecentShare(window, percent))
    hot = tokens(rng, 200)  # one prompt again and again: affinity alone would send all of it to one engine
    prompts = [hot, hot + tokens(rng, 40), tokens(rng, 100), []]
    picks = []
    with ExitStack() as leases:  # legs in flight that never finish: the in-flight bound must not break it
        for _ in range(300):
            prompt = rng.choice(prompts)
            if rng.random() < 0.3:
                prompt = prompt + tokens(rng, 20)
                prompts.append(prompt)
            picks.append(pool.pick(prompt=prompt))
            if rng.random() < 0.1:
                leases.enter_context(pool.lease(picks[-1]))
    assert (broken := bound_holds(picks, urls, window, percent)) is None, broken
    assert set(picks) == set(urls)


def test_the_bound_counts_only_the_window_and_always_leaves_a_candidate() -> None:
    share = RecentShare(window=4, bound_percent=100)
    assert share.cap(2) == 1 and share.allowed(URLS[:2]) == list(URLS[:2])
    for url in (URLS[0], URLS[1], URLS[0]):
        share.record(url)
    assert share.cap(2) == 2 and share.allowed(URLS[:2]) == [URLS[1]], "4 legs: 2 each"
    share.record(URLS[1])
    assert share.count(URLS[0]) == 1, "the first leg left the window"
    with pytest.raises(ValueError):
        RecentShare(bound_percent=99)


@pytest.mark.parametrize("endpoints", [2, 3, 4])
def test_a_shared_system_prompt_alone_does_not_pull_conversations_to_one_endpoint(endpoints: int) -> None:
    rng = random.Random(endpoints)
    urls = URLS[:endpoints]
    # The share bound off (1000%): the spread here is the placement of new conversations alone.
    pool = EndpointPool("prefill", lambda: urls, "prefix-affinity", block_tokens=16,
                        share=RecentShare(bound_percent=1000))
    system = tokens(rng, 500)
    first = Counter(pool.pick(prompt=system + tokens(rng, 60) + GENERATION_PROMPT) for _ in range(6 * endpoints))
    assert set(first) == set(urls) and max(first.values()) - min(first.values()) <= 2, first
    alone = Counter(pool.pick(prompt=system) for _ in range(2 * endpoints))
    assert len(alone) == endpoints, f"the bare system prompt is held everywhere, so it spreads too: {alone}"


def test_legs_sent_while_an_endpoint_is_out_do_not_count_against_it_when_it_returns() -> None:
    rng = random.Random(5)
    now = [0.0]
    pool = EndpointPool("prefill", lambda: URLS[:2], "prefix-affinity", clock=lambda: now[0], block_tokens=16)
    system = tokens(rng, 200)
    pool.mark_failed(URLS[0])
    during = [pool.pick(prompt=system + tokens(rng, 60)) for _ in range(20)]
    assert set(during) == {URLS[1]} and pool.share.count(URLS[1]) == 0, "no choice: not counted"
    now[0] = 10.0  # the cooldown is over
    after = Counter(pool.pick(prompt=system + tokens(rng, 60)) for _ in range(20))
    assert after[URLS[1]] >= 8, f"the returning endpoint does not take every new conversation: {after}"
    retried = pool.pick(exclude=[URLS[0]], prompt=system + tokens(rng, 60))
    assert retried == URLS[1] and pool.share.count(URLS[1]) == after[URLS[1]], "a retry's leg is not counted"
