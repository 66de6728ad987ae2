"""The process helpers every server start goes through (no servers needed)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from disagg_engine.servers import ServerSpec, ServerStartError, free_port, port_in_use, start, wait_healthy


def _ephemeral_range() -> range:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def test_free_ports_are_distinct_unused_and_not_ephemeral():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not any(p in _ephemeral_range() for p in ports)
    assert not any(port_in_use(p) for p in ports)


def test_port_in_use_sees_a_listener_and_not_a_closed_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        port = s.getsockname()[1]
        assert port_in_use(port)
    assert not port_in_use(port)


def test_a_server_that_exits_after_answering_fails_the_wait(tmp_path):
    # Someone else's server answers on "dies"'s port (its own bind failed), then "dies" exits while
    # "slow" still starts: the wait must report the exit, not wait for "slow" and call it healthy.
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", free_port()))
        foreign.listen()
        port = foreign.getsockname()[1]
        answer = subprocess.Popen([sys.executable, "-c", (
            "import socket\n"
            f"s = socket.socket(fileno={foreign.fileno()})\n"
            "while True:\n"
            "    c, _ = s.accept(); c.recv(4096)\n"
            "    c.sendall(b'HTTP/1.1 200 OK\\r\\nContent-Length: 0\\r\\nConnection: close\\r\\n\\r\\n'); c.close()\n")],
            pass_fds=[foreign.fileno()])
        try:
            dying = start(ServerSpec("dies", [sys.executable, "-c", "import time; time.sleep(1.5)"], port), tmp_path)
            slow = start(ServerSpec("slow", [sys.executable, "-c", "import time; time.sleep(60)"], free_port()),
                         tmp_path)
            try:
                with pytest.raises(ServerStartError, match="dies exited"):
                    wait_healthy([dying, slow], timeout=30)
            finally:
                slow.stop(grace=1)
        finally:
            answer.kill()
            answer.wait()
