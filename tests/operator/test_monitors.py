"""PodMonitors (objects/monitors.py): what they select, the labels they give every series, the switch."""

from __future__ import annotations

from typing import Any

import pytest

from disagg_operator import names
from disagg_operator.objects import build_objects
from disagg_operator.plan import Plan
from tests.operator.builders import full_spec, plan_of
from tests.operator.cases import merged


def monitors(plan: Plan) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in build_objects(plan) if o["kind"] == "PodMonitor"}


def templates(plan: Plan) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["labels"][names.POOL]: o["spec"]["template"]
            for o in build_objects(plan) if o["kind"] == "Deployment"}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_every_pod_carries_its_pools_revision() -> None:
    plan = plan_of(full_spec())
    for pool in plan.pools:
        labels = templates(plan)[str(pool.role)]["metadata"]["labels"]
        assert labels[names.REVISION] == pool.config_hash
        assert names.REVISION not in names.selector(plan.name, pool.role)  # selectors stay immutable


def test_engines_of_every_pool_and_sidecars_of_decode_pods_are_scraped() -> None:
    plan = plan_of(full_spec())
    found = monitors(plan)
    assert set(found) == {"qwen3-8b-engines", "qwen3-8b-sidecars"}
    pods = {pool: t["metadata"]["labels"] for pool, t in templates(plan).items()}
    engines, sidecars = found["qwen3-8b-engines"]["spec"], found["qwen3-8b-sidecars"]["spec"]
    assert {p for p, labels in pods.items() if selects(engines["selector"]["matchLabels"], labels)} == {
        "prefill", "decode", "render", "derender"}
    assert {p for p, labels in pods.items() if selects(sidecars["selector"]["matchLabels"], labels)} == {"decode"}
    # The ports they name exist on the selected pods' containers.
    ports = {p: {port["name"] for c in t["spec"]["containers"] for port in c.get("ports", [])}
             for p, t in templates(plan).items()}
    assert all(names.ENGINE_PORT in ports[p] for p in ports)
    assert [e["port"] for e in engines["podMetricsEndpoints"]] == [names.ENGINE_PORT]
    assert [e["port"] for e in sidecars["podMetricsEndpoints"]] == [names.HTTP_PORT] and names.HTTP_PORT in ports["decode"]
    for spec in (engines, sidecars):
        (endpoint,) = spec["podMetricsEndpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"


@pytest.mark.parametrize("monitor,role", [("qwen3-8b-engines", "engine"), ("qwen3-8b-sidecars", "sidecar")])
def test_series_get_model_pool_role_and_revision_labels(monitor: str, role: str) -> None:
    (endpoint,) = monitors(plan_of(full_spec()))[monitor]["spec"]["podMetricsEndpoints"]
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["model"]["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
    assert relabel["pool"]["sourceLabels"] == ["__meta_kubernetes_pod_label_disagg_dev_pool"]
    assert relabel["revision"]["sourceLabels"] == ["__meta_kubernetes_pod_label_disagg_dev_revision"]
    assert relabel["role"]["replacement"] == role and "sourceLabels" not in relabel["role"]


def test_sidecars_do_not_repeat_the_engines_series() -> None:
    (endpoint,) = monitors(plan_of(full_spec()))["qwen3-8b-sidecars"]["spec"]["podMetricsEndpoints"]
    assert endpoint["metricRelabelings"] == [{"sourceLabels": ["__name__"], "regex": "vllm:.*", "action": "drop"}]


def test_tls_engines_are_scraped_over_https_against_the_models_ca() -> None:
    spec = merged(full_spec(), {"security": {"tls": {"secretName": "engine-tls"}}})
    (endpoint,) = monitors(plan_of(spec))["qwen3-8b-engines"]["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": "engine-tls", "key": "ca.crt"}},
                                     "serverName": names.engine_tls_name("qwen3-8b", "prod")}


@pytest.mark.parametrize("setting,count", [("auto", 2), ("true", 2), ("false", 0)])
def test_the_switch(setting: str, count: int) -> None:
    spec = merged(full_spec(), {"monitoring": {"podMonitors": setting, "interval": "30s"}})
    found = monitors(plan_of(spec))
    assert len(found) == count
    assert all(e["interval"] == "30s" for m in found.values() for e in m["spec"]["podMetricsEndpoints"])


@pytest.mark.parametrize("setting", ["auto", "true"])
def test_status_says_which_monitors_exist_and_why_not(setting: str) -> None:
    from disagg_operator.kinds import POD_MONITOR
    from disagg_operator.status import compute_status

    plan = plan_of(merged(full_spec(), {"monitoring": {"podMonitors": setting}}))
    served = compute_status(plan, {}, generation=1, previous={}, now="2026-01-01T00:00:00Z")
    assert served["monitoring"] == {"podMonitors": ["qwen3-8b-engines", "qwen3-8b-sidecars"]}
    missing = compute_status(plan, {}, generation=1, previous={}, now="2026-01-01T00:00:00Z",
                             unavailable=(POD_MONITOR.crd,))
    assert missing["monitoring"] is None
    conditions = {c["type"]: c for c in missing["conditions"]}
    if setting == "true":  # asked for: the model says what is missing
        assert (conditions["PodMonitorsReady"]["status"], conditions["PodMonitorsReady"]["reason"]) == (
            "False", "CRDNotInstalled")
        assert POD_MONITOR.crd in conditions["PodMonitorsReady"]["message"]
    else:  # auto: nothing to report
        assert "PodMonitorsReady" not in conditions


def sidecar_file(plan: Plan) -> dict[str, Any]:
    import yaml

    from disagg_operator.objects.configmaps import SIDECAR_CONFIG_FILE

    (config_map,) = [o for o in build_objects(plan) if o["kind"] == "ConfigMap" and SIDECAR_CONFIG_FILE in o["data"]]
    return yaml.safe_load(config_map["data"][SIDECAR_CONFIG_FILE])


def test_tracing_points_the_sidecars_at_the_otlp_endpoint() -> None:
    from disagg_sidecar.config import SidecarConfig

    spec = merged(full_spec(), {"monitoring": {"tracing": {"otlpEndpoint": "http://otel.monitoring.svc:4318",
                                                           "sampleRatio": 0.25}}})
    plan = plan_of(spec)
    written = sidecar_file(plan)
    assert plan.kv_revision is not None
    assert written["tracing"] == {"otlp_endpoint": "http://otel.monitoring.svc:4318", "sample_ratio": 0.25,
                                  "resource_attributes": {"disagg.pool": "decode", "disagg.model": "qwen3-8b",
                                                          "k8s.namespace.name": "prod",
                                                          "disagg.kv_revision": plan.kv_revision}}
    assert SidecarConfig.model_validate(written).tracing is not None  # the sidecar reads what was written
    assert "tracing" not in sidecar_file(plan_of(full_spec())), "off unless asked for"


@pytest.mark.parametrize("tracing,problem", [
    ({"otlpEndpoint": "http://otel.monitoring.svc:4318", "sampleRatio": 1.5}, "sampleRatio must be between 0 and 1"),
    ({"otlpEndpoint": "http://otel.monitoring.svc"}, "otlpEndpoint"),  # the sidecar needs the port
    ({"otlpEndpoint": "file:///spans"}, "otlpEndpoint"),
])
def test_a_tracing_spec_the_sidecar_cannot_use_is_refused(tracing: dict[str, Any], problem: str) -> None:
    from disagg_operator.manifest import parse_spec
    from disagg_operator.spec import SpecError

    with pytest.raises(SpecError, match=problem):
        parse_spec(merged(full_spec(), {"monitoring": {"tracing": tracing}}))
