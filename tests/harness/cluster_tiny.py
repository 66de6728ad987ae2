"""examples/cluster-tiny.yaml deployed on the real node the way a user deploys it: the locally built
images (scripts/disagg-images) imported with ctr, `helm install` of charts/disagg with the operator
image, `kubectl apply -f` of the example. The PodMonitor CRD (tests/operator/crds/) is installed before
the operator, so the operator writes the model's monitors (podMonitors: auto), as in a cluster with the
Prometheus Operator; it is removed again with the rest.

``start_cluster_tiny`` returns once the example is applied; the pods then start on their own. The
harness (tests/harness/engine.py) calls it in the background as soon as the control-plane tests
are done, so the three engines start while the engine tests run, and stops it after the last
module using it. The modules on it import ``cluster_tiny`` and ``tiny`` (the example Ready) from
here: tests/e2e/test_cluster_prometheus.py, tests/e2e/test_cluster_scaling.py, then
tests/e2e/test_cluster_tiny.py, whose last tests take the node and the model down."""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.cluster import (
    REAL_NODE,
    REAL_NODE_SESSION,
    REAL_NODE_TAINT,
    Cluster,
    ensure_cluster,
    node_script,
    start_real_node,
)
from tests.harness.engine import early_fixture
from tests.operator.monitor_cluster import install_monitor_crd, remove_monitor_crd

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cluster-tiny.yaml"
CHART = REPO / "charts" / "disagg"
MODEL = "cluster-tiny"
VOLUMES = ("disagg-host-cache", "disagg-kv-shared", "disagg-engine-cache")  # scripts/node's PersistentVolumes
STOP_TIMEOUT = 180.0
READY_TIMEOUT = float(os.environ.get("DISAGG_CLUSTER_TINY_TIMEOUT", "1200"))  # three engines on 2 busy cores


def get(cluster: Cluster, *args: str) -> dict[str, Any]:
    return yaml.safe_load(cluster.kubectl("get", "-o", "yaml", *args).stdout)


def pods(cluster: Cluster, ns: str, pool: str | None = None) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={MODEL}" + (f",app.kubernetes.io/component={pool}" if pool else "")
    return get(cluster, "pods", "-n", ns, "-l", selector)["items"]


def release_volumes(cluster: Cluster) -> None:
    """Make the node's volumes Available again after an earlier claim was deleted (Retain policy);
    a node that is down has none (scripts/node removes them)."""
    names = {pv["metadata"]["name"]: pv for pv in get(cluster, "pv")["items"]}
    for pv in VOLUMES:
        if pv in names and names[pv]["status"]["phase"] == "Released":
            cluster.kubectl("patch", "pv", pv, "--type=json", "-p", '[{"op": "remove", "path": "/spec/claimRef"}]')


@dataclass
class ClusterTiny:
    """The operator release in ``operator_ns`` and the example applied in ``ns`` at ``applied``
    (time.monotonic())."""
    cluster: Cluster
    operator_ns: str
    release: str
    ns: str = ""
    applied: float = 0.0
    monitor_crd: bool = False  # installed by start_cluster_tiny: removed by stop()

    def stop(self) -> None:
        """Delete the model's namespace and wait until its pods are gone (three engines must not
        outlive the tests, also when they never became Ready), then the operator release. Nothing
        to do once the session's cluster is down (`scripts/cluster down` took the node down first)."""
        if not (self.cluster.state_dir / "cluster.env").exists():
            return
        if self.ns:
            self.cluster.kubectl("delete", "namespace", self.ns, "--wait=false", check=False)
            self.cluster.wait_for(lambda: not pods(self.cluster, self.ns), f"the pods of {MODEL} gone",
                                  timeout=STOP_TIMEOUT, interval=1)
            self.ns = ""
        if self.release:
            self.cluster.helm("uninstall", self.release, "-n", self.operator_ns, "--wait", check=False)
            self.cluster.kubectl("delete", "namespace", self.operator_ns, "--wait=false", check=False)
            self.release = ""
        if self.monitor_crd:
            remove_monitor_crd(self.cluster)
            self.monitor_crd = False


def import_images(cluster: Cluster) -> dict[str, str]:
    """Build what is missing (cached by content hash) and import it into the node's containerd:
    image name -> archive."""
    t0 = time.monotonic()
    proc = subprocess.run([str(REPO / "scripts" / "disagg-images"), "--import"], capture_output=True, text=True,
                          env={**os.environ, "DISAGG_CLUSTER_DIR": str(cluster.state_dir)}, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"images built/imported in {time.monotonic() - t0:.0f}s")
    return dict(line.split() for line in proc.stdout.splitlines())


def start_cluster_tiny() -> ClusterTiny:
    cluster = ensure_cluster()
    if REAL_NODE_SESSION.before is None and (cluster.state_dir / "node").exists():
        # Up before this session: restart it, so the node-down test knows the machine without it.
        assert node_script("down", cluster.state_dir, timeout=300).returncode == 0
    start_real_node(cluster, REAL_NODE_SESSION)
    images = import_images(cluster)
    operator_ns = cluster.create_namespace("disagg-system")
    tiny = ClusterTiny(cluster, operator_ns, f"disagg-e2e-{operator_ns.rsplit('-', 1)[1]}")  # per-release RBAC names
    try:
        install_monitor_crd(cluster)  # before the operator starts, so it watches PodMonitors
        tiny.monitor_crd = True
        repo, tag = next(name for name in images if name.startswith("disagg.local/disagg:")).rsplit(":", 1)
        cluster.helm("install", tiny.release, str(CHART), "-n", operator_ns, "--wait", "--timeout", "5m",
                     "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
                     "--set", "image.pullPolicy=Never", "--set", f"nodeSelector.kubernetes\\.io/hostname={REAL_NODE}",
                     "--set", f"tolerations[0].key={REAL_NODE_TAINT}", "--set", "tolerations[0].operator=Exists")
        tiny.ns = cluster.create_namespace("cluster-tiny")
        release_volumes(cluster)
        cluster.kubectl("apply", "-n", tiny.ns, "-f", str(EXAMPLE))
        tiny.applied = time.monotonic()
    except BaseException:
        tiny.stop()
        raise
    return tiny


# Applied in the background while the engine tests run (tests/harness/engine.py).
cluster_tiny = early_fixture("cluster_tiny", start_cluster_tiny, after_cluster_tests=True)


@dataclass
class Deployed:
    ns: str
    operator_ns: str
    release: str
    url: str  # the decode Service: http://<ClusterIP>:8000


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


@pytest.fixture(scope="module")
def tiny(cluster: Cluster, cluster_tiny: ClusterTiny) -> Deployed:
    ns = cluster_tiny.ns

    def model_ready() -> bool:
        conditions = get(cluster, "dm", MODEL, "-n", ns).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    try:
        cluster.wait_for(model_ready, f"DisaggregatedModel {MODEL} Ready", timeout=READY_TIMEOUT, interval=2)
    except AssertionError:
        for pod in pods(cluster, ns):
            for c in pod["spec"]["containers"]:
                out = cluster.kubectl("logs", pod["metadata"]["name"], "-n", ns, "-c", c["name"], "--tail=30",
                                      check=False)
                print(f"----- {pod['metadata']['name']}/{c['name']}\n{out.stdout}{out.stderr}")
        raise
    print(f"{MODEL} Ready {time.monotonic() - cluster_tiny.applied:.0f}s after it was applied")
    ip = get(cluster, "service", MODEL, "-n", ns)["spec"]["clusterIP"]
    return Deployed(ns, cluster_tiny.operator_ns, cluster_tiny.release, f"http://{ip}:8000")
