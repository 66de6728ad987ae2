"""``scripts/cluster up|down|status`` and ``scripts/node up|down|status`` (``node ...``).

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

from disagg_cli.cluster.layout import readiness_timeout, state_dir

USAGE = """usage: scripts/cluster up|down|status
  up      start (idempotent), print `export KUBECONFIG=...`
  down    stop the real node if any (scripts/node), then exactly the recorded processes;
          remove the state dir
  status  show ports, processes and health
   or: scripts/node up|down|status (python -m disagg_cli.cluster node ...)"""
_lock = None  # the open lock file, held until we exit


def _locked() -> None:
    """One global lock for up/down of any state dir (also keeps port picking race-free); the
    same file scripts/cluster's earlier bash took with flock(1). Held until we exit."""
    global _lock
    _lock = open(os.path.join(os.environ.get("TMPDIR") or "/tmp", "disagg-cluster.lock"), "w")
    fcntl.flock(_lock, fcntl.LOCK_EX)


def main(argv: list[str]) -> int:
    state = state_dir(dict(os.environ))
    state.parent.mkdir(parents=True, exist_ok=True)
    cmd, args = (argv[0], argv[1:]) if argv else ("", [])
    if cmd == "node":
        from disagg_cli.cluster import node
        return node.main(args)
    if cmd not in ("up", "down", "status") or args:
        print(USAGE, file=sys.stderr)
        return 2
    from disagg_cli.cluster import lifecycle
    if cmd == "up":
        _locked()
        return lifecycle.up(state, readiness_timeout(dict(os.environ)))
    if cmd == "down":
        _locked()
        return lifecycle.down(state)
    return lifecycle.status(state)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as exc:
        print(f"cluster: ERROR: {' '.join(map(str, exc.cmd))} exited with {exc.returncode}", file=sys.stderr)
        sys.exit(1)
