"""`make demo`'s program (``python -m disagg_cli.demo``): a streamed answer, leg timings, nothing left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from disagg_cli import demo

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _processes_with(mark: str) -> list[int]:
    """Pids whose environment carries ``mark`` (every descendant of the demo inherits it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return found


def test_demo_streams_an_answer_and_leaves_nothing_behind(tmp_path):
    mark = f"DISAGG_DEMO_RUN={uuid.uuid4().hex}"
    key, value = mark.split("=")
    env = {**os.environ, key: value, "TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "disagg_cli.demo"], capture_output=True, text=True, timeout=1500,
                         cwd=ROOT, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"^endpoint: http://127\.0\.0\.1:\d+$", out, re.M)
    # The forced answer, as the qwen3 parser splits it into reasoning and content.
    reasoning, content = demo.ANSWER.split("</think>")
    assert f"assistant (reasoning): {reasoning.removeprefix('<think>').strip()}" in out
    assert f"assistant: {content.strip()}" in out
    for leg in ("render", "prefill", "decode"):
        assert re.search(rf"^  {leg} +\d+\.\d{{3}} s$", out, re.M), out
    assert re.search(r"^stopped 4 processes$", out, re.M)
    assert _processes_with(mark) == []
    assert not list(tmp_path.glob("disagg-demo-*")), "the demo's state directory was not removed"
