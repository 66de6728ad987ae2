"""What every KV connector module defines: its per-request legs and its deployment profile."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
EnginePool = Literal["prefill", "decode"]


@dataclass(frozen=True)
class SideChannel:
    """A connector whose engines talk to each other directly (a handshake port, then the transfer).

    Each engine listens on ``base port + data-parallel rank``; ``host_env`` gets the pod's address
    and ``port_env`` the base port. ``port_name`` names those ports in pods and Services.
    """

    host_env: str
    port_env: str
    port_name: str


@dataclass(frozen=True)
class PrefilledAt:
    """The prefill endpoint a prompt was prefilled on: what its ``kv_transfer_params`` may name."""

    host: str  # as the sidecar dialled it (an EndpointSlice's address)
    side_channel_ports: tuple[int, ...] = ()  # its side channel's ports (one per data-parallel rank)


class InvalidKVParams(ValueError):
    """A prefill answer's ``kv_transfer_params`` are not what the connector's prefill engines return
    (e.g. they name another host): they never reach decode."""


class KVConnector(Protocol):
    name: str  # as vLLM's kv_connector factory spells it
    summary: str | None  # how the CRD's description names it, e.g. "shared storage"
    kv_roles: Mapping[str, str]  # engine pool (prefill | decode) -> vLLM kv_role
    runs_locally: bool  # `disagg up` can run it on one machine (no GPUs/RDMA)
    engine_module: str | None  # the engines' kv_connector_module_path (None: vLLM's own class)
    shared_path_key: str | None  # kv_connector_extra_config key of a directory prefill and decode share
    side_channel: SideChannel | None  # engines connect to each other (None: they never do)

    def prefill_params(self) -> dict[str, Any] | None:
        """``kv_transfer_params`` for the prefill leg (None: the connector needs no handshake)."""

    def decode_params(self, prefill_response_params: Any, prefilled: PrefilledAt) -> dict[str, Any] | None:
        """``kv_transfer_params`` for the decode leg, from what the prefill leg on ``prefilled``
        returned; raises ``InvalidKVParams`` for anything that engine would not legitimately return
        (the prefill engine is not trusted to name where decode connects)."""

    def min_prompt_tokens(self, block_size: int) -> int:
        """Shorter prompts are prefilled on decode (route ``skipped``), never sent to prefill."""
