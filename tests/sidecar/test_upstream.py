"""How a leg's transport failures are classified (pure): the kind decides retries, metrics labels
and what the client is told (tests/sidecar/test_reliability.py drives them with real servers)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp

from disagg_sidecar.upstream.reading import transport_error


def test_transport_errors_become_leg_error_kinds() -> None:
    """A leg timeout is also an aiohttp ClientError (ServerTimeoutError): it must count as a timeout."""
    key = SimpleNamespace(host="10.0.0.7", port=8200, ssl=None)
    cases = {"timeout": [asyncio.TimeoutError(), aiohttp.ServerTimeoutError("read")],
             "connect": [aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused"))],
             "disconnect": [aiohttp.ServerDisconnectedError(), aiohttp.ClientPayloadError("cut")]}
    for kind, errors in cases.items():
        for exc in errors:
            error = transport_error("prefill", "http://10.0.0.7:8200", exc)
            assert (error.leg, error.kind, error.url) == ("prefill", kind, "http://10.0.0.7:8200"), exc
