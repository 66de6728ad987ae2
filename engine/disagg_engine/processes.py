"""Local processes and their ports: every port range the project listens on, free ports and port
blocks, starting a process with its log, "is this recorded pid still ours", stopping with a grace
period and polling readiness with a timeout.

Shared by the vLLM/sidecar servers (``servers.py``: local mode, the test harness, the benchmarks)
and the local control plane (``disagg_cli.cluster``). Standard library only: ``scripts/cluster``
runs it on a bare ``python3.11`` when ``.venv`` is missing.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

# Listening ports come from below the kernel's ephemeral range (32768-60999 by default): a port
# from bind(0) is an ephemeral one, and any outgoing connection's implicit bind can take it before
# our server binds it (seen: a vLLM server dying with EADDRINUSE under load).
SERVER_PORTS = range(15000, 27400)
# The control plane's blocks: CLUSTER_BLOCK consecutive ports from each base, first free one wins.
CLUSTER_PORT_BASES = range(27400, 28000, 10)
CLUSTER_BLOCK = 6
STOP_GRACE = 15.0  # seconds a stopped process has before the next signal (KILL)

_handed_out: set[int] = set()  # not yet bound by whoever asked: never hand them out twice
_handing_out = threading.Lock()  # threads asking at once (seen: two proxies given one port)


# --- ports -----------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on or connects from, for a server about to start."""
    rng = random.SystemRandom()
    with _handing_out:
        for _ in range(1000):
            port = rng.choice(SERVER_PORTS)
            if port not in _handed_out and not port_in_use(port, host):
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free port in {SERVER_PORTS.start}-{SERVER_PORTS.stop - 1}")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Someone listens on it. SO_REUSEADDR as servers set it: TIME_WAIT leftovers of closed
    connections do not stop a new server from binding, so they do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


_TIME_WAIT = "06"  # include/net/tcp_states.h


def socket_ports(tables: Iterable[str]) -> set[int]:
    """Local ports of every TCP socket in /proc/net/tcp{,6} texts (any address, any state but
    TIME_WAIT, which servers bind over)."""
    ports = set()
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] != _TIME_WAIT:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def busy_ports() -> set[int]:
    tables = []
    for name in ("tcp", "tcp6"):
        try:
            tables.append(Path("/proc/net", name).read_text())
        except OSError:
            pass
    return socket_ports(tables)


def free_block(busy: set[int], bases: Iterable[int] = CLUSTER_PORT_BASES, size: int = CLUSTER_BLOCK) -> int | None:
    """The first base whose ``size`` consecutive ports no socket uses, or None."""
    return next((b for b in bases if not busy.intersection(range(b, b + size))), None)


# --- processes -------------------------------------------------------------------------------

def start_logged(argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
                 pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """Start ``argv`` (a list, never a shell string) in its own session, so that a Ctrl-C in the
    caller's terminal spares it and stopping its group stops its children; stdout and stderr go
    to ``log_path`` (appended), stdin is /dev/null. Our descriptors (locks) are not inherited but
    ``pass_fds``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env), start_new_session=True, pass_fds=tuple(pass_fds),
        )


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """Running, not a zombie waiting for its (re)parent to reap it: that one has already exited."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _state(pid) not in (None, "Z")


def is_ours(pid: int, exe: str) -> bool:
    """A recorded pid is still the process we started while /proc/<pid>/exe is the binary we
    started (guards against pid reuse; still ours if the binary was deleted since) and it is not
    a zombie."""
    try:
        real = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return real.removesuffix(" (deleted)") == exe and _state(pid) not in (None, "Z")


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_group(pid: int, sig: int) -> None:
    """Signal a process group we may not be the parent of, reaping its leader if it is ours."""
    _signal_group(pid, sig)
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (also once its leader is gone: a vLLM engine core
    stays in its API server's group, reparented to init, when only the server was killed)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(proc.name))
    return found


def reap_group(pgid: int) -> None:
    """KILL what is left of a process group whose leader has exited (before it is started again:
    an orphaned engine core holds its memory and devices), and reap the leader if it is ours."""
    if group_members(pgid):
        signal_group(pgid, signal.SIGKILL)
    else:
        try:
            os.waitpid(pgid, os.WNOHANG)
        except ChildProcessError:
            pass


def poll_until(ready: Callable[[], bool], timeout: float, interval: float = 0.2,
               check: Callable[[], None] | None = None) -> bool:
    """Call ``ready`` until it returns true (True) or ``timeout`` seconds pass (False); ``check``
    runs after each miss and raises to fail fast (e.g. when a process it waits for has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        if ready():
            return True
        if check:
            check()
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def stop_pids(pids: Sequence[int], running: Callable[[int], bool], signals: Sequence[int] = (signal.SIGTERM, signal.SIGKILL),
              grace: float = STOP_GRACE, on_left: Callable[[int, list[int]], None] | None = None) -> list[int]:
    """Send each signal in turn to the ``pids`` still ``running`` (in the given order) and wait up
    to ``grace`` seconds for all of them to stop; returns those left after the last signal."""
    left = [p for p in pids if running(p)]
    for sig in signals:
        for pid in left:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        poll_until(lambda: not any(running(p) for p in pids), grace, interval=0.2)
        left = [p for p in pids if running(p)]
        if not left:
            return []
        if on_left:
            on_left(sig, left)
    return left


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = STOP_GRACE) -> None:
    """Send ``sig`` to the process group ``proc`` leads (started with ``start_new_session``), KILL
    the group if ``proc`` outlives ``grace`` seconds; no-op once it has exited."""
    if proc.poll() is not None:
        return
    _signal_group(proc.pid, sig)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    # Children that ignored the signal (e.g. a vLLM engine core) go with the group.
    _signal_group(proc.pid, signal.SIGKILL)


def log_tail(path: Path, lines: int = 40, width: int | None = None) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "<no log>"
    return "\n".join(line[:width] for line in text)
