"""A NetworkPolicy per pool (``ingress.py`` decides what each allows): ingress only, TCP."""

from __future__ import annotations

from typing import Any

from disagg_operator.ingress import Ingress, ingress_plan
from disagg_operator import names
from disagg_operator.plan import Plan


def _rule(plan: Plan, rule: Ingress) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not rule.from_anywhere:  # no `from`: every source
        out["from"] = [{"podSelector": {"matchLabels": names.selector(plan.name, role)}} for role in rule.from_roles]
        out["from"] += [dict(peer) for peer in rule.from_peers]
    if rule.ports:  # no `ports`: every port
        out["ports"] = [{"protocol": "TCP", "port": port} for port in rule.ports]
    return out


def network_policies(plan: Plan, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [{
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(plan.name, plan.namespace, pool.name, pool.role, owner),
        "spec": {
            "podSelector": {"matchLabels": names.selector(plan.name, pool.role)},
            "policyTypes": ["Ingress"],
            "ingress": [_rule(plan, rule) for rule in pool.rules],
        },
    } for pool in ingress_plan(plan)]
