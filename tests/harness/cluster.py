"""Session-scoped real Kubernetes control plane (``scripts/cluster``) for tests marked ``cluster``.

The ``cluster`` fixture reuses a healthy cluster in the state dir (``$DISAGG_CLUSTER_DIR`` or
``<repo>/.cluster``) or starts one. Only a cluster started by a pytest session is stopped again,
and only by the last pytest process using it (pytest-xdist workers share one cluster).

The ``real_node`` fixture adds the real kubelet node (``scripts/node``) to that cluster on first
use only, so tests that do not need it pay nothing; pods reach it through ``on_real_node``.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import requests

from disagg_engine.servers import pid_alive

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "scripts" / "cluster"
K8S_BINS_SCRIPT = REPO / "scripts" / "k8s-bins"
NODE_SCRIPT = REPO / "scripts" / "node"
REAL_NODE = "disagg-node"                 # scripts/node's NODE_NAME
REAL_NODE_TAINT = "disagg.dev/real-node"  # NoSchedule: only pods that tolerate it land there
BUSYBOX_IMAGE = "disagg.local/busybox:1"  # built by scripts/node-images, imported by scripts/node up
# A cold scripts/k8s-bins build (first run on a machine) takes ~30 min on 2 cores.
UP_TIMEOUT = float(os.environ.get("DISAGG_CLUSTER_UP_TIMEOUT", "3600"))
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")

T = TypeVar("T")


class ClusterError(AssertionError):
    """A cluster command failed; the message carries its output (and log tails where useful)."""


def default_state_dir() -> Path:
    return Path(os.environ.get("DISAGG_CLUSTER_DIR") or REPO / ".cluster").resolve()


def cluster_script(
    action: str, state_dir: Path, *, timeout: float = UP_TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/cluster <action>`` against ``state_dir`` (no check; callers decide)."""
    full_env = {**os.environ, **(env or {}), "DISAGG_CLUSTER_DIR": str(state_dir)}
    return subprocess.run(
        [str(CLUSTER_SCRIPT), action], env=full_env, capture_output=True, text=True,
        stdin=subprocess.DEVNULL, timeout=timeout,
    )


def node_script(action: str, state_dir: Path, *, timeout: float = UP_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/node <action>`` against the cluster in ``state_dir`` (no check)."""
    env = {**os.environ, "DISAGG_CLUSTER_DIR": str(state_dir)}
    return subprocess.run([str(NODE_SCRIPT), action], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


def on_real_node(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """``pod_spec`` pinned to the real node: its hostname selector and a toleration of its taint."""
    return {
        **pod_spec,
        "nodeSelector": {**pod_spec.get("nodeSelector", {}), "kubernetes.io/hostname": REAL_NODE},
        "tolerations": [*pod_spec.get("tolerations", []),
                        {"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
    }


# What the real node may change on the machine (scripts/node records and restores the same).
HOST_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward",
                "net/ipv4/conf/all/route_localnet")
HOST_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/var/lib/cni", "/run/netns",
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
        "sysctls": {s: Path("/proc/sys", s).read_text().strip() for s in HOST_SYSCTLS},
        "cgroups": sorted(glob.glob("/sys/fs/cgroup/*/kubepods")),
        "paths": [p for p in HOST_PATHS if os.path.lexists(p)],
    }


def read_env(state_dir: Path) -> dict[str, str]:
    """Parse ``cluster.env`` (BIN_DIR and the ports) written by ``scripts/cluster up``."""
    pairs = (line.split("=", 1) for line in (state_dir / "cluster.env").read_text().splitlines() if "=" in line)
    return {k: v for k, v in pairs}


def log_tails(state_dir: Path, lines: int = 30) -> str:
    out = []
    for name in COMPONENTS:
        log = state_dir / "logs" / f"{name}.log"
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"----- {name}.log (last {len(tail)} lines) -----\n" + "\n".join(tail))
    return "\n".join(out) or f"(no component logs in {state_dir / 'logs'})"


@dataclass
class Cluster:
    state_dir: Path
    kubeconfig: Path
    bin_dir: Path
    ports: dict[str, int]

    @classmethod
    def from_state_dir(cls, state_dir: Path) -> "Cluster":
        env = read_env(state_dir)
        ports = {k: int(v) for k, v in env.items() if k.endswith("_PORT")}
        return cls(state_dir, state_dir / "kubeconfig", Path(env["BIN_DIR"]), ports)

    def run(
        self, tool: str, args: Sequence[str], *, input: str | None = None, check: bool = True,
        timeout: float = 180,
    ) -> subprocess.CompletedProcess[str]:
        """Run a cached binary against this cluster; on failure raise with its output."""
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            # Keep helm's repo/cache config inside the state dir, never the user's ~/.config.
            "HELM_CONFIG_HOME": str(self.state_dir / "helm" / "config"),
            "HELM_CACHE_HOME": str(self.state_dir / "helm" / "cache"),
            "HELM_DATA_HOME": str(self.state_dir / "helm" / "data"),
        }
        cmd = [str(self.bin_dir / tool), *args]
        proc = subprocess.run(
            cmd, input=input, env=env, capture_output=True, text=True, timeout=timeout,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            raise ClusterError(
                f"{tool} {' '.join(args)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        # A private discovery cache: fresh CRDs show up without touching ~/.kube/cache.
        cache = f"--cache-dir={self.state_dir / 'kubectl-cache'}"
        return self.run("kubectl", [f"--kubeconfig={self.kubeconfig}", cache, *args],
                        input=input, check=check, timeout=timeout)

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return self.run("helm", [f"--kubeconfig={self.kubeconfig}", *args],
                        input=input, check=check, timeout=timeout)

    def api(self, method: str, path: str, body: dict | None = None, *, as_user: str | None = None,
            accept: str = "application/json", timeout: float = 30) -> dict[str, Any]:
        """One API request as the admin (optionally impersonating ``as_user``, like ``kubectl --as``),
        in-process: for checks made by the hundred, where a kubectl process each costs 0.1 CPU-s."""
        pki = self.state_dir / "pki"
        headers = {"Accept": accept, **({"Impersonate-User": as_user} if as_user else {})}
        resp = requests.request(method, f"https://127.0.0.1:{self.ports['API_PORT']}{path}", json=body,
                                headers=headers, timeout=timeout, verify=str(pki / "ca.crt"),
                                cert=(str(pki / "admin.crt"), str(pki / "admin.key")))
        if resp.status_code >= 300:
            raise ClusterError(f"{method} {path} -> {resp.status_code}: {resp.text[:2000]}")
        return resp.json()

    def log_tails(self, lines: int = 30) -> str:
        return log_tails(self.state_dir, lines)

    def wait_for(self, probe: Callable[[], T], what: str, timeout: float = 90, interval: float = 0.25) -> T:
        """Poll ``probe`` until it returns something truthy; on timeout fail with log tails."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            try:
                last = probe()
                if last:
                    return last
            except (ClusterError, subprocess.TimeoutExpired) as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"timed out after {timeout}s waiting for {what}; last result: {last!r}\n{self.log_tails()}"
                )
            time.sleep(interval)

    def wait_established(self, crd: str, timeout: float = 60) -> None:
        """Poll a CRD's Established condition (`kubectl wait` fails on a CRD that has no conditions yet)."""
        def established() -> bool:
            obj = json.loads(self.kubectl("get", "crd", crd, "-o", "json").stdout)
            return any(c["type"] == "Established" and c["status"] == "True"
                       for c in obj.get("status", {}).get("conditions") or [])

        self.wait_for(established, f"{crd} established", timeout=timeout)

    def create_namespace(self, prefix: str) -> str:
        """A fresh namespace with a unique name (tests stay independent across runs)."""
        name = f"{prefix[:40].rstrip('-').lower()}-{os.urandom(3).hex()}"
        self.kubectl("create", "namespace", name)
        return name


# --- session fixture --------------------------------------------------------------------------

@contextmanager
def _session_lock(state_dir: Path) -> Iterator[None]:
    # Outside the state dir: `scripts/cluster down` removes that dir.
    key = hashlib.sha1(str(state_dir).encode()).hexdigest()[:12]
    with open(Path(tempfile.gettempdir()) / f"disagg-cluster-{key}.pytest.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield



def _start_or_reuse(state_dir: Path) -> None:
    """Start the cluster unless a healthy one is there; register this process as a user."""
    users = state_dir / "pytest-users"
    if cluster_script("status", state_dir, timeout=60).returncode != 0:
        up = cluster_script("up", state_dir)
        if up.returncode != 0:
            raise ClusterError(
                f"scripts/cluster up failed ({up.returncode})\nstdout:\n{up.stdout}\n"
                f"stderr:\n{up.stderr}\n{log_tails(state_dir)}"
            )
        (state_dir / "pytest-owned").touch()  # started by pytest: the last user stops it
    users.mkdir(exist_ok=True)
    (users / str(os.getpid())).touch()


def _release(state_dir: Path) -> str | None:
    """Unregister; stop the cluster if pytest started it and nobody else uses it. Returns an error."""
    users = state_dir / "pytest-users"
    (users / str(os.getpid())).unlink(missing_ok=True)
    others = [p for p in users.glob("*") if p.name.isdigit() and pid_alive(int(p.name))] if users.is_dir() else []
    if others or not (state_dir / "pytest-owned").exists():
        return None
    down = cluster_script("down", state_dir, timeout=120)
    if down.returncode != 0:
        return f"scripts/cluster down failed ({down.returncode}):\n{down.stdout}\n{down.stderr}"
    return None


def ensure_cluster() -> Cluster:
    """The session's cluster, started or reused as the ``cluster`` fixture does (for work outside
    fixtures; the fixture, which every cluster test uses, releases it at the end)."""
    state_dir = default_state_dir()
    with _session_lock(state_dir):
        _start_or_reuse(state_dir)
    return Cluster.from_state_dir(state_dir)


_starting: Future[Cluster] | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the control plane in the background as soon as a collected test needs it: the modules
    that need neither it nor an engine run first (tests/harness/engine.py orders them)."""
    global _starting
    if not session.config.option.collectonly and any(
            "cluster" in getattr(item, "fixturenames", ()) for item in session.items):
        _starting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cluster-start").submit(ensure_cluster)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Release a cluster started in the background for tests that never ran (e.g. after ``-x``)."""
    if _starting is not None and _starting.exception() is None:
        _release_session(_starting.result())


def _release_session(c: Cluster) -> None:
    global _starting
    _starting = None
    with _session_lock(c.state_dir):
        error = _release(c.state_dir)
    if error:
        raise ClusterError(error)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The real control plane: etcd, kube-apiserver, controller-manager, scheduler, kwok (2 nodes)."""
    c = _starting.result() if _starting is not None else ensure_cluster()
    try:
        yield c
    finally:
        _release_session(c)


@dataclass
class RealNodeSession:
    started: bool = False               # this process started the node: it stops it at the end
    before: dict[str, Any] | None = None  # host_state() just before that start


REAL_NODE_SESSION = RealNodeSession()  # one per process: background starts use it too (tests/harness/cluster_tiny.py)


@pytest.fixture(scope="session")
def real_node_session(cluster: Cluster) -> Iterator[RealNodeSession]:
    session = REAL_NODE_SESSION
    yield session
    users = cluster.state_dir / "pytest-users"
    others = [p for p in users.glob("*") if p.name.isdigit() and int(p.name) != os.getpid()
              and pid_alive(int(p.name))] if users.is_dir() else []
    if session.started and not others and (cluster.state_dir / "node").exists():
        down = node_script("down", cluster.state_dir, timeout=300)
        if down.returncode != 0:
            raise ClusterError(f"scripts/node down failed ({down.returncode}):\n{down.stderr}")


@pytest.fixture
def real_node(cluster: Cluster, real_node_session: RealNodeSession) -> str:
    """The real kubelet node's name, started on first use (and again if a test stopped it)."""
    return start_real_node(cluster, real_node_session)


def start_real_node(cluster: Cluster, real_node_session: RealNodeSession) -> str:
    """``scripts/node up`` (idempotent), for fixtures of any scope; the session stops what it started."""
    with _session_lock(cluster.state_dir):
        before = None if (cluster.state_dir / "node").exists() else host_state()
        up = node_script("up", cluster.state_dir)  # idempotent: a healthy node returns at once
        if up.returncode != 0:
            raise ClusterError(f"scripts/node up failed ({up.returncode})\n{up.stderr}")
        if "already up" not in up.stderr:
            real_node_session.started = True
            real_node_session.before = before
    return REAL_NODE
