"""``scripts/node up|down|status``: the real kubelet node (``node_config.py``) beside the kwok nodes.

Host-wide things (cgroups, sysctls, iptables, the bridge, kubelet's fixed paths) allow one real
node per machine: ``up`` waits for a lock that the node's processes hold while they live.
Everything ``up`` changes outside the state dir is recorded first in <node>/before and restored by
``down``. Processes are recorded in <node>/pids/<name> as "<pid> <exe>" and count as ours only
while /proc/<pid>/exe is still <exe>.

Env: DISAGG_CLUSTER_DIR (as scripts/cluster), DISAGG_CLUSTER_TIMEOUT (per readiness wait),
DISAGG_NODE_LOCK_TIMEOUT (s, 600), DISAGG_NODE_DRAIN (0: ``down`` skips draining through the API).
"""

from __future__ import annotations

import fcntl
import glob
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from disagg_cli.cluster import node_config as nc
from disagg_cli.cluster import pki, probes
from disagg_cli.cluster.layout import REPO, SERVICE_CIDR, Cluster, cache_dir, readiness_timeout, state_dir
from disagg_engine.processes import is_ours, log_tail, pid_alive, poll_until, start_logged, stop_pids

SCRIPTS = REPO / "scripts"


class Failed(Exception):
    """The node did not come up: ``up`` prints the logs' tails and undoes what it did."""


def log(msg: str) -> None:
    print(f"node: {msg}", file=sys.stderr, flush=True)


def _run(*argv: str, check: bool = False) -> subprocess.CompletedProcess:
    """A host command; its errors are shown only when they stop ``up`` (``check``)."""
    return subprocess.run(argv, check=check, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=None if check else subprocess.DEVNULL)


def _script(name: str, *args: str) -> str:
    """Run scripts/<name> (a build or an install), its stdout."""
    return subprocess.run([str(SCRIPTS / name), *args], check=True, stdout=subprocess.PIPE, text=True).stdout


class Node:
    def __init__(self, state: Path, environ: dict[str, str]):
        self.state = state
        self.n = nc.NodeDir(state / "node", state / "pki")
        self.environ = environ
        self.cache = Path(os.path.realpath(cache_dir(environ)))
        self.engine_cache = self.cache / "node-engine-home"  # kept across node restarts: a cache, like the rest
        self.cluster = self._load()

    def _load(self) -> Cluster | None:
        try:
            return Cluster.from_env_text(self.state, (self.state / "cluster.env").read_text())
        except (OSError, KeyError, ValueError):
            return None

    @property
    def dir(self) -> Path:
        return self.n.dir

    # --- processes -----------------------------------------------------------------------------

    def _recorded(self, name: str) -> tuple[int, str] | None:
        try:
            pid, exe = self.n.pidfile(name).read_text().split(maxsplit=1)
            return int(pid), exe.strip()
        except (OSError, ValueError):
            return None

    def alive(self, name: str) -> bool:
        rec = self._recorded(name)
        return rec is not None and is_ours(*rec)

    def spawn(self, name: str, argv: list[str], lock_fd: int) -> None:
        """In its own session, holding the node lock (its fd), not the cluster's."""
        self.n.log(name).unlink(missing_ok=True)
        proc = start_logged(argv, self.n.log(name), pass_fds=(lock_fd,))
        self.n.pidfile(name).write_text(f"{proc.pid} {argv[0]}\n")

    @staticmethod
    def stop(pids: list[int], signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGKILL)) -> None:
        """Each signal in turn, STOP_GRACE apart, until they are gone."""
        def left(sig: int, pids: list[int]) -> None:
            if sig == signals[-1]:
                log(f"still running after SIGKILL: {' '.join(map(str, pids))}")
        stop_pids(pids, pid_alive, signals, on_left=left)

    def strays(self) -> list[int]:
        """Processes outside pids/ that belong to this node: containerd's shims and whatever still
        runs in its cgroups (found by this node's socket path and cgroup names, never by a name)."""
        found = set()
        sock = str(self.n.socket).encode()
        for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                if sock in Path(cmdline).read_bytes():
                    found.add(int(cmdline.split("/")[2]))
            except OSError:
                pass
        for depth in range(4):
            for procs in glob.glob("/sys/fs/cgroup/*/kubepods/" + "*/" * depth + "cgroup.procs"):
                try:
                    found.update(int(p) for p in Path(procs).read_text().split())
                except OSError:
                    pass
        return sorted(found - {os.getpid()})

    def wait_for(self, what: str, seconds: int, probe) -> None:
        def exited() -> None:
            for name in nc.PROCESSES:
                if self.n.pidfile(name).is_file() and not self.alive(name):
                    raise Failed(f"{name} exited while waiting for {what}")
        if not poll_until(probe, seconds, interval=0.2, check=exited):
            raise Failed(f"timed out after {seconds}s waiting for {what}")

    # --- the cluster ---------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
        assert self.cluster is not None
        return probes.kubectl(self.cluster, *args, input=input)

    def node_ready(self) -> bool:
        ready = '{.status.conditions[?(@.type=="Ready")].status}'
        return self.kubectl("get", "node", nc.NODE_NAME, "-o", f"jsonpath={ready}").stdout == "True"

    def dns_ready(self) -> bool:
        return probes.http_ok(f"http://{nc.NODE_IP}:{nc.DNS_READY_PORT}/ready") is not None

    def healthy(self) -> bool:
        return all(self.alive(p) for p in nc.PROCESSES) and self.node_ready()

    def objects(self) -> str:
        assert self.cluster is not None
        return nc.cluster_objects(self.n, str(self.cache), str(self.engine_cache), self.cluster.ports.api)

    # --- host state, recorded before anything changes -----------------------------------------

    @staticmethod
    def chains(tool: str) -> tuple[set[str], dict[str, str]]:
        """``<tool>`` is iptables or ip6tables: its chains, and each table's saved text."""
        texts = {t: subprocess.run([f"{tool}-save", "-t", t], capture_output=True, text=True).stdout
                 for t in nc.IPTABLES_TABLES}
        return set().union(*(nc.chains(t, text) for t, text in texts.items())), texts

    def snapshot(self) -> None:
        before = self.dir / "before"
        before.mkdir(parents=True, exist_ok=True)
        values = []
        for name in nc.SYSCTLS:
            try:
                values.append(f"{name}={_sysctl(name).read_text().strip()}")
            except OSError:
                pass
        (before / "sysctl").write_text("".join(v + "\n" for v in values))
        (before / "paths").write_text("".join(p + "\n" for p in nc.HOST_PATHS if os.path.exists(p)))
        for tool in ("iptables", "ip6tables"):
            (before / tool).write_text("".join(c + "\n" for c in sorted(self.chains(tool)[0])))
        (before / "cgroups").write_text("".join(p + "\n" for p in glob.glob("/sys/fs/cgroup/*/kubepods")))

    def _before(self, name: str) -> set[str] | None:
        try:
            return set((self.dir / "before" / name).read_text().splitlines())
        except OSError:
            return None

    # --- up ------------------------------------------------------------------------------------

    def up(self) -> int:
        if self.cluster is None:
            log(f"the cluster is not up ({self.state}): run scripts/cluster up first")
            return 1
        if self.dir.is_dir() and self.healthy():
            log(f"already up ({nc.NODE_NAME})")
            return 0
        if self.dir.is_dir():
            log(f"stale node state in {self.dir}: cleaning up")
            self.down()
        if not (self.state / "pki" / "apiserver-kubelet-client.crt").is_file():
            log("WARNING: this cluster predates the real node: kubectl logs/exec need scripts/cluster down + up")
        t0 = time.monotonic()
        _script("node-deps")
        bin_dir = _script("k8s-bins", "kubelet", "kube-proxy").strip()  # built on first use
        coredns = _script("node-coredns").strip()
        images = _script("node-images").split()
        lock = self._lock()
        try:
            self._start(lock.fileno(), bin_dir, coredns, images)
        except (Failed, subprocess.CalledProcessError) as exc:
            log(f"ERROR: {exc}")
            for path in sorted((self.dir / "logs").glob("*.log")):
                print(f"----- {path.name} -----\n{log_tail(path, 20)}", file=sys.stderr)
            log("cleaning up")
            self.down()
            return 1
        log(f"up in {int(time.monotonic() - t0)}s: {nc.NODE_NAME} ({nc.NODE_IP}), taint {nc.TAINT}:NoSchedule")
        return 0

    def _lock(self):
        lock = open(nc.LOCK, "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = nc.OWNER.read_text().strip() if nc.OWNER.is_file() else "?"
            log(f"waiting for the real node of {owner} (one per machine)")

            def taken() -> bool:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    return False
            if not poll_until(taken, int(self.environ.get("DISAGG_NODE_LOCK_TIMEOUT") or nc.LOCK_TIMEOUT), 0.5):
                log("ERROR: the machine's real node is still in use")
                raise SystemExit(1)
        # The lock is free, so no node runs; a previous owner that died without `down` left state.
        prev = nc.OWNER.read_text().strip() if nc.OWNER.is_file() else ""
        if prev and prev != str(self.state) and (Path(prev) / "node").is_dir():
            log(f"cleaning up the dead node of {prev}")
            Node(Path(prev), self.environ).down()
        nc.OWNER.write_text(f"{self.state}\n")
        # Leftovers of a node whose state dir is gone: the names are this module's own.
        if _run("ip", "link", "del", nc.BRIDGE).returncode == 0:
            log(f"removed a stale {nc.BRIDGE}")
        for chain in ("OUTPUT", "FORWARD"):
            _run("iptables", "-D", chain, "-j", nc.IPTABLES_GUARD)
        if _run("iptables", "-F", nc.IPTABLES_GUARD).returncode == 0 and _run("iptables", "-X", nc.IPTABLES_GUARD).returncode == 0:
            log(f"removed a stale {nc.IPTABLES_GUARD} chain")
        return lock

    def _start(self, lock_fd: int, bin_dir: str, coredns: str, images: list[str]) -> None:
        assert self.cluster is not None
        for sub in ("pids", "logs", "pod-logs", "volume-plugins"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        for shared in (self.dir / "kv-shared", self.engine_cache):  # engines run as uid 1000; a hostPath gets no fsGroup
            shared.mkdir(parents=True, exist_ok=True)
            shared.chmod(0o1777)
        self.snapshot()
        _run("ip", "link", "add", nc.BRIDGE, "type", "bridge", check=True)
        (self.dir / "bridge-created").touch()
        _run("ip", "addr", "add", f"{nc.NODE_IP}/{nc.POD_CIDR.split('/')[1]}", "dev", nc.BRIDGE, check=True)
        _run("ip", "link", "set", nc.BRIDGE, "up", check=True)
        # ClusterIPs route to the bridge, never the default route: traffic kube-proxy has not (yet)
        # translated stays on this machine. The route goes with the bridge.
        _run("ip", "route", "add", SERVICE_CIDR, "dev", nc.BRIDGE, "src", nc.NODE_IP, check=True)
        for cert in nc.CERTIFICATES:
            pki.issue(self.n.pki, cert.name, cert.subject, cert.extensions)
            if cert.kubeconfig:
                pki.write_kubeconfig(self.n.pki, cert.name, self.cluster.ports.api, self.n.pki / f"{cert.name}.kubeconfig")
        for path, text in nc.config_files(self.n).items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        argv = nc.commands(self.n, bin_dir, coredns, self.cluster.ports.api)
        ctr = ["ctr", "--address", str(self.n.socket), "-n", nc.CTR_NAMESPACE]
        self.spawn("containerd", argv["containerd"], lock_fd)
        self.wait_for("containerd", nc.CONTAINERD_TIMEOUT, lambda: _run(*ctr, "version").returncode == 0)
        for image in images:
            if _run(*ctr, "images", "import", image).returncode:
                raise Failed(f"import {image}")
        self.spawn("kubelet", argv["kubelet"], lock_fd)
        for rule in nc.guard_rules():
            _run("iptables", *rule, check=True)
        self.spawn("kube-proxy", argv["kube-proxy"], lock_fd)
        self.spawn("api-relay", argv["api-relay"], lock_fd)
        applied = self.kubectl("apply", "-f", "-", input=self.objects())
        if applied.returncode:
            raise Failed(f"could not create the node's cluster objects: {applied.stderr.strip()}")
        self.spawn("coredns", argv["coredns"], lock_fd)
        timeout = readiness_timeout(self.environ)
        self.wait_for(f"node {nc.NODE_NAME} Ready", timeout, self.node_ready)
        self.wait_for("CoreDNS ready", timeout, self.dns_ready)

    # --- down ----------------------------------------------------------------------------------

    def down(self) -> int:
        if not self.dir.is_dir():
            log(f"no node in {self.state}")
            return 0
        # 1. While the cluster stays up, drain through the API so no pod is left Terminating on a
        #    dead node: kubelet stops the containers and tears down their networks (CNI DEL) itself.
        #    Bounded: a dead apiserver or kubelet must not block the rest. (scripts/cluster down skips this.)
        if self.environ.get("DISAGG_NODE_DRAIN", "1") == "1" and self.cluster is not None:
            if self.alive("kubelet") and self.node_ready():
                self.kubectl("cordon", nc.NODE_NAME)
                if self.kubectl("delete", "pods", "-A", "--field-selector", f"spec.nodeName={nc.NODE_NAME}",
                                "--grace-period=1", "--timeout=30s", "--wait=true").returncode:
                    log(f"draining {nc.NODE_NAME} timed out; killing its containers")
            self.kubectl("delete", "node", nc.NODE_NAME, "--wait=false")
            self.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=self.objects())
        # 2. The node's daemons; containers the drain did not stop are killed through containerd.
        #    The relay's per-connection children share its process group (it leads its session).
        if self.alive("api-relay"):
            pid = self._recorded("api-relay")[0]  # type: ignore[index]
            try:
                os.killpg(pid, signal.SIGTERM)
            except OSError:
                pass
            self.stop([pid])
        for name in ("coredns", "kube-proxy", "kubelet"):
            if self.alive(name):
                self.stop([self._recorded(name)[0]])  # type: ignore[index]
        if self.alive("containerd"):
            ctr = ["ctr", "--address", str(self.n.socket), "-n", nc.CTR_NAMESPACE]
            tasks = subprocess.run([*ctr, "tasks", "ls", "-q"], capture_output=True, text=True).stdout.split()
            for task in tasks:
                _run(*ctr, "tasks", "kill", "-s", "SIGKILL", task)
            self.stop([self._recorded("containerd")[0]])  # type: ignore[index]
        # Shims and containers without their containerd: nothing to wait for (a container's PID 1
        # without a handler would ignore TERM).
        if strays := self.strays():
            self.stop(strays, (signal.SIGKILL,))
        # 3. Mounts (rootfs, volumes, the pods' network namespaces: all under the node dir), then
        #    links: the veths went with their namespaces, unless a container process still held one.
        umount_under(str(self.dir))
        if (self.dir / "bridge-created").is_file():
            ports = subprocess.run(["ip", "-o", "link", "show", "master", nc.BRIDGE], capture_output=True, text=True)
            for line in ports.stdout.splitlines():
                _run("ip", "link", "del", line.split(": ")[1].split("@")[0])
            _run("ip", "link", "del", nc.BRIDGE)
        # 4. iptables chains and sysctls.
        for tool in ("iptables", "ip6tables"):
            self.del_chains(tool)
        for line in sorted(self._before("sysctl") or ()):
            name, value = line.split("=", 1)
            try:
                if _sysctl(name).read_text().strip() != value:
                    _sysctl(name).write_text(value)
            except OSError:
                log(f"could not restore {name}={value}")
        # 5. kubepods cgroups (every v1 hierarchy), deepest first; then fixed paths this node created.
        cgroups_before = self._before("cgroups") or set()
        for cgroup in glob.glob("/sys/fs/cgroup/*/kubepods"):
            if cgroup not in cgroups_before and not rmdir_tree(cgroup):
                log(f"could not remove {cgroup}")
        paths_before = self._before("paths")
        for path in nc.HOST_PATHS:
            if os.path.exists(path) and paths_before is not None and path not in paths_before:
                umount_under(path)
                shutil.rmtree(path, ignore_errors=True)
        # Kept paths that existed before: only entries that point into this node.
        for link in glob.glob("/var/log/containers/*"):
            if os.path.islink(link) and os.readlink(link).startswith(f"{self.dir}/"):
                os.unlink(link)
        for result in glob.glob(f"/var/lib/cni/results/{nc.CNI_NETWORK}-*"):
            os.unlink(result)
        if nc.OWNER.is_file() and nc.OWNER.read_text().strip() == str(self.state):
            nc.OWNER.unlink()
        shutil.rmtree(self.dir, ignore_errors=True)
        log("down")
        return 0

    def del_chains(self, tool: str) -> None:
        """The chains this node added (not in the snapshot), after every rule that jumps into them."""
        now, texts = self.chains(tool)
        ours = nc.added_chains(now, self._before(tool) or set())
        if not ours:
            return
        for table, text in texts.items():
            for rule in nc.jumps_into(table, text, ours):
                _run(tool, "-t", table, "-D", *shlex.split(rule)[1:])  # iptables-save quotes comments
        for action in ("-F", "-X"):
            for chain in ours:
                table, name = chain.split(" ", 1)
                _run(tool, "-t", table, action, name)

    # --- status --------------------------------------------------------------------------------

    def status(self) -> int:
        if not self.dir.is_dir():
            print(f"no node ({self.state})")
            return 1
        if self.cluster is None:
            return 1
        rc = 0
        for name in nc.PROCESSES:
            if self.alive(name):
                print(f"  {name}: running (pid {self._recorded(name)[0]})")  # type: ignore[index]
            else:
                print(f"  {name}: NOT running")
                rc = 1
        sys.stdout.flush()
        got = probes.kubectl(self.cluster, "get", "node", nc.NODE_NAME, "-o", "wide", stdout=None, stderr=None)
        return rc or got.returncode


def _sysctl(name: str) -> Path:
    return Path("/proc/sys", name.replace(".", "/"))


def umount_under(prefix: str) -> None:
    """Every mount at or below ``prefix``, deepest first (lazily if busy)."""
    targets = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout.splitlines()
    for target in sorted((t for t in targets if t == prefix or t.startswith(prefix + "/")), reverse=True):
        if _run("umount", target).returncode:
            _run("umount", "-l", target)


def rmdir_tree(root: str) -> bool:
    """rmdir ``root`` and every directory under it, deepest first (a cgroup goes with rmdir alone)."""
    ok = True
    for directory, _, _ in os.walk(root, topdown=False):
        try:
            os.rmdir(directory)
        except OSError:
            ok = False
    return ok


def main(argv: list[str]) -> int:
    node = Node(state_dir(dict(os.environ)), dict(os.environ))
    action = {"up": node.up, "down": node.down, "status": node.status}.get(argv[0] if len(argv) == 1 else "")
    if action is None:
        print("usage: scripts/node up|down|status", file=sys.stderr)
        return 2
    return action()
