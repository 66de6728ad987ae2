"""The KV connector's part of a plan, read from its profile (``disagg_sidecar.connectors``).

Nothing here names a connector: roles, engine class, shared directory, side channel and the
shortest prompt it carries all come from the registered profile, so a new connector needs no
change here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from disagg_operator import engine_args
from disagg_operator.names import Role
from disagg_operator.pool_plan import POD_IP, EnvVar
from disagg_operator.rules import NO_CONNECTOR
from disagg_sidecar.connectors import REGISTRY, KVConnector, SideChannel

if TYPE_CHECKING:
    from disagg_operator.spec import DisaggregatedModelSpec, GPUPoolSpec

KV_SHARED_PATH = "/var/lib/disagg/kv"  # a connector's shared directory in pods


@dataclass(frozen=True)
class KVPlan:
    connector: KVConnector | None  # None: no KV transfer (no prefill pool, or the spec's None)
    extra_config: Mapping[str, Any]  # kv_connector_extra_config, with the shared directory filled in
    engine_module: str | None  # kv_connector_module_path, where the engines can import it
    shared_path: str | None  # the directory prefill and decode share, if the connector uses one
    shared_claim: str | None
    side_channel_port: int  # the first rank's, when the connector has a side channel
    min_prompt_tokens: int  # shorter prompts skip the prefill pool
    block_tokens: int  # the engines' KV block size (the largest, if pools differ)

    @property
    def name(self) -> str | None:
        return self.connector.name if self.connector else None

    @property
    def side_channel(self) -> SideChannel | None:
        return self.connector.side_channel if self.connector else None

    def flags(self, role: Role) -> list[str]:
        if self.connector is None:
            return []
        return engine_args.kv_transfer_flags(engine_args.kv_transfer_config(
            self.connector.name, self.extra_config, self.connector.kv_roles[role], self.engine_module))

    def side_channel_env(self, pool: GPUPoolSpec) -> tuple[list[EnvVar], tuple[int, ...]]:
        """The engine's side-channel environment and ports (one per data-parallel rank)."""
        channel = self.side_channel
        if channel is None:
            return [], ()
        ports = tuple(self.side_channel_port + rank for rank in range(pool.parallelism.data))
        return [EnvVar(channel.host_env, value_from=POD_IP), EnvVar(channel.port_env, str(self.side_channel_port))], ports


def kv_plan(spec: DisaggregatedModelSpec, *, disaggregated: bool, shared_path: str, engine_package: bool,
            engines: Sequence[GPUPoolSpec]) -> KVPlan:
    """``shared_path``: where the shared directory is (pods: KV_SHARED_PATH; local mode: its own);
    ``engine_package``: the engines can import the disagg package (its connector classes)."""
    kv = spec.kv_transfer
    connector = REGISTRY[kv.connector]() if disaggregated and kv.connector != NO_CONNECTOR else None
    extra = dict(kv.extra_config or {})
    path = None
    if connector is not None and connector.shared_path_key:
        path = extra.setdefault(connector.shared_path_key, shared_path)
    # The shortest prompt the connector carries depends on the engines' KV block size.
    block = max(engine_args.block_size([*spec.model.engine_args, *p.extra_args], engine_args.requests_gpu(p.resources))
                for p in engines)
    return KVPlan(
        connector=connector, extra_config=extra,
        engine_module=connector.engine_module if connector and engine_package else None,
        shared_path=path, shared_claim=kv.shared_storage_claim if path else None,
        side_channel_port=kv.side_channel_port, min_prompt_tokens=connector.min_prompt_tokens(block) if connector else 0,
        block_tokens=block,
    )
