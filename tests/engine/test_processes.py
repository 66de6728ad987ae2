"""Ports, port blocks and recorded processes (disagg_engine.processes) with real sockets and
real child processes; no servers needed."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagg_engine import processes
from disagg_engine.processes import (
    CLUSTER_BLOCK, CLUSTER_PORT_BASES, SERVER_PORTS, busy_ports, free_block, is_ours, log_tail, poll_until,
    socket_ports, start_logged, stop_pids,
)


def test_server_ports_and_cluster_blocks_do_not_overlap_or_reach_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    cluster = {p for b in CLUSTER_PORT_BASES for p in range(b, b + CLUSTER_BLOCK)}
    assert not cluster & set(SERVER_PORTS)
    assert max(cluster | set(SERVER_PORTS)) < low


def test_free_block_skips_blocks_with_any_busy_port():
    first = CLUSTER_PORT_BASES[0]
    assert free_block(set()) == first
    assert free_block({first + CLUSTER_BLOCK - 1}) == CLUSTER_PORT_BASES[1]
    assert free_block({first + CLUSTER_BLOCK}) == first  # the gap between blocks is not used
    assert free_block({p for b in CLUSTER_PORT_BASES for p in (b + 2,)}) is None


def test_socket_ports_reads_proc_net_tcp_and_ignores_time_wait():
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    listen = "   0: 0100007F:6B08 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n"
    time_wait = "   1: 0100007F:6B09 0100007F:6B08 06 00000000:00000000 03:00000000 00000000     0        0 0 3\n"
    v6 = "   0: 00000000000000000000000001000000:6B0A 00000000000000000000000000000000:0000 01 0 0 0 0 0 1 1\n"
    assert socket_ports([header + listen + time_wait, header + v6]) == {0x6B08, 0x6B0A}


def test_busy_ports_sees_a_listener_and_a_connected_client_port():
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.connect(server.getsockname())
        busy = busy_ports()
        assert server.getsockname()[1] in busy and client.getsockname()[1] in busy


def test_a_recorded_pid_is_ours_only_while_it_runs_the_binary_we_started(tmp_path):
    proc = start_logged([sys.executable, "-c", "import time; print('hi', flush=True); time.sleep(60)"],
                        tmp_path / "logs" / "p.log")
    exe = str(Path(f"/proc/{proc.pid}/exe").resolve())
    try:
        assert poll_until(lambda: log_tail(tmp_path / "logs" / "p.log") == "hi", 10, interval=0.05)
        assert is_ours(proc.pid, exe)
        assert not is_ours(proc.pid, "/usr/bin/other")
    finally:
        proc.kill()
    assert poll_until(lambda: not is_ours(proc.pid, exe), 10, interval=0.05)  # a zombie is gone already
    proc.wait()
    assert not is_ours(proc.pid, exe)


def test_stop_pids_kills_what_ignores_term_after_the_grace_period(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    stubborn = start_logged([sys.executable, "-c", code], tmp_path / "stubborn.log")
    polite = start_logged([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "polite.log")
    assert poll_until(lambda: log_tail(tmp_path / "stubborn.log") == "ready", 10, interval=0.05)
    procs = {stubborn.pid: stubborn, polite.pid: polite}
    reports = []
    started = time.monotonic()
    left = stop_pids(list(procs), lambda pid: procs[pid].poll() is None, grace=1.0,
                     on_left=lambda sig, pids: reports.append((sig, pids)))
    assert left == [] and reports == [(signal.SIGTERM, [stubborn.pid])]
    assert stubborn.returncode == -signal.SIGKILL and polite.returncode == -signal.SIGTERM
    assert time.monotonic() - started >= 1.0


def test_poll_until_fails_fast_through_check_and_times_out():
    with pytest.raises(RuntimeError, match="died"):
        poll_until(lambda: False, 30, interval=0.01, check=lambda: (_ for _ in ()).throw(RuntimeError("died")))
    started = time.monotonic()
    assert poll_until(lambda: False, 0.2, interval=0.05) is False
    assert 0.2 <= time.monotonic() - started < 5


def test_start_logged_passes_argv_unparsed_and_appends_to_the_log(tmp_path):
    log = tmp_path / "x.log"
    for word in ("a b", "$HOME;"):
        subprocess.Popen.wait(start_logged([sys.executable, "-c", "import sys; print(sys.argv[1])", word], log))
    assert log.read_text().splitlines() == ["a b", "$HOME;"]
    assert processes.log_tail(tmp_path / "missing.log") == "<no log>"
