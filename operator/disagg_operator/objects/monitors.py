"""PodMonitors (monitoring.coreos.com/v1) for a model's pods: every pool's vLLM ``/metrics`` and the
decode pods' sidecars' ``/metrics`` (spec.monitoring.podMonitors; docs/autoscaling.md).

Every series gets the labels a dashboard and the planner's Prometheus queries group by: ``model``
(the DisaggregatedModel), ``pool`` (prefill, decode, render, derender), ``role`` (engine or sidecar)
and ``revision`` (the pool's configuration hash, ``names.REVISION`` on every pod), beside the
``namespace`` and ``pod`` labels Prometheus adds. With ``security.tls`` the engines are scraped over
HTTPS, verified against the model's CA as the sidecar verifies them.
"""

from __future__ import annotations

from typing import Any

from disagg_operator import names
from disagg_operator.kinds import POD_MONITOR
from disagg_operator.names import Role
from disagg_operator.plan import Plan
from disagg_sidecar import wire

ENGINE_ROLE = "engine"
SIDECAR_ROLE = "sidecar"


def _label(pod_label: str) -> str:
    """The Prometheus meta label of a pod label (non-alphanumerics become _)."""
    return "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in pod_label)


def _relabelings(role: str) -> list[dict[str, Any]]:
    copy = [(names.INSTANCE, "model"), (names.POOL, "pool"), (names.REVISION, "revision")]
    return [
        *({"sourceLabels": [_label(src)], "targetLabel": target, "action": "replace"} for src, target in copy),
        {"targetLabel": "role", "replacement": role, "action": "replace"},
    ]


def _endpoint(plan: Plan, port: str, role: str) -> dict[str, Any]:
    return {"port": port, "path": wire.METRICS, "interval": plan.spec.monitoring.interval,
            "relabelings": _relabelings(role)}


def enabled(plan: Plan) -> bool:
    return plan.spec.monitoring.pod_monitors != "false"


def pod_monitors(plan: Plan, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    if not enabled(plan):
        return []
    engines = _endpoint(plan, names.ENGINE_PORT, ENGINE_ROLE)
    if (tls := plan.spec.security.tls) is not None:
        engines |= {"scheme": "https", "tlsConfig": {
            "ca": {"secret": {"name": tls.secret_name, "key": "ca.crt"}},
            "serverName": names.engine_tls_name(plan.name, plan.namespace)}}
    sidecars = _endpoint(plan, names.HTTP_PORT, SIDECAR_ROLE)
    # With metrics.include_engine the sidecar repeats its engine's families: those come from the engine.
    sidecars["metricRelabelings"] = [{"sourceLabels": ["__name__"], "regex": "vllm:.*", "action": "drop"}]

    def monitor(name: str, selector: dict[str, str], endpoint: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": POD_MONITOR.api_version, "kind": POD_MONITOR.kind,
            "metadata": names.metadata(plan.name, plan.namespace, name, names.MONITORING_COMPONENT, owner),
            "spec": {"selector": {"matchLabels": selector}, "podMetricsEndpoints": [endpoint]},
        }

    model_pods = {names.NAME: names.APP, names.INSTANCE: plan.name}
    return [
        monitor(names.engine_monitor(plan.name), model_pods, engines),
        monitor(names.sidecar_monitor(plan.name), names.selector(plan.name, Role.DECODE), sidecars),
    ]

