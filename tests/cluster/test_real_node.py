"""The real kubelet node (scripts/node) beside the kwok nodes: real containers from a locally built
image behind real probes, kubectl logs/exec, a Service through kube-proxy, and `scripts/node down`
while the cluster runs. (`scripts/cluster down` with a real node: test_control_plane.py.)"""
from __future__ import annotations

import ipaddress
from typing import Any

import pytest
import requests

from tests.cluster.real_node import node_pids, running, web_pod
from tests.cluster.test_control_plane import KWOK_NODES, apply, condition, get_json, pinned
from tests.harness.cluster import (
    REAL_NODE_TAINT,
    Cluster,
    ClusterError,
    RealNodeSession,
    host_state,
    node_script,
)

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

POD_CIDR = ipaddress.ip_network("10.244.0.0/24")  # scripts/node's POD_CIDR
NODE_IP = "10.244.0.1"


def pod(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return get_json(cluster, "pod", name, "-n", ns)


def ready(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    p = pod(cluster, ns, name)
    return p if condition(p, "Ready") == "True" else None


def test_real_node_is_ready_tainted_and_beside_the_kwok_nodes(cluster: Cluster, real_node: str) -> None:
    node = get_json(cluster, "node", real_node)
    assert condition(node, "Ready") == "True", node["status"]["conditions"]
    assert {"type": "InternalIP", "address": NODE_IP} in node["status"]["addresses"]
    assert {"key": REAL_NODE_TAINT, "value": "true", "effect": "NoSchedule"} in node["spec"]["taints"]
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == pinned("K8S_VERSION")
    assert info["containerRuntimeVersion"].startswith("containerd://1.")
    for name in KWOK_NODES:
        assert condition(get_json(cluster, "node", name), "Ready") == "True"


def test_real_probes_logs_and_exec(cluster: Cluster, real_node: str, ns: str) -> None:
    apply(cluster, web_pod("web"), web_pod("unready", healthz=False), ns=ns)
    web = cluster.wait_for(lambda: ready(cluster, ns, "web"), "pod web Ready", timeout=60)
    assert web["spec"]["nodeName"] == real_node and web["status"]["phase"] == "Running"
    [status] = web["status"]["containerStatuses"]
    assert status["containerID"].startswith("containerd://") and status["started"] is True
    assert ipaddress.ip_address(web["status"]["podIP"]) in POD_CIDR
    # The container itself answers on its pod IP (the bridge is a local interface).
    resp = requests.get(f"http://{web['status']['podIP']}:8080/", timeout=10)
    assert resp.status_code == 200 and resp.text.strip() == "web"

    logs = cluster.kubectl("logs", "web", "-n", ns).stdout
    assert "serving web as uid 65534" in logs
    assert cluster.kubectl("exec", "web", "-n", ns, "--", "id", "-u").stdout.strip() == "65534"

    # Readiness comes from the real probe: without /healthz the running container stays unready...
    def running(name: str) -> dict[str, Any] | None:
        p = pod(cluster, ns, name)
        statuses = p["status"].get("containerStatuses") or [{}]
        return p if statuses[0].get("started") else None

    unready = cluster.wait_for(lambda: running("unready"), "pod unready started", timeout=60)
    assert condition(unready, "Ready") == "False", unready["status"]
    # ... until exec creates it.
    cluster.kubectl("exec", "unready", "-n", ns, "--", "sh", "-c", "echo ok >/tmp/www/healthz")
    cluster.wait_for(lambda: ready(cluster, ns, "unready"), "pod unready Ready after exec", timeout=60)


def test_cluster_ip_service_through_kube_proxy(cluster: Cluster, real_node: str, ns: str) -> None:
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"selector": {"app": "svc-web"}, "ports": [{"port": 80, "targetPort": "http"}]}}
    apply(cluster, web_pod("svc-web"), service, ns=ns)
    cluster.wait_for(lambda: ready(cluster, ns, "svc-web"), "pod svc-web Ready", timeout=60)
    ip = get_json(cluster, "service", "web", "-n", ns)["spec"]["clusterIP"]

    def answer() -> str | None:
        try:
            return requests.get(f"http://{ip}/", timeout=2).text.strip()
        except requests.RequestException:
            return None  # kube-proxy has not synced the Service yet

    assert cluster.wait_for(answer, f"the ClusterIP {ip} to answer", timeout=60) == "svc-web"


def test_pods_resolve_service_names_and_reach_the_api_server(cluster: Cluster, real_node: str, ns: str) -> None:
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "named"},
               "spec": {"selector": {"app": "named-web"}, "ports": [{"port": 80, "targetPort": "http"}]}}
    apply(cluster, web_pod("named-web"), web_pod("client"), service, ns=ns)
    for name in ("named-web", "client"):
        cluster.wait_for(lambda: ready(cluster, ns, name), f"pod {name} Ready", timeout=60)
    ip = get_json(cluster, "service", "named", "-n", ns)["spec"]["clusterIP"]

    def in_pod(*cmd: str) -> str | None:
        proc = cluster.kubectl("exec", "client", "-n", ns, "--", *cmd, check=False)
        return proc.stdout if proc.returncode == 0 else None

    # CoreDNS answers for Services (short names through the pod's search path) ...
    out = cluster.wait_for(lambda: in_pod("nslookup", f"named.{ns}.svc.cluster.local"), "DNS answer", timeout=60)
    assert ip in out
    assert cluster.wait_for(lambda: in_pod("wget", "-qO-", "http://named/"), "http://named/", timeout=60).strip() \
        == "named-web"
    assert "10.96.0.1" in in_pod("nslookup", "kubernetes.default.svc.cluster.local")
    # ... and for nothing else: no name leaves the machine.
    assert in_pod("nslookup", "example.com") is None
    # The `kubernetes` Service leads to the apiserver (TLS checked end to end by the operator pod's
    # tests, tests/e2e/test_cluster_tiny.py).
    assert in_pod("sh", "-c", "echo | nc -w 5 10.96.0.1 443") is not None
    [slice_] = get_json(cluster, "endpointslices", "-n", "default", "-l",
                        "kubernetes.io/service-name=kubernetes")["items"]
    assert slice_["endpoints"][0]["addresses"] == [NODE_IP]


def test_node_down_while_the_cluster_runs_removes_its_pods_and_leaves_nothing(
    cluster: Cluster, real_node: str, real_node_session: RealNodeSession, ns: str
) -> None:
    # Last in this module: it stops the session's node (the real_node fixture would start it again).
    before = real_node_session.before
    if before is None:  # the node was up before this session: restart it to see the machine without
        assert node_script("down", cluster.state_dir, timeout=300).returncode == 0
        before = host_state()
        assert node_script("up", cluster.state_dir, timeout=600).returncode == 0
    apply(cluster, web_pod("web"), ns=ns)
    cluster.wait_for(lambda: ready(cluster, ns, "web"), "pod web Ready", timeout=60)
    pids = node_pids(cluster.state_dir / "node")
    assert {"shim", "container", "kubelet", "containerd", "kube-proxy"} <= set(pids.values()), pids

    down = node_script("down", cluster.state_dir, timeout=300)
    assert down.returncode == 0, down.stderr
    # Drained through the API: the pod is gone, not left Terminating on a dead node; so is the Node.
    for kind, name, where in (("pod", "web", ["-n", ns]), ("node", real_node, [])):
        with pytest.raises(ClusterError, match="NotFound"):
            cluster.kubectl("get", kind, name, *where)
    assert {pid: what for pid, what in pids.items() if running(pid)} == {}
    assert host_state() == before
