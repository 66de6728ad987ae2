"""Services: `<name>` for clients (→ decode sidecars), headless `<name>-prefill` for discovery,
`<name>-render` and `<name>-derender` for the sidecar's render/derender legs."""

from __future__ import annotations

from typing import Any

from disagg_operator import names
from disagg_operator.names import Role
from disagg_operator.plan import Plan


def _service(plan: Plan, name: str, component: str, selector_role: Role, ports: list[dict[str, Any]],
             owner: dict[str, Any] | None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata(plan.name, plan.namespace, name, component, owner),
        "spec": {"selector": names.selector(plan.name, selector_role), "ports": ports, **spec},
    }


def _engine_port(plan: Plan) -> dict[str, Any]:
    return {"name": names.ENGINE_PORT, "port": plan.spec.engine.port, "targetPort": names.ENGINE_PORT,
            "protocol": "TCP"}


def services(plan: Plan, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = [_service(
        plan, names.client_service(plan.name), names.CLIENT_COMPONENT, Role.DECODE,
        [{"name": names.HTTP_PORT, "port": plan.service_port, "targetPort": names.HTTP_PORT, "protocol": "TCP"}],
        owner, type=plan.service_type,
    )]
    prefill = plan.pool(Role.PREFILL)
    if prefill is not None:
        ports = [_engine_port(plan)] + [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                                        for name, port in plan.side_channel_ports(prefill)]
        # Headless: the sidecar picks a prefill pod itself (EndpointSlices), never a kube-proxy VIP.
        out.append(_service(plan, names.pool_service(plan.name, Role.PREFILL), Role.PREFILL, Role.PREFILL,
                            ports, owner, clusterIP="None"))
        if plan.kv_revision is not None:  # what the sidecars discover: the prefill pods of their KV revision
            revision = _service(plan, names.prefill_revision_service(plan.name, plan.kv_revision), Role.PREFILL,
                                Role.PREFILL, ports, owner, clusterIP="None")
            revision["spec"]["selector"][names.KV_REVISION] = plan.kv_revision
            revision["metadata"]["labels"][names.KV_REVISION] = plan.kv_revision
            out.append(revision)
    if plan.render_tier:
        out.append(_service(plan, names.pool_service(plan.name, Role.RENDER), Role.RENDER, Role.RENDER,
                            [_engine_port(plan)], owner))
        # Always present with a render tier; it selects the render pods while they also derender.
        derender_pods = Role.RENDER if plan.derender_shared else Role.DERENDER
        out.append(_service(plan, names.pool_service(plan.name, Role.DERENDER), Role.DERENDER, derender_pods,
                            [_engine_port(plan)], owner))
    return out
