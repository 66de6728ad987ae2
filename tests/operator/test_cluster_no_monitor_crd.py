"""A cluster without the PodMonitor CRD: models on "auto" (the default) are served without monitors
and without a complaint; a model asking for them ("true") gets a clear condition."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from disagg_operator.kinds import POD_MONITOR
from tests.harness.cluster import Cluster
from tests.harness.operator import OperatorProcess
from tests.operator.cases import merged
from tests.operator.conftest import running_operator
from tests.operator.monitor_cluster import remove_monitor_crd
from tests.operator.test_cluster import example, get, wait_ready

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def operator_without_monitors(cluster: Cluster, crd_installed,  # type: ignore[no-untyped-def]
                              tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    remove_monitor_crd(cluster)  # before the operator starts
    yield from running_operator(cluster, tmp_path_factory)


def test_auto_is_quiet_and_true_says_what_is_missing(cluster: Cluster, operator_without_monitors: OperatorProcess,
                                                     ns: str) -> None:
    small = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "render": {"replicas": 0}}
    auto = example()
    auto["metadata"]["name"] = "auto"
    auto["spec"]["pools"] = merged(auto["spec"]["pools"], small)
    wanting = example()
    wanting["metadata"]["name"] = "wanting"
    wanting["spec"]["pools"] = merged(wanting["spec"]["pools"], small)
    wanting["spec"]["monitoring"] = {"podMonitors": "true"}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                    "items": [auto, wanting]}))
    dm = wait_ready(cluster, operator_without_monitors, ns, "auto")
    assert "monitoring" not in dm["status"]
    assert all(c["type"] != "PodMonitorsReady" for c in dm["status"]["conditions"])

    def condition() -> dict[str, str] | None:
        conditions = get(cluster, ns, "dm", "wanting").get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "PodMonitorsReady"), None)
    cond = cluster.wait_for(condition, "PodMonitorsReady on the model asking for monitors", timeout=120)
    assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled") and POD_MONITOR.crd in cond["message"]
    assert operator_without_monitors.alive()
