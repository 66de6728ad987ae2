"""``disagg up | down | status | supervise``: a DisaggregatedModel as local processes (see runner.py
and supervise.py)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from disagg_cli.local import runner
from disagg_cli.local.supervise import Supervisor
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
        try:
            _start_supervisor(deployment)
        except ServerStartError as exc:
            print(f"disagg up: {exc}", file=sys.stderr)
            return 1
        return 0
    stop = _stop_on_signals()
    print("Ctrl-C stops everything.", flush=True)
    supervisor = Supervisor(deployment.members(servers), deployment.record, lambda line: print(line, file=sys.stderr,
                                                                                                flush=True))
    supervisor.run(stop.wait)
    _report_down(*runner.down(Path(deployment.state_dir)))
    stop_all(servers)  # reaps our children
    for m in supervisor.members:
        if m.proc is not None:
            m.proc.poll()  # restarted ones too
    return 0


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _start_supervisor(deployment: runner.Deployment) -> None:
    """A detached ``disagg supervise`` for the processes this command leaves running."""
    log = Path(deployment.state_dir, runner.LOG_DIR, "supervisor.log")
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "disagg_cli.main", "supervise", "--state-dir",
                                 deployment.state_dir], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60  # it records itself: then `disagg down` stops it first
    while runner.Deployment.load(Path(deployment.state_dir)).supervisor_pid != proc.pid:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ServerStartError(f"the supervisor did not start; see {log}")
        time.sleep(0.1)
    print(f"supervisor: pid {proc.pid} restarts crashed processes (log: {log})", flush=True)


def supervise_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="disagg supervise",
                                 description="Restart crashed processes of a detached `disagg up` (it starts this).")
    ap.add_argument("--state-dir", required=True, type=Path, help="the deployment's state directory")
    args = ap.parse_args(argv)
    stop = _stop_on_signals()
    deployment = runner.Deployment(**{**runner.Deployment.load(args.state_dir).__dict__, "supervisor_pid": os.getpid()})
    deployment.save()
    Supervisor(deployment.members(), deployment.record, lambda line: print(line, flush=True)).run(stop.wait)
    return 0


def _report_down(stopped: list[str], logs: Path | None) -> None:
    print(f"stopped {len(stopped)} processes: {', '.join(stopped)}")
    if logs is not None:
        print(f"logs kept in {logs} (a process had crashed)")


def down_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="disagg down", description="Stop what `disagg up` started.")
    ap.add_argument("--name", help="deployment name (default: the only one)")
    ap.add_argument("--state-dir", default=".disagg")
    args = ap.parse_args(argv)
    _report_down(*runner.down(runner.find_state(_state_root(args), args.name)))
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
            restarts = f" restarts={m['restarts']}" if m["restarts"] else ""
            print(f"  {pool:9s} {m['name']:12s} {m['url']:24s} pid={m['pid']:<7d} "
                  f"{'healthy' if m['healthy'] else 'DOWN'}{restarts}")
    return 0 if all(m["healthy"] for ms in report["pools"].values() for m in ms) else 1
