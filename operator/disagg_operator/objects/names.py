"""Names, labels and selectors of every object a DisaggregatedModel owns (one place, so they agree)."""

from __future__ import annotations

from typing import Any

from disagg_operator.plan import Role

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
PART_OF = "app.kubernetes.io/part-of"
MANAGED_BY = "app.kubernetes.io/managed-by"
POOL = "disagg.dev/pool"
CONFIG_HASH = "disagg.dev/config-hash"

APP = "disagg"
OPERATOR = "disagg-operator"  # also the server-side-apply field manager

SIDECAR_COMPONENT = "sidecar"
CONFIG_COMPONENT = "config"
CLIENT_COMPONENT = "router"

# Container and port names (Services target ports by name).
VLLM_CONTAINER = "vllm"
SIDECAR_CONTAINER = "sidecar"
ENGINE_PORT = "engine"  # every vLLM server's HTTP port
HTTP_PORT = "http"  # the sidecar's client-facing port in decode pods
NIXL_PORT = "nixl"


def pool_name(model: str, role: Role) -> str:
    return f"{model}-{role}"


def client_service(model: str) -> str:
    return model


def pool_service(model: str, role: Role) -> str:
    return f"{model}-{role}"


def config_map(model: str) -> str:
    return f"{model}-config"


def sidecar_account(model: str) -> str:
    return f"{model}-sidecar"


def nixl_port_name(rank: int) -> str:
    return NIXL_PORT if rank == 0 else f"{NIXL_PORT}-{rank}"


def labels(model: str, component: str) -> dict[str, str]:
    component = str(component)  # plain str, also for Role members: objects hold JSON types only
    out = {NAME: APP, INSTANCE: model, COMPONENT: component, PART_OF: APP, MANAGED_BY: OPERATOR}
    if component in tuple(Role):
        out[POOL] = component
    return out


def selector(model: str, role: Role) -> dict[str, str]:
    """Pod selector of a pool; never changes for a given model (Deployment selectors are immutable)."""
    return {NAME: APP, INSTANCE: model, POOL: str(role)}


def owned_selector(model: str) -> str:
    """Label selector for everything the operator made for one model (used to prune)."""
    return f"{INSTANCE}={model},{MANAGED_BY}={OPERATOR}"


def metadata(model: str, namespace: str, name: str, component: str,
             owner: dict[str, Any] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels(model, component)}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def owner_reference(api_version: str, kind: str, name: str, uid: str) -> dict[str, Any]:
    """Controller reference: garbage collection deletes the children with the DisaggregatedModel."""
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}
