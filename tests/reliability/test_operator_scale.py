"""100 ``DisaggregatedModel``s created at once: every child applied and every status written within
60 s, twice the 50-model test's goal for twice the objects (tests/operator/test_cluster.py), or, on a
machine where the API server itself is slower than that, within 3× what `kubectl apply
--server-side` needs for the very same objects in the same run (measured only then: 1,800 objects
take it 14-26 s here, and deleting them as much again of the controller manager's work). `make
bench BENCH=operator` runs 50 and 500 against the goal of 2× kubectl, always measured (500 here took
9.5 min of the suite's 15-minute budget on 2 cores)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.operator_load import create_at_once, kubectl_baseline
from tests.harness.cluster import Cluster
from tests.harness.operator import OperatorProcess

pytestmark = [pytest.mark.cluster, pytest.mark.reliability]

MODELS = 100
GOAL_SECONDS = 60.0
BOUND = 3.0


def test_a_hundred_models_at_once(cluster: Cluster, operator: OperatorProcess, ns: str, record_property: Any) -> None:
    # Earlier tests' namespaces are garbage-collected by the same API server: let that finish first.
    cluster.wait_for(lambda: not [n for n in cluster.api("GET", "/api/v1/namespaces")["items"]
                                  if n["status"].get("phase") == "Terminating"],
                     "earlier tests' namespaces deleted", timeout=600, interval=0.5)
    run = create_at_once(cluster, operator, ns, MODELS)
    record_property("hundred_models_seconds", round(run["seconds"], 1))
    summary = (f"{MODELS} models ({run['objects']} objects): children {run['children_seconds']:.1f}s, "
               f"statuses {run['status_seconds']:.1f}s")
    if run["seconds"] <= GOAL_SECONDS:
        print(f"{summary} (goal {GOAL_SECONDS:.0f}s)")
        return
    baseline_ns = cluster.create_namespace("hundred-kubectl")
    try:
        baseline = kubectl_baseline(cluster, baseline_ns, MODELS)
    finally:
        cluster.kubectl("delete", "namespace", baseline_ns, "--wait=false", check=False)
    record_property("hundred_kubectl_seconds", round(baseline, 1))
    print(f"{summary}, over the {GOAL_SECONDS:.0f}s goal; kubectl --server-side {baseline:.1f}s "
          f"(bound {BOUND * baseline:.1f}s)")
    assert run["seconds"] <= BOUND * baseline
