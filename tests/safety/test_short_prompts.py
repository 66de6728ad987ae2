"""No request can kill an engine: the short prompts that did (tests/safety/short_prompts.py),
through a sidecar started here in front of the harness's producer/consumer set on each vLLM lane
(its KV config is ``disagg_engine.testing.server_set``'s; the local deployment's is tested by
tests/e2e/test_local_safety.py). No engine process exits and every engine keeps answering."""

from __future__ import annotations

import pytest

from disagg_engine.servers import pid_alive
from disagg_operator.engine_args import DEFAULT_BLOCK_SIZE
from disagg_sidecar.connectors import get_connector
from tests.safety.short_prompts import check, engine_answers, send_all
from tests.sidecar.support import SERVED, run_sidecar, sidecar_config

pytestmark = [pytest.mark.engine, pytest.mark.reliability]


def test_short_prompts_answer_and_no_engine_dies(lane_set):
    minimum = get_connector("ExampleConnector").min_prompt_tokens(DEFAULT_BLOCK_SIZE["cpu"])
    config = sidecar_config(lane_set, prefill={"min_prompt_tokens": minimum})
    engines = {role: lane_set.servers[role] for role in ("prefill", "decode")}
    pids = {role: s.pid for role, s in engines.items()}
    with run_sidecar(config) as sidecar:
        sent = send_all(sidecar.url, SERVED)
        assert sidecar.metric("disagg_sidecar_prefill_total", outcome="skipped") > 0
        assert sidecar.metric("disagg_sidecar_prefill_total", outcome="remote") > 0
        assert sidecar.metric("disagg_sidecar_prefill_total", outcome="fallback") == 0
    check(sent, minimum)
    for role, server in engines.items():
        assert server.pid == pids[role] and pid_alive(server.pid)
        assert engine_answers(server.url), f"{role} stopped answering:\n{server.log_tail(30)}"
