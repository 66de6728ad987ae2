"""`make demo`'s program (``python -m disagg_cli.demo``): a streamed answer, leg timings, nothing left behind.

The harness starts the program in the background when the first engine test runs (``demo_run`` in
tests/harness/engine.py); this test waits for it and checks what it printed and left."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from disagg_cli import demo

pytestmark = pytest.mark.e2e


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


def test_demo_streams_an_answer_and_leaves_nothing_behind(demo_run):
    code, out, err = demo_run.wait(timeout=1500)
    assert code == 0, out[-3000:] + err[-3000:]
    assert re.search(r"^endpoint: http://127\.0\.0\.1:\d+$", out, re.M)
    # The forced answer, as the qwen3 parser splits it into reasoning and content.
    reasoning, content = demo.ANSWER.split("</think>")
    assert f"assistant (reasoning): {reasoning.removeprefix('<think>').strip()}" in out
    assert f"assistant: {content.strip()}" in out
    for leg in ("render", "prefill", "decode"):
        assert re.search(rf"^  {leg} +\d+\.\d{{3}} s$", out, re.M), out
    assert re.search(r"^stopped 4 processes$", out, re.M)
    assert _processes_with(demo_run.mark) == []
    assert not list(demo_run.tmp.glob("disagg-demo-*")), "the demo's state directory was not removed"
