"""Run a few lines of Python against a vLLM lane's own code: the main lane's (this venv's vLLM) in
this process, which has it imported already (a new interpreter would import torch and vLLM again,
10-20 s), another lane's in a process that runs that lane's vLLM (``lanes.lane_env``)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from typing import Any

from disagg_engine.testing.lanes import lane_dir, lane_env


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
        done = subprocess.run([sys.executable, "-c", script, json.dumps(arg)], env={**os.environ, **lane_env(lane)},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        text = done.stdout
    (line,) = [x for x in text.splitlines() if x.startswith(tag + " ")]
    return json.loads(line.removeprefix(tag + " "))
