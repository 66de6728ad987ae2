"""An operator restart writes nothing: its resume finds every child and the status as they should
be. Its own module: the operator it restarts must be the only one reconciling the model (the
cluster-wide operator of test_cluster.py's other tests would write the same status beside it, each
from its own view).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg_operator import names
from tests.harness.cluster import Cluster
from tests.harness.operator import OperatorProcess
from tests.operator.cases import base
from tests.operator.test_cluster import (
    EXAMPLE,
    KINDS,
    READY_TIMEOUT,
    apply,
    children,
    condition,
    get,
    model,
    wait_ready,
)

pytestmark = pytest.mark.cluster


OPERATOR_MANAGERS = {"disagg-operator", "kopf"}  # server-side apply / status patches / kopf bookkeeping


def operator_writes(cluster: Cluster, ns: str) -> dict[tuple[str, str], list[tuple[str, str, str]]]:
    """Per object, the operator's managedFields entries (a write by the operator changes their time)."""
    items = get(cluster, ns, KINDS, "-l", names.MANAGED_BY, "--show-managed-fields")["items"]
    items += get(cluster, ns, "disaggregatedmodels", "--show-managed-fields")["items"]
    return {(o["kind"], o["metadata"]["name"]): sorted(
        (m["manager"], m.get("subresource", ""), m["time"]) for m in o["metadata"].get("managedFields", [])
        if m["manager"] in OPERATOR_MANAGERS) for o in items}


def test_an_operator_restart_writes_nothing(cluster: Cluster, crd_installed: Path, ns: str,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    op = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("restart"), args=["--namespace", ns])
    op.start()
    try:
        cluster.wait_for(op.alive, "the operator", timeout=60)
        cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
        wait_ready(cluster, op, ns, "qwen3-8b")
        # Ready can come before the rollout ends (surge pods still counted): the status changes again then.
        cluster.wait_for(lambda: condition(model(cluster, ns, "qwen3-8b"), "Progressing") == "False",
                         "the example's pools complete (Progressing False)", timeout=READY_TIMEOUT)
        before = operator_writes(cluster, ns)
        status_before = get(cluster, ns, "disaggregatedmodels")["items"][0]["status"]
        assert all(before.values()), before
        op.stop()
        op.start()
        cluster.wait_for(op.alive, "the restarted operator", timeout=60)
        cluster.wait_for(lambda: "Resuming is processed" in op.log(), "the resume handler to run", timeout=120)
        # One more observable round trip through the operator: a new object gets its children.
        apply(cluster, ns, base("marker"))
        cluster.wait_for(lambda: children(cluster, ns, "marker"), "children of a marker object", timeout=60)
        after = {k: v for k, v in operator_writes(cluster, ns).items() if not k[1].startswith("marker")}
        # Controllers may still update Deployment/PDB status; the operator itself wrote nothing, and
        # its status would only change if the Deployments' readiness had.
        changed = sorted(k for k in before if before[k] != after.get(k))
        status_after = get(cluster, ns, "disaggregatedmodels/qwen3-8b")["status"]
        assert not changed, f"written on restart: {changed}\nstatus before: {status_before}\nafter: {status_after}\n" \
                            f"{op.log_tail()}"
    finally:
        op.stop()
