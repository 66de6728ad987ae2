"""Endpoint selection and discovery (no HTTP)."""

from __future__ import annotations

import pytest

from disagg_sidecar.config import DNSDiscovery, EndpointSliceDiscovery, KubernetesAPI, StaticDiscovery
from disagg_sidecar.upstream.discovery import DNSSource, EndpointSliceSource, StaticSource, make_source
from disagg_sidecar.upstream.endpoints import FAILURE_COOLDOWN_SECONDS, EndpointPool

URLS = ("http://a:1", "http://b:1", "http://c:1")


def test_least_requests_prefers_the_idlest_and_rotates_ties() -> None:
    pool = EndpointPool("p", lambda: URLS, "least-requests")
    with pool.lease("http://a:1"), pool.lease("http://a:1"), pool.lease("http://b:1"):
        assert pool.pick() == "http://c:1"
        with pool.lease("http://c:1"):
            assert pool.pick() in ("http://b:1", "http://c:1")
    assert pool.outstanding("http://a:1") == 0
    assert {pool.pick() for _ in range(6)} == set(URLS)


def test_round_robin_and_exclusion() -> None:
    pool = EndpointPool("p", lambda: URLS, "round-robin")
    assert [pool.pick() for _ in range(4)] == [URLS[0], URLS[1], URLS[2], URLS[0]]
    assert pool.pick(exclude=URLS[:2]) == URLS[2]
    assert pool.pick(exclude=URLS) is None


def test_failed_endpoints_are_avoided_for_a_while() -> None:
    now = [100.0]
    pool = EndpointPool("p", lambda: URLS[:2], "round-robin", clock=lambda: now[0])
    pool.mark_failed(URLS[0])
    assert {pool.pick() for _ in range(4)} == {URLS[1]}
    assert pool.pick(exclude=[URLS[1]]) == URLS[0], "a failed endpoint beats none"
    now[0] += FAILURE_COOLDOWN_SECONDS + 1
    assert {pool.pick() for _ in range(4)} == set(URLS[:2])


def test_sources() -> None:
    assert isinstance(make_source(None), StaticSource) and make_source(None).endpoints() == ()
    assert make_source(StaticDiscovery(urls=("http://p:1",))).endpoints() == ("http://p:1",)
    dns = make_source(DNSDiscovery(host="prefill.ns.svc", port=8200))
    assert isinstance(dns, DNSSource) and dns.host == "prefill.ns.svc"
    slices = make_source(EndpointSliceDiscovery(namespace="ns", service="m-prefill", port_name="engine",
                                                api=KubernetesAPI(url="https://127.0.0.1:6443")))
    assert isinstance(slices, EndpointSliceSource) and slices.endpoints() == ()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
async def test_dns_source_resolves_every_address(host: str) -> None:
    source = DNSSource(host, 8200, refresh=60)
    await source.start()
    try:
        assert "http://127.0.0.1:8200" in source.endpoints()
    finally:
        await source.stop()


async def test_dns_source_keeps_the_last_answer_when_a_lookup_fails() -> None:
    source = DNSSource("localhost", 8200, refresh=60)
    await source.start()
    before = source.endpoints()
    source.host = "does-not-exist.invalid"
    await source._refresh_once()
    assert source.endpoints() == before
    await source.stop()
