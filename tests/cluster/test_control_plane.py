"""The local control plane behaves like a real cluster: versions, CRDs + CEL, admission policies,
workloads scheduled onto kwok nodes, garbage collection, Helm, and clean up/down cycles (the second
with a real node running a pod: the machine is left as it was)."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.real_node import node_pids, running, web_pod
from tests.harness.cluster import (
    K8S_BINS_SCRIPT,
    Cluster,
    ClusterError,
    cluster_script,
    host_state,
    log_tails,
    node_script,
    read_env,
)

pytestmark = pytest.mark.cluster

CHART = Path(__file__).parent / "charts" / "tiny"
KWOK_NODES = {"kwok-node-0", "kwok-node-1"}


def pinned(name: str) -> str:
    """The version scripts/k8s-bins builds: env override, else its `NAME=${NAME:-vX}` default."""
    match = re.search(rf"^{name}=\$\{{{name}:-(v[0-9][^}}]*)\}}", K8S_BINS_SCRIPT.read_text(), re.M)
    assert match, f"no {name} default in {K8S_BINS_SCRIPT}"
    return os.environ.get(name) or match.group(1)


def apply(cluster: Cluster, *objs: dict[str, Any], ns: str | None = None, check: bool = True):
    # JSON is YAML: no yaml dependency needed to feed kubectl.
    items = {"apiVersion": "v1", "kind": "List", "items": list(objs)}
    args = ["apply", "-f", "-"] + (["-n", ns] if ns else [])
    return cluster.kubectl(*args, input=json.dumps(items), check=check)


def get_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def condition(obj: dict[str, Any], kind: str) -> str | None:
    return next((c["status"] for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


# --- version and health ----------------------------------------------------------------------

def test_server_and_client_report_the_pinned_versions(cluster: Cluster) -> None:
    want = pinned("K8S_VERSION")
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == want
    assert version["clientVersion"]["gitVersion"] == want
    assert (version["serverVersion"]["major"], version["serverVersion"]["minor"]) == ("1", want.split(".")[1])
    assert cluster.kubectl("get", "--raw", "/readyz").stdout == "ok"
    # etcd must be the 3.6.x we built (Debian's 3.4 breaks watches on apiserver >= 1.31).
    etcd = subprocess.run([str(cluster.bin_dir / "etcd"), "--version"], capture_output=True, text=True, check=True)
    assert f"etcd Version: {pinned('ETCD_VERSION').lstrip('v')}" in etcd.stdout


def test_fake_nodes_are_ready_and_renew_their_leases(cluster: Cluster) -> None:
    nodes = get_json(cluster, "nodes")["items"]
    assert {n["metadata"]["name"] for n in nodes} >= KWOK_NODES
    for node in nodes:
        if node["metadata"]["name"] in KWOK_NODES:
            assert condition(node, "Ready") == "True", node["status"]
    # Without fresh leases the node controller flips the nodes (and their pods) to NotReady
    # every ~50 s; kwok renews a 40 s lease every ~10 s.
    now = datetime.now(timezone.utc)
    for name in KWOK_NODES:
        lease = get_json(cluster, "lease", name, "-n", "kube-node-lease")
        renewed = datetime.fromisoformat(lease["spec"]["renewTime"].replace("Z", "+00:00"))
        assert (now - renewed).total_seconds() < 40, lease["spec"]


# --- CRDs with printer columns and CEL ---------------------------------------------------------

def test_crd_printer_column_and_cel_rule(cluster: Cluster, ns: str) -> None:
    group = f"t{os.urandom(3).hex()}.test.disagg.dev"  # CRDs are cluster-scoped: unique per run
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "additionalPrinterColumns": [
                    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
                    {"name": "Tier", "type": "string", "jsonPath": ".spec.tier"},
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {"spec": {
                        "type": "object",
                        "required": ["replicas", "maxReplicas"],
                        "properties": {
                            "replicas": {"type": "integer"},
                            "maxReplicas": {"type": "integer"},
                            "tier": {"type": "string"},
                        },
                        "x-kubernetes-validations": [{
                            "rule": "self.replicas <= self.maxReplicas",
                            "message": "replicas must not exceed maxReplicas",
                        }],
                    }},
                }},
            }],
        },
    }
    apply(cluster, crd)
    try:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/widgets.{group}", "--timeout=60s")

        def widget(name: str, replicas: int, max_replicas: int) -> dict[str, Any]:
            return {"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": name},
                    "spec": {"replicas": replicas, "maxReplicas": max_replicas, "tier": "gold"}}

        apply(cluster, widget("good", 3, 5), ns=ns)
        table = cluster.kubectl("get", f"widgets.{group}", "-n", ns).stdout.splitlines()
        header = table[0].split()
        assert header[:3] == ["NAME", "REPLICAS", "TIER"], table
        rows = {line.split()[0]: dict(zip(header, line.split())) for line in table[1:]}
        assert rows["good"]["REPLICAS"] == "3" and rows["good"]["TIER"] == "gold", table

        bad = apply(cluster, widget("bad", 6, 5), ns=ns, check=False)
        assert bad.returncode != 0
        assert "replicas must not exceed maxReplicas" in bad.stderr
        missing = cluster.kubectl("get", f"widgets.{group}", "bad", "-n", ns, check=False)
        assert "NotFound" in missing.stderr
    finally:
        cluster.kubectl("delete", "crd", f"widgets.{group}", "--wait=false", check=False)


def test_validating_admission_policy_denies_with_cel(cluster: Cluster, ns: str) -> None:
    name = f"{ns}-no-forbidden"  # cluster-scoped objects: named after the unique namespace
    cluster.kubectl("label", "namespace", ns, f"disagg-test={ns}")
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"], "resources": ["configmaps"],
            }]},
            "validations": [{
                "expression": "!has(object.data) || !('forbidden' in object.data)",
                "message": "key 'forbidden' is not allowed",
            }],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {"disagg-test": ns}}},
        },
    }
    apply(cluster, policy, binding)
    try:
        def cm(data: dict[str, str]) -> str:
            return json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": data})

        # The admission plugin picks the policy up through an informer: poll with server dry-runs.
        def denied() -> str | None:
            res = cluster.kubectl("create", "-n", ns, "--dry-run=server", "-f", "-",
                                  input=cm({"forbidden": "x"}), check=False)
            return res.stderr if res.returncode != 0 else None

        err = cluster.wait_for(denied, "the ValidatingAdmissionPolicy to be enforced", timeout=60)
        assert "key 'forbidden' is not allowed" in err
        cluster.kubectl("create", "-n", ns, "-f", "-", input=cm({"allowed": "y"}))
    finally:
        cluster.kubectl("delete", "validatingadmissionpolicybinding", name, check=False)
        cluster.kubectl("delete", "validatingadmissionpolicy", name, check=False)


# --- workloads on kwok nodes -------------------------------------------------------------------

def test_deployment_pods_run_on_kwok_nodes_and_back_an_endpointslice(cluster: Cluster, ns: str) -> None:
    labels = {"app": "web"}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    # One pod per node proves the scheduler sees both kwok nodes.
                    "topologySpreadConstraints": [{
                        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": labels},
                    }],
                    "containers": [{"name": "web", "image": "example.invalid/web:1",
                                    "ports": [{"containerPort": 8080, "name": "http"}]}],
                },
            },
        },
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": "http"}]}}
    apply(cluster, deployment, service, ns=ns)
    cluster.kubectl("rollout", "status", "deployment/web", "-n", ns, "--timeout=120s", timeout=150)

    dep = get_json(cluster, "deployment", "web", "-n", ns)
    assert dep["status"].get("readyReplicas") == 2 and dep["status"].get("availableReplicas") == 2, dep["status"]
    assert condition(dep, "Available") == "True"
    rs = get_json(cluster, "replicasets", "-n", ns)["items"]
    assert [o["metadata"]["ownerReferences"][0]["name"] for o in rs] == ["web"]

    pods = get_json(cluster, "pods", "-n", ns, "-l", "app=web")["items"]
    assert len(pods) == 2
    assert {p["spec"]["nodeName"] for p in pods} == KWOK_NODES
    for pod in pods:
        assert pod["status"]["phase"] == "Running" and condition(pod, "Ready") == "True", pod["status"]
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
    want = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}

    def slice_endpoints() -> dict[str, str] | None:
        slices = get_json(cluster, "endpointslices", "-n", ns, "-l", "kubernetes.io/service-name=web")["items"]
        got = {e["targetRef"]["name"]: e["addresses"][0]
               for s in slices for e in s.get("endpoints") or [] if e.get("conditions", {}).get("ready")}
        return got if got == want else None

    cluster.wait_for(slice_endpoints, "an EndpointSlice listing both ready pods", timeout=60)


def test_deleting_an_owner_garbage_collects_its_dependents(cluster: Cluster, ns: str) -> None:
    owner = json.loads(cluster.kubectl("create", "configmap", "owner", "-n", ns, "-o", "json").stdout)
    dependent = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "dependent", "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"],
        }]},
        "data": {"k": "v"},
    }
    apply(cluster, dependent, ns=ns)
    cluster.kubectl("delete", "configmap", "owner", "-n", ns)

    def gone() -> bool:
        res = cluster.kubectl("get", "configmap", "dependent", "-n", ns, check=False)
        return res.returncode != 0 and "NotFound" in res.stderr

    cluster.wait_for(gone, "the garbage collector to delete the dependent ConfigMap", timeout=60)


# --- helm ------------------------------------------------------------------------------------

def test_helm_install_upgrade_uninstall(cluster: Cluster, ns: str) -> None:
    def ready_replicas(n: int) -> Callable[[], bool]:
        # helm --wait checks the new ReplicaSet; the Deployment's own status may lag a moment.
        return lambda: get_json(cluster, "deployment", "rel-tiny", "-n", ns)["status"].get("readyReplicas") == n

    def data() -> dict[str, str]:
        return get_json(cluster, "configmap", "rel-tiny", "-n", ns)["data"]

    cluster.helm("install", "rel", str(CHART), "-n", ns, "--wait", "--timeout=2m")
    cluster.wait_for(ready_replicas(1), "1 ready replica after helm install", timeout=30)
    assert data() == {"message": "hello", "kubeVersion": pinned("K8S_VERSION")}

    cluster.helm("upgrade", "rel", str(CHART), "-n", ns, "--set", "replicas=2,message=bye",
                 "--wait", "--timeout=2m")
    cluster.wait_for(ready_replicas(2), "2 ready replicas after helm upgrade", timeout=30)
    assert data()["message"] == "bye"
    [release] = json.loads(cluster.helm("list", "-n", ns, "-o", "json").stdout)
    assert (release["name"], release["revision"], release["status"]) == ("rel", "2", "deployed")

    cluster.helm("uninstall", "rel", "-n", ns, "--wait", "--timeout=2m")
    assert json.loads(cluster.helm("list", "-n", ns, "-o", "json").stdout) == []
    left = cluster.kubectl("get", "deployment,service,configmap", "-n", ns,
                           "-l", "app.kubernetes.io/instance=rel", "-o", "name").stdout
    assert left.strip() == ""


# --- up/down lifecycle -------------------------------------------------------------------------

def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is fine
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_up_down_twice_in_a_separate_state_dir_leaves_nothing_behind(cluster: Cluster) -> None:
    # A short path: kubelet's unix sockets under it must stay within 107 bytes, which pytest's
    # tmp_path (/tmp/pytest-of-root/pytest-NNN/<test name>0/...) exceeds once NNN has 3 digits.
    state = Path(tempfile.mkdtemp(prefix="disagg-updown-")) / "cluster"
    session_ports = set(cluster.ports.values())
    # One real node per machine: stop the session's, if a test started it (real_node restarts it).
    assert node_script("down", cluster.state_dir, timeout=300).returncode == 0
    before = host_state()
    for round_ in (1, 2):
        up = cluster_script("up", state, timeout=600)
        assert up.returncode == 0, f"round {round_}: up failed\n{up.stderr}\n{log_tails(state)}"
        assert up.stdout.strip() == f"export KUBECONFIG={state / 'kubeconfig'}"
        env = read_env(state)
        ports = {int(v) for k, v in env.items() if k.endswith("_PORT")}
        assert len(ports) == 6 and not ports & session_ports, (ports, session_ports)
        pids = {p.name: int(p.read_text()) for p in (state / "pids").iterdir()}
        assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}
        other = Cluster.from_state_dir(state)
        assert other.kubectl("get", "--raw", "/readyz").stdout == "ok"
        assert {n["metadata"]["name"] for n in get_json(other, "nodes")["items"]} == KWOK_NODES

        again = cluster_script("up", state, timeout=120)  # idempotent: same processes
        assert again.returncode == 0 and "already up" in again.stderr, again.stderr
        assert {p.name: int(p.read_text()) for p in (state / "pids").iterdir()} == pids

        node: dict[int, str] = {}
        if round_ == 2:  # a real node running a pod: cluster down must undo all it did to the machine
            try:
                up = node_script("up", state, timeout=600)
                assert up.returncode == 0, up.stderr
                ns = other.create_namespace("down")
                apply(other, web_pod("web"), ns=ns)
                other.wait_for(lambda: condition(get_json(other, "pod", "web", "-n", ns), "Ready") == "True",
                               "pod web Ready", timeout=60)
                during = host_state()
                node = node_pids(state / "node")
            finally:
                if not node:
                    cluster_script("down", state, timeout=300)
            # It did change the machine, so the comparison after down means something.
            assert "disagg0" in during["links"] and len(during["links"]) > len(before["links"]) + 1  # + a veth
            assert any("/netns/cni-" in m for m in during["mounts"]), during["mounts"]
            assert any(m.startswith(f"{state}/node/kubelet/pods/") for m in during["mounts"])
            assert during["sysctls"]["vm/overcommit_memory"] == "1" and during["cgroups"]
            assert any("KUBE-SERVICES" in line for line in during["iptables"])
            assert {"shim", "container", "kubelet", "containerd", "kube-proxy"} <= set(node.values()), node

        down = cluster_script("down", state, timeout=120)
        assert down.returncode == 0, down.stderr
        assert not state.exists()
        assert [n for n, pid in pids.items() if running(pid)] == []
        assert [p for p in sorted(ports) if not _bindable(p)] == []
        assert cluster_script("status", state, timeout=60).returncode != 0
        assert {pid: what for pid, what in node.items() if running(pid)} == {}
        assert host_state() == before

    # The session cluster was not disturbed.
    assert cluster.kubectl("get", "--raw", "/readyz").stdout == "ok"
    state.parent.rmdir()  # empty: `down` removed the state dir


def test_kubectl_errors_carry_output(cluster: Cluster) -> None:
    with pytest.raises(ClusterError, match="NotFound"):
        cluster.kubectl("get", "namespace", f"missing-{os.urandom(3).hex()}")
