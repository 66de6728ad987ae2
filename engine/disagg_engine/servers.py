"""Start, health-poll and stop local server processes (vLLM servers, sidecars) by their own pids.

Used by the test harness, local mode and the benchmarks. No vLLM import: servers are separate
processes started from argument lists (never a shell string), each in its own session so that
stopping one stops its children too.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

# The process and port primitives live in processes.py; these names are imported from here too.
from disagg_engine.processes import (  # noqa: F401
    free_port, group_members, log_tail, pid_alive, poll_until, port_in_use, reap_group, signal_group, start_logged,
    stop_group,
)


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
        return log_tail(self.log_path, lines, width)

    def stop(self, grace: float = 15.0) -> None:
        """TERM the server's process group, then KILL it if it outlives ``grace`` seconds."""
        stop_group(self.proc, grace=grace)


def start(spec: ServerSpec, log_dir: Path) -> ManagedServer:
    log_path = log_dir / f"{spec.name}.log"
    return ManagedServer(spec, start_logged(spec.argv, log_path, {**os.environ, **spec.env}), log_path)


def wait_healthy(servers: Iterable[ManagedServer], timeout: float, poll: float = 0.5,
                 progress: Callable[[str], None] | None = None) -> None:
    """Poll every server's health endpoint until all answer 200. Fails fast when any server exits,
    also one that already answered (if its port was taken, someone else's server answered for it)."""
    servers = list(servers)
    pending = list(servers)
    started = time.monotonic()
    last_report = [0.0]

    def exited() -> None:
        for server in servers:
            if not server.alive():
                raise ServerStartError(
                    f"{server.spec.name} exited with {server.proc.returncode}:\n{server.log_tail()}"
                )

    def all_healthy() -> bool:
        exited()
        for server in list(pending):
            if server.healthy():
                pending.remove(server)
                if progress:
                    progress(f"  healthy: {server.spec.name:12s} {server.url}  ({time.monotonic() - started:.0f}s)")
        elapsed = time.monotonic() - started
        if pending and progress and elapsed - last_report[0] >= 15:
            last_report[0] = elapsed
            progress(f"  waiting for {', '.join(s.spec.name for s in pending)} ({elapsed:.0f}s)")
        return not pending

    if not poll_until(all_healthy, timeout, interval=poll):
        tails = "\n\n".join(f"--- {s.spec.name} ---\n{s.log_tail()}" for s in pending)
        raise ServerStartError(f"not healthy after {timeout:.0f}s: {[s.spec.name for s in pending]}\n{tails}")
    exited()  # also one that already answered: if its port was taken, someone else's server did


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
    """Stop every server at once: a vLLM server takes seconds to shut down, and they do not wait
    on one another."""
    servers = list(servers)
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(ManagedServer.stop, servers))
