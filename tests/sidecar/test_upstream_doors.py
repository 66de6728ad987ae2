"""Network calls only through ``Upstream`` (disagg_sidecar/upstream/client.py): the derender
sessions' endpoint capabilities (asked once per TTL, kept on the app's ``Upstream``) and the
session stream itself, against a recording upstream (no engines needed for the plumbing; the
sessions themselves run on real renders in tests/sidecar/test_sessions.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp

from disagg_sidecar import wire
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.derender import sessions
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.upstream.client import Upstream
from disagg_sidecar.upstream.endpoints import EndpointPool
from tests.sidecar.support import FakeEngine, fake_config, fake_engine

SESSION = "/disagg/v1/sessions/chat"


def _upstream(session: aiohttp.ClientSession, engine: FakeEngine) -> Upstream:
    config = SidecarConfig.model_validate({**fake_config(engine), "listen": {"host": "127.0.0.1", "port": 8000}})
    pools = {tier: EndpointPool(tier, lambda: (engine.url,), "least-requests")
             for tier in ("render", "derender", "prefill")}
    return Upstream(session, config, Metrics(), **pools)


async def test_session_endpoints_are_asked_through_upstream_once_per_ttl() -> None:
    with fake_engine() as engine:
        engine.answer[wire.CAPABILITIES] = (200, json.dumps({"derender_sessions": {"chat_path": SESSION}}).encode())
        async with aiohttp.ClientSession() as session:
            up = _upstream(session, engine)
            assert await sessions.endpoint_with_sessions(up, "chat") == (engine.url, SESSION)
            assert await sessions.endpoint_with_sessions(up, "completions") is None  # no completions sessions
            assert await sessions.endpoint_with_sessions(up, "chat") == (engine.url, SESSION)
            other = _upstream(session, engine)  # another app's Upstream asks for itself
            assert await sessions.endpoint_with_sessions(other, "chat") == (engine.url, SESSION)
        assert [c.path for c in engine.calls].count(wire.CAPABILITIES) == 2


async def test_a_session_stream_goes_out_through_upstream_as_ndjson() -> None:
    async def lines() -> AsyncIterator[bytes]:
        yield b'{"request_id":"r1"}\n'
        yield b'[0,[7]]\n'

    with fake_engine() as engine:
        engine.answer[SESSION] = (200, b"data: [DONE]\n\n")
        async with aiohttp.ClientSession() as session:
            up = _upstream(session, engine)
            async with up.session_stream(engine.url + SESSION, lines(), {wire.REQUEST_ID: "r1"}) as resp:
                assert (resp.status, await resp.read()) == (200, b"data: [DONE]\n\n")
        [call] = [c for c in engine.calls if c.path == SESSION]
        assert call.body == b'{"request_id":"r1"}\n[0,[7]]\n'
        headers = {k.lower(): v for k, v in call.headers.items()}
        assert headers["content-type"] == "application/x-ndjson" and headers[wire.REQUEST_ID.lower()] == "r1"


async def test_an_oversized_capabilities_answer_offers_no_sessions() -> None:
    with fake_engine() as engine:
        engine.answer[wire.CAPABILITIES] = (200, b'{"derender_sessions":{"chat_path":"' + b"x" * (2 << 20) + b'"}}')
        async with aiohttp.ClientSession() as session:
            assert await sessions.endpoint_with_sessions(_upstream(session, engine), "chat") is None
        assert wire.CAPABILITIES in [c.path for c in engine.calls]  # asked, and its answer not taken
