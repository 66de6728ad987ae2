"""Every refusal on the Messages paths is Anthropic's error object (``{"type": "error", "error":
{"type", "message"}}``), with the status the chat paths give: bad bodies (the hostile corpus sent
to ``/v1/messages``), limits, keys, failed legs before and after the first byte. The upstreams
are fake recording engines (``support.fake_engine``): the point is what the sidecar forwards and
says; the parity of real refusals is in ``test_messages_parity``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from disagg_sidecar import wire
from tests.sidecar.hostile import Answer, corpus_outcomes
from tests.sidecar.support import REFUSED, FakeEngine, fake_config, fake_engine, run_sidecar

FAKE_MESSAGE = json.loads(REFUSED)["error"]["message"]
VALID = {"model": "tiny-qwen3", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}
# What a render tier answers for VALID (the fields the sidecar reads).
RENDERED = {"request_id": "chatcmpl-x", "token_ids": [1, 2, 3, 4], "model": "tiny-qwen3", "stream": False,
            "sampling_params": {"max_tokens": 4}, "output_mode": "tokens"}


def anthropic_error(answer: Answer) -> dict | None:
    """The ``error`` object when the body is Anthropic's error object."""
    try:
        data = json.loads(answer.body)
    except ValueError:
        return None
    if not isinstance(data, dict) or set(data) != {"type", "error"} or data["type"] != "error":
        return None
    error = data["error"]
    ok = isinstance(error, dict) and set(error) == {"type", "message"} and all(isinstance(v, str) for v in error.values())
    return error if ok and error["message"] else None


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    with fake_engine() as fake:
        yield fake


def test_the_bad_input_corpus_gets_anthropics_error_object(engine: FakeEngine) -> None:
    with run_sidecar(fake_config(engine, max_body_bytes=1 << 20)) as sidecar:
        failures, refused, forwarded = corpus_outcomes(sidecar.url, engine, wire.MESSAGES, wire.MESSAGES_RENDER,
                                                       FAKE_MESSAGE, anthropic_error)
    assert not failures, failures[:10]
    assert refused > 100 and forwarded > 10


def _post(url: str, body: object, path: str = wire.MESSAGES, **kw) -> requests.Response:
    return requests.post(url + path, json=body, timeout=30, **kw)


def _error_of(resp: requests.Response) -> dict:
    error = anthropic_error(Answer(resp.status_code, {}, resp.content))
    assert error is not None, resp.text
    return error


def test_limits_keys_and_methods_in_anthropics_words(engine: FakeEngine, tmp_path: Path) -> None:
    key = tmp_path / "client-key"
    key.write_text("sk-client")
    config = fake_config(engine, max_body_bytes=4096, auth={"client_api_key_file": str(key)})
    with run_sidecar(config) as sidecar:
        before = len(engine.posts())
        no_key = _post(sidecar.url, VALID)
        assert no_key.status_code == 401 and "API key" in _error_of(no_key)["message"]
        auth = {"Authorization": "Bearer sk-client"}
        too_big = _post(sidecar.url, {**VALID, "system": "x" * 5000}, headers=auth)
        assert too_big.status_code == 413 and "max_body_bytes" in _error_of(too_big)["message"]
        not_bool = _post(sidecar.url, {**VALID, "stream": "yes"}, headers=auth)
        assert not_bool.status_code == 400 and _error_of(not_bool)["message"] == "stream must be a boolean"
        for path in (wire.MESSAGES, wire.MESSAGES_COUNT_TOKENS):
            not_object = _post(sidecar.url, [VALID], path, headers=auth)
            assert not_object.status_code == 400 and "JSON object" in _error_of(not_object)["message"]
        wrong_method = requests.get(sidecar.url + wire.MESSAGES, headers=auth, timeout=30)
        assert wrong_method.status_code == 405 and _error_of(wrong_method)["type"]
        assert len(engine.posts()) == before  # none of it reached an engine
        # the chat paths keep OpenAI's shape
        chat = requests.post(sidecar.url + "/v1/chat/completions", json=[1], headers=auth, timeout=30)
        assert chat.status_code == 400 and set(chat.json()) == {"error"}


@pytest.fixture
def two_engines() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    """Render (and prefill) on one fake, decode on the other."""
    with fake_engine() as tiers, fake_engine() as decode:
        tiers.answer[wire.MESSAGES_RENDER] = (200, json.dumps(RENDERED).encode())
        yield tiers, decode


def _config(tiers: FakeEngine, decode: FakeEngine) -> dict:
    return fake_config(tiers, decode={"url": decode.url}, prefill={"mode": "local"})


def test_failed_legs_before_the_first_byte(two_engines: tuple[FakeEngine, FakeEngine]) -> None:
    tiers, decode = two_engines
    with run_sidecar(_config(tiers, decode)) as sidecar:
        # the decode engine's own 4xx, its message kept
        refused = _post(sidecar.url, VALID)
        assert refused.status_code == 400 and _error_of(refused) == {"type": "BadRequestError",
                                                                     "message": FAKE_MESSAGE}
        # a 5xx: its body (tracebacks) stays in the log
        decode.answer[wire.GENERATE] = (500, b'{"error": {"message": "Traceback: secret", "code": 500}}')
        failed = _post(sidecar.url, {**VALID, "stream": True})
        assert failed.status_code == 502 and "secret" not in failed.text
        assert _error_of(failed)["message"].startswith("The decode engine failed")
        # render's 5xx, and render's 4xx in Anthropic's object
        tiers.answer[wire.MESSAGES_RENDER] = (503, b"upstream connect error")
        unavailable = _post(sidecar.url, VALID)
        assert unavailable.status_code == 503 and "connect error" not in unavailable.text
        assert _error_of(unavailable)["message"].startswith("The render tier is unavailable")
        tiers.answer[wire.MESSAGES_RENDER] = (400, REFUSED)
        for path in (wire.MESSAGES, wire.MESSAGES_COUNT_TOKENS):
            render_refused = _post(sidecar.url, VALID, path)
            assert render_refused.status_code == 400 and _error_of(render_refused)["message"] == FAKE_MESSAGE


def test_a_stream_that_fails_after_the_first_byte_ends_with_an_error_event(
        two_engines: tuple[FakeEngine, FakeEngine]) -> None:
    tiers, decode = two_engines
    first = {"request_id": "x", "output_mode": "text",
             "choices": [{"index": 0, "text": "Hel", "token_ids": [5], "finish_reason": None}]}
    broken = {"error": {"message": "engine died: Traceback", "type": "InternalServerError", "code": 500}}
    decode.answer[wire.GENERATE] = (200, b"data: " + json.dumps(first).encode() + b"\n\ndata: "
                                    + json.dumps(broken).encode() + b"\n\n")
    config = _config(tiers, decode)
    config["decode"]["capabilities"] = {"output_modes": ["text"], "streaming_output_modes": ["text"]}
    with run_sidecar(config) as sidecar:
        resp = _post(sidecar.url, {**VALID, "stream": True}, stream=True)
        assert resp.status_code == 200
        text = resp.content.decode()
    events = [block.split("\n") for block in text.strip().split("\n\n")]
    names = [e[0].removeprefix("event: ") for e in events]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
    error = json.loads(events[-1][1].removeprefix("data: "))
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert "Traceback" not in error["error"]["message"]


@pytest.mark.parametrize(("name", "value"), [("kv_transfer_params", {"remote_host": "10.0.0.1"}),
                                           ("ec_transfer_params", {}), ("mm_payload", "none"),
                                           ("return_mm_kwargs", False)])
def test_a_refused_option_is_named_in_anthropics_object_and_not_forwarded(engine: FakeEngine, name: str,
                                                                         value: object) -> None:
    """``plan/options.py``'s refusals for Messages, through the app: a 400 naming the field, in
    Anthropic's object, before any leg."""
    with run_sidecar(fake_config(engine)) as sidecar:
        before = len(engine.posts())
        for stream in (False, True):
            resp = _post(sidecar.url, {**VALID, "stream": stream, name: value})
            assert resp.status_code == 400 and _error_of(resp)["message"].startswith(f"{name} is not supported")
        assert len(engine.posts()) == before


def test_leg_seconds_name_the_api(two_engines: tuple[FakeEngine, FakeEngine]) -> None:
    """``disagg_sidecar_leg_seconds{leg, api}``: each leg timed under the API its request came in on."""
    tiers, decode = two_engines
    with run_sidecar(_config(tiers, decode)) as sidecar:
        _post(sidecar.url, VALID)  # decode (the fake) refuses it: both legs were still sent
        _post(sidecar.url, VALID, wire.MESSAGES_COUNT_TOKENS)
        requests.post(sidecar.url + "/v1/chat/completions", json={"model": "m", "messages": []}, timeout=30)

        def count(leg: str, api: str) -> float:
            return sidecar.metric("disagg_sidecar_leg_seconds_count", leg=leg, api=api)

        assert (count("render", "messages"), count("decode", "messages")) == (1, 1)
        assert (count("render", "count_tokens"), count("decode", "count_tokens")) == (1, 0)
        assert count("render", "chat") == 1  # the fake render refuses chat: no decode leg
        assert count("render", "none") == 0
