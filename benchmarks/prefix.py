"""Part 6, prefix affinity: multi-turn conversations through one sidecar in front of two prefill
engines, with ``prefix-affinity`` and with ``least-requests`` prefill selection. Reported per side:
the prefill engines' prefix-cache hit rate (vLLM's own ``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries`` counters, in tokens) and how the requests split between the two
engines, against the sidecar's stated share bound (``share_cap``). The sides alternate in rounds; every round and side gets conversations of its own (a
seed each, which also heads the system prompt all its conversations share), so no side finds a
prefix the other left in an engine's cache."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import requests

from benchmarks.client import TIMEOUT
from benchmarks.outputs import SERVED, WORDS
from benchmarks.stack import sidecar, sidecar_config
from disagg_sidecar.config import DEFAULT_LOAD_BOUND_PERCENT, DEFAULT_SHARE_WINDOW
from disagg_engine.servers import start_all, stop_all
from disagg_engine.testing.server_set import role_specs
from tests.harness.forced import NO_THINKING

CONVERSATIONS, TURNS, ROUNDS = 10, 8, 2
ANSWER_TOKENS = 24
SIDES = ("prefix-affinity", "least-requests")
# Long enough to span several of the CPU engines' 128-token KV blocks, shared by every conversation.
SYSTEM = "You are a careful assistant. " + " ".join(WORDS[i % len(WORDS)] for i in range(400))


def system_prompt(seed: int) -> str:
    return f"Session {seed}. {SYSTEM}"


def share_cap(legs: int, endpoints: int, window: int = DEFAULT_SHARE_WINDOW,
              percent: int = DEFAULT_LOAD_BOUND_PERCENT) -> int:
    """The most of ``legs`` one endpoint may take from a fresh sidecar under the share bound
    (docs/llm-d.md): the last ``window`` legs, the ``window`` before them, ..., and the first rest
    are each within ceil(percent/100 * their legs / endpoints)."""
    full, rest = divmod(legs, window)
    return full * -(-percent * window // (100 * endpoints)) + -(-percent * rest // (100 * endpoints))


def counters(url: str) -> dict[str, float]:
    """The prefill engine's prefix-cache counters and finished requests (sums over label sets)."""
    out = {"hits": 0.0, "queries": 0.0, "requests": 0.0}
    names = {"vllm:prefix_cache_hits_total": "hits", "vllm:prefix_cache_queries_total": "queries",
             "vllm:request_success_total": "requests"}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


def user_turn(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 80))) + "?"


async def conversations(url: str, seed: int, count: int, turns: int) -> int:
    """``count`` conversations of ``turns`` turns, all conversations' turn k at once; the errors."""
    rng = random.Random(seed)
    history = [[{"role": "system", "content": system_prompt(seed)}] for _ in range(count)]
    errors = 0

    async def turn(session: aiohttp.ClientSession, messages: list[dict[str, str]]) -> bool:
        messages.append({"role": "user", "content": user_turn(rng)})
        body = {"model": SERVED, "messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0, **NO_THINKING}
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                return False
            answer = (await resp.json())["choices"][0]["message"]["content"] or ""
        messages.append({"role": "assistant", "content": answer})
        return True

    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(turns):
            results = await asyncio.gather(*(turn(session, h) for h in history))
            errors += results.count(False)
    return errors


def side_run(sset, prefills: list[str], selection: str, seed: int, count: int, turns: int) -> dict[str, Any]:
    before = [counters(u) for u in prefills]
    config = sidecar_config(sset, prefill={"discovery": {"kind": "static", "urls": prefills}, "selection": selection})
    with sidecar(config) as side:
        errors = asyncio.run(conversations(side.url, seed, count, turns))
    after = [counters(u) for u in prefills]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    hits, queries = sum(d["hits"] for d in delta), sum(d["queries"] for d in delta)
    per_engine = [d["requests"] for d in delta]
    return {"selection": selection, "seed": seed, "errors": errors, "hit_rate": hits / queries if queries else float("nan"),
            "hits": hits, "queries": queries, "requests_per_engine": per_engine,
            "imbalance": max(per_engine) / max(min(per_engine), 1.0),
            "over_share_cap": max(per_engine) - share_cap(round(sum(per_engine)), len(per_engine))}


def run(ctx) -> dict[str, Any]:
    sset = ctx.servers()
    count, turns, rounds = ctx.sizes("conversations", CONVERSATIONS), ctx.sizes("turns", TURNS), ctx.sizes("rounds", ROUNDS)
    second = start_all(role_specs(("prefill",), sset.model_dir, sset.kv_dir, name_prefix="second-"),
                       sset.log_dir, timeout=900)
    ctx.stack.callback(stop_all, second)
    prefills = [sset.url("prefill"), second[0].url]
    runs = []
    for r in range(rounds):
        for i, selection in enumerate(SIDES if r % 2 == 0 else SIDES[::-1]):
            res = side_run(sset, prefills, selection, seed=1000 * r + i, count=count, turns=turns)
            ctx.log(f"prefix round {r} {selection}: hit rate {res['hit_rate']:.3f}, requests {res['requests_per_engine']}, "
                    f"errors {res['errors']}")
            runs.append(res)

    def total(selection: str, key: str) -> float:
        return sum(r[key] for r in runs if r["selection"] == selection)

    keys: dict[str, Any] = {"prefix_errors": int(sum(r["errors"] for r in runs))}
    for selection in SIDES:
        name = selection.replace("-", "_")
        keys[f"prefix_hit_rate_{name}"] = total(selection, "hits") / max(total(selection, "queries"), 1.0)
        keys[f"prefix_imbalance_{name}"] = max(r["imbalance"] for r in runs if r["selection"] == selection)
    keys["prefix_over_share_cap"] = max(r["over_share_cap"] for r in runs if r["selection"] == "prefix-affinity")
    keys["prefix_hit_rate_gain"] = keys["prefix_hit_rate_prefix_affinity"] - keys["prefix_hit_rate_least_requests"]
    return {"keys": keys, "conversations": count, "turns": turns, "rounds": rounds, "answer_tokens": ANSWER_TOKENS,
            "runs": runs}
