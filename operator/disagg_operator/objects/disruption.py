"""A PodDisruptionBudget per pool: voluntary disruptions (drains) take one pod of a pool at a time."""

from __future__ import annotations

from typing import Any

from disagg_operator import names
from disagg_operator.plan import Plan


def disruption_budgets(plan: Plan, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [{
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": names.metadata(plan.name, plan.namespace, pool.name, pool.role, owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": names.selector(plan.name, pool.role)}},
    } for pool in plan.pools]
