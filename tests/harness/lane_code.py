"""Run a few lines of Python against a vLLM lane's own code: the main lane's (this venv's vLLM) in
this process, which has it imported already (a new interpreter would import torch and vLLM again,
10-20 s), another lane's in one interpreter per lane that runs that lane's vLLM (``lanes.lane_env``)
and is kept for the session, so the modules that ask a lane share its one import."""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from disagg_engine.testing.lanes import lane_dir, lane_env

TIMEOUT = 300.0  # one script, the lane's first vLLM import included
REPLY = b"LANE-REPLY "

# Reads one JSON request a line ({"script", "arg", "tag"}), runs the script as ``python -c script
# arg`` would (its own globals, ``sys.argv[1]`` the argument) and answers one line ``LANE-REPLY <json>``:
# its stdout, or the traceback of a script that raised (other lines, e.g. a library writing to the real
# stdout, are skipped).
_INTERPRETER = r"""
import contextlib, io, json, sys, traceback
for line in sys.stdin:
    request = json.loads(line)
    out = io.StringIO()
    sys.argv = ["-c", json.dumps(request["arg"])]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(request["script"], "<" + request["tag"] + ">", "exec"), {"__name__": "__lane__"})
        reply = {"stdout": out.getvalue()}
    except BaseException:
        reply = {"error": traceback.format_exc()}
    sys.__stdout__.write("LANE-REPLY " + json.dumps(reply) + "\n")
    sys.__stdout__.flush()
"""


class _Interpreter:
    """A lane's interpreter: one script at a time."""

    def __init__(self, lane: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _INTERPRETER], env={**os.environ, **lane_env(lane)},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.lock = threading.Lock()
        self.buffer = b""
        atexit.register(self.proc.kill)

    def run(self, script: str, arg: Any, tag: str) -> str:
        with self.lock:
            assert self.proc.poll() is None, f"the lane's interpreter exited ({self.proc.returncode})"
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"script": script, "arg": arg, "tag": tag}) + "\n").encode())
            self.proc.stdin.flush()
            deadline = time.monotonic() + TIMEOUT
            while not (line := self._line(deadline)).startswith(REPLY):
                pass
            reply = json.loads(line.removeprefix(REPLY))
        assert "error" not in reply, reply["error"][-3000:]
        return reply["stdout"]

    def _line(self, deadline: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"the lane's interpreter gave no answer within {TIMEOUT:g} s"
            data = os.read(fd, 1 << 16)
            assert data, f"the lane's interpreter exited ({self.proc.wait()})"
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


_interpreters: dict[str, _Interpreter] = {}
_started = threading.Lock()


def run_in_lane(lane: str, script: str, arg: Any, tag: str) -> Any:
    """``script`` (it reads ``json.loads(sys.argv[1])`` and prints one line ``TAG <json>``) run on
    ``lane``'s vLLM with ``arg``: that line's JSON."""
    if lane_dir(lane) is None:
        out = io.StringIO()
        argv = sys.argv
        try:
            sys.argv = ["-c", json.dumps(arg)]
            with contextlib.redirect_stdout(out):
                exec(compile(script, f"<{tag} on {lane}>", "exec"), {"__name__": "__lane__"})
        finally:
            sys.argv = argv
        text = out.getvalue()
    else:
        with _started:
            interpreter = _interpreters.get(lane) or _interpreters.setdefault(lane, _Interpreter(lane))
        text = interpreter.run(script, arg, f"{tag} on {lane}")
    (line,) = [x for x in text.splitlines() if x.startswith(tag + " ")]
    return json.loads(line.removeprefix(tag + " "))
