"""spec.monitoring.podMonitors against the real control plane with the PodMonitor CRD installed
(tests/operator/crds/): the monitors appear by default (auto), are accepted by the API server's
schema, select the pods the Deployments run, are restored after drift and pruned when turned off."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from disagg_operator import names
from tests.harness.cluster import Cluster
from tests.harness.operator import OperatorProcess
from tests.operator.cases import merged
from tests.operator.conftest import running_operator
from tests.operator.monitor_cluster import install_monitor_crd, monitors, remove_monitor_crd
from tests.operator.test_cluster import example, get

pytestmark = pytest.mark.cluster

SMALL = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "render": {"replicas": 1}}


@pytest.fixture(scope="module")
def operator_with_monitors(cluster: Cluster, crd_installed, tmp_path_factory: pytest.TempPathFactory  # type: ignore[no-untyped-def]
                           ) -> Iterator[OperatorProcess]:
    install_monitor_crd(cluster)  # before the operator starts, so it watches PodMonitors
    try:
        yield from running_operator(cluster, tmp_path_factory)
    finally:
        remove_monitor_crd(cluster)  # the other modules' operators run without it


def apply_doc(cluster: Cluster, ns: str, doc: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))


def pods_of(cluster: Cluster, ns: str, selector: dict[str, str]) -> list[dict[str, Any]]:
    query = ",".join(f"{k}={v}" for k, v in selector.items())
    return json.loads(cluster.kubectl("get", "pods", "-n", ns, "-l", query, "-o", "json").stdout)["items"]


def test_monitors_select_every_pool_with_its_revision_restored_and_pruned(
        cluster: Cluster, operator_with_monitors: OperatorProcess, ns: str) -> None:
    doc = example()
    doc["spec"]["pools"] = merged(doc["spec"]["pools"], SMALL)
    apply_doc(cluster, ns, doc)
    found = cluster.wait_for(lambda: len(monitors(cluster, ns)) == 2 and monitors(cluster, ns),
                             "the two PodMonitors", timeout=120)
    engines, sidecars = found["qwen3-8b-engines"], found["qwen3-8b-sidecars"]
    dm = get(cluster, ns, "dm", "qwen3-8b")
    for m in (engines, sidecars):
        ref = m["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("DisaggregatedModel", dm["metadata"]["uid"], True)
    # The pods the monitors select, as the API server lists them: every pool's, and decode's for the sidecars.
    def pools(monitor: dict[str, Any]) -> set[str]:
        return {p["metadata"]["labels"][names.POOL] for p in pods_of(cluster, ns, monitor["spec"]["selector"]["matchLabels"])}
    cluster.wait_for(lambda: pools(engines) == {"prefill", "decode", "render"}, "engine pods of every pool", timeout=180)
    assert pools(sidecars) == {"decode"}
    # Every pod carries its pool's revision: the hash the status reports for that pool.
    status_pools = cluster.wait_for(lambda: get(cluster, ns, "dm", "qwen3-8b").get("status", {}).get("pools"),
                                    "status.pools", timeout=120)
    for pod in pods_of(cluster, ns, engines["spec"]["selector"]["matchLabels"]):
        labels = pod["metadata"]["labels"]
        assert labels[names.REVISION] == status_pools[labels[names.POOL]]["configHash"]
    (endpoint,) = engines["spec"]["podMetricsEndpoints"]
    assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"model", "pool", "role", "revision"}
    assert cluster.wait_for(lambda: get(cluster, ns, "dm", "qwen3-8b")["status"].get("monitoring"),
                            "status.monitoring", timeout=60) == {"podMonitors": ["qwen3-8b-engines", "qwen3-8b-sidecars"]}

    # Drift: an edited endpoint is put back.
    cluster.kubectl("patch", "podmonitor", "qwen3-8b-engines", "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"podMetricsEndpoints": [{"port": "other"}]}}))
    cluster.wait_for(lambda: monitors(cluster, ns)["qwen3-8b-engines"]["spec"]["podMetricsEndpoints"][0]["port"]
                     == names.ENGINE_PORT, "the engines' monitor restored", timeout=90)

    # Turned off: both pruned, the status entry removed.
    doc["spec"]["monitoring"] = {"podMonitors": "false"}
    apply_doc(cluster, ns, doc)
    cluster.wait_for(lambda: monitors(cluster, ns) == {}, "the PodMonitors pruned", timeout=90)
    cluster.wait_for(lambda: "monitoring" not in get(cluster, ns, "dm", "qwen3-8b")["status"],
                     "status.monitoring removed", timeout=90)


def test_the_api_server_validates_what_the_operator_writes(cluster: Cluster, operator_with_monitors: OperatorProcess,
                                                          ns: str) -> None:
    """The test CRD refuses a monitor ours must never resemble (no selector), so acceptance above is a check."""
    bad = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "bad"},
           "spec": {"podMetricsEndpoints": [{"port": "engine"}]}}
    out = cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(bad), check=False)
    assert out.returncode != 0 and "selector" in out.stderr
