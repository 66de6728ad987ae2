"""Prefix-affinity prefill selection (no HTTP): block chains, homes, spread and the load bound."""

from __future__ import annotations

import random
from collections import Counter

from disagg_sidecar.upstream.affinity import PrefixIndex, RecentShare, block_chain, rendezvous
from disagg_sidecar.upstream.endpoints import EndpointPool

URLS = ("http://a:1", "http://b:1", "http://c:1")
rng = random.Random(7)


def tokens(n: int) -> list[int]:
    return [rng.randrange(1, 150_000) for _ in range(n)]


def test_a_block_chain_has_one_hash_per_full_block_and_each_covers_everything_before() -> None:
    prompt = tokens(40)
    chain = block_chain(prompt, 16)
    assert len(chain) == 2, "the partial tail block is left out"
    assert block_chain(prompt[:32] + [0] * 8, 16) == chain
    assert block_chain(prompt + tokens(30), 16)[:2] == chain, "a longer prompt extends the chain"
    changed = [prompt[0] + 1] + prompt[1:]
    assert block_chain(changed, 16)[1] != chain[1], "block 2's hash depends on block 1"
    assert block_chain(prompt[:15], 16) == []


def test_rendezvous_is_stable_when_another_candidate_leaves() -> None:
    keys = [bytes([i, j]) for i in range(16) for j in range(16)]
    before = {k: rendezvous(k, URLS) for k in keys}
    after = {k: rendezvous(k, URLS[:2]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == URLS[2] for k in moved), "only the leaving endpoint's keys move"
    assert 0.2 < Counter(before.values())[URLS[0]] / len(keys) < 0.45


def test_a_conversation_s_next_turn_goes_where_its_last_turn_went() -> None:
    pool = EndpointPool("prefill", lambda: URLS, "prefix-affinity", block_tokens=16)
    system = tokens(64)  # shared by every conversation: it must not pull them all to one engine
    conversations = [system + tokens(50) for _ in range(30)]
    first = [pool.pick(prompt=c) for c in conversations]
    spread = Counter(first)
    assert set(spread) == set(URLS) and min(spread.values()) >= 5, f"new conversations spread: {spread}"
    for turn in range(3):
        conversations = [c + tokens(40) for c in conversations]
        assert [pool.pick(prompt=c) for c in conversations] == first, f"turn {turn + 2} follows its prefix"


def test_affinity_gives_way_to_load_beyond_the_imbalance_bound() -> None:
    # The share bound would move the second leg of 3 endpoints' first two: this is the in-flight bound alone.
    pool = EndpointPool("prefill", lambda: URLS, "prefix-affinity", block_tokens=16,
                        prefixes=PrefixIndex(max_imbalance=2), share=RecentShare(bound_percent=1000))
    prompt = tokens(100)
    home = pool.pick(prompt=prompt)
    with pool.lease(home), pool.lease(home):
        assert pool.pick(prompt=prompt) == home, "two legs above the others is within the bound"
        with pool.lease(home):
            other = pool.pick(prompt=prompt)
            assert other != home, "three above is not"
    assert pool.pick(prompt=prompt) in (home, other), "both now hold the prefix"


def test_a_shared_prefix_is_recognised_once_prompts_branch_from_it() -> None:
    index = PrefixIndex()
    system = tokens(48)
    chains = [block_chain(system + tokens(32), 16) for _ in range(3)]
    index.record(URLS[0], chains[0])
    assert index.shared_depth(chains[1]) == 0, "one other continuation: may be the same conversation"
    index.record(URLS[1], chains[1])
    assert index.shared_depth(chains[2]) == 3, "two others: the system prompt's 3 blocks are shared"
    assert index.shared_depth(chains[0]) == 0, "its own continuation does not count"
    longer = block_chain(system + tokens(32) + tokens(32), 16)
    assert index.shared_depth(longer) == 3


def test_short_prompts_and_departed_endpoints() -> None:
    live = list(URLS)
    pool = EndpointPool("prefill", lambda: tuple(live), "prefix-affinity", block_tokens=16)
    with pool.lease(URLS[0]), pool.lease(URLS[1]):
        assert pool.pick(prompt=tokens(10)) == URLS[2], "no full block: least-requests"
    prompt = tokens(64)
    home = pool.pick(prompt=prompt)
    live.remove(home)
    moved = pool.pick(prompt=prompt)
    assert moved in live
    live.append(home)
    assert pool.prefixes.matched_blocks(home, block_chain(prompt, 16)) == 0, "a departed engine's cache is gone"


def test_the_index_is_bounded_and_forgets_the_least_recently_sent() -> None:
    index = PrefixIndex(capacity_blocks=8)
    old, new = block_chain(tokens(64), 16), block_chain(tokens(128), 16)
    index.record(URLS[0], old)
    index.record(URLS[0], new)
    assert index.matched_blocks(URLS[0], new) == 8
    assert index.matched_blocks(URLS[0], old) == 0
