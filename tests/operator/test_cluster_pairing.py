"""KV-revision pairing against the real control plane: the Service each decode pod's sidecar
discovers prefill pods through lists exactly the prefill pods of its KV revision (the EndpointSlices
the sidecar reads), a KV-relevant change makes a new one, and the old one goes once decode rolled."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from disagg_operator import names
from tests.harness.cluster import Cluster
from tests.harness.operator import OperatorProcess
from tests.operator.test_cluster import READY_TIMEOUT, example, expected_plan, get

pytestmark = pytest.mark.cluster


def slice_pods(cluster: Cluster, ns: str, service: str) -> set[str]:
    """The ready pods the Service's EndpointSlices list (what the sidecar's discovery reads)."""
    out = cluster.kubectl("get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={service}", "-o", "json")
    return {e["targetRef"]["name"] for s in json.loads(out.stdout)["items"] for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready") and e.get("targetRef")}


def prefill_pods(cluster: Cluster, ns: str, revision: str) -> set[str]:
    out = cluster.kubectl("get", "pods", "-n", ns, "-l",
                          f"{names.INSTANCE}=qwen3-8b,{names.POOL}=prefill,{names.KV_REVISION}={revision}", "-o", "json")
    return {p["metadata"]["name"] for p in json.loads(out.stdout)["items"] if not p["metadata"].get("deletionTimestamp")}


def discovered(cluster: Cluster, ns: str) -> str:
    config = yaml.safe_load(get(cluster, ns, "configmap", names.config_map("qwen3-8b"))["data"]["sidecar.yaml"])
    return config["prefill"]["discovery"]["service"]


def services(cluster: Cluster, ns: str) -> set[str]:
    out = cluster.kubectl("get", "services", "-n", ns, "-l", f"{names.INSTANCE}=qwen3-8b", "-o", "json")
    return {s["metadata"]["name"] for s in json.loads(out.stdout)["items"]}


def test_sidecars_see_only_prefill_pods_of_their_revision_across_a_rollout(
        cluster: Cluster, operator: OperatorProcess, ns: str) -> None:
    doc: dict[str, Any] = example()
    doc["spec"]["pools"]["render"] = {"replicas": 0}
    doc["spec"]["pools"]["prefill"]["replicas"] = 2
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
    old = expected_plan(doc, ns).kv_revision
    assert old is not None
    old_service = names.prefill_revision_service("qwen3-8b", old)
    cluster.wait_for(lambda: discovered(cluster, ns) == old_service, "the sidecar config naming the revision's Service",
                     timeout=120)
    cluster.wait_for(lambda: len(prefill_pods(cluster, ns, old)) == 2
                     and slice_pods(cluster, ns, old_service) == prefill_pods(cluster, ns, old),
                     "the revision's Service listing both prefill pods", timeout=READY_TIMEOUT)

    # A KV-relevant change: a new revision, its own Service, listing only the new prefill pods.
    doc["spec"]["model"]["maxModelLen"] = 8192
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
    new = expected_plan(doc, ns).kv_revision
    assert new is not None and new != old
    new_service = names.prefill_revision_service("qwen3-8b", new)
    cluster.wait_for(lambda: discovered(cluster, ns) == new_service, "the sidecar config naming the new Service",
                     timeout=120)

    def paired() -> bool:
        listed = slice_pods(cluster, ns, new_service)
        assert not listed & prefill_pods(cluster, ns, old), "an old prefill pod in the new revision's Service"
        assert not slice_pods(cluster, ns, old_service) & prefill_pods(cluster, ns, new), "a new pod in the old one's"
        return len(listed) == 2 and listed == prefill_pods(cluster, ns, new)
    cluster.wait_for(paired, "the new revision's Service listing the new prefill pods", timeout=READY_TIMEOUT)
    # The old revision's Service goes once no decode pod of that revision remains.
    cluster.wait_for(lambda: old_service not in services(cluster, ns), "the old revision's Service pruned",
                     timeout=READY_TIMEOUT)
    assert new_service in services(cluster, ns)
