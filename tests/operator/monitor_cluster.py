"""Shared by the PodMonitor cluster tests: the test CRD and reading the monitors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg_operator.kinds import POD_MONITOR
from tests.harness.cluster import Cluster

MONITOR_CRD = Path(__file__).resolve().parent / "crds" / "monitoring.coreos.com_podmonitors.yaml"


def install_monitor_crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(MONITOR_CRD))
    cluster.wait_established(POD_MONITOR.crd)


def remove_monitor_crd(cluster: Cluster) -> None:
    cluster.kubectl("delete", "crd", POD_MONITOR.crd, "--ignore-not-found", "--wait=true", "--timeout=120s")


def monitors(cluster: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    if cluster.kubectl("get", "crd", POD_MONITOR.crd, check=False).returncode != 0:
        return {}
    items = json.loads(cluster.kubectl("get", "podmonitors.monitoring.coreos.com", "-n", ns, "-o", "json").stdout)["items"]
    return {m["metadata"]["name"]: m for m in items}
