"""The real kubelet node (scripts/node) beside the kwok nodes: real containers from a locally built
image behind real probes, kubectl logs/exec, a Service through kube-proxy, and `scripts/cluster
down` leaving nothing behind on the machine."""
from __future__ import annotations

import glob
import ipaddress
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.cluster.test_control_plane import KWOK_NODES, apply, condition, get_json, pinned
from tests.harness.cluster import (
    BUSYBOX_IMAGE,
    REAL_NODE_TAINT,
    Cluster,
    cluster_script,
    log_tails,
    node_script,
    on_real_node,
)

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

POD_CIDR = ipaddress.ip_network("10.244.0.0/24")  # scripts/node's POD_CIDR
NODE_IP = "10.244.0.1"


def web_pod(name: str, *, healthz: bool = True) -> dict[str, Any]:
    """busybox httpd as nobody, serving its hostname; ready once /healthz exists (if ``healthz``)."""
    script = ("mkdir /tmp/www && hostname >/tmp/www/index.html"
              + (" && echo ok >/tmp/www/healthz" if healthz else "")
              + ' && echo "serving $(hostname) as uid $(id -u)" && exec httpd -f -p 8080 -h /tmp/www')
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
        "spec": on_real_node({
            "terminationGracePeriodSeconds": 1,  # httpd as PID 1 ignores SIGTERM
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65534, "runAsGroup": 65534},
            "containers": [{
                "name": "web", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["sh", "-c", script],
                "ports": [{"containerPort": 8080, "name": "http"}],
                "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 1},
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            }],
        }),
    }


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


# --- cluster down leaves nothing behind ------------------------------------------------------

SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward")
HOST_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/var/lib/cni",
              "/run/containerd", "/etc/cni", "/opt/cni", "/opt/containerd")


def _iptables() -> list[str]:
    """Every chain and rule, per table; not the (possibly empty, harmless) tables themselves."""
    out = []
    for tool in ("iptables-save", "ip6tables-save"):
        table = ""
        for line in subprocess.run([tool], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith("-A ") or line.startswith(":") and line.split()[1] == "-":  # user chains
                out.append(f"{tool} {table} {line.split(' [')[0]}")
    return sorted(out)


def host_state() -> dict[str, Any]:
    """What scripts/node may change on the machine, read independently of its own records."""
    links = json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True, check=True).stdout)
    return {
        "links": sorted(link["ifname"] for link in links),
        "netns": sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else [],
        "mounts": sorted({line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}),
        "iptables": _iptables(),
        "sysctls": {s: Path("/proc/sys", s).read_text().strip() for s in SYSCTLS},
        "cgroups": sorted(glob.glob("/sys/fs/cgroup/*/kubepods")),
        "paths": [p for p in HOST_PATHS if os.path.lexists(p)],
    }


def node_pids(node_dir: Path) -> dict[int, str]:
    """The node's daemons, containerd's shims and every container process, by pid."""
    pids = {int(f.read_text().split()[0]): f.name for f in (node_dir / "pids").iterdir()}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(node_dir / "containerd.sock") in cmdline:
            pids[int(proc.name)] = "shim"
    for procs in glob.glob("/sys/fs/cgroup/pids/kubepods/**/cgroup.procs", recursive=True):
        pids.update({int(p): "container" for p in Path(procs).read_text().split()})
    return pids


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_cluster_down_with_a_real_node_leaves_nothing_behind(cluster: Cluster, tmp_path: Path) -> None:
    # One real node per machine: stop the session's (the real_node fixture starts it again).
    down = node_script("down", cluster.state_dir, timeout=300)
    assert down.returncode == 0, down.stderr
    before = host_state()

    state = tmp_path / "cluster"
    up = cluster_script("up", state, timeout=600)
    try:
        assert up.returncode == 0, f"{up.stderr}\n{log_tails(state)}"
        up = node_script("up", state, timeout=600)
        assert up.returncode == 0, up.stderr
        other = Cluster.from_state_dir(state)
        ns = other.create_namespace("down")
        apply(other, web_pod("web"), ns=ns)
        other.wait_for(lambda: ready(other, ns, "web"), "pod web Ready", timeout=60)
        during = host_state()
        pids = node_pids(state / "node")
    finally:
        down = cluster_script("down", state, timeout=300)
    assert down.returncode == 0, down.stderr
    # The node did change the machine (so the comparison below means something).
    assert "disagg0" in during["links"] and len(during["links"]) > len(before["links"]) + 1  # + a veth
    assert any("/netns/cni-" in m for m in during["mounts"]), during["mounts"]
    assert any(m.startswith(f"{state}/node/kubelet/pods/") for m in during["mounts"])
    assert during["sysctls"]["vm/overcommit_memory"] == "1" and during["cgroups"]
    assert any("KUBE-SERVICES" in line for line in during["iptables"])
    assert {"shim", "container", "kubelet", "containerd", "kube-proxy"} <= set(pids.values()), pids

    assert not state.exists()
    assert {pid: what for pid, what in pids.items() if _running(pid)} == {}
    assert host_state() == before
