"""The control plane's pure parts (command lines, cluster.env, kubeconfigs, state dir) and its
PKI with the real openssl; the running cluster is tests/cluster/test_control_plane.py's."""

from __future__ import annotations

import base64
import re
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from kubernetes.utils import parse_quantity

from disagg_cli.cluster import components, layout, pki
from disagg_cli.cluster.layout import COMPONENTS, Cluster, Ports, state_dir
from disagg_operator.commands import render_manifests

BIN = "/opt/k8s/bin"
STARTERS = (components.etcd, components.apiserver, components.controller_manager, components.scheduler,
            components.kwok)


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv[1:])


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Cluster:
    """A cluster's state as `up` writes it before starting anything: certificates, kubeconfigs."""
    c = Cluster(tmp_path_factory.mktemp("cluster"), BIN, Ports.from_base(27550))
    pki.make_pki(c.pki)
    pki.write_kubeconfig(c.pki, "admin", c.ports.api, c.kubeconfig)
    for user in ("kube-controller-manager", "kube-scheduler", "kwok"):
        pki.write_kubeconfig(c.pki, user, c.ports.api, c.pki / f"{user}.kubeconfig")
    return c


def test_ports_are_six_consecutive_from_the_base():
    ports = Ports.from_base(27430)
    assert sorted(vars(ports).values()) == list(range(27430, 27436))
    assert ports.api == 27430 and "apiserver 27430, etcd 27431/27432" in ports.describe()


def test_components_run_our_binaries_with_flags_as_single_arguments(made):
    assert [Path(f(made)[0]).name for f in STARTERS] == list(COMPONENTS)
    for start in STARTERS:
        argv = start(made)
        assert argv[0] == f"{BIN}/{Path(argv[0]).name}"
        assert all(a.startswith("--") and "=" in a and " " not in a for a in argv[1:]), argv


def test_every_file_a_component_reads_is_one_up_writes(made):
    for start in STARTERS:
        for flag, value in _flags(start(made)).items():
            if re.search(r"(file|certificate|key|kubeconfig|authority|ca-file)$", flag):
                assert Path(value).is_file() and made.dir in Path(value).parents, (flag, value)


def test_listeners_stay_on_loopback_at_the_clusters_ports(made):
    p = made.ports
    etcd = _flags(components.etcd(made))
    assert etcd["listen-client-urls"] == f"http://127.0.0.1:{p.etcd}"
    assert etcd["listen-peer-urls"] == etcd["initial-advertise-peer-urls"] == f"http://127.0.0.1:{p.etcd_peer}"
    api = _flags(components.apiserver(made))
    assert (api["bind-address"], api["secure-port"], api["etcd-servers"]) == (
        "127.0.0.1", str(p.api), f"http://127.0.0.1:{p.etcd}")
    for start, port in ((components.controller_manager, p.kcm), (components.scheduler, p.scheduler)):
        flags = _flags(start(made))
        assert (flags["bind-address"], flags["secure-port"], flags["profiling"]) == ("127.0.0.1", str(port), "false")
    assert _flags(components.kwok(made))["server-address"] == f"127.0.0.1:{p.kwok}"


def test_apiserver_authenticates_and_authorizes_like_a_real_cluster(made):
    api = _flags(components.apiserver(made))
    assert api["authorization-mode"] == "Node,RBAC"
    assert api["client-ca-file"] == f"{made.pki}/ca.crt"
    assert api["service-account-issuer"] == "https://kubernetes.default.svc.cluster.local"
    assert (api["service-account-key-file"], api["service-account-signing-key-file"]) == (
        f"{made.pki}/sa.pub", f"{made.pki}/sa.key")
    assert api["service-cluster-ip-range"] == layout.SERVICE_CIDR
    kcm = _flags(components.controller_manager(made))
    assert kcm["use-service-account-credentials"] == "true"  # each controller with its own RBAC
    assert kcm["service-account-private-key-file"] == api["service-account-signing-key-file"]


def _subject(path: Path) -> str:
    return subprocess.run(["openssl", "x509", "-in", str(path), "-noout", "-subject", "-nameopt", "compat"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_certificates_chain_to_their_ca_with_the_identities_rbac_expects(made):
    def verify(name: str, ca: str = "ca") -> None:
        subprocess.run(["openssl", "verify", "-CAfile", str(made.pki / f"{ca}.crt"), str(made.pki / f"{name}.crt")],
                       capture_output=True, check=True)

    for name in ("apiserver", "admin", "kube-controller-manager", "kube-scheduler", "kwok", "apiserver-kubelet-client"):
        verify(name)
    verify("front-proxy-client", "front-proxy-ca")
    assert _subject(made.pki / "admin.crt") == "subject=/O=system:masters/CN=disagg-admin"
    assert _subject(made.pki / "kube-scheduler.crt") == "subject=/CN=system:kube-scheduler"
    sans = subprocess.run(["openssl", "x509", "-in", str(made.pki / "apiserver.crt"), "-noout", "-ext",
                           "subjectAltName"], capture_output=True, text=True, check=True).stdout
    for san in ("IP Address:127.0.0.1", "IP Address:10.96.0.1", "DNS:kubernetes.default.svc.cluster.local"):
        assert san in sans
    assert not list(made.pki.glob("*.csr"))


def test_issue_signs_a_new_identity_with_the_given_extensions(made):
    pki.issue(made.pki, "extra", "/O=system:nodes/CN=system:node:n1", "subjectAltName=IP:10.0.0.9\n" + pki.CLIENT)
    assert _subject(made.pki / "extra.crt") == "subject=/O=system:nodes/CN=system:node:n1"
    text = subprocess.run(["openssl", "x509", "-in", str(made.pki / "extra.crt"), "-noout", "-text"],
                          capture_output=True, text=True, check=True).stdout
    assert "IP Address:10.0.0.9" in text and "TLS Web Client Authentication" in text


def test_kubeconfigs_embed_the_users_own_certificate(made):
    for user, path in (("admin", made.kubeconfig), ("kwok", made.pki / "kwok.kubeconfig")):
        config = yaml.safe_load(path.read_text())
        [cluster], [entry] = config["clusters"], config["users"]
        assert cluster["cluster"]["server"] == f"https://127.0.0.1:{made.ports.api}"
        assert base64.b64decode(cluster["cluster"]["certificate-authority-data"]) == (made.pki / "ca.crt").read_bytes()
        assert entry["name"] == user
        assert base64.b64decode(entry["user"]["client-certificate-data"]) == (made.pki / f"{user}.crt").read_bytes()
        assert base64.b64decode(entry["user"]["client-key-data"]) == (made.pki / f"{user}.key").read_bytes()
        assert config["contexts"][0]["context"] == {"cluster": "disagg", "user": user}


def test_cluster_env_is_what_scripts_node_sources_and_reads_back(tmp_path):
    c = Cluster(tmp_path, BIN, Ports.from_base(27600))
    (tmp_path / "cluster.env").write_text(c.env_text())
    out = subprocess.run(["bash", "-c", 'source "$1/cluster.env"; echo "$BIN_DIR $API_PORT $KWOK_PORT"', "-",
                          str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert out.split() == [BIN, "27600", "27605"]
    assert Cluster.from_env_text(tmp_path, c.env_text()) == c


def test_state_dir_defaults_to_the_repo_and_is_made_absolute(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    assert state_dir({}, repo) == repo / ".cluster"
    assert state_dir({"DISAGG_CLUSTER_DIR": ""}, repo) == repo / ".cluster"
    monkeypatch.chdir(tmp_path)
    assert state_dir({"DISAGG_CLUSTER_DIR": "a/../b/state/"}, repo) == tmp_path / "b" / "state"


def test_fake_nodes_are_kwok_managed_with_gpus():
    nodes = [d for d in yaml.safe_load_all(components.fake_nodes()) if d]
    assert [n["metadata"]["name"] for n in nodes] == ["kwok-node-0", "kwok-node-1"]
    for node in nodes:
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"  # kwok's selector
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"


def test_the_fake_nodes_hold_the_gpu_example_four_times_over():
    """The operator cluster tests make a model per test and delete its namespace in the background:
    the pods of four examples/qwen3-8b.yaml models fit on the kwok nodes at once (first fit), so a
    test's model becomes Ready without waiting for earlier tests' pods to go."""
    example = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "qwen3-8b.yaml").read_text())
    pods = []
    for obj in render_manifests([example], "default"):
        if obj["kind"] == "Deployment":
            requests: dict[str, Decimal] = {}
            for container in obj["spec"]["template"]["spec"]["containers"]:
                for resource, value in container.get("resources", {}).get("requests", {}).items():
                    requests[resource] = requests.get(resource, Decimal(0)) + parse_quantity(value)
            pods += [requests] * obj["spec"]["replicas"]
    assert any("nvidia.com/gpu" in pod for pod in pods)
    free = [{r: parse_quantity(v) for r, v in d["status"]["allocatable"].items()}
            for d in yaml.safe_load_all(components.fake_nodes()) if d]
    for pod in sorted(pods * 4, key=lambda p: -p.get("nvidia.com/gpu", 0)):
        node = next((n for n in free if n["pods"] >= 1 and all(n.get(r, 0) >= q for r, q in pod.items())), None)
        assert node is not None, (pod, free)
        node["pods"] -= 1
        for resource, quantity in pod.items():
            node[resource] -= quantity
