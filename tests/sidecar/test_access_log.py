"""The access line names, per request, where its prompt was prefilled: the prefill endpoint of the
successful prefill leg (as discovery gave it), or the outcome otherwise (fallback, skipped, local,
failed). Operators read it to know which prefill pod served a request; the rollout test in real
pods (tests/e2e/test_cluster_tiny.py) checks KV-revision pairing with it. Engine-free: the engines
are recording fakes (tests/sidecar/support.py), prefill ones answering 200 or 500."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from disagg_sidecar.logs import JsonFormatter
from tests.sidecar.support import SERVED, FakeEngine, fake_config, fake_engine, run_sidecar

GENERATE = "/inference/v1/generate"
PROMPT = list(range(1, 41))  # 40 tokens
DECODED = {"request_id": "x", "choices": [{"index": 0, "token_ids": [5], "finish_reason": "stop"}]}
PREFILLED = {"request_id": "x", "choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}],
             "kv_transfer_params": None}  # ExampleConnector: nothing of it goes to decode


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, FakeEngine]]:
    """decode; prefill engines: ``good`` answering 200, ``bad`` 500."""
    with ExitStack() as stack:
        engines = {name: stack.enter_context(fake_engine()) for name in ("decode", "good", "bad")}
        engines["decode"].answer[GENERATE] = (200, json.dumps(DECODED).encode())
        engines["good"].answer[GENERATE] = (200, json.dumps(PREFILLED).encode())
        engines["bad"].answer[GENERATE] = (500, b'{"error": "broken"}')
        yield engines


def _access(caplog: pytest.LogCaptureFixture, config: dict[str, Any],
            headers: dict[str, str] | None = None) -> tuple[requests.Response, dict[str, Any]]:
    """One GenerateRequest through a sidecar of ``config``: the answer and its access line as
    the sidecar writes it (JSON)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="disagg_sidecar.access"), run_sidecar(config) as sidecar:
        answer = requests.post(sidecar.url + GENERATE, json={"model": SERVED, "token_ids": PROMPT,
                                                           "sampling_params": {"max_tokens": 1}},
                               headers=headers or {}, timeout=30)
    [line] = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "disagg_sidecar.access"]
    assert line["path"] == GENERATE and line["status"] == answer.status_code
    return answer, line


def _config(engines: dict[str, FakeEngine], prefill: list[str], **settings: Any) -> dict[str, Any]:
    return fake_config(engines["decode"], prefill={
        "mode": "remote", "discovery": {"kind": "static", "urls": [engines[p].url for p in prefill]}, **settings})


@pytest.mark.parametrize(("prefill", "settings", "status", "outcome", "endpoints"), [
    (["good"], {}, 200, "remote", ["good"]),
    (["bad"], {}, 200, "fallback", None),  # after its retry: decode prefills the prompt itself
    (["bad"], {"failure_policy": "fail"}, 503, "failed", None),
    (["good"], {"min_prompt_tokens": len(PROMPT) + 1}, 200, "skipped", None),
])
def test_the_access_line_names_the_prefill_endpoint_or_how_the_prompt_was_prefilled(
        engines: dict[str, FakeEngine], caplog: pytest.LogCaptureFixture, prefill: list[str],
        settings: dict[str, Any], status: int, outcome: str, endpoints: list[str] | None) -> None:
    answer, line = _access(caplog, _config(engines, prefill, **settings))
    assert answer.status_code == status, answer.text
    assert answer.headers.get("x-disagg-prefill") == outcome
    assert line["prefill"] == outcome
    assert line.get("prefill_endpoints") == (None if endpoints is None else [engines[e].url for e in endpoints])


def test_a_retried_prefill_leg_names_the_endpoint_that_prefilled(
        engines: dict[str, FakeEngine], caplog: pytest.LogCaptureFixture) -> None:
    """The first attempt goes to the broken endpoint (the client's x-prefiller-host-port, trusted
    here), the retry to the other one: the line names the one whose answer decode used."""
    bad = engines["bad"]
    calls = len([c for c in bad.calls if c.path == GENERATE])
    config = _config(engines, ["bad", "good"], trust_prefiller_header=True)
    answer, line = _access(caplog, config, {"x-prefiller-host-port": urlsplit(bad.url).netloc})
    assert answer.status_code == 200 and len([c for c in bad.calls if c.path == GENERATE]) == calls + 1
    assert line["prefill"] == "remote" and line["prefill_endpoints"] == [engines["good"].url]


def test_without_a_prefill_tier_the_prompt_is_prefilled_locally(
        engines: dict[str, FakeEngine], caplog: pytest.LogCaptureFixture) -> None:
    answer, line = _access(caplog, fake_config(engines["decode"], prefill={"mode": "local"}))
    assert answer.status_code == 200 and line["prefill"] == "local" and "prefill_endpoints" not in line


def test_a_request_refused_before_any_leg_names_no_prefill(
        engines: dict[str, FakeEngine], caplog: pytest.LogCaptureFixture) -> None:
    """A bad body is refused before the request has a context: no prefill fields, and none left
    over from an earlier request on the same connection."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="disagg_sidecar.access"), \
            run_sidecar(_config(engines, ["good"])) as sidecar, requests.Session() as session:
        ok = session.post(sidecar.url + GENERATE, json={"model": SERVED, "token_ids": PROMPT,
                                                        "sampling_params": {"max_tokens": 1}}, timeout=30)
        refused = session.post(sidecar.url + GENERATE, data=b"{not json", timeout=30,
                               headers={"Content-Type": "application/json"})
    assert (ok.status_code, refused.status_code) == (200, 400)
    first, second = [r.fields for r in caplog.records if r.name == "disagg_sidecar.access"]  # type: ignore[attr-defined]
    assert first["prefill"] == "remote" and first["prefill_endpoints"] == [engines["good"].url]
    assert second["status"] == 400 and "prefill" not in second and "prefill_endpoints" not in second
