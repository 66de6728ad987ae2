"""Part 5, soak: many concurrent chat streams through one ``disagg sidecar`` process for a fixed
time (the whole path: render, remote prefill, decode). Errors, the sidecar's RSS at 10 s and at
the end, and, once the load stops, its open TCP connections, threads, file descriptors and
in-flight requests back to what they were before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil
import requests

from benchmarks.client import TIMEOUT, one
from benchmarks.outputs import plain_ids, short_chat
from benchmarks.stack import sidecar, sidecar_config

STREAMS, SECONDS, EARLY = 200, 60.0, 10.0
ANSWER_TOKENS = 32


@dataclass
class Footprint:
    client_connections: int    # accepted on the sidecar's port
    upstream_connections: int  # to the engines: health checks plus idle keep-alive (closed after 4 s unused)
    upstream_endpoints: int
    threads: int
    fds: int
    in_flight: float           # the sidecar's own gauge: requests holding a slot

    @classmethod
    def of(cls, pid: int, url: str) -> "Footprint":
        proc = psutil.Process(pid)
        port = int(url.rsplit(":", 1)[1])
        conns = [c for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED]
        upstream = [c for c in conns if c.laddr.port != port]
        # Our own scrape closes its connection at once, so it is not counted the next time.
        metrics = requests.get(url + "/metrics", timeout=10, headers={"Connection": "close"}).text
        in_flight = next((float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                          if line.startswith("disagg_sidecar_requests_in_flight ")), float("nan"))
        return cls(len(conns) - len(upstream), len(upstream), len({c.raddr.port for c in upstream}),
                   proc.num_threads(), proc.num_fds(), in_flight)

    def settled(self, base: "Footprint") -> bool:
        """Back to base: no client connection or request left, no thread more, and upstream at most
        the health checker's pair per endpoint (with the file descriptors those take)."""
        upstream_cap = max(base.upstream_connections, 2 * max(base.upstream_endpoints, self.upstream_endpoints))
        extra_fds = max(self.upstream_connections - base.upstream_connections, 0)
        return (self.client_connections == 0 and self.in_flight == 0 and self.threads <= base.threads
                and self.upstream_connections <= upstream_cap and self.fds <= base.fds + extra_fds)


@dataclass
class SoakResult:
    requests: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    chunks: int = 0
    rss_mb: dict[str, float] = field(default_factory=dict)
    base: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    settle_seconds: float = float("nan")
    load_seconds: float = float("nan")  # until the last stream ended (each finishes the one it started)

    @property
    def rss_growth_mb(self) -> float:
        return self.rss_mb["end"] - self.rss_mb["early"]

    @property
    def rss_growth_ratio(self) -> float:
        return self.rss_growth_mb / self.rss_mb["early"]


def soak(url: str, pid: int, body: Callable[[int], dict], streams: int = STREAMS, seconds: float = SECONDS,
         early: float = EARLY, settle_timeout: float = 60.0) -> SoakResult:
    """``streams`` clients, each sending ``body(i)`` streams back to back for ``seconds``."""
    res = SoakResult()
    base = Footprint.of(pid, url)
    proc = psutil.Process(pid)

    async def main() -> None:
        deadline = time.monotonic() + seconds
        conn = aiohttp.TCPConnector(limit=streams)
        async with aiohttp.ClientSession(connector=conn, timeout=TIMEOUT) as session:
            async def client(k: int) -> None:
                i = k
                while time.monotonic() < deadline:
                    s = await one(session, url + "/v1/chat/completions", body(i))
                    res.requests += 1
                    res.chunks += s.chunks
                    if not s.ok:
                        res.errors += 1
                        if len(res.error_samples) < 5:
                            res.error_samples.append(s.error)
                    i += streams

            async def sample_rss() -> None:
                await asyncio.sleep(early)
                res.rss_mb["early"] = proc.memory_info().rss / 2**20
                await asyncio.sleep(max(deadline - time.monotonic(), 0))
                res.rss_mb["end"] = proc.memory_info().rss / 2**20

            await asyncio.gather(sample_rss(), *(client(k) for k in range(streams)))

    t0 = time.monotonic()
    asyncio.run(main())
    res.load_seconds = time.monotonic() - t0
    t0 = time.monotonic()
    while True:  # poll until the sidecar is back to its footprint before the load
        after = Footprint.of(pid, url)
        if after.settled(base) or time.monotonic() - t0 > settle_timeout:
            break
        time.sleep(0.25)
    res.settle_seconds = time.monotonic() - t0 if after.settled(base) else float("nan")
    res.base, res.after = vars(base), vars(after)
    return res


def run(ctx) -> dict[str, Any]:
    sset = ctx.servers()
    ids = plain_ids(ANSWER_TOKENS, ctx.tokenizer())
    streams, seconds = ctx.sizes("streams", STREAMS), ctx.sizes("seconds", SECONDS)
    with sidecar(sidecar_config(sset)) as side:
        res = soak(side.url, side.proc.pid, lambda i: short_chat(ids, True, i), streams, seconds)
    ctx.log(f"soak: {res.requests} streams, {res.errors} errors, RSS {res.rss_mb}, settled in {res.settle_seconds:.1f}s")
    return {"keys": {"soak_errors": res.errors, "soak_rss_growth_mb": res.rss_growth_mb,
                     "soak_rss_growth_ratio": res.rss_growth_ratio, "soak_requests": res.requests,
                     "soak_settle_seconds": res.settle_seconds, "soak_load_seconds": res.load_seconds},
            "streams": streams, "seconds": seconds, "answer_tokens": ANSWER_TOKENS, "chunks": res.chunks,
            "rss_mb": res.rss_mb, "base": res.base, "after": res.after, "error_samples": res.error_samples}
