"""router.inferencePool against the real control plane with the InferencePool CRD installed
(tests/operator/crds/): the pool and the role labels appear exactly when enabled, are accepted by
the API server's validation, survive drift, and go away when disabled."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from disagg_operator import names
from tests.harness.cluster import Cluster
from tests.harness.operator import OperatorProcess
from tests.operator.pool_cluster import enable, install_pool_crd, member_roles, pool, template_labels
from tests.operator.test_cluster import READY_TIMEOUT, example, expected_plan, get, wait_ready

pytestmark = pytest.mark.cluster

PICKER = {"name": "qwen3-8b-epp", "port": 9002, "failureMode": "FailOpen"}


@pytest.fixture(scope="module")
def pool_crd(cluster: Cluster) -> Iterator[None]:
    install_pool_crd(cluster)  # before the operator starts, so it watches InferencePools
    yield


@pytest.fixture(scope="module")
def operator_with_pools(pool_crd: None, operator: OperatorProcess) -> OperatorProcess:
    return operator


def apply_doc(cluster: Cluster, ns: str, doc: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))


def test_pool_and_labels_exactly_when_enabled_restored_after_drift_removed_when_disabled(
        cluster: Cluster, operator_with_pools: OperatorProcess, ns: str) -> None:
    op = operator_with_pools
    doc = enable(example(), endpointPicker=PICKER)
    apply_doc(cluster, ns, doc)
    dm = wait_ready(cluster, op, ns, "qwen3-8b")
    port = expected_plan(doc, ns).sidecar.port

    live = cluster.wait_for(lambda: pool(cluster, ns, "qwen3-8b"), "the InferencePool", timeout=90)
    assert live["spec"]["targetPorts"] == [{"number": port}]
    assert live["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "qwen3-8b-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailOpen"}
    ref = live["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
        "DisaggregatedModel", "qwen3-8b", dm["metadata"]["uid"], True)
    selector = live["spec"]["selector"]["matchLabels"]
    # The live pods the pool selects: decode and prefill, each with its llm-d role label.
    cluster.wait_for(lambda: member_roles(cluster, ns, selector) == {"decode", "prefill"},
                     "decode and prefill pods (only) in the pool", timeout=READY_TIMEOUT)
    for role in ("decode", "prefill"):
        assert member_roles(cluster, ns, {**selector, names.LLM_D_ROLE: role}) == {role}
    assert cluster.wait_for(lambda: get(cluster, ns, "dm", "qwen3-8b")["status"].get("inferencePool"),
                            "status.inferencePool", timeout=60) == {
        "name": "qwen3-8b", "targetPort": port, "selector": selector}
    config = get(cluster, ns, "configmap", names.config_map("qwen3-8b"))["data"]["sidecar.yaml"]
    assert "trust_prefiller_header: true" in config and f"pool_port: {port}" in config

    # Drift: deleted → recreated; edited → our fields restored.
    uid = live["metadata"]["uid"]
    cluster.kubectl("delete", "inferencepool", "qwen3-8b", "-n", ns, "--wait=false")
    cluster.wait_for(lambda: (pool(cluster, ns, "qwen3-8b") or {}).get("metadata", {}).get("uid") not in (None, uid),
                     "the InferencePool recreated", timeout=90)
    cluster.kubectl("patch", "inferencepool", "qwen3-8b", "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"targetPorts": [{"number": 9999}]}}))
    cluster.wait_for(lambda: pool(cluster, ns, "qwen3-8b")["spec"]["targetPorts"] == [{"number": port}],
                     "the InferencePool's target port restored", timeout=90)

    # Disabled: the pool, the labels and the status entry go away; Deployment selectors never changed.
    selectors = {d: get(cluster, ns, "deployment", f"qwen3-8b-{d}")["spec"]["selector"] for d in ("decode", "prefill")}
    doc["spec"]["router"]["inferencePool"] = {"enabled": False}
    apply_doc(cluster, ns, doc)
    cluster.wait_for(lambda: pool(cluster, ns, "qwen3-8b") is None, "the InferencePool pruned", timeout=90)
    cluster.wait_for(lambda: all(names.LLM_D_ROLE not in labels and names.INFERENCE_POOL not in labels
                                 for labels in template_labels(cluster, ns, "qwen3-8b").values()),
                     "the role labels removed from every pod template", timeout=90)
    cluster.wait_for(lambda: "inferencePool" not in get(cluster, ns, "dm", "qwen3-8b")["status"],
                     "status.inferencePool removed", timeout=90)
    assert {d: get(cluster, ns, "deployment", f"qwen3-8b-{d}")["spec"]["selector"]
            for d in ("decode", "prefill")} == selectors


def test_the_api_server_validates_what_the_operator_writes(cluster: Cluster, pool_crd: None, ns: str) -> None:
    """The test CRD rejects a pool our objects must never resemble (no target port), so acceptance above
    is a real check."""
    bad = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "bad"},
           "spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []}}
    out = cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(bad), check=False)
    assert out.returncode != 0 and "targetPorts" in out.stderr
