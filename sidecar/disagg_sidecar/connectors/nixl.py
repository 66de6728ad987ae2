"""vLLM's NixlConnector: decode pulls the prefilled blocks from the prefill engine (GPU, RDMA)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg_sidecar.connectors.base import SideChannel


class NixlConnector:
    """The prefill leg asks for remote decode, the decode leg gets the reply verbatim."""

    name = "NixlConnector"
    summary: str | None = None
    # Both roles on both pools: NIXL's handshake decides direction per request (kv_transfer_params).
    kv_roles: Mapping[str, str] = {"prefill": "kv_both", "decode": "kv_both"}
    runs_locally = False
    engine_module: str | None = None  # vLLM's own class
    shared_path_key: str | None = None
    # Decode reaches the prefill engine's side channel, then UCX moves the KV (vllm/envs.py names).
    side_channel: SideChannel | None = SideChannel(
        host_env="VLLM_NIXL_SIDE_CHANNEL_HOST", port_env="VLLM_NIXL_SIDE_CHANNEL_PORT", port_name="nixl")

    def prefill_params(self) -> dict[str, Any]:
        return {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        }

    def decode_params(self, prefill_response_params: dict[str, Any] | None) -> dict[str, Any] | None:
        return prefill_response_params

    def min_prompt_tokens(self, block_size: int) -> int:
        return 0  # the handshake names the blocks to pull, for any prompt length
