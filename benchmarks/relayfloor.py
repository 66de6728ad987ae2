"""``python -m benchmarks.relayfloor TARGET PORT``: the floor of a relay in this stack, an aiohttp
server that forwards ``/inference/v1/generate`` to ``TARGET`` and its answer's bytes as they come,
parsing nothing. Part 1 measures its CPU per chunk beside the sidecar's: what aiohttp, asyncio and
the kernel cost per chunk before the sidecar does anything."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
from aiohttp import web

GENERATE = "/inference/v1/generate"


async def serve(target: str, port: int) -> None:
    session = aiohttp.ClientSession()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with session.post(target + GENERATE, data=body, headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")})
            await resp.prepare(request)
            async for data in up.content.iter_any():
                await resp.write(data)
            return resp

    app = web.Application()
    app.router.add_post(GENERATE, relay)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))
