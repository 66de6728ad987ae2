"""Plan → Kubernetes objects (plain dicts), without any API call.

``build_objects`` is used by the operator (with an owner reference) and by ``disagg manifests``
(without one), so both produce the same objects.
"""

from __future__ import annotations

from typing import Any

from disagg_operator.kinds import APPLY_ORDER
from disagg_operator.objects.autoscaling import autoscalers
from disagg_operator.objects.configmaps import config_map
from disagg_operator.objects.deployments import deployment
from disagg_operator.objects.disruption import disruption_budgets
from disagg_operator.objects.inference_pool import inference_pools
from disagg_operator.objects.monitors import pod_monitors
from disagg_operator.objects.network import network_policies
from disagg_operator.objects.rbac import rbac
from disagg_operator.objects.secrets import engine_api_key_secrets
from disagg_operator.objects.services import services
from disagg_operator.plan import Plan


def build_objects(plan: Plan, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    objects = [
        *network_policies(plan, owner),
        *engine_api_key_secrets(plan, owner),
        *rbac(plan, owner),
        config_map(plan, owner),
        *services(plan, owner),
        *(deployment(plan, pool, owner) for pool in plan.pools),
        *autoscalers(plan, owner),
        *disruption_budgets(plan, owner),
        *inference_pools(plan, owner),
        *pod_monitors(plan, owner),
    ]
    return sorted(objects, key=lambda o: APPLY_ORDER[o["kind"]])


__all__ = ["build_objects"]
