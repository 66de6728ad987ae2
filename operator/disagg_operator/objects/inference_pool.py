"""The InferencePool (Gateway API Inference Extension) an llm-d endpoint picker routes with (docs/llm-d.md).

Members are the model's decode and prefill pods (their templates carry the selector's labels only
while it is enabled, see objects/deployments.py); the target port is the sidecar's, which decode
pods serve. Prefill pods have no sidecar: a picker names them at that port in
``x-prefiller-host-port``, and the sidecar maps ``<prefill pod>:<port>`` to the prefill engine
(its ``prefill.pool_port``).
"""

from __future__ import annotations

from typing import Any

from disagg_operator import names
from disagg_operator.kinds import INFERENCE_POOL
from disagg_operator.plan import Plan


def inference_pools(plan: Plan, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    pool = plan.spec.router.inference_pool
    if not pool.enabled:
        return []
    spec: dict[str, Any] = {
        "selector": {"matchLabels": names.inference_pool_selector(plan.name)},
        "targetPorts": [{"number": plan.sidecar.port}],
    }
    picker = pool.endpoint_picker
    if picker is not None:
        spec["endpointPickerRef"] = {"kind": "Service", "name": picker.name, "port": {"number": picker.port},
                                     "failureMode": picker.failure_mode}
    return [{
        "apiVersion": INFERENCE_POOL.api_version,
        "kind": INFERENCE_POOL.kind,
        "metadata": names.metadata(plan.name, plan.namespace, plan.name, names.CLIENT_COMPONENT, owner),
        "spec": spec,
    }]
