"""Shared by the InferencePool cluster tests: the test CRD, and reading the pool and its members."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg_operator import names
from disagg_operator.kinds import INFERENCE_POOL
from tests.harness.cluster import Cluster

POOL_CRD = Path(__file__).resolve().parent / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
POOL_PATH = "apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"


def install_pool_crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(POOL_CRD))
    cluster.wait_established(INFERENCE_POOL.crd)


def remove_pool_crd(cluster: Cluster) -> None:
    cluster.kubectl("delete", "crd", INFERENCE_POOL.crd, "--ignore-not-found", "--wait=true", "--timeout=120s")


def pool(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", "inferencepools", name, "-n", ns, "-o", "json", "--ignore-not-found")
    return json.loads(out.stdout) if out.stdout.strip() else None


def enable(doc: dict[str, Any], **settings: Any) -> dict[str, Any]:
    doc["spec"]["router"]["inferencePool"] = {"enabled": True, **settings}
    return doc


def member_roles(cluster: Cluster, ns: str, selector: dict[str, str]) -> set[str]:
    """The pool roles of the live pods a label selector matches."""
    query = ",".join(f"{k}={v}" for k, v in selector.items())
    pods = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-l", query, "-o", "json").stdout)["items"]
    return {p["metadata"]["labels"][names.POOL] for p in pods}


def template_labels(cluster: Cluster, ns: str, model: str) -> dict[str, dict[str, str]]:
    items = json.loads(cluster.kubectl("get", "deployments", "-n", ns, "-l", f"{names.INSTANCE}={model}",
                                       "-o", "json").stdout)["items"]
    return {d["metadata"]["labels"][names.POOL]: d["spec"]["template"]["metadata"]["labels"] for d in items}
