"""Prometheus ``scrape_configs`` equivalent to PodMonitors (pure), for a Prometheus that no Prometheus
Operator configures: the jobs that operator generates from a PodMonitor (its ``promcfg.go``,
``generatePodMonitorConfig``), for the fields the model's monitors use (objects/monitors.py):

- one job per endpoint, ``podMonitor/<namespace>/<name>/<index>``, discovering pods
  (``kubernetes_sd_configs`` role ``pod``) in the monitor's namespace (or its ``namespaceSelector``);
- keep-relabels for the selector (each ``matchLabels`` pair, sorted, needs the label present with that
  value; ``matchExpressions`` as In/NotIn/Exists/DoesNotExist), pods neither Failed nor Succeeded, and
  the container port named by the endpoint;
- the labels ``namespace``, ``container``, ``pod``, ``job`` (``<namespace>/<name>``) and ``endpoint``
  (the port), then the endpoint's own relabelings (``model``, ``pool``, ``role``, ``revision``) and
  metric relabelings, camelCase fields in Prometheus's snake_case;
- ``scrape_interval``, ``metrics_path``, ``scheme``, and a ``tls_config`` whose CA is a file: a Secret
  key ``<secrets_dir>/<secret>/<key>``, where the Prometheus Operator mounts ``spec.secrets``.

Left out: the Prometheus Operator's sharding relabels (one Prometheus scrapes everything) and the
fields the model's monitors never set (a ``ValueError`` names them, so nothing is dropped silently).
``kubeconfig_file`` points the discovery at a cluster from outside it; unset, Prometheus uses its pod's
service account.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

KIND = ("monitoring.coreos.com/v1", "PodMonitor")
SECRETS_DIR = "/etc/prometheus/secrets"
_RELABEL_FIELDS = {"sourceLabels": "source_labels", "separator": "separator", "targetLabel": "target_label",
                   "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}
_SPEC_FIELDS = {"selector", "namespaceSelector", "podMetricsEndpoints"}
_ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "scheme", "tlsConfig", "relabelings",
                    "metricRelabelings"}


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _label(name: str) -> list[str]:
    return [f"__meta_kubernetes_pod_label_{_sanitize(name)}", f"__meta_kubernetes_pod_labelpresent_{_sanitize(name)}"]


def _relabel(rule: Mapping[str, Any]) -> dict[str, Any]:
    if unknown := set(rule) - set(_RELABEL_FIELDS):
        raise ValueError(f"relabeling fields not translated: {sorted(unknown)}")
    out = {_RELABEL_FIELDS[k]: v for k, v in rule.items()}
    if "action" in out:
        out["action"] = str(out["action"]).lower()
    return out


def _selector(selector: Mapping[str, Any]) -> list[dict[str, Any]]:
    rules = [{"action": "keep", "source_labels": _label(k), "regex": f"({v});true"}
             for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for exp in selector.get("matchExpressions") or []:
        key, op, values = exp["key"], exp["operator"], "|".join(exp.get("values") or [])
        present = [_label(key)[1]]
        rules.append({
            "In": {"action": "keep", "source_labels": _label(key), "regex": f"({values});true"},
            "NotIn": {"action": "drop", "source_labels": _label(key), "regex": f"({values});true"},
            "Exists": {"action": "keep", "source_labels": present, "regex": "true"},
            "DoesNotExist": {"action": "drop", "source_labels": present, "regex": "true"},
        }[op])
    return rules


def _tls(tls: Mapping[str, Any], secrets_dir: str) -> dict[str, Any]:
    if unknown := set(tls) - {"ca", "serverName"}:
        raise ValueError(f"tlsConfig fields not translated: {sorted(unknown)}")
    out: dict[str, Any] = {}
    if "ca" in tls:
        secret = tls["ca"].get("secret")
        if secret is None:
            raise ValueError("tlsConfig.ca: only a Secret key is translated")
        out["ca_file"] = f"{secrets_dir}/{secret['name']}/{secret['key']}"
    if "serverName" in tls:
        out["server_name"] = tls["serverName"]
    return out


def _job(monitor: Mapping[str, Any], index: int, endpoint: Mapping[str, Any], kubeconfig_file: str | None,
         secrets_dir: str) -> dict[str, Any]:
    if unknown := set(endpoint) - _ENDPOINT_FIELDS:
        raise ValueError(f"podMetricsEndpoints fields not translated: {sorted(unknown)}")
    meta, spec = monitor["metadata"], monitor["spec"]
    ns, name, port = meta["namespace"], meta["name"], endpoint.get("port")
    selector = spec.get("namespaceSelector") or {}
    sd: dict[str, Any] = {"role": "pod"}
    if not selector.get("any"):  # any: every namespace; else matchNames, by default the monitor's own
        sd["namespaces"] = {"names": list(selector.get("matchNames") or [ns])}
    if kubeconfig_file:
        sd["kubeconfig_file"] = kubeconfig_file
    job: dict[str, Any] = {"job_name": f"podMonitor/{ns}/{name}/{index}", "honor_labels": False,
                           "kubernetes_sd_configs": [sd]}
    for field, key in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout"),
                       ("path", "metrics_path"), ("scheme", "scheme")):
        if field in endpoint:
            job[key] = endpoint[field]
    if "tlsConfig" in endpoint:
        job["tls_config"] = _tls(endpoint["tlsConfig"], secrets_dir)
    job["relabel_configs"] = [
        {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        *_selector(spec["selector"]),
        *([{"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": port}]
          if port else []),
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{ns}/{name}"},
        *([{"target_label": "endpoint", "replacement": port}] if port else []),
        *(_relabel(r) for r in endpoint.get("relabelings") or []),
    ]
    if endpoint.get("metricRelabelings"):
        job["metric_relabel_configs"] = [_relabel(r) for r in endpoint["metricRelabelings"]]
    return job


def scrape_configs(monitors: Iterable[Mapping[str, Any]], *, kubeconfig_file: str | None = None,
                   secrets_dir: str = SECRETS_DIR) -> list[dict[str, Any]]:
    """The ``scrape_configs`` of ``monitors`` (PodMonitor objects, in order; other objects are refused)."""
    jobs = []
    for monitor in monitors:
        if (monitor.get("apiVersion"), monitor.get("kind")) != KIND:
            raise ValueError(f"not a PodMonitor: {monitor.get('apiVersion')} {monitor.get('kind')}")
        if unknown := set(monitor["spec"]) - _SPEC_FIELDS:
            raise ValueError(f"PodMonitor {monitor['metadata']['name']}: spec fields not translated: {sorted(unknown)}")
        jobs += [_job(monitor, i, ep, kubeconfig_file, secrets_dir)
                 for i, ep in enumerate(monitor["spec"]["podMetricsEndpoints"])]
    return jobs
