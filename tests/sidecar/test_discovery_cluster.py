"""EndpointSlice discovery against the real API server, with a ServiceAccount token and the operator's Role.

The Service has no selector, so no controller touches its slices: the test writes them by hand and
watches the sidecar's discovery follow. Every wait polls an observable condition with a bound.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_operator.objects.rbac import SIDECAR_RULES
from disagg_sidecar.config import EndpointSliceDiscovery, KubernetesAPI
from disagg_sidecar.upstream.discovery import EndpointSliceSource
from tests.harness.cluster import Cluster

pytestmark = pytest.mark.cluster

SERVICE = "prefill"
TIMEOUT = 60  # the loaded 2-core machine: watch events usually arrive in well under a second


@pytest.fixture
def ns(cluster: Cluster) -> Iterator[str]:
    name = cluster.create_namespace("sidecar-discovery")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def apply(cluster: Cluster, ns: str, *docs: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(docs)}))


def account(name: str, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ServiceAccount bound to a Role with ``rules`` (the operator's sidecar identity, by shape)."""
    meta = {"name": name}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name}]},
    ]


def service() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE},
            "spec": {"clusterIP": "None", "ports": [{"name": "engine", "port": 8200, "protocol": "TCP"},
                                                     {"name": "nixl", "port": 5600, "protocol": "TCP"}]}}


def endpoint_slice(name: str, endpoints: list[dict[str, Any]], service_name: str = SERVICE) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service_name,
                                                  "endpointslice.kubernetes.io/managed-by": "disagg-tests"}},
            "addressType": "IPv4",
            "ports": [{"name": "nixl", "port": 5600, "protocol": "TCP"}, {"name": "engine", "port": 8200, "protocol": "TCP"}],
            "endpoints": endpoints}


def ep(address: str, ready: bool | None = True) -> dict[str, Any]:
    return {"addresses": [address]} if ready is None else {"addresses": [address], "conditions": {"ready": ready}}


def api_access(cluster: Cluster, ns: str, account_name: str, tmp_path: Path) -> KubernetesAPI:
    """The API server of the kubeconfig, with a freshly minted token of ``account_name`` (not the admin cert)."""
    kubeconfig = yaml.safe_load(cluster.kubeconfig.read_text())
    server = kubeconfig["clusters"][0]["cluster"]
    ca = tmp_path / "ca.crt"
    ca.write_bytes(base64.b64decode(server["certificate-authority-data"]))
    token = tmp_path / f"{account_name}.token"
    token.write_text(cluster.kubectl("create", "token", account_name, "-n", ns, "--duration=1h").stdout.strip())
    return KubernetesAPI(url=server["server"], token_file=str(token), ca_file=str(ca))


def source(ns: str, api: KubernetesAPI) -> EndpointSliceSource:
    return EndpointSliceSource(EndpointSliceDiscovery(
        namespace=ns, service=SERVICE, port_name="engine", api=api, backoff_seconds=0.1, max_backoff_seconds=1), env={})


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)  # polling; the watch runs on this loop meanwhile


def urls(*addresses: str) -> tuple[str, ...]:
    return tuple(sorted(f"http://{a}:8200" for a in addresses))


async def test_endpointslice_watch_follows_the_service(cluster: Cluster, ns: str, tmp_path: Path) -> None:
    kubectl = cluster.kubectl  # blocking: run in a thread so the watch keeps reading meanwhile
    apply(cluster, ns, *account("sidecar", SIDECAR_RULES), service(),
          endpoint_slice("prefill-a", [ep("10.0.0.1"), ep("10.0.0.2", None), ep("10.0.0.3", False)]),
          endpoint_slice("other-a", [ep("10.0.9.9")], service_name="other"))
    discovery = source(ns, api_access(cluster, ns, "sidecar", tmp_path))
    await discovery.start()
    try:
        assert discovery.endpoints() == urls("10.0.0.1", "10.0.0.2"), "ready (or unknown) endpoints, engine port"

        await asyncio.to_thread(apply, cluster, ns, endpoint_slice("prefill-b", [ep("10.0.0.4")]))
        await eventually(lambda: "http://10.0.0.4:8200" in discovery.endpoints(), "a new slice's endpoint")

        await asyncio.to_thread(apply, cluster, ns, endpoint_slice(
            "prefill-a", [ep("10.0.0.1", False), ep("10.0.0.2", None), ep("10.0.0.3", True), ep("10.0.0.5")]))
        await eventually(lambda: discovery.endpoints() == urls("10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"),
                         "a modified slice: 10.0.0.1 not ready, 10.0.0.3 ready, 10.0.0.5 added")

        await asyncio.to_thread(kubectl, "delete", "endpointslice", "prefill-b", "-n", ns)
        await eventually(lambda: discovery.endpoints() == urls("10.0.0.2", "10.0.0.3", "10.0.0.5"),
                         "the deleted slice's endpoint gone")
        assert discovery._task is not None and not discovery._task.done()
    finally:
        await discovery.stop()


async def test_missing_permission_is_logged_and_recovers_once_granted(
        cluster: Cluster, ns: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="disagg_sidecar.upstream.discovery")
    apply(cluster, ns, *account("nobody", [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}]),
          service(), endpoint_slice("prefill-a", [ep("10.0.0.1")]))
    discovery = source(ns, api_access(cluster, ns, "nobody", tmp_path))
    await discovery.start()  # must not raise
    try:
        assert discovery.endpoints() == ()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("forbidden (403)" in m and "endpointslices.discovery.k8s.io" in m and f"system:serviceaccount:{ns}:nobody" in m
                   for m in errors), errors
        assert discovery._task is not None and not discovery._task.done(), "the loop keeps retrying"

        # Granting the operator's rules later is picked up by the retry loop, without a restart.
        rules = [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}, *SIDECAR_RULES]
        await asyncio.to_thread(apply, cluster, ns, account("nobody", rules)[1])
        await eventually(lambda: discovery.endpoints() == urls("10.0.0.1"), "endpoints once the Role allows it")
    finally:
        await discovery.stop()
