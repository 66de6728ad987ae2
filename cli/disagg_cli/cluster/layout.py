"""Where a cluster's state lives and which ports it uses (pure)."""

from __future__ import annotations

import ipaddress
import os.path
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")  # start order
NODES = ("kwok-node-0", "kwok-node-1")
TOOLS = (*COMPONENTS, "kubectl", "helm")  # what scripts/k8s-bins must provide
DEFAULT_TIMEOUT = 120  # seconds for each readiness wait ($DISAGG_CLUSTER_TIMEOUT)
SERVICE_CIDR = "10.96.0.0/16"  # the apiserver's Service range; the real node routes it to its bridge
API_SERVICE_IP = str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))  # the `kubernetes` Service's ClusterIP
CLUSTER_DOMAIN = "cluster.local"


def readiness_timeout(environ: dict[str, str]) -> int:
    """Seconds allowed for each readiness wait of the control plane and the real node."""
    return int(environ.get("DISAGG_CLUSTER_TIMEOUT") or DEFAULT_TIMEOUT)


def cache_dir(environ: dict[str, str]) -> Path:
    """$DISAGG_CACHE or ~/.cache/disagg: what `make setup` and the Kubernetes builds cache."""
    return Path(environ.get("DISAGG_CACHE") or Path.home() / ".cache" / "disagg")


def state_dir(environ: dict[str, str] | None, repo: Path = REPO) -> Path:
    """$DISAGG_CLUSTER_DIR (empty means unset) or <repo>/.cluster, made absolute without
    resolving symlinks."""
    raw = (environ or {}).get("DISAGG_CLUSTER_DIR") or str(repo / ".cluster")
    raw = raw.rstrip("/") or "/"
    path = Path(raw)
    return Path(os.path.abspath(path.parent)) / path.name


@dataclass(frozen=True)
class Ports:
    api: int
    etcd: int
    etcd_peer: int
    kcm: int
    scheduler: int
    kwok: int

    @classmethod
    def from_base(cls, base: int) -> "Ports":
        return cls(base, base + 1, base + 2, base + 3, base + 4, base + 5)

    def describe(self) -> str:
        return (f"apiserver {self.api}, etcd {self.etcd}/{self.etcd_peer}, kcm {self.kcm}, "
                f"scheduler {self.scheduler}, kwok {self.kwok}")


@dataclass(frozen=True)
class Cluster:
    """One cluster: its state dir, binaries and ports (what cluster.env records)."""
    dir: Path
    bin_dir: str
    ports: Ports

    @property
    def pki(self) -> Path:
        return self.dir / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    def exe(self, name: str) -> str:
        return f"{self.bin_dir}/{name}"

    def env_text(self) -> str:
        """cluster.env: shell assignments, read by the real node (``node.py``) and the test harness."""
        p = self.ports
        return (f"BIN_DIR={self.bin_dir}\nAPI_PORT={p.api}\nETCD_PORT={p.etcd}\nETCD_PEER_PORT={p.etcd_peer}\n"
                f"KCM_PORT={p.kcm}\nSCHED_PORT={p.scheduler}\nKWOK_PORT={p.kwok}\n")

    @classmethod
    def from_env_text(cls, state: Path, text: str) -> "Cluster":
        env = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        ports = Ports(*(int(env[k]) for k in ("API_PORT", "ETCD_PORT", "ETCD_PEER_PORT", "KCM_PORT",
                                              "SCHED_PORT", "KWOK_PORT")))
        return cls(state, env["BIN_DIR"], ports)
