"""No request can kill an engine of ``disagg up examples/local-tiny.yaml``: the short prompts that
did (tests/safety/short_prompts.py) through the deployment's own sidecar, whose config the
operator's plan wrote (``prefill.min_prompt_tokens`` from the connector and the CPU block size).
No process exits or restarts, and every engine keeps answering."""

from __future__ import annotations

import json

import pytest
import yaml

from disagg_cli.local.runner import Deployment, find_state
from disagg_engine.servers import pid_alive
from tests.harness.engine import disagg
from tests.safety.short_prompts import check, engine_answers, send_all

pytestmark = [pytest.mark.e2e, pytest.mark.reliability]


def _processes(local_tiny) -> dict[str, dict]:
    return {p["name"]: p for p in Deployment.load(find_state(local_tiny.state, None)).processes}


def test_short_prompts_answer_and_no_engine_dies(local_tiny):
    state = find_state(local_tiny.state, None)
    minimum = yaml.safe_load((state / "sidecar-0.yaml").read_text())["prefill"]["min_prompt_tokens"]
    assert minimum == 130  # ExampleConnector on CPU engines: block size 128 + 2
    before = _processes(local_tiny)
    decode_log = before["decode-0"]["log"]
    hits = open(decode_log, errors="replace").read().count("External Cache Hit")
    check(send_all(local_tiny.endpoint, "tiny-qwen3"), minimum)
    # Prompts of 130 tokens and more went to prefill, and decode loaded their KV.
    assert open(decode_log, errors="replace").read().count("External Cache Hit") > hits
    after = _processes(local_tiny)
    report = json.loads(disagg("status", "--json", "--state-dir", str(local_tiny.state)).stdout)
    for members in report["pools"].values():
        for m in members:
            assert m["healthy"] and m["restarts"] == 0 and m["pid"] == before[m["name"]]["pid"], m
    for name in ("prefill-0", "decode-0"):
        assert pid_alive(after[name]["pid"]) and engine_answers(after[name]["url"]), name
