"""KV connectors by name: one module each, registered in ``REGISTRY``.

A connector holds both what the sidecar does per request (the ``kv_transfer_params`` of the
prefill and decode legs) and its profile, which the operator's plan and local mode read: the
``kv_role`` of each engine pool, whether it runs on one machine, and the shortest prompt it can
carry from prefill to decode. Adding a connector means one module here and one line in ``REGISTRY``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

from disagg_sidecar.connectors.example import ExampleConnector
from disagg_sidecar.connectors.nixl import NixlConnector

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
EnginePool = Literal["prefill", "decode"]


class KVConnector(Protocol):
    name: str
    kv_roles: Mapping[str, str]  # engine pool (prefill | decode) -> vLLM kv_role
    runs_locally: bool  # `disagg up` can run it on one machine (no GPUs/RDMA)
    engine_module: str | None  # the engines' kv_connector_module_path (None: vLLM's own class)

    def prefill_params(self) -> dict[str, Any] | None:
        """``kv_transfer_params`` for the prefill leg (None: the connector needs no handshake)."""

    def decode_params(self, prefill_response_params: dict[str, Any] | None) -> dict[str, Any] | None:
        """``kv_transfer_params`` for the decode leg, from what the prefill leg returned."""

    def min_prompt_tokens(self, block_size: int) -> int:
        """Shorter prompts are prefilled on decode (route ``skipped``), never sent to prefill."""


REGISTRY: dict[str, type] = {c.name: c for c in (NixlConnector, ExampleConnector)}


def get_connector(name: str) -> KVConnector:
    try:
        return REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown KV connector {name!r}; known: {sorted(REGISTRY)}") from None


__all__ = ["REGISTRY", "EnginePool", "ExampleConnector", "KVConnector", "KVRole", "NixlConnector", "get_connector"]
