"""Where the prefill endpoints are: a static list, the DNS records of a headless Service, or a
watch of the Service's EndpointSlices (what the operator configures).

Every discovery has the same small interface (``endpoints()``, ``start()``, ``stop()``); the pool
reads ``endpoints()`` on every pick, so a source only has to keep its answer current. A source
that loses its backend keeps the last answer: stale endpoints are retried and marked failed by
the pool, while an empty list would turn every request into a fallback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from typing import Protocol

import aiohttp

from disagg_sidecar.upstream import endpointslices as es
from disagg_sidecar.upstream import kubeapi
from disagg_sidecar.config import DNSDiscovery, Discovery, EndpointSliceDiscovery, StaticDiscovery
from disagg_sidecar.upstream.endpointslices import endpoint_url as _url

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


class EndpointSliceSource:
    """List, then watch, the EndpointSlices labelled ``kubernetes.io/service-name=<service>``.

    Watches resume from the last resourceVersion (bookmarks keep it fresh); 410 Gone relists;
    any other error is logged and retried with exponential backoff, keeping the last endpoints.
    """

    def __init__(self, discovery: EndpointSliceDiscovery, env: Mapping[str, str] | None = None):
        self.discovery = discovery
        self._access = kubeapi.resolve_access(discovery.api, os.environ if env is None else env)
        self._urls: tuple[str, ...] = ()
        self._slices: dict[str, es.Slice] = {}
        self._version: str | None = None  # None: (re)list before watching
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    def endpoints(self) -> tuple[str, ...]:
        return self._urls

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=kubeapi.ssl_context(self._access)))
        try:  # endpoints known before the first request when the API answers; never fatal
            await self._list()
        except Exception as exc:  # logged and retried by the loop, like any later failure
            self._log_failure(exc)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session:
            await self._session.close()

    async def _run(self) -> None:
        d = self.discovery
        delay, gone_before = d.backoff_seconds, False
        while True:
            try:
                if self._version is None:
                    await self._list()
                started = asyncio.get_running_loop().time()
                events = await self._watch()  # returns when the server ends the watch (timeoutSeconds)
                if events == 0 and asyncio.get_running_loop().time() - started < 1:
                    raise es.WatchError("the API server ended the watch at once")  # back off, don't spin
                delay, gone_before = d.backoff_seconds, False
                continue
            except es.Gone as exc:
                log.info("prefill discovery: %s; relisting", exc)
                self._version = None
                if not gone_before:  # relist at once, but never spin on repeated 410s
                    gone_before = True
                    continue
            except Exception as exc:  # a discovery bug must not stop discovery
                self._log_failure(exc)
                if isinstance(exc, es.WatchError):
                    self._version = None  # a watch we cannot follow: start over from a list
            await asyncio.sleep(delay)
            delay = min(delay * 2, d.max_backoff_seconds)

    async def _list(self) -> None:
        d = self.discovery
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=10)
        body = await kubeapi.get_json(self._require_session(), self._access, es.list_path(d.namespace, d.service),
                                      timeout)
        self._slices, self._version = es.from_list(body)
        self._publish()

    async def _watch(self) -> int:
        """Follow one watch request; returns how many events it carried."""
        d = self.discovery
        events = 0
        assert self._version is not None
        path = es.watch_path(d.namespace, d.service, self._version, d.watch_seconds)
        # No total timeout: the server closes the watch; bookmarks arrive about once a minute.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=d.watch_seconds + 60)
        try:
            async for event in kubeapi.watch(self._require_session(), self._access, path, timeout):
                self._slices, version = es.apply_event(self._slices, event)
                self._version = version or self._version
                self._publish()
                events += 1
        except kubeapi.APIError as exc:
            if exc.status == 410:
                raise es.Gone(es.status_message(exc.body)[:200]) from exc
            raise
        return events

    def _publish(self) -> None:
        d = self.discovery
        urls = es.service_urls(self._slices.values(), port_name=d.port_name, port=d.port, scheme=d.scheme)
        if urls != self._urls:
            log.info("prefill endpoints: %s", ", ".join(urls) or "none")
            self._urls = urls

    def _log_failure(self, exc: BaseException) -> None:
        d = self.discovery
        where = f"endpointslices of {d.namespace}/{d.service} at {self._access.base_url}"
        if isinstance(exc, kubeapi.APIError):
            log.error("prefill discovery: %s: %s", where, es.explain(exc.status, exc.body, d.namespace))
        else:
            log.error("prefill discovery: %s: %s: %s (keeping %d known endpoints)",
                      where, type(exc).__name__, exc, len(self._urls))

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EndpointSliceSource.start() was not called")
        return self._session


def make_source(discovery: Discovery | None) -> EndpointSource:
    if discovery is None:
        return StaticSource(())
    if isinstance(discovery, StaticDiscovery):
        return StaticSource(discovery.urls)
    if isinstance(discovery, DNSDiscovery):
        return DNSSource(discovery.host, discovery.port, discovery.scheme, discovery.refresh_seconds)
    assert isinstance(discovery, EndpointSliceDiscovery)
    return EndpointSliceSource(discovery)
