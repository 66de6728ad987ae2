"""Where the prefill endpoints are: a static list, or the DNS records of a headless Service.

Every discovery has the same small interface (``endpoints()``, ``start()``, ``stop()``), so an
EndpointSlice watch can be added as one more class. ``endpointslices`` (what the operator writes
today) is resolved through the Service's DNS name until then: with a headless Service that is
exactly the ready pods.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Protocol

from disagg_sidecar.config import DNSDiscovery, Discovery, EndpointSliceDiscovery, StaticDiscovery

log = logging.getLogger(__name__)


class EndpointSource(Protocol):
    def endpoints(self) -> tuple[str, ...]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class StaticSource:
    def __init__(self, urls: tuple[str, ...]):
        self._urls = urls

    def endpoints(self) -> tuple[str, ...]:
        return self._urls

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def _url(scheme: str, address: str, port: int) -> str:
    return f"{scheme}://[{address}]:{port}" if ":" in address else f"{scheme}://{address}:{port}"


class DNSSource:
    """Resolves ``host`` every ``refresh`` seconds; keeps the last good answer if a lookup fails."""

    def __init__(self, host: str, port: int, scheme: str = "http", refresh: float = 5.0):
        self.host, self.port, self.scheme, self.refresh = host, port, scheme, refresh
        self._urls: tuple[str, ...] = ()
        self._task: asyncio.Task | None = None

    def endpoints(self) -> tuple[str, ...]:
        return self._urls

    async def resolve(self) -> tuple[str, ...]:
        infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        addresses = sorted({info[4][0] for info in infos})
        return tuple(_url(self.scheme, a, self.port) for a in addresses)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh)
            await self._refresh_once()

    async def _refresh_once(self) -> None:
        try:
            urls = await self.resolve()
        except OSError as exc:
            log.warning("prefill discovery: cannot resolve %s: %s", self.host, exc)
            return
        if urls != self._urls:
            log.info("prefill endpoints: %s", ", ".join(urls) or "none")
            self._urls = urls

    async def start(self) -> None:
        await self._refresh_once()
        self._task = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def make_source(discovery: Discovery | None) -> EndpointSource:
    if discovery is None:
        return StaticSource(())
    if isinstance(discovery, StaticDiscovery):
        return StaticSource(discovery.urls)
    if isinstance(discovery, DNSDiscovery):
        return DNSSource(discovery.host, discovery.port, discovery.scheme, discovery.refresh_seconds)
    assert isinstance(discovery, EndpointSliceDiscovery)
    return DNSSource(f"{discovery.service}.{discovery.namespace}.svc", discovery.port, "http",
                     discovery.refresh_seconds)
