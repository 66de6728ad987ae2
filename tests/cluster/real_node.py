"""Helpers for tests of the real node (scripts/node): a test pod for it and the node's processes."""
from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

from tests.harness.cluster import BUSYBOX_IMAGE, on_real_node


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


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
