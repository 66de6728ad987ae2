"""Plan → Kubernetes objects (plain dicts), without any API call.

``build_objects`` is used by the operator (with an owner reference) and by ``disagg manifests``
(without one), so both produce the same objects.
"""

from __future__ import annotations

from typing import Any

from disagg_operator.objects.autoscaling import autoscalers
from disagg_operator.objects.configmaps import config_map
from disagg_operator.objects.deployments import deployment
from disagg_operator.objects.disruption import disruption_budgets
from disagg_operator.objects.network import network_policies
from disagg_operator.objects.rbac import rbac
from disagg_operator.objects.services import services
from disagg_operator.plan import Plan

# Every kind the operator may own, in apply order (what a pod mounts or uses exists first).
# (apiVersion, kind, plural): apply.py lists them to prune what the plan no longer wants.
MANAGED_KINDS: tuple[tuple[str, str, str], ...] = (
    ("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),  # before any pod it guards
    ("v1", "ServiceAccount", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "Role", "roles"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    ("v1", "ConfigMap", "configmaps"),
    ("v1", "Service", "services"),
    ("apps/v1", "Deployment", "deployments"),
    ("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    ("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
)
_ORDER = {kind: i for i, (_, kind, _) in enumerate(MANAGED_KINDS)}


def build_objects(plan: Plan, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    objects = [
        *network_policies(plan, owner),
        *rbac(plan, owner),
        config_map(plan, owner),
        *services(plan, owner),
        *(deployment(plan, pool, owner) for pool in plan.pools),
        *autoscalers(plan, owner),
        *disruption_budgets(plan, owner),
    ]
    return sorted(objects, key=lambda o: _ORDER[o["kind"]])


def object_key(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    """(apiVersion, kind, namespace, name): identity of an object for diffing and pruning."""
    meta = obj["metadata"]
    return obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"]


__all__ = ["MANAGED_KINDS", "build_objects", "object_key"]
