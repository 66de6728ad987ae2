"""The derender benchmark's pass-through (benchmarks/stack.py): a session's request body lasts as long
as its answer, so the proxy must hand each piece on as it comes, both ways, and count its bytes."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from benchmarks.stack import counting_proxy, traffic
from disagg_engine.servers import free_port
from tests.sidecar.support import LoopThread


async def _echo_lines(request: web.Request) -> web.StreamResponse:
    """Answers every line of the request body as soon as it arrives (as a derender session does)."""
    out = web.StreamResponse(headers={"Content-Type": "text/plain"})
    await out.prepare(request)
    async for line in request.content:
        await out.write(b"got " + line)
    await out.write_eof()
    return out


def test_a_duplex_body_passes_line_by_line_and_is_counted() -> None:
    lt, port = LoopThread(), free_port()

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/session", _echo_lines)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = lt.run(start())
    lines = [b"open\n", b"chunk one\n", b"chunk two\n"]
    try:
        with counting_proxy(f"http://127.0.0.1:{port}") as proxy:
            async def converse() -> list[bytes]:
                sent: asyncio.Queue[bytes | None] = asyncio.Queue()

                async def body():
                    while (line := await sent.get()) is not None:
                        yield line

                answers = []
                async with aiohttp.ClientSession() as client:
                    await sent.put(lines[0])
                    async with client.post(proxy.url + "/session", data=body()) as resp:
                        for i, line in enumerate(lines):
                            # The next line is written only after this one's answer came back:
                            # a proxy that waited for the whole body would never answer.
                            answers.append(await asyncio.wait_for(resp.content.readline(), 10))
                            await sent.put(lines[i + 1] if i + 1 < len(lines) else None)
                        assert await resp.content.read() == b""
                return answers

            assert lt.run(converse(), timeout=60) == [b"got " + line for line in lines]
            moved = traffic(proxy.calls)
    finally:
        lt.run(runner.cleanup())
        lt.close()
    assert moved["calls"] == {"/session": 1}
    assert moved["bytes_out"]["/session"] == sum(map(len, lines))
    assert moved["bytes_in"]["/session"] == sum(len(b"got " + line) for line in lines)
