"""The sidecar's identity: read EndpointSlices in its own namespace (prefill discovery), nothing more.

Only made when a prefill pool exists; without one the sidecar needs no API access at all.
"""

from __future__ import annotations

from typing import Any

from disagg_operator import names
from disagg_operator.plan import Plan

SIDECAR_RULES = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                  "verbs": ["get", "list", "watch"]}]


def rbac(plan: Plan, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    if not plan.disaggregated:
        return []
    account = names.sidecar_account(plan.name)

    def meta() -> dict[str, Any]:
        return names.metadata(plan.name, plan.namespace, account, names.SIDECAR_COMPONENT, owner)

    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(),
         "automountServiceAccountToken": False},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(),
         "rules": [dict(r) for r in SIDECAR_RULES]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": plan.namespace}]},
    ]
