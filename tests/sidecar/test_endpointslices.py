"""EndpointSlice discovery: the pure slice -> URL rules, and the list/watch loop against a scripted API server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from disagg_sidecar.upstream import endpointslices as es
from disagg_sidecar.config import EndpointSliceDiscovery, KubernetesAPI
from disagg_sidecar.upstream.discovery import EndpointSliceSource
from disagg_sidecar.upstream.kubeapi import resolve_access


def ep(address: str, ready: bool | None = True, *more: str) -> dict[str, Any]:
    endpoint: dict[str, Any] = {"addresses": [address, *more]}
    if ready is not None:
        endpoint["conditions"] = {"ready": ready}
    return endpoint


def eslice(name: str, endpoints: list[dict[str, Any]], ports: list[dict[str, Any]] | None = None,
           version: str = "1") -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version},
            "addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": "engine", "port": 8200, "protocol": "TCP"}] if ports is None else ports}


ENGINE_AND_NIXL = [{"name": "engine", "port": 8200, "protocol": "TCP"}, {"name": "nixl", "port": 5600, "protocol": "TCP"}]


@pytest.mark.parametrize(("ports", "port_name", "port", "expected"), [
    (ENGINE_AND_NIXL, "engine", None, 8200),
    (ENGINE_AND_NIXL, "nixl", None, 5600),
    (ENGINE_AND_NIXL, "metrics", None, None),  # a named port that is not there: no endpoints, no guess
    (ENGINE_AND_NIXL, None, None, None),  # ambiguous
    (ENGINE_AND_NIXL, None, 5600, 5600),  # disambiguated by number
    ([{"port": 9000}], None, None, 9000),  # the only port; protocol defaults to TCP
    ([{"name": "", "port": 9000}], "", None, 9000),
    ([{"name": "engine", "port": 8200, "protocol": "UDP"}], "engine", None, None),
    ([{"name": "engine", "port": None}], "engine", None, None),  # "all ports": nothing to dial
    ([], None, 8200, None),
])
def test_slice_port(ports: list[dict[str, Any]], port_name: str | None, port: int | None, expected: int | None) -> None:
    assert es.slice_port(eslice("s", [], ports), port_name, port) == expected


@pytest.mark.parametrize(("endpoint", "ready"), [
    (ep("10.0.0.1", True), True),
    (ep("10.0.0.1", False), False),
    (ep("10.0.0.1", None), True),  # missing conditions: ready (k8s semantics)
    # Terminating: no new legs, whatever `ready` says (missing, or true under publishNotReadyAddresses).
    ({"addresses": ["10.0.0.1"], "conditions": {"serving": True, "terminating": True}}, False),
    ({"addresses": ["10.0.0.1"], "conditions": {"ready": True, "serving": True, "terminating": True}}, False),
    ({"addresses": ["10.0.0.1"], "conditions": {"ready": True, "serving": True, "terminating": False}}, True),
    ({"addresses": ["10.0.0.1"], "conditions": {"ready": False, "serving": True, "terminating": True}}, False),
])
def test_readiness(endpoint: dict[str, Any], ready: bool) -> None:
    assert es.is_ready(endpoint) is ready


def test_slice_urls_keep_ready_endpoints_with_the_named_port() -> None:
    s = eslice("a", [ep("10.0.0.1"), ep("10.0.0.2", False), ep("10.0.0.3", None), ep("10.0.0.4", True, "10.9.9.9"),
                     {"addresses": [], "conditions": {"ready": True}}], ENGINE_AND_NIXL)
    assert es.slice_urls(s, port_name="engine") == {
        "http://10.0.0.1:8200", "http://10.0.0.3:8200", "http://10.0.0.4:8200"}
    assert es.slice_urls(s, port_name="nixl", scheme="https") == {
        "https://10.0.0.1:5600", "https://10.0.0.3:5600", "https://10.0.0.4:5600"}
    assert es.slice_urls(s, port_name="other") == frozenset()


def test_service_urls_merge_slices_sorted_and_bracket_ipv6() -> None:
    slices = [eslice("b", [ep("10.0.0.2"), ep("10.0.0.1")]), eslice("a", [ep("10.0.0.1")]),
              {**eslice("v6", [ep("fd00::1")]), "addressType": "IPv6"}]
    assert es.service_urls(slices, port_name="engine") == (
        "http://10.0.0.1:8200", "http://10.0.0.2:8200", "http://[fd00::1]:8200")
    assert es.service_urls([], port_name="engine") == ()


def test_list_and_events() -> None:
    slices, version = es.from_list({"metadata": {"resourceVersion": "7"}, "items": [eslice("a", [ep("10.0.0.1")])]})
    assert set(slices) == {"a"} and version == "7"
    added, v = es.apply_event(slices, {"type": "ADDED", "object": eslice("b", [ep("10.0.0.2")], version="8")})
    assert set(added) == {"a", "b"} and v == "8" and set(slices) == {"a"}, "the input is not mutated"
    modified, v = es.apply_event(added, {"type": "MODIFIED", "object": eslice("a", [], version="9")})
    assert modified["a"]["endpoints"] == [] and v == "9"
    deleted, v = es.apply_event(modified, {"type": "DELETED", "object": eslice("b", [], version="10")})
    assert set(deleted) == {"a"} and v == "10"
    bookmark, v = es.apply_event(deleted, {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "99"}}})
    assert bookmark == deleted and v == "99"
    with pytest.raises(es.Gone):
        es.apply_event(deleted, {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}})
    with pytest.raises(es.WatchError, match="500"):
        es.apply_event(deleted, {"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "boom"}})
    with pytest.raises(es.WatchError, match="SURPRISE"):
        es.apply_event(deleted, {"type": "SURPRISE", "object": {}})


def test_paths_select_the_service_and_resume_the_watch() -> None:
    assert es.list_path("ns", "m-prefill") == (
        "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices?labelSelector=kubernetes.io%2Fservice-name%3Dm-prefill")
    watch = es.watch_path("ns", "m-prefill", "42", 300)
    assert watch.startswith("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices?labelSelector=")
    for part in ("watch=1", "allowWatchBookmarks=true", "resourceVersion=42", "timeoutSeconds=300"):
        assert part in watch.split("?")[1].split("&")


def test_explain_names_the_missing_permission() -> None:
    message = es.explain(403, '{"kind": "Status", "message": "cannot list"}', "prod")
    assert "endpointslices.discovery.k8s.io" in message and "'prod'" in message and message.endswith(": cannot list")
    assert es.explain(500, "not json", "prod").endswith(": not json")
    assert "401" in es.explain(401, "", "prod")


def test_in_cluster_access_comes_from_the_service_env() -> None:
    access = resolve_access(KubernetesAPI(), {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert access.base_url == "https://10.96.0.1:443"
    assert str(access.token_file) == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert str(access.ca_file) == "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    v6 = resolve_access(KubernetesAPI(), {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert v6.base_url == "https://[fd00::1]:443"
    explicit = resolve_access(KubernetesAPI(url="https://127.0.0.1:6443", ca_file=None), {})
    assert explicit.base_url == "https://127.0.0.1:6443" and explicit.ca_file is None
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        resolve_access(KubernetesAPI(), {})


# --- the loop against a scripted API server ------------------------------------------------------

Watch = list[dict[str, Any]] | int  # events to stream then hold open (last script) / close, or an HTTP status


class FakeAPI:
    """Serves scripted lists and watches; records every request with the source's endpoints at that moment."""

    def __init__(self, lists: list[dict[str, Any]], watches: list[Watch]):
        self.lists, self.watches = lists, watches
        self.requests: list[tuple[dict[str, str], str, tuple[str, ...]]] = []
        self.observe: Callable[[], tuple[str, ...]] = lambda: ()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((query, request.headers.get("Authorization", ""), self.observe()))
        if "watch" not in query:
            return web.json_response(self.lists.pop(0))
        script = self.watches.pop(0)
        if isinstance(script, int):
            return web.json_response({"kind": "Status", "code": script}, status=script)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for event in script:
            await resp.write(json.dumps(event).encode() + b"\n")
        if not self.watches:  # the last watch stays open, like a healthy one
            await asyncio.Event().wait()
        return resp


@pytest.fixture
async def fake_api(tmp_path: Path) -> AsyncIterator[tuple[FakeAPI, str]]:
    api = FakeAPI([], [])
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices", api.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield api, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = 10) -> None:
    """Poll (the loop runs meanwhile) until ``predicate`` holds, or fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def listing(version: str, *slices: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "EndpointSliceList", "metadata": {"resourceVersion": version}, "items": list(slices)}


async def test_watch_relists_on_410_and_keeps_endpoints_through_errors(
        fake_api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    api, url = fake_api
    token = tmp_path / "token"
    token.write_text("first\n")
    api.lists = [listing("1", eslice("a", [ep("10.0.0.1")])),
                 listing("5", eslice("a", [ep("10.0.0.1")]), eslice("b", [ep("10.0.0.2")]))]
    api.watches = [
        [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}],
        503,
        [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "6"}}}],  # then the server ends the watch
        [{"type": "ADDED", "object": eslice("c", [ep("10.0.0.3"), ep("10.0.0.4", False)], version="7")}],
    ]
    source = EndpointSliceSource(EndpointSliceDiscovery(
        namespace="ns", service="p", port_name="engine", backoff_seconds=0.01,
        api=KubernetesAPI(url=url, token_file=str(token), ca_file=None)), env={})
    api.observe = source.endpoints
    await source.start()
    try:
        assert source.endpoints() == ("http://10.0.0.1:8200",), "listed before start() returns"
        token.write_text("rotated\n")
        await eventually(lambda: len(source.endpoints()) == 3, "the slice added by the last watch")
        assert source.endpoints() == ("http://10.0.0.1:8200", "http://10.0.0.2:8200", "http://10.0.0.3:8200")
    finally:
        await source.stop()
    kinds = [(q.get("watch"), q.get("resourceVersion")) for q, _, _ in api.requests]
    # list, watch@1 -> 410, relist, watch@5 -> 503, retry watch@5 -> bookmark 6, watch@6
    assert kinds == [(None, None), ("1", "1"), (None, None), ("1", "5"), ("1", "5"), ("1", "6")]
    assert api.requests[4][2] == ("http://10.0.0.1:8200", "http://10.0.0.2:8200"), "kept through the 503"
    assert api.requests[0][1] == "Bearer first" and api.requests[-1][1] == "Bearer rotated"
    assert all(q["labelSelector"] == "kubernetes.io/service-name=p" for q, _, _ in api.requests)


async def test_an_unreachable_api_server_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    source = EndpointSliceSource(EndpointSliceDiscovery(
        namespace="ns", service="p", port_name="engine", backoff_seconds=0.01, max_backoff_seconds=0.05,
        api=KubernetesAPI(url="http://127.0.0.1:1", token_file=str(token), ca_file=None)), env={})
    await source.start()
    try:
        assert source.endpoints() == ()
        await eventually(lambda: sum("prefill discovery" in r.getMessage() for r in caplog.records) >= 3,
                         "repeated retries")
        assert source._task is not None and not source._task.done()
    finally:
        await source.stop()


async def test_a_watch_closed_at_once_backs_off_and_relists(fake_api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    api, url = fake_api
    token = tmp_path / "token"
    token.write_text("t")
    api.lists = [listing("1", eslice("a", [ep("10.0.0.1")])), listing("3", eslice("a", [ep("10.0.0.2")]))]
    api.watches = [[], [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "4"}}}]]
    source = EndpointSliceSource(EndpointSliceDiscovery(
        namespace="ns", service="p", port_name="engine", backoff_seconds=0.01,
        api=KubernetesAPI(url=url, token_file=str(token), ca_file=None)), env={})
    await source.start()
    try:
        await eventually(lambda: source.endpoints() == ("http://10.0.0.2:8200",), "the relisted endpoint")
        await eventually(lambda: len(api.requests) == 4, "the second watch")
    finally:
        await source.stop()
    assert [(q.get("watch"), q.get("resourceVersion")) for q, _, _ in api.requests] == [
        (None, None), ("1", "1"), (None, None), ("1", "3")]
