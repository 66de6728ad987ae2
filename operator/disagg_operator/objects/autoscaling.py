"""A HorizontalPodAutoscaler (autoscaling/v2) for each pool that asks for one."""

from __future__ import annotations

from typing import Any

from disagg_operator import names
from disagg_operator.plan import Plan


def autoscalers(plan: Plan, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = []
    for pool in plan.pools:
        if pool.autoscaling is None:
            continue
        out.append({
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": names.metadata(plan.name, plan.namespace, pool.name, pool.role, owner),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": pool.name},
                "minReplicas": pool.autoscaling.min_replicas,
                "maxReplicas": pool.autoscaling.max_replicas,
                "metrics": [dict(m) for m in pool.autoscaling.metrics],
            },
        })
    return out
