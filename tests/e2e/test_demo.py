"""`make demo`'s program (``python -m disagg_cli.demo``): ``disagg up``, a streamed answer, leg timings.

The harness starts the program with ``--keep`` in the background right after collection
(``demo_run`` in tests/harness/engine.py); this test waits for it and checks what it printed. The
deployment it leaves running serves the shared engine set's render, prefill and decode, and
tests/e2e/test_local_mode.py drives it; tests/e2e/test_local_down.py takes it down last with
``disagg down`` (the command the demo ends with without ``--keep``), checking that no process the
demo started survives."""

from __future__ import annotations

import re

import pytest

from disagg_cli import demo
from disagg_cli.local.runner import STATE_FILE
from tests.harness.forced import OUTPUTS

pytestmark = pytest.mark.e2e


def test_demo_brings_the_example_up_and_streams_an_answer(demo_run):
    code, out, err = demo_run.wait(timeout=1500)
    assert code == 0, out[-3000:] + err[-3000:]
    assert re.search(r"^starting 4 processes for local-tiny: ", out, re.M), out  # disagg up's own progress
    assert re.search(r"^endpoint: http://127\.0\.0\.1:\d+$", out, re.M)
    # The forced answer, as the qwen3 parser splits it into reasoning and content.
    reasoning, content = demo.ANSWER.split("</think>")
    assert f"assistant (reasoning): {reasoning.removeprefix('<think>').strip()}" in out
    assert f"assistant: {content.strip()}" in out
    assert re.search(r"^usage: prompt \d+, completion \d+ tokens$", out, re.M)
    for leg in ("render", "prefill", "decode"):
        assert re.search(rf"^  {leg} +\d+\.\d{{3}} s$", out, re.M), out
    state = demo_run.tmp / "state"
    assert f"left running: disagg status --state-dir {state}; disagg down --state-dir {state}" in out
    assert (state / "local-tiny" / STATE_FILE).is_file()


def test_the_demos_forced_ids_are_transformers_ids(forcer):
    """The demo tokenizes with ``tokenizers`` alone; the harness's ``forcer`` (and vLLM) go through
    transformers. Texts with special tokens, tool-call markup and multi-byte characters."""
    for text in (demo.ANSWER, OUTPUTS["reasoning_tool_call"][0], OUTPUTS["multibyte"][0]):
        assert demo.forced_ids(forcer.model_dir, text) == forcer.ids(text), text
