"""``up``, ``down`` and ``status``: processes recorded in <state>/pids, guarded against pid reuse
(a pid counts only while it runs the binary we started), readiness waits that fail fast when a
component exits, and ``down`` that stops exactly what was recorded."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from disagg_cli.cluster import components, node, pki, probes
from disagg_cli.cluster.layout import COMPONENTS, REPO, TOOLS, Cluster, Ports
from disagg_engine.processes import (
    CLUSTER_BLOCK, CLUSTER_PORT_BASES, busy_ports, free_block, is_ours, log_tail, poll_until, start_logged, stop_pids,
)


_children: list[subprocess.Popen] = []  # started by this run of `up`: reaped once they exit


class Failed(Exception):
    """A component did not start or get ready: up stops what it started, keeps the logs."""


def log(msg: str) -> None:
    print(f"cluster: {msg}", file=sys.stderr, flush=True)


def load(state: Path) -> Cluster | None:
    try:
        return Cluster.from_env_text(state, (state / "cluster.env").read_text())
    except (OSError, KeyError, ValueError):
        return None


def pid_of(state: Path, name: str) -> int | None:
    try:
        return int((state / "pids" / name).read_text())
    except (OSError, ValueError):
        return None


def recorded(state: Path) -> list[str]:
    return [n for n in COMPONENTS if (state / "pids" / n).is_file()]


def ours(c: Cluster, name: str) -> bool:
    pid = pid_of(c.dir, name)
    return pid is not None and is_ours(pid, c.exe(name))


# Stopped in this order: the apiserver's clients, the apiserver, etcd. Signalled together with etcd,
# the apiserver took ~11 s to stop (and etcd ~6 s); in this order `down` takes ~2 s.
_STOP_LAST = ("kube-apiserver", "etcd")


def stop_all(c: Cluster) -> bool:
    """TERM, then KILL after 15 s, every recorded component still ours, in reverse start order:
    the others together, then kube-apiserver, then etcd."""
    names = {pid: n for n in reversed(recorded(c.dir)) if (pid := pid_of(c.dir, n)) is not None}

    def running(pid: int) -> bool:
        for child in _children:
            child.poll()  # reap our own exited children: no zombies left behind
        return is_ours(pid, c.exe(names[pid]))

    in_order = lambda pids: " ".join(n for n in COMPONENTS if n in {names[p] for p in pids})  # noqa: E731
    stages = [[p for p, n in names.items() if n not in _STOP_LAST]]
    stages += [[p for p, n in names.items() if n == last] for last in _STOP_LAST]
    left = []
    for pids in filter(None, stages):
        left += stop_pids(pids, running, (signal.SIGTERM, signal.SIGKILL),
                          on_left=lambda sig, pids: log(f"still running after {signal.Signals(sig).name}: "
                                                        f"{in_order(pids)}"))
    return not left


def healthy(state: Path) -> Cluster | None:
    c = load(state)
    if c is None or not all(ours(c, n) for n in COMPONENTS):
        return None
    # All processes are alive: give a busy apiserver time before `up` replaces a cluster in use.
    return c if poll_until(lambda: probes.readyz(c), 30, interval=1) else None


def pick_ports() -> Ports | None:
    """$DISAGG_CLUSTER_PORT_BASE's block if no socket uses it, else the first free block; None
    (with the reason logged) if there is none. Callers hold the lock: the choice is race-free."""
    busy = busy_ports()
    if base := os.environ.get("DISAGG_CLUSTER_PORT_BASE"):
        taken = [p for p in range(int(base), int(base) + CLUSTER_BLOCK) if p in busy]
        if taken:
            log(f"port {taken[0]} is in use")
            return None
        return Ports.from_base(int(base))
    found = free_block(busy)
    if found is None:
        last = CLUSTER_PORT_BASES[-1] + CLUSTER_BLOCK - 1
        log(f"no free block of {CLUSTER_BLOCK} ports in {CLUSTER_PORT_BASES.start}-{last}")
        return None
    return Ports.from_base(found)


def start(c: Cluster, argv: list[str]) -> None:
    name = Path(argv[0]).name
    proc = start_logged(argv, c.dir / "logs" / f"{name}.log")
    _children.append(proc)
    (c.dir / "pids" / name).write_text(f"{proc.pid}\n")

    def exited() -> None:
        if proc.poll() is not None:
            raise Failed(f"{name} did not start")

    if not poll_until(lambda: ours(c, name), 10, interval=0.05, check=exited):
        raise Failed(f"{name} did not start")


def wait_until(c: Cluster, timeout: int, what: str, probe) -> None:
    def exited() -> None:
        for n in recorded(c.dir):
            if not ours(c, n):
                raise Failed(f"{n} exited while waiting for {what}")

    if not poll_until(probe, timeout, interval=0.2, check=exited):
        raise Failed(f"timed out after {timeout}s waiting for {what}")


def log_tails(state: Path) -> None:
    for path in sorted((state / "logs").glob("*.log")):
        tail = log_tail(path, 25)
        print(f"----- {path.name} (last 25 lines) -----" + (f"\n{tail}" if tail else ""), file=sys.stderr)


def export(state: Path) -> None:
    print(f"export KUBECONFIG={state}/kubeconfig", flush=True)


def up(state: Path, timeout: int) -> int:
    if healthy(state):
        log(f"already up and healthy ({state})")
        export(state)
        return 0
    if state.is_dir():
        log(f"stale state in {state}: cleaning up")
        if down(state):
            return 1
    t0 = time.monotonic()
    bins = subprocess.run([str(REPO / "scripts" / "k8s-bins"), *TOOLS], stdout=subprocess.PIPE, text=True)
    if bins.returncode:
        return bins.returncode
    ports = pick_ports()
    if ports is None:
        return 1
    c = Cluster(state, bins.stdout.rstrip("\n"), ports)
    for sub in ("pids", "logs"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "etcd").mkdir()
    (state / "etcd").chmod(0o700)  # etcd warns about a world-readable data dir
    (state / "cluster.env").write_text(c.env_text())
    pki.make_pki(c.pki)
    pki.write_kubeconfig(c.pki, "admin", c.ports.api, c.kubeconfig)
    for user in ("kube-controller-manager", "kube-scheduler", "kwok"):
        pki.write_kubeconfig(c.pki, user, c.ports.api, c.pki / f"{user}.kubeconfig")
    log(f"ports: {c.ports.describe()}")
    try:
        _start_components(c, timeout)
    except Failed as exc:
        log(f"ERROR: {exc}")
        log_tails(state)
        stop_all(c)
        log(f"processes stopped; logs kept in {state}/logs (scripts/cluster down removes them)")
        return 1
    log(f"up in {int(time.monotonic() - t0)}s ({state})")
    export(state)
    return 0


def _start_components(c: Cluster, timeout: int) -> None:
    local = "http://127.0.0.1"
    start(c, components.etcd(c))
    wait_until(c, timeout, "etcd /health", lambda: probes.http_ok(f"{local}:{c.ports.etcd}/health") is not None)
    start(c, components.apiserver(c))
    wait_until(c, timeout, "kube-apiserver /readyz", lambda: probes.readyz(c))
    start(c, components.controller_manager(c))
    start(c, components.scheduler(c))
    start(c, components.kwok(c))
    for what, port in (("kube-controller-manager", c.ports.kcm), ("kube-scheduler", c.ports.scheduler)):
        url = f"https://127.0.0.1:{port}/healthz"
        wait_until(c, timeout, f"{what} /healthz", lambda: probes.http_ok(url, context=probes.insecure()) is not None)
    if probes.kubectl(c, "apply", "-f", "-", input=components.fake_nodes(), stdout=subprocess.DEVNULL,
                      stderr=None).returncode:
        raise Failed("could not create fake nodes")
    wait_until(c, timeout, f"nodes {' '.join(components.NODES)} Ready", lambda: probes.nodes_ready(c))
    wait_until(c, timeout, "ServiceAccount default/default",
               lambda: probes.kubectl(c, "-n", "default", "get", "serviceaccount", "default").returncode == 0)


def down(state: Path) -> int:
    if not state.is_dir():
        log(f"not running ({state} does not exist)")
        return 0
    if (state / "node").is_dir():  # the real node first: its processes and host changes (no drain)
        if node.Node(state, {**os.environ, "DISAGG_NODE_DRAIN": "0"}).down():
            log(f"ERROR: the real node's down failed; state kept in {state}")
            return 1
    c = load(state)
    if c is not None:
        if not stop_all(c):
            log(f"ERROR: could not stop all processes; state kept in {state}")
            return 1
    elif [p for p in (state / "pids").glob("*") if not p.name.startswith(".")]:
        log(f"ERROR: {state} has pids but no cluster.env; not killing blindly")
        return 1
    shutil.rmtree(state)
    log(f"down ({state} removed)")
    return 0


def status(state: Path) -> int:
    c = load(state)
    if c is None:
        print(f"not running ({state})")
        return 1
    rc = 0
    print(f"state: {state}\nbins:  {c.bin_dir}\nports: {c.ports.describe()}")
    for n in COMPONENTS:
        if ours(c, n):
            print(f"  {n}: running (pid {pid_of(state, n)})")
        else:
            print(f"  {n}: NOT running")
            rc = 1
    if probes.readyz(c):
        print("readyz: ok", flush=True)
        nodes = probes.kubectl(c, "get", "nodes", stdout=None, stderr=None)
        if nodes.returncode:
            return nodes.returncode
    else:
        print("readyz: FAILED")
        rc = 1
    export(state)
    return rc
