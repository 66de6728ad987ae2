"""The load client: requests with a fixed number in flight, timed per request and per SSE chunk."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

TIMEOUT = aiohttp.ClientTimeout(total=900, sock_read=300)


@dataclass
class Sample:
    ok: bool
    status: int
    latency: float                 # request sent -> last byte
    ttft: float                    # request sent -> first SSE data event (the whole answer when batch)
    gaps: list[float] = field(default_factory=list)  # between SSE data events
    chunks: int = 0                # SSE data events, [DONE] excluded
    events: list[Any] | None = None  # parsed events / the JSON answer, when kept
    error: str = ""


async def one(session: aiohttp.ClientSession, url: str, body: dict, keep: bool = False) -> Sample:
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if not body.get("stream"):
                raw = await resp.read()
                t = time.perf_counter() - t0
                ok = resp.status == 200
                return Sample(ok, resp.status, t, t, events=[json.loads(raw)] if keep and ok else None,
                              error="" if ok else raw[:300].decode(errors="replace"))
            events: list[Any] = []
            last = first = None
            gaps: list[float] = []
            chunks = 0
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                data = line[5:].strip()
                if data == b"[DONE]":
                    if keep:
                        events.append("[DONE]")
                    continue
                chunks += 1
                if last is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                if keep:
                    events.append(json.loads(data))
            t = time.perf_counter() - t0
            ok = resp.status == 200 and chunks > 0
            return Sample(ok, resp.status, t, (first or time.perf_counter()) - t0, gaps, chunks,
                          events if keep else None, "" if ok else f"status {resp.status}, {chunks} chunks")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return Sample(False, 0, time.perf_counter() - t0, float("nan"), error=repr(exc)[:300])


async def load(url: str, bodies: Sequence[dict], concurrency: int, keep: bool = False) -> list[Sample]:
    """Every body once, at most ``concurrency`` in flight; samples in the order of ``bodies``."""
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=TIMEOUT) as session:
        async def run(body: dict) -> Sample:
            async with sem:
                return await one(session, url, body, keep)
        return list(await asyncio.gather(*(run(b) for b in bodies)))


def run_load(url: str, bodies: Sequence[dict], concurrency: int = 1, keep: bool = False) -> list[Sample]:
    return asyncio.run(load(url, bodies, concurrency, keep))
