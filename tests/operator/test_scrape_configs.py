"""scrape_configs.py: the Prometheus jobs equivalent to PodMonitors, field by field (table), and what
those jobs do to the targets Prometheus's pod discovery makes of the model's pods (evaluated below with
Prometheus's relabeling rules: anchored regexes, ';'-joined source labels, replace by default)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from disagg_operator import names
from disagg_operator.objects import build_objects
from disagg_operator.scrape_configs import scrape_configs
from tests.operator.builders import full_spec, plan_of
from tests.operator.cases import merged


def monitor(spec: dict[str, Any], name: str = "m-engines", namespace: str = "prod") -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


ENDPOINT = {"port": "engine"}
SELECTOR = {"matchLabels": {"app": "x"}}


def job(spec: dict[str, Any], **kw: Any) -> dict[str, Any]:
    [only] = scrape_configs([monitor(spec)], **kw)
    return only


def relabels(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return job(spec)["relabel_configs"]


@pytest.mark.parametrize(("spec", "kw", "expected"), [
    ({"selector": SELECTOR, "podMetricsEndpoints": [ENDPOINT]}, {},
     {"job_name": "podMonitor/prod/m-engines/0", "honor_labels": False,
      "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": ["prod"]}}]}),
    ({"selector": SELECTOR, "podMetricsEndpoints": [ENDPOINT]}, {"kubeconfig_file": "/k/config"},
     {"kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": ["prod"]}, "kubeconfig_file": "/k/config"}]}),
    ({"selector": SELECTOR, "namespaceSelector": {"matchNames": ["a", "b"]}, "podMetricsEndpoints": [ENDPOINT]}, {},
     {"kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": ["a", "b"]}}]}),
    ({"selector": SELECTOR, "namespaceSelector": {"any": True}, "podMetricsEndpoints": [ENDPOINT]}, {},
     {"kubernetes_sd_configs": [{"role": "pod"}]}),
    ({"selector": SELECTOR, "podMetricsEndpoints": [
        {"port": "engine", "path": "/metrics", "interval": "1s", "scrapeTimeout": "900ms", "scheme": "https"}]}, {},
     {"scrape_interval": "1s", "scrape_timeout": "900ms", "metrics_path": "/metrics", "scheme": "https"}),
    ({"selector": SELECTOR, "podMetricsEndpoints": [{"port": "engine", "tlsConfig": {
        "ca": {"secret": {"name": "m-tls", "key": "ca.crt"}}, "serverName": "m-engine.prod.svc"}}]}, {},
     {"tls_config": {"ca_file": "/etc/prometheus/secrets/m-tls/ca.crt", "server_name": "m-engine.prod.svc"}}),
    ({"selector": SELECTOR, "podMetricsEndpoints": [{"port": "engine", "tlsConfig": {
        "ca": {"secret": {"name": "m-tls", "key": "ca.crt"}}}}]}, {"secrets_dir": "/s"},
     {"tls_config": {"ca_file": "/s/m-tls/ca.crt"}}),
    ({"selector": SELECTOR, "podMetricsEndpoints": [{"port": "http", "metricRelabelings": [
        {"sourceLabels": ["__name__"], "regex": "vllm:.*", "action": "Drop"}]}]}, {},
     {"metric_relabel_configs": [{"source_labels": ["__name__"], "regex": "vllm:.*", "action": "drop"}]}),
], ids=["job", "kubeconfig", "match-names", "any-namespace", "endpoint-fields", "tls", "secrets-dir",
        "metric-relabelings"])
def test_a_monitors_fields_become_the_jobs(spec: dict[str, Any], kw: dict[str, Any], expected: dict[str, Any]) -> None:
    got = job(spec, **kw)
    assert {k: got.get(k) for k in expected} == expected
    absent = {"scrape_interval", "scrape_timeout", "metrics_path", "scheme", "tls_config", "metric_relabel_configs"}
    assert not (absent - set(expected)) & set(got)  # nothing the monitor did not say


SELECTED = [
    ({"matchLabels": {"b.io/x": "2", "a": "1"}},
     [{"action": "keep", "source_labels": ["__meta_kubernetes_pod_label_a", "__meta_kubernetes_pod_labelpresent_a"],
       "regex": "(1);true"},
      {"action": "keep", "source_labels": ["__meta_kubernetes_pod_label_b_io_x",
                                           "__meta_kubernetes_pod_labelpresent_b_io_x"], "regex": "(2);true"}]),
    ({"matchExpressions": [{"key": "k", "operator": "In", "values": ["a", "b"]}]},
     [{"action": "keep", "source_labels": ["__meta_kubernetes_pod_label_k", "__meta_kubernetes_pod_labelpresent_k"],
       "regex": "(a|b);true"}]),
    ({"matchExpressions": [{"key": "k", "operator": "NotIn", "values": ["a"]}]},
     [{"action": "drop", "source_labels": ["__meta_kubernetes_pod_label_k", "__meta_kubernetes_pod_labelpresent_k"],
       "regex": "(a);true"}]),
    ({"matchExpressions": [{"key": "k", "operator": "Exists"}]},
     [{"action": "keep", "source_labels": ["__meta_kubernetes_pod_labelpresent_k"], "regex": "true"}]),
    ({"matchExpressions": [{"key": "k", "operator": "DoesNotExist"}]},
     [{"action": "drop", "source_labels": ["__meta_kubernetes_pod_labelpresent_k"], "regex": "true"}]),
]


@pytest.mark.parametrize(("selector", "expected"), SELECTED, ids=["labels-sorted", "in", "not-in", "exists", "absent"])
def test_the_selector_becomes_keep_and_drop_rules_after_the_running_filter(
        selector: dict[str, Any], expected: list[dict[str, Any]]) -> None:
    rules = relabels({"selector": selector, "podMetricsEndpoints": [ENDPOINT]})
    assert rules[:2] == [
        {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}]
    assert rules[2:2 + len(expected)] == expected
    assert rules[2 + len(expected)] == {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                                        "regex": "engine"}


def test_target_labels_then_the_monitors_relabelings_in_snake_case() -> None:
    rules = relabels({"selector": SELECTOR, "podMetricsEndpoints": [{"port": "engine", "relabelings": [
        {"sourceLabels": ["__meta_kubernetes_pod_label_p"], "targetLabel": "pool", "action": "replace"},
        {"targetLabel": "role", "replacement": "engine", "separator": ",", "action": "Replace"}]}]})
    assert rules[4:] == [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": "prod/m-engines"},
        {"target_label": "endpoint", "replacement": "engine"},
        {"source_labels": ["__meta_kubernetes_pod_label_p"], "target_label": "pool", "action": "replace"},
        {"target_label": "role", "replacement": "engine", "separator": ",", "action": "replace"},
    ]


def endpoint(**fields: Any) -> dict[str, Any]:
    return monitor({"selector": SELECTOR, "podMetricsEndpoints": [{"port": "engine", **fields}]})


@pytest.mark.parametrize(("doc", "message"), [
    ({**endpoint(), "kind": "ServiceMonitor"}, "not a PodMonitor"),
    (monitor({"selector": SELECTOR, "podMetricsEndpoints": [ENDPOINT], "sampleLimit": 5}), "sampleLimit"),
    (endpoint(basicAuth={}), "basicAuth"),
    (endpoint(relabelings=[{"targetLabel": "a", "regex": "x", "bogus": 1}]), "bogus"),
    (endpoint(tlsConfig={"ca": {"configMap": {"name": "c", "key": "k"}}}), "Secret"),
    (endpoint(tlsConfig={"insecureSkipVerify": True}), "insecureSkipVerify"),
], ids=["kind", "spec-field", "endpoint-field", "relabel-field", "ca-config-map", "tls-field"])
def test_what_is_not_translated_is_refused_not_dropped(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scrape_configs([endpoint(), doc])


# --- what the jobs make of the model's pods ------------------------------------------------------

def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def discovered(pod: dict[str, Any], namespace: str, job_name: str) -> list[dict[str, str]]:
    """The targets of Prometheus's pod role for one pod: one per declared container port."""
    labels = pod["metadata"]["labels"]
    meta = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": "pod-1",
            "__meta_kubernetes_pod_phase": "Running", "job": job_name,
            **{f"__meta_kubernetes_pod_label_{_sanitize(k)}": v for k, v in labels.items()},
            **{f"__meta_kubernetes_pod_labelpresent_{_sanitize(k)}": "true" for k in labels}}
    return [{**meta, "__address__": f"10.0.0.1:{port['containerPort']}", "__meta_kubernetes_pod_container_name": c["name"],
             "__meta_kubernetes_pod_container_port_name": port.get("name", "")}
            for c in pod["spec"]["containers"] for port in c.get("ports", [])]


def relabel(target: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus's keep/drop/replace: None when the target is dropped; labels without __ after."""
    out = dict(target)
    for rule in rules:
        value = rule.get("separator", ";").join(out.get(s, "") for s in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep" and not match or action == "drop" and match:
            return None
        if action == "replace" and match:
            out[rule["target_label"]] = re.sub(r"\$\{?(\d+)\}?", lambda g: match.group(int(g[1])) or "",
                                               rule.get("replacement", "$1"))
    return {k: v for k, v in out.items() if not k.startswith("__")}


def test_the_jobs_scrape_every_pools_engine_and_the_decode_sidecars_with_their_labels() -> None:
    plan = plan_of(full_spec())
    objects = build_objects(plan)
    monitors = [o for o in objects if o["kind"] == "PodMonitor"]
    pods = {o["metadata"]["labels"][names.POOL]: o["spec"]["template"] for o in objects if o["kind"] == "Deployment"}
    found: dict[tuple[str, str], dict[str, str]] = {}
    for j in scrape_configs(monitors):
        for pool, pod in pods.items():
            for target in discovered(pod, "prod", j["job_name"]):
                if (labels := relabel(target, j["relabel_configs"])) is not None:
                    found[(pool, labels["role"])] = labels
    assert set(found) == {("prefill", "engine"), ("decode", "engine"), ("render", "engine"), ("derender", "engine"),
                          ("decode", "sidecar")}
    for (pool, role), labels in found.items():
        pod_labels = pods[pool]["metadata"]["labels"]
        assert labels["model"] == "qwen3-8b" and labels["pool"] == pool == pod_labels[names.POOL]
        assert labels["revision"] == pod_labels[names.REVISION] and labels["namespace"] == "prod"
        assert labels["endpoint"] == {"engine": "engine", "sidecar": "http"}[role]
        assert labels["job"] == f"prod/qwen3-8b-{role}s"
    # A pod of another model in the namespace is not scraped.
    other = {**pods["decode"], "metadata": {"labels": {**pods["decode"]["metadata"]["labels"], names.INSTANCE: "other"}}}
    assert all(relabel(t, j["relabel_configs"]) is None for j in scrape_configs(monitors)
               for t in discovered(other, "prod", j["job_name"]))


def test_tls_engines_are_scraped_over_https_with_the_models_ca_as_a_mounted_file() -> None:
    plan = plan_of(merged(full_spec(), {"security": {"tls": {"secretName": "engine-tls"}}}))
    jobs = {j["job_name"]: j for j in scrape_configs([o for o in build_objects(plan) if o["kind"] == "PodMonitor"],
                                                     secrets_dir="/etc/s")}
    engines, sidecars = jobs["podMonitor/prod/qwen3-8b-engines/0"], jobs["podMonitor/prod/qwen3-8b-sidecars/0"]
    assert engines["scheme"] == "https"
    assert engines["tls_config"] == {"ca_file": "/etc/s/engine-tls/ca.crt",
                                     "server_name": names.engine_tls_name("qwen3-8b", "prod")}
    assert "scheme" not in sidecars and "tls_config" not in sidecars  # the client port stays plain HTTP
