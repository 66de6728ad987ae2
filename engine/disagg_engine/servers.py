"""Start, health-poll and stop local server processes (vLLM servers, sidecars) by their own pids.

Used by the test harness, local mode and the benchmarks. No vLLM import: servers are separate
processes started from argument lists (never a shell string), each in its own session so that
stopping one stops its children too.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


# Environment that works for vLLM's CPU build on small machines (docs/protocol.md §7), shared by
# local mode and the test harness. VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps vLLM's CPU platform from
# replacing the uniproc executor with the mp one: the worker runs inside the engine-core process
# (one process fewer per engine: ~0.9 GB and ~14 CPU-s of start-up less), fine with unpinned threads.
# TORCH_COMPILE_DISABLE=1: CPU engines run --enforce-eager, yet vLLM still torch.compiles small
# sampler helpers when first used (the logprob ranks), and on CPU that means a C++ build inside the
# request: the first logprobs request took 3.5 s instead of 0.9 s on an idle machine, same values.
CPU_ENGINE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time; the message carries its log tail."""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: list[str]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class ManagedServer:
    spec: ServerSpec
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.spec.health_path, timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40, width: int = 300) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
            return "\n".join(line[:width] for line in text)
        except OSError:
            return "<no log>"

    def stop(self, grace: float = 15.0) -> None:
        """TERM the server's process group, then KILL it if it outlives ``grace`` seconds."""
        stop_group(self.proc, grace=grace)


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
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


def pid_alive(pid: int) -> bool:
    """Running, not a zombie waiting for its (re)parent to reap it: that one has already exited."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# Listening ports come from below the kernel's ephemeral range (32768-60999 by default): a port
# from bind(0) is an ephemeral one, and any outgoing connection's implicit bind can take it before
# our server binds it (seen: a vLLM server dying with EADDRINUSE under load). scripts/cluster uses
# 27400-27995.
_LISTEN_PORTS = range(15000, 27400)
_handed_out: set[int] = set()  # not yet bound by whoever asked: never hand them out twice


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on or connects from, for a server about to start."""
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.choice(_LISTEN_PORTS)
        if port not in _handed_out and not port_in_use(port, host):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in {_LISTEN_PORTS.start}-{_LISTEN_PORTS.stop - 1}")


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


def start(spec: ServerSpec, log_dir: Path) -> ManagedServer:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    env = {**os.environ, **spec.env}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )
    return ManagedServer(spec, proc, log_path)


def wait_healthy(servers: Iterable[ManagedServer], timeout: float, poll: float = 0.5,
                 progress: Callable[[str], None] | None = None) -> None:
    """Poll every server's health endpoint until all answer 200. Fails fast when any server exits,
    also one that already answered (if its port was taken, someone else's server answered for it)."""
    servers = list(servers)
    pending = list(servers)
    started = time.monotonic()
    last_report = 0.0
    while True:
        for server in servers:
            if not server.alive():
                raise ServerStartError(
                    f"{server.spec.name} exited with {server.proc.returncode}:\n{server.log_tail()}"
                )
        if not pending:
            return
        for server in list(pending):
            if server.healthy():
                pending.remove(server)
                if progress:
                    progress(f"  healthy: {server.spec.name:12s} {server.url}  ({time.monotonic() - started:.0f}s)")
        elapsed = time.monotonic() - started
        if pending and elapsed > timeout:
            tails = "\n\n".join(f"--- {s.spec.name} ---\n{s.log_tail()}" for s in pending)
            raise ServerStartError(f"not healthy after {timeout:.0f}s: {[s.spec.name for s in pending]}\n{tails}")
        if pending and progress and elapsed - last_report >= 15:
            last_report = elapsed
            progress(f"  waiting for {', '.join(s.spec.name for s in pending)} ({elapsed:.0f}s)")
        if pending:
            time.sleep(poll)


def start_all(specs: Iterable[ServerSpec], log_dir: Path, timeout: float = 300.0) -> list[ManagedServer]:
    """Start servers in parallel and wait until all are healthy; on failure stop all of them."""
    servers = [start(spec, log_dir) for spec in specs]
    try:
        wait_healthy(servers, timeout)
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: Iterable[ManagedServer]) -> None:
    for server in servers:
        server.stop()
