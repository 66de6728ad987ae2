"""The sidecar keys version differences off the release its decode engine reports (``GET /version``),
not off the configuration: shapes (vLLM 0.34 omits null ``annotations``/``prompt_tokens_details``)
and render's ``parse_context`` as that engine reads it. Engine-free: every tier is a recording fake."""

from __future__ import annotations

import json

import pytest
import requests

from tests.sidecar.support import SERVED, fake_config, fake_engine, run_sidecar

CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4, "prompt_tokens_details": None}
MODES = ["tokens", "text", "derender"]


def _rendered(parse_context: dict | None = None) -> bytes:
    gen = {"request_id": "chatcmpl-x", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4},
           "model": SERVED, **({"parse_context": parse_context} if parse_context is not None else {})}
    return json.dumps(gen).encode()


def _version(v: str) -> tuple[int, bytes]:
    return 200, json.dumps({"version": v}).encode()


@pytest.mark.parametrize(("reported", "omitted"), [("0.34.0", True), ("0.33.0", False), ("0.35.0", False)])
def test_null_fields_follow_the_release_decode_reports(reported: str, omitted: bool) -> None:
    with fake_engine() as engine:
        engine.answer["/version"] = _version(reported)
        engine.answer["/v1/chat/completions/render"] = (200, _rendered())
        engine.answer["/inference/v1/generate"] = (200, json.dumps({
            "request_id": "x", "output_mode": "text", "usage": USAGE,
            "choices": [{"index": 0, "text": "hi", "finish_reason": "stop", "token_ids": [5]}]}).encode())
        text_only = {"output_modes": ["tokens", "text"], "streaming_output_modes": ["tokens", "text"],
                     "parser_configured": False}
        # The configuration says 0.32 (null fields): the engine's own answer decides.
        config = {**fake_config(engine, prefill={"mode": "local"},
                                decode={"url": engine.url, "capabilities": text_only, "probe_capabilities": False}),
                  "engine": {"vllm_version": "0.32.0"}}
        with run_sidecar(config) as sidecar:
            answer = requests.post(sidecar.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    message = body["choices"][0]["message"]
    assert message["content"] == "hi"
    assert ("annotations" not in message) is omitted and ("prompt_tokens_details" not in body["usage"]) is omitted
    if not omitted:
        assert message["annotations"] is None and body["usage"]["prompt_tokens_details"] is None


def _derender_capabilities() -> tuple[int, bytes]:
    return 200, json.dumps({"extension": "disagg", "output_modes": MODES, "streaming_output_modes": MODES,
                            "derender_context_forms": ["parse_context"], "parser_configured": True}).encode()


@pytest.mark.parametrize(("reported", "token_ids", "leg_mode", "leg_context"), [
    ("0.34.0", None, "derender", {"tools": None, "return_tokens_as_token_ids": None}),  # 0.34 reads the field
    ("0.33.0", None, "derender", {"tools": None}),  # unknown to 0.33's generate: dropped, not refused there
    ("0.33.0", True, "tokens", None),  # 0.33 cannot honour it: chained instead of a wrong inline answer
])
def test_parse_context_goes_to_decode_as_its_release_reads_it(reported: str, token_ids: bool | None, leg_mode: str,
                                                             leg_context: dict | None) -> None:
    with fake_engine() as engine:
        engine.answer["/version"] = _version(reported)
        engine.answer["/disagg/v1/capabilities"] = _derender_capabilities()
        engine.answer["/v1/chat/completions/render"] = (200, _rendered(
            {"tools": None, "return_tokens_as_token_ids": token_ids}))
        config = {**fake_config(engine, prefill={"mode": "local"}), "engine": {"vllm_version": "0.34.0", "extension": True}}
        with run_sidecar(config) as sidecar:
            requests.post(sidecar.url + "/v1/chat/completions", json=CHAT, timeout=30)  # the fake refuses the leg
        (leg, *_) = [json.loads(c.body) for c in engine.calls if c.path == "/inference/v1/generate"]
    assert leg["output_mode"] == leg_mode
    assert leg.get("parse_context") == leg_context
