"""A vLLM version outside the release table, against the real control plane: the CRD accepts it, the
operator deploys it the conservative way and says so (condition VersionSupported, an Event)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg_sidecar import vllm_releases
from tests.harness.cluster import Cluster
from tests.harness.operator import OperatorProcess
from tests.operator.cases import base, merged
from tests.operator.test_cluster import READY_TIMEOUT, apply, deployments, model

pytestmark = pytest.mark.cluster

NAME = "future"


def _version_condition(cluster: Cluster, ns: str) -> dict[str, Any] | None:
    dm = model(cluster, ns, NAME)
    status = dm.get("status", {})
    if status.get("observedGeneration") != dm["metadata"]["generation"]:
        return None
    return next((c for c in status.get("conditions", []) if c["type"] == "VersionSupported"), None)


def _events(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    found = cluster.api("GET", f"/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name%3D{NAME}")
    return found["items"] or []


def test_an_untested_version_is_deployed_conservatively_and_reported(cluster: Cluster, operator: OperatorProcess,
                                                                     ns: str) -> None:
    apply(cluster, ns, merged(base(NAME), {"spec": {"engine": {"vllmVersion": "0.35.0"}}}))
    cond = cluster.wait_for(lambda: (c := _version_condition(cluster, ns)) and c["status"] == "False" and c,
                            "VersionSupported False", timeout=READY_TIMEOUT)
    assert cond["reason"] == "UntestedVersion" and "0.35.0" in cond["message"], cond
    assert model(cluster, ns, NAME)["status"]["derender"] == {"strategy": "stateless"}  # no sessions assumed
    assert {"render", "prefill", "decode"} <= set(deployments(cluster, ns, NAME))  # deployed all the same
    warned = cluster.wait_for(lambda: [e for e in _events(cluster, ns) if e.get("reason") == "UntestedVersion"],
                              "the UntestedVersion Event", timeout=60)
    assert warned[0]["type"] == "Warning" and "0.35.0" in warned[0]["message"]

    supported = vllm_releases.NEWEST.name + ".0"
    cluster.kubectl("patch", "dm", NAME, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"engine": {"vllmVersion": supported}}}))
    cond = cluster.wait_for(lambda: (c := _version_condition(cluster, ns)) and c["status"] == "True" and c,
                            "VersionSupported True", timeout=READY_TIMEOUT)
    assert cond["reason"] == "Supported"
