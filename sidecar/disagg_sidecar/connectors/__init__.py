"""KV connectors by name: one module each, registered in ``REGISTRY``.

A connector holds both what the sidecar does per request (the ``kv_transfer_params`` of the
prefill and decode legs) and its profile (``base.KVConnector``), which the operator's plan, its
rules and objects, and local mode read: the ``kv_role`` of each engine pool, a side channel
between engines, a shared directory, whether it runs on one machine, and the shortest prompt it
can carry from prefill to decode. Adding a connector means one module here and one entry in
``REGISTRY``.
"""

from __future__ import annotations

from disagg_sidecar.connectors.base import EnginePool, InvalidKVParams, KVConnector, KVRole, PrefilledAt, SideChannel
from disagg_sidecar.connectors.example import ExampleConnector
from disagg_sidecar.connectors.nixl import NixlConnector

REGISTRY: dict[str, type[KVConnector]] = {c.name: c for c in (NixlConnector, ExampleConnector)}
DEFAULT = NixlConnector.name


def get_connector(name: str) -> KVConnector:
    try:
        return REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown KV connector {name!r}; known: {sorted(REGISTRY)}") from None


def local_connectors() -> list[str]:
    """Names of the connectors `disagg up` can run on one machine."""
    return [name for name, c in REGISTRY.items() if c.runs_locally]


__all__ = ["DEFAULT", "REGISTRY", "EnginePool", "ExampleConnector", "InvalidKVParams", "KVConnector", "KVRole",
           "NixlConnector", "PrefilledAt", "SideChannel", "get_connector", "local_connectors"]
