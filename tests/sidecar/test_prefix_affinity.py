"""Prefix-aware prefill selection through the real sidecar and render tier: a conversation's next
turns go to the prefill endpoint its first turn went to, distinct conversations spread over the
endpoints, and an endpoint picker may name a prefill pod at an InferencePool's port. Two recording
proxies in front of the one prefill engine stand for two prefill pods."""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack

import pytest

from disagg_sidecar import wire
from disagg_sidecar.keys import UPSTREAM
from tests.sidecar.support import chat, recording_proxy, run_sidecar, sidecar_config, wait_for

pytestmark = pytest.mark.engine

# Several 16-token blocks shared by every conversation, as a system prompt is.
SYSTEM = "You answer briefly and exactly. " + "word " * 120
CONVERSATIONS, TURNS = 12, 3


def test_a_conversation_keeps_its_prefill_endpoint_and_conversations_spread(engine_set, forcer) -> None:
    with ExitStack() as stack:
        proxies = [stack.enter_context(recording_proxy(engine_set.url("prefill"))) for _ in range(2)]
        config = sidecar_config(engine_set, prefill={
            "discovery": {"kind": "static", "urls": [p.url for p in proxies]},
            "selection": "prefix-affinity", "affinity_block_tokens": 16})
        # A health probe slower than its 2 s (a loaded machine) benches an endpoint for 5 s, which moves
        # conversations: not this test's subject. Only the start-up probe runs, and both must pass it.
        config["limits"] = {**config.get("limits", {}), "health_interval_seconds": 3600}
        sidecar = stack.enter_context(run_sidecar(config))
        prefill = sidecar.app[UPSTREAM].pools["prefill"]
        assert wait_for(lambda: len(prefill.available()) == 2, timeout=30), "both prefill endpoints healthy"
        history = {c: [{"role": "system", "content": SYSTEM}] for c in range(CONVERSATIONS)}
        homes: dict[int, list[int]] = {c: [] for c in history}
        for turn in range(TURNS):
            for c, messages in history.items():
                messages.append({"role": "user", "content": f"Conversation {c}, question {turn}: " + "why " * 10})
                before = [p.count(wire.GENERATE) for p in proxies]
                resp = chat(sidecar.url, {**forcer.chat_body("plain"), "messages": messages})
                assert resp.status_code == 200 and resp.headers[wire.PREFILL_OUTCOME] == "remote", resp.text
                went = [i for i, p in enumerate(proxies) if p.count(wire.GENERATE) > before[i]]
                assert len(went) == 1, went
                homes[c].append(went[0])
                messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
        assert all(len(set(h)) == 1 for h in homes.values()), homes
        assert set(Counter(h[0] for h in homes.values())) == {0, 1}, f"every conversation on one endpoint: {homes}"


def test_an_inference_pool_port_names_the_prefill_engine_on_that_host(engine_set, forcer) -> None:
    with recording_proxy(engine_set.url("prefill")) as proxy:
        host = proxy.url.split("//", 1)[1].rsplit(":", 1)[0]
        pool_port = 8000 if not proxy.url.endswith(":8000") else 8001
        config = sidecar_config(engine_set, prefill={"discovery": {"kind": "static", "urls": [proxy.url]},
                                                     "trust_prefiller_header": True, "pool_port": pool_port})
        body = {**forcer.chat_body("plain"), "messages": [{"role": "user", "content": SYSTEM}]}
        with run_sidecar(config) as sidecar:
            resp = chat(sidecar.url, body, headers={wire.PREFILLER_HOST_PORT: f"{host}:{pool_port}"})
            assert resp.status_code == 200 and resp.headers[wire.PREFILL_OUTCOME] == "remote", resp.text
            assert proxy.count(wire.GENERATE) == 1
            refused = chat(sidecar.url, body, headers={wire.PREFILLER_HOST_PORT: f"{host}:{pool_port + 1}"})
            assert refused.status_code == 403 and refused.json()["error"]["param"] == wire.PREFILLER_HOST_PORT
            assert proxy.count(wire.GENERATE) == 1, "a refused header sends no leg"
