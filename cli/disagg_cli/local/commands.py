"""``disagg up | down | status``: a DisaggregatedModel as local processes (see runner.py)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from disagg_cli.local import runner
from disagg_engine.servers import ServerStartError, stop_all
from disagg_operator.spec import SpecError


def _state_root(args) -> Path:
    return Path(args.state_dir)


def up_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="disagg up", description="Run a DisaggregatedModel on this machine.")
    ap.add_argument("file", type=Path, help="DisaggregatedModel YAML (same schema as the CRD)")
    ap.add_argument("--port", type=int, help="client endpoint port (default: a free port)")
    ap.add_argument("--state-dir", default=".disagg", help="where pids, configs and logs go (default .disagg)")
    ap.add_argument("--detach", action="store_true", help="return once healthy; stop later with `disagg down`")
    args = ap.parse_args(argv)
    try:
        deployment, servers = runner.up(args.file, port=args.port, state_root=_state_root(args))
    except SpecError as exc:
        print(f"disagg up: {exc}", file=sys.stderr)
        return 2
    except ServerStartError as exc:
        print(f"disagg up: {exc}", file=sys.stderr)
        return 1
    print(f"endpoint: {deployment.endpoint}", flush=True)
    if args.detach:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print("Ctrl-C stops everything.", flush=True)
    while not stop.wait(1.0):
        dead = [s.spec.name for s in servers if not s.alive()]
        if dead:
            print(f"disagg up: {', '.join(dead)} exited; stopping", file=sys.stderr)
            break
    runner.down(Path(deployment.state_dir))
    stop_all(servers)  # reaps our children
    return 0


def down_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="disagg down", description="Stop what `disagg up` started.")
    ap.add_argument("--name", help="deployment name (default: the only one)")
    ap.add_argument("--state-dir", default=".disagg")
    args = ap.parse_args(argv)
    stopped = runner.down(runner.find_state(_state_root(args), args.name))
    print(f"stopped {len(stopped)} processes: {', '.join(stopped)}")
    return 0


def status_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="disagg status", description="Show a local deployment.")
    ap.add_argument("--name")
    ap.add_argument("--state-dir", default=".disagg")
    ap.add_argument("--json", action="store_true", help='{"endpoint": URL, "pools": {POOL: [{"url", "pid", "healthy"}]}}')
    args = ap.parse_args(argv)
    report = runner.status(runner.find_state(_state_root(args), args.name))
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"endpoint: {report['endpoint']}")
    for pool, members in report["pools"].items():
        for m in members:
            print(f"  {pool:9s} {m['name']:12s} {m['url']:24s} pid={m['pid']:<7d} {'healthy' if m['healthy'] else 'DOWN'}")
    return 0 if all(m["healthy"] for ms in report["pools"].values() for m in ms) else 1
