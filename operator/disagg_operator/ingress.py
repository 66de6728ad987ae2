"""Who may open connections to each pool's pods: the per-model NetworkPolicies as a pure plan.

Connections inside one model (objects/services.py, sidecar_config.py):
- clients → decode pods on the sidecar port (the `<name>` Service): the sidecar is the model's front
  door and strips what clients must not set, so any source may reach it;
- decode pods (their sidecar) → render and derender pods, and prefill pods, on the engine port;
- a KV connector with a side channel (NIXL): decode → prefill side channel (one port per
  data-parallel rank), then the transfer (NIXL's UCX over TCP listens on ports it picks and connects
  in both directions), so a model's prefill and decode pods accept any port from each other (RDMA
  traffic bypasses NetworkPolicies anyway);
- the sidecar reaches its own decode engine over the pod's loopback, which no policy filters, so the
  decode engine port stays closed to everything else.
Kubelet probes come from the node, which NetworkPolicies always allow. Egress is not restricted
(engines download weights). The objects are written by ``objects/network.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_operator.names import Role
from disagg_operator.plan import Plan


@dataclass(frozen=True)
class Ingress:
    """One allow rule: connections to ``ports`` (empty: every port) from the listed sources."""

    ports: tuple[int, ...]
    from_roles: tuple[Role, ...] = ()  # this model's pods of these pools
    from_peers: tuple[Mapping[str, Any], ...] = ()  # NetworkPolicyPeers from spec.networkPolicy
    from_anywhere: bool = False

    def __post_init__(self) -> None:
        # A rule with neither ports nor sources would open every port to everyone.
        if not (self.from_anywhere or self.from_roles or self.from_peers):
            raise ValueError("an ingress rule needs sources (or from_anywhere)")
        if self.from_anywhere and (self.from_roles or self.from_peers or not self.ports):
            raise ValueError("from_anywhere is only for named ports, without other sources")


@dataclass(frozen=True)
class PoolIngress:
    """What a pool's NetworkPolicy allows in; everything else is denied once it exists."""

    role: Role
    name: str
    rules: tuple[Ingress, ...]


def ingress_plan(plan: Plan) -> tuple[PoolIngress, ...]:
    """One entry per active pool, or none when spec.networkPolicy.enabled is false."""
    policy = plan.spec.network_policy
    if not policy.enabled:
        return ()
    engines_connect = plan.kv.side_channel is not None
    extra = tuple(policy.extra_engine_from)
    out = []
    for pool in plan.pools:
        if pool.role == Role.DECODE:
            rules = [Ingress((plan.sidecar.port,), from_anywhere=True)]
            if engines_connect:
                rules.append(Ingress((), from_roles=(Role.PREFILL,)))
        elif pool.role == Role.PREFILL:
            rules = [Ingress(() if engines_connect else (pool.port,), from_roles=(Role.DECODE,))]
        else:  # render, derender: the sidecar's render and derender legs
            rules = [Ingress((pool.port,), from_roles=(Role.DECODE,))]
        if extra:
            rules.append(Ingress((pool.port,), from_peers=extra))
        out.append(PoolIngress(pool.role, pool.name, tuple(rules)))
    return tuple(out)
