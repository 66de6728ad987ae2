"""``scripts/cluster up|down|status`` (and ``issue``/``kubeconfig``/``dir`` for scripts/node).

Env: DISAGG_CLUSTER_DIR  state dir (default <repo>/.cluster): kubeconfig, cluster.env, pki/,
                         pids/, logs/, etcd/
     DISAGG_CLUSTER_PORT_BASE  first of 6 consecutive ports (default: first free block from
                         27400 in steps of 10)
     DISAGG_CLUSTER_TIMEOUT  seconds allowed for each readiness wait (default 120)
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

from disagg_cli.cluster import pki
from disagg_cli.cluster.layout import DEFAULT_TIMEOUT, Cluster, state_dir

USAGE = """usage: scripts/cluster up|down|status
  up      start (idempotent), print `export KUBECONFIG=...`
  down    stop the real node if any (scripts/node), then exactly the recorded processes;
          remove the state dir
  status  show ports, processes and health
for scripts/node: dir | issue NAME SUBJECT EXTENSIONS [CA] | kubeconfig USER FILE"""
_lock = None  # the open lock file, held until we exit


def _locked() -> None:
    """One global lock for up/down of any state dir (also keeps port picking race-free); the
    same file scripts/cluster's earlier bash took with flock(1). Held until we exit."""
    global _lock
    _lock = open(os.path.join(os.environ.get("TMPDIR") or "/tmp", "disagg-cluster.lock"), "w")
    fcntl.flock(_lock, fcntl.LOCK_EX)


def main(argv: list[str]) -> int:
    # scripts/node calls the helpers once per certificate: they do not import lifecycle (ssl, urllib).
    state = state_dir(dict(os.environ))
    state.parent.mkdir(parents=True, exist_ok=True)
    cmd, args = (argv[0], argv[1:]) if argv else ("", [])
    if cmd in ("up", "down", "status") and not args:
        from disagg_cli.cluster import lifecycle
    if cmd == "up" and not args:
        _locked()
        return lifecycle.up(state, int(os.environ.get("DISAGG_CLUSTER_TIMEOUT") or DEFAULT_TIMEOUT))
    if cmd == "down" and not args:
        _locked()
        return lifecycle.down(state)
    if cmd == "status" and not args:
        return lifecycle.status(state)
    if cmd == "dir" and not args:
        print(state)
        return 0
    if cmd == "issue" and len(args) in (3, 4):
        pki.issue(state / "pki", *args)
        return 0
    if cmd == "kubeconfig" and len(args) == 2:
        env = state / "cluster.env"
        if not env.is_file():
            print(f"cluster: not running ({state}): no cluster.env", file=sys.stderr)
            return 1
        cluster = Cluster.from_env_text(state, env.read_text())
        pki.write_kubeconfig(cluster.pki, args[0], cluster.ports.api, Path(os.path.abspath(args[1])))
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as exc:
        print(f"cluster: ERROR: {' '.join(map(str, exc.cmd))} exited with {exc.returncode}", file=sys.stderr)
        sys.exit(1)
