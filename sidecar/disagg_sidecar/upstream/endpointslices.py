"""EndpointSlices -> prefill URLs, and the list/watch bookkeeping. Pure: no I/O.

The transport (``kubeapi``) and the loop (``discovery.EndpointSliceSource``) feed these functions
the API server's JSON; everything they decide is testable without a cluster.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
API_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"

Slice = Mapping[str, Any]
Slices = Mapping[str, Slice]  # by metadata.name


class Gone(Exception):
    """HTTP 410: the watch's resourceVersion is too old; only a fresh list recovers."""


class WatchError(Exception):
    """An ERROR event (other than 410) or an event this code does not understand."""


def endpoint_url(scheme: str, address: str, port: int) -> str:
    return f"{scheme}://[{address}]:{port}" if ":" in address else f"{scheme}://{address}:{port}"


def slice_port(slice_: Slice, port_name: str | None, port: int | None = None) -> int | None:
    """The slice's port number for ``port_name``; unnamed: the only TCP port, or the one numbered ``port``."""
    # A null port means "all ports" (selector-less Services); it names no number we could dial.
    ports = [p for p in slice_.get("ports") or () if p.get("port") is not None and p.get("protocol", "TCP") == "TCP"]
    if port_name is not None:
        return next((p["port"] for p in ports if p.get("name", "") == port_name), None)
    if len(ports) == 1:
        return ports[0]["port"]
    return port if port is not None and any(p["port"] == port for p in ports) else None


def is_ready(endpoint: Mapping[str, Any]) -> bool:
    """Ready and not terminating. EndpointConditions: a missing `ready` reads as true; a
    terminating pod (still `serving` while it finishes its legs) takes no new ones, even when
    `ready` stays true (a Service with publishNotReadyAddresses)."""
    conditions = endpoint.get("conditions") or {}
    return conditions.get("ready") is not False and conditions.get("terminating") is not True


def slice_urls(slice_: Slice, *, port_name: str | None, port: int | None = None,
               scheme: str = "http") -> frozenset[str]:
    number = slice_port(slice_, port_name, port)
    if number is None:
        return frozenset()
    # An endpoint's addresses are fungible (one pod): the first one stands for it.
    return frozenset(endpoint_url(scheme, e["addresses"][0], number)
                     for e in slice_.get("endpoints") or () if is_ready(e) and e.get("addresses"))


def service_urls(slices: Iterable[Slice], *, port_name: str | None, port: int | None = None,
                 scheme: str = "http") -> tuple[str, ...]:
    """Every ready endpoint of the Service, once, in a stable order."""
    urls: set[str] = set()
    for s in slices:
        urls |= slice_urls(s, port_name=port_name, port=port, scheme=scheme)
    return tuple(sorted(urls))


def from_list(body: Mapping[str, Any]) -> tuple[dict[str, Slice], str]:
    """An EndpointSliceList -> (slices by name, the list's resourceVersion to watch from)."""
    slices = {item["metadata"]["name"]: item for item in body.get("items") or ()}
    return slices, body["metadata"]["resourceVersion"]


def apply_event(slices: Slices, event: Mapping[str, Any]) -> tuple[dict[str, Slice], str | None]:
    """One watch event -> (the new slices, the resourceVersion to resume from; None: unchanged)."""
    kind, obj = event.get("type"), event.get("object") or {}
    if kind == "ERROR":  # obj is a metav1.Status
        if obj.get("code") == 410:
            raise Gone(obj.get("message", "resourceVersion too old"))
        raise WatchError(f"watch error {obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
    meta = obj.get("metadata") or {}
    out = dict(slices)
    if kind in ("ADDED", "MODIFIED"):
        out[meta["name"]] = obj
    elif kind == "DELETED":
        out.pop(meta["name"], None)
    elif kind != "BOOKMARK":  # a bookmark only moves the resourceVersion forward
        raise WatchError(f"unexpected watch event type {kind!r}")
    return out, meta.get("resourceVersion")


def list_path(namespace: str, service: str) -> str:
    return API_PATH.format(namespace=namespace) + "?" + urlencode({"labelSelector": f"{SERVICE_NAME_LABEL}={service}"})


def watch_path(namespace: str, service: str, resource_version: str, timeout_seconds: int) -> str:
    query = {"labelSelector": f"{SERVICE_NAME_LABEL}={service}", "watch": "1", "allowWatchBookmarks": "true",
             "resourceVersion": resource_version, "timeoutSeconds": str(timeout_seconds)}
    return API_PATH.format(namespace=namespace) + "?" + urlencode(query)


def status_message(body: str) -> str:
    """The ``message`` of a metav1.Status body, or the body itself."""
    try:
        message = json.loads(body).get("message")
    except (ValueError, AttributeError):
        message = None
    return message if isinstance(message, str) else body.strip()


def explain(status: int, body: str, namespace: str) -> str:
    """A log line for a failed API call that says what to fix."""
    detail = status_message(body)[:500]
    if status == 401:
        return f"the API server rejected the token (401 Unauthorized): {detail}"
    if status == 403:
        return (f"forbidden (403): the sidecar's ServiceAccount needs get/list/watch on "
                f"endpointslices.discovery.k8s.io in namespace {namespace!r}: {detail}")
    return f"API server answered {status}: {detail}"
