"""A dead decode engine is visible: the sidecar's readiness turns false within its health interval
when the engine's process is gone, and when it answers 5xx to every request while its own /health
says 200 (vLLM with a dead output handler); it turns true again once the engine serves.

Fake upstreams inject the faults (a real engine in those states needs a crash this work prevents)."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
import requests

from tests.sidecar.support import fake_config, fake_engine, run_sidecar, wait_for

pytestmark = pytest.mark.reliability
GENERATE = "/inference/v1/generate"
INTERVAL = 0.3
DEAD = (500, b'{"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": 500}}')
SERVING_CHECK = "/v1/completions"
COMPLETION = (200, b'{"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]}')
ANSWER = (200, b'{"request_id": "x", "choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}]}')


def _health(url: str) -> tuple[int, list[str]]:
    resp = requests.get(url + "/health", timeout=5)
    return resp.status_code, resp.json().get("reasons", [])


def _generate(url: str) -> requests.Response:
    return requests.post(url + GENERATE, json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}}, timeout=10)


def _within_interval(predicate) -> float:
    """Seconds until ``predicate`` holds; fails beyond one health interval plus a probe's time."""
    started = time.monotonic()
    assert wait_for(predicate, timeout=INTERVAL + 2.5)
    return time.monotonic() - started


def _probes(engine) -> int:
    return len([c for c in engine.calls if c.path == "/health"])


def test_decode_answering_5xx_while_healthy_turns_readiness_off_until_it_serves():
    with fake_engine() as engine:
        config = fake_config(engine, prefill={"mode": "local"}, render={"mode": "local"},
                             limits={"health_interval_seconds": INTERVAL})
        with run_sidecar(config) as sidecar:
            engine.answer[GENERATE], engine.answer[SERVING_CHECK] = ANSWER, COMPLETION
            assert _generate(sidecar.url).status_code == 200
            probes = _probes(engine)  # a probe after the success: the 5xx below is all it sees next
            assert wait_for(lambda: _probes(engine) > probes and _health(sidecar.url)[0] == 200, timeout=5)
            engine.answer[GENERATE] = engine.answer[SERVING_CHECK] = DEAD
            resp = _generate(sidecar.url)
            assert resp.status_code == 502 and resp.json()["error"]["type"]  # OpenAI-shaped, no upstream body
            assert "EngineCore" not in resp.text
            took = _within_interval(lambda: _health(sidecar.url) == (503, ["decode failing (5xx)"]))
            print(f"\nreadiness off {took:.2f} s after the first 5xx (interval {INTERVAL} s)")
            assert [c for c in engine.calls if c.path == SERVING_CHECK]  # the sidecar's own real request
            engine.answer[GENERATE], engine.answer[SERVING_CHECK] = ANSWER, COMPLETION  # e.g. restarted
            _within_interval(lambda: _health(sidecar.url)[0] == 200)


def test_an_error_among_successes_is_no_outage():
    with fake_engine() as engine:
        config = fake_config(engine, prefill={"mode": "local"}, render={"mode": "local"},
                             limits={"health_interval_seconds": INTERVAL})
        with run_sidecar(config) as sidecar:
            engine.answer[GENERATE] = engine.answer[SERVING_CHECK] = DEAD
            assert _generate(sidecar.url).status_code == 502
            engine.answer[GENERATE], engine.answer[SERVING_CHECK] = ANSWER, COMPLETION
            assert _generate(sidecar.url).status_code == 200
            probes = _probes(engine)
            assert wait_for(lambda: _probes(engine) >= probes + 2, timeout=5)
            assert _health(sidecar.url)[0] == 200  # (a serving check, if one ran, got the answer)


def test_decode_process_gone_turns_readiness_off_at_the_first_probe():
    with ExitStack() as engine_stack:
        engine = engine_stack.enter_context(fake_engine())
        config = fake_config(engine, prefill={"mode": "local"}, render={"mode": "local"},
                             limits={"health_interval_seconds": INTERVAL})
        with run_sidecar(config) as sidecar:
            assert wait_for(lambda: _health(sidecar.url)[0] == 200, timeout=5)
            engine_stack.close()  # the engine's server stops: nothing listens on its port
            took = _within_interval(lambda: _health(sidecar.url) == (503, ["decode unreachable"]))
            print(f"\nreadiness off {took:.2f} s after the decode process went (interval {INTERVAL} s)")
