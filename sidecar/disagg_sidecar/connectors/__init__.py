"""KV connectors by name: what the prefill leg asks for and what the decode leg gets back.

Adding a connector means one module here and one line in ``REGISTRY``.
"""

from __future__ import annotations

from typing import Any, Protocol


class KVConnector(Protocol):
    name: str

    def prefill_params(self) -> dict[str, Any] | None:
        """``kv_transfer_params`` for the prefill leg (None: the connector needs no handshake)."""

    def decode_params(self, prefill_response_params: dict[str, Any] | None) -> dict[str, Any] | None:
        """``kv_transfer_params`` for the decode leg, from what the prefill leg returned."""


class NixlConnector:
    """NIXL pull: the prefill leg asks for remote decode, the decode leg gets the reply verbatim."""

    name = "NixlConnector"

    def prefill_params(self) -> dict[str, Any]:
        return {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        }

    def decode_params(self, prefill_response_params: dict[str, Any] | None) -> dict[str, Any] | None:
        return prefill_response_params


class ExampleConnector:
    """vLLM's shared-storage ExampleConnector: KV is found by prompt hash, no params either way."""

    name = "ExampleConnector"

    def prefill_params(self) -> None:
        return None

    def decode_params(self, prefill_response_params: dict[str, Any] | None) -> None:
        return None


REGISTRY: dict[str, type] = {c.name: c for c in (NixlConnector, ExampleConnector)}


def get_connector(name: str) -> KVConnector:
    try:
        return REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown KV connector {name!r}; known: {sorted(REGISTRY)}") from None
