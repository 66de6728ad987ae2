"""Names, labels and selectors of every object a DisaggregatedModel owns (one place, so they agree).

The bottom of the operator: it imports nothing of it, and the plan, the objects and the status
all take pool roles, Service names and port names from here.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    RENDER = "render"
    DERENDER = "derender"


ROLES: tuple[Role, ...] = (Role.PREFILL, Role.DECODE, Role.RENDER, Role.DERENDER)

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
PART_OF = "app.kubernetes.io/part-of"
MANAGED_BY = "app.kubernetes.io/managed-by"
POOL = "disagg.dev/pool"
INFERENCE_POOL = "disagg.dev/inference-pool"  # only on pods of an enabled InferencePool
LLM_D_ROLE = "llm-d.ai/role"  # what llm-d's P/D filters select prefill and decode pods by
CONFIG_HASH = "disagg.dev/config-hash"
# On every pod: its pool's configuration hash (monitors copy it to the label `revision`; the sidecar pairs by it).
REVISION = "disagg.dev/revision"
# On prefill and decode pods: the hash of what decides whether a prefill pod's KV cache fits a decode pod
# (plan.kv_revision). A decode pod's sidecar sends prefill legs only to prefill pods of its own.
KV_REVISION = "disagg.dev/kv-revision"

APP = "disagg"
OPERATOR = "disagg-operator"  # also the server-side-apply field manager

SIDECAR_COMPONENT = "sidecar"
SECURITY_COMPONENT = "security"
CONFIG_COMPONENT = "config"
CLIENT_COMPONENT = "router"
MONITORING_COMPONENT = "monitoring"

# Container and port names (Services target ports by name).
VLLM_CONTAINER = "vllm"
SIDECAR_CONTAINER = "sidecar"
ENGINE_PORT = "engine"  # every vLLM server's HTTP port (the sidecar's EndpointSlice discovery reads it)
HTTP_PORT = "http"  # the sidecar's client-facing port in decode pods


def pool_name(model: str, role: Role) -> str:
    return f"{model}-{role}"


def client_service(model: str) -> str:
    return model


def pool_service(model: str, role: Role) -> str:
    return f"{model}-{role}"


def prefill_revision_service(model: str, kv_revision: str) -> str:
    """The headless Service of the prefill pods of one KV revision (a DNS label: 54 + 3 + 6 characters)."""
    return f"{model}-kv{kv_revision[:6]}"


def config_map(model: str) -> str:
    return f"{model}-config"


def engine_monitor(model: str) -> str:
    return f"{model}-engines"


def sidecar_monitor(model: str) -> str:
    return f"{model}-sidecars"


def engine_api_key_secret(model: str) -> str:
    return f"{model}-engine-api-key"


API_KEY_KEY = "api-key"  # the key of the engine key Secret's data (and a client key Secret's default)


def sidecar_account(model: str) -> str:
    return f"{model}-sidecar"


def side_channel_port_name(prefix: str, rank: int) -> str:
    """A KV connector's side-channel port of one data-parallel rank (``prefix``: the connector's)."""
    return prefix if rank == 0 else f"{prefix}-{rank}"


def service_url(service: str, namespace: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://{service}.{namespace}.svc:{port}"


def engine_tls_name(model: str, namespace: str) -> str:
    """The DNS name every engine certificate carries (security.tls): the sidecar verifies it."""
    return f"{model}-engine.{namespace}.svc"


def labels(model: str, component: str) -> dict[str, str]:
    component = str(component)  # plain str, also for Role members: objects hold JSON types only
    out = {NAME: APP, INSTANCE: model, COMPONENT: component, PART_OF: APP, MANAGED_BY: OPERATOR}
    if component in tuple(Role):
        out[POOL] = component
    return out


def selector(model: str, role: Role) -> dict[str, str]:
    """Pod selector of a pool; never changes for a given model (Deployment selectors are immutable)."""
    return {NAME: APP, INSTANCE: model, POOL: str(role)}


def inference_pool_selector(model: str) -> dict[str, str]:
    """The InferencePool's selector: this model's decode and prefill pods, only while it is enabled."""
    return {NAME: APP, INSTANCE: model, INFERENCE_POOL: "member"}


def inference_pool_labels(model: str, role: Role) -> dict[str, str]:
    """Pod template labels of a decode or prefill pod in an InferencePool (never in a Deployment selector)."""
    return {**inference_pool_selector(model), LLM_D_ROLE: str(role)}


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
