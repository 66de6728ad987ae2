"""vLLM's NixlConnector: decode pulls the prefilled blocks from the prefill engine (GPU, RDMA)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg_sidecar.connectors.base import InvalidKVParams, PrefilledAt, SideChannel

MAX_PARAM_KEYS = 64


def _ids(value: Any) -> bool:
    """Block ids: a list of ints, or (hybrid KV caches) a list of such lists."""
    return isinstance(value, list) and all(
        (type(v) is int and v >= 0) or (isinstance(v, list) and all(type(i) is int and i >= 0 for i in v))
        for v in value)


def _plain(value: Any) -> bool:
    """A scalar, or a list of block ids: what vLLM's NixlConnector puts into its other fields."""
    return value is None or isinstance(value, (str, int, float, bool)) or _ids(value)


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

    def decode_params(self, prefill_response_params: Any, prefilled: PrefilledAt) -> dict[str, Any] | None:
        """The prefill's answer when it names the endpoint that was prefilled: ``remote_host`` its
        address, ``remote_port`` one of its side-channel ports; the fields vLLM's NixlConnector
        returns with their types (``request_finished``: the version decides which others there are,
        so those are kept when they are scalars or block ids). None (nothing to pull): decode
        prefills itself."""
        params = prefill_response_params
        if params is None:
            return None
        if not isinstance(params, dict) or len(params) > MAX_PARAM_KEYS:
            raise InvalidKVParams("kv_transfer_params is not an object of NIXL's fields")
        if params.get("remote_host") != prefilled.host:
            raise InvalidKVParams("remote_host is not the prefill endpoint's address")
        port = params.get("remote_port")
        if type(port) is not int or port not in prefilled.side_channel_ports:
            raise InvalidKVParams("remote_port is not one of the prefill endpoint's side-channel ports "
                                  "(prefill.side_channel_ports)")
        if params.get("do_remote_prefill") is not True or params.get("do_remote_decode") not in (False, None):
            raise InvalidKVParams("kv_transfer_params do not ask decode to pull the prefilled blocks")
        if not isinstance(params.get("remote_engine_id"), str) or not _ids(params.get("remote_block_ids")):
            raise InvalidKVParams("remote_engine_id or remote_block_ids are missing or malformed")
        if not all(isinstance(k, str) and _plain(v) for k, v in params.items()):
            raise InvalidKVParams("kv_transfer_params hold values NIXL's fields never have")
        return params

    def min_prompt_tokens(self, block_size: int) -> int:
        return 0  # the handshake names the blocks to pull, for any prompt length
