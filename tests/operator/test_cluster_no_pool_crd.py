"""A cluster without the InferencePool CRD: a model enabling router.inferencePool gets a clear
condition, other models are served as usual, and installing the CRD later lets the pool appear."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from disagg_operator.kinds import INFERENCE_POOL
from tests.harness.cluster import Cluster
from tests.harness.operator import OperatorProcess
from tests.operator.cases import merged
from tests.operator.conftest import running_operator
from tests.operator.pool_cluster import enable, install_pool_crd, pool, remove_pool_crd
from tests.operator.test_cluster import example, get, wait_ready

RETRY_SECONDS = 5  # the operator's --crd-retry-seconds here (default 60): the CRD is installed mid-test

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def no_pool_crd(cluster: Cluster) -> Iterator[None]:
    remove_pool_crd(cluster)  # before the operator starts
    yield


@pytest.fixture(scope="module")
def operator_without_pools(no_pool_crd: None, cluster: Cluster, crd_installed,  # type: ignore[no-untyped-def]
                           tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    yield from running_operator(cluster, tmp_path_factory, ["--crd-retry-seconds", str(RETRY_SECONDS)])


def pool_condition(cluster: Cluster, ns: str, name: str) -> dict[str, str] | None:
    conditions = get(cluster, ns, "dm", name).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == "InferencePoolReady"), None)


def test_missing_crd_is_a_condition_and_other_models_are_served(
        cluster: Cluster, operator_without_pools: OperatorProcess, ns: str) -> None:
    op = operator_without_pools
    # Small pools: the kwok nodes' GPUs are shared with the other model.
    small = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "render": {"replicas": 0}}
    plain = example()
    plain["metadata"]["name"] = "plain"
    plain["spec"]["pools"] = merged(plain["spec"]["pools"], small)
    wanting = enable(example())
    wanting["spec"]["pools"] = merged(wanting["spec"]["pools"], small)
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                    "items": [plain, wanting]}))
    wait_ready(cluster, op, ns, "plain")
    cond = cluster.wait_for(lambda: pool_condition(cluster, ns, "qwen3-8b"), "InferencePoolReady", timeout=120)
    assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled") and INFERENCE_POOL.crd in cond["message"]
    status = get(cluster, ns, "dm", "qwen3-8b")["status"]
    assert "inferencePool" not in status
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["status"] == "False"
    assert op.alive()  # no crash loop

    # Installed later: the operator's retry applies the pool and the condition turns True.
    install_pool_crd(cluster)
    cluster.wait_for(lambda: pool(cluster, ns, "qwen3-8b"), "the InferencePool after the CRD appeared",
                     timeout=RETRY_SECONDS * 2 + 30)
    cluster.wait_for(lambda: (pool_condition(cluster, ns, "qwen3-8b") or {}).get("status") == "True",
                     "InferencePoolReady True", timeout=120)
