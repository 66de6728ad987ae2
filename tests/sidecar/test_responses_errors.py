"""The Responses API's refusals and routes, against fake recording engines (``support.fake_engine``):
what the sidecar forwards and says. Bad bodies (the hostile corpus sent to ``/v1/responses``) get
OpenAI's error shape, 4xx, nothing forwarded past render; requests that read vLLM's response store
go to the decode engine alone; a decode answer or stream that is not whole is an error the client
sees. The parity of real answers and refusals is in ``test_responses_parity``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests

from disagg_sidecar import wire
from tests.sidecar.hostile import Answer, corpus_outcomes
from tests.sidecar.support import REFUSED, FakeEngine, fake_config, fake_engine, run_sidecar

FAKE_MESSAGE = json.loads(REFUSED)["error"]["message"]
VALID = {"model": "tiny-qwen3", "input": "Hello", "max_output_tokens": 4}
RENDERED = {"request_id": "resp_x", "token_ids": list(range(1, 300)), "model": "tiny-qwen3", "stream": False,
            "sampling_params": {"max_tokens": 4}, "output_mode": "tokens"}
RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "output": [],
            "usage": {"input_tokens": 299, "input_tokens_details": {"cached_tokens": 256}, "output_tokens": 1}}


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    with fake_engine() as fake:
        yield fake


def test_the_bad_input_corpus_gets_openais_error_shape(engine: FakeEngine) -> None:
    with run_sidecar(fake_config(engine, max_body_bytes=1 << 20)) as sidecar:
        failures, refused, forwarded = corpus_outcomes(sidecar.url, engine, wire.RESPONSES, wire.RESPONSES_RENDER,
                                                       FAKE_MESSAGE, Answer.openai_error)
    assert not failures, failures[:10]
    assert refused > 100 and forwarded > 10


@pytest.fixture
def two_engines() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    """Render and prefill on one fake, decode on the other."""
    with fake_engine() as tiers, fake_engine() as decode:
        tiers.answer[wire.RESPONSES_RENDER] = (200, json.dumps(RENDERED).encode())
        tiers.answer[wire.GENERATE] = (200, json.dumps({"choices": [{"index": 0, "token_ids": [7]}],
                                                        "kv_transfer_params": None}).encode())
        yield tiers, decode


def _config(tiers: FakeEngine, decode: FakeEngine, **overrides) -> dict:
    return fake_config(tiers, decode={"url": decode.url}, **{"kv_connector": "ExampleConnector", **overrides})


def test_legs_and_what_the_decode_engine_gets(two_engines: tuple[FakeEngine, FakeEngine]) -> None:
    """Render, prefill, then the client's request on decode's ``/v1/responses``, without the
    kv_transfer_params a client put into ``vllm_xargs`` (top level: refused, as on every API); the
    answer as decode gave it (cached tokens unchanged: the ExampleConnector reports no prefill cache hits)."""
    tiers, decode = two_engines
    decode.answer[wire.RESPONSES] = (200, json.dumps(RESPONSE).encode())
    body = {**VALID, "vllm_xargs": {"kv_transfer_params": "x", "keep": 1}}
    with run_sidecar(_config(tiers, decode)) as sidecar:
        refused = requests.post(sidecar.url + wire.RESPONSES, timeout=30,
                                json={**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.9"}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
        assert tiers.posts() == [] and decode.posts() == []
        resp = requests.post(sidecar.url + wire.RESPONSES, json=body, timeout=30)
        assert resp.status_code == 200 and resp.json() == RESPONSE
        assert resp.headers[wire.PREFILL_OUTCOME] == "remote"
        assert [c.path for c in tiers.posts()] == [wire.RESPONSES_RENDER, wire.GENERATE]
        (call,) = decode.posts()
        sent = json.loads(call.body)
        assert call.path == wire.RESPONSES and "kv_transfer_params" not in sent
        assert sent == {**VALID, "vllm_xargs": {"keep": 1}}
        assert json.loads(tiers.posts()[0].body) == sent  # render gets the same, cleaned


@pytest.mark.parametrize("field, value", [("previous_response_id", "resp_abc"), ("background", True)])
def test_a_request_reading_the_response_store_goes_to_decode_alone(two_engines, field: str, value: object) -> None:
    tiers, decode = two_engines
    not_found = json.dumps({"error": {"message": "Response with id 'resp_abc' not found.",
                                      "type": "invalid_request_error", "param": "response_id", "code": 404}})
    decode.answer[wire.RESPONSES] = (404, not_found.encode())
    with run_sidecar(_config(tiers, decode)) as sidecar:
        resp = requests.post(sidecar.url + wire.RESPONSES, json={**VALID, field: value}, timeout=30)
        assert resp.status_code == 404 and resp.json()["error"]["message"] == "Response with id 'resp_abc' not found."
        assert tiers.posts() == [] and [c.path for c in decode.posts()] == [wire.RESPONSES]
        assert sidecar.metric("disagg_sidecar_decode_answered_total", reason="stored response") == 1


def test_get_and_cancel_by_id_are_the_decode_engines(two_engines) -> None:
    tiers, decode = two_engines
    decode.answer[wire.RESPONSES + "/resp_1"] = (200, json.dumps(RESPONSE).encode())
    decode.answer[wire.RESPONSES + "/resp_1/cancel"] = (400, REFUSED)
    with run_sidecar(_config(tiers, decode)) as sidecar:
        got = requests.get(sidecar.url + wire.RESPONSES + "/resp_1?stream=false&other=1", timeout=30)
        assert got.status_code == 200 and got.json() == RESPONSE
        cancel = requests.post(sidecar.url + wire.RESPONSES + "/resp_1/cancel", timeout=30)
        assert cancel.status_code == 400 and cancel.json()["error"]["message"] == FAKE_MESSAGE
        missing = requests.get(sidecar.url + wire.RESPONSES + "/resp_2", timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]  # the fake's bare 404, in OpenAI's shape
        odd = requests.get(sidecar.url + wire.RESPONSES + "/a%2F..%2Fmetrics", timeout=30)
        assert odd.status_code == 404 and "not found" in odd.json()["error"]["message"]
        calls = [(c.path, c.body) for c in decode.calls if c.path.startswith(wire.RESPONSES)]
        assert calls == [(wire.RESPONSES + "/resp_1", b""), (wire.RESPONSES + "/resp_1/cancel", b""),
                         (wire.RESPONSES + "/resp_2", b"")]
        assert tiers.posts() == []


@pytest.mark.parametrize("answer, why", [
    (b'{"object": "chat.completion", "choices": []}', "not a response"),
    (b'{"error": {"message": "x"}}', "an error"),
    (b"[1, 2]", "not a JSON object"),
])
def test_a_batch_answer_that_is_not_a_response_is_a_502(two_engines, answer: bytes, why: str) -> None:
    tiers, decode = two_engines
    decode.answer[wire.RESPONSES] = (200, answer)
    with run_sidecar(_config(tiers, decode)) as sidecar:
        resp = requests.post(sidecar.url + wire.RESPONSES, json=VALID, timeout=30)
        assert resp.status_code == 502 and resp.json()["error"]["type"] == "BadGatewayError", why


def _events(*events: dict) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n" for e in events)


CREATED = {"type": "response.created", "sequence_number": 0, "response": RESPONSE}
DELTA = {"type": "response.output_text.delta", "sequence_number": 1, "delta": "Hi", "item_id": "m",
         "output_index": 0, "content_index": 0}
COMPLETED = {"type": "response.completed", "sequence_number": 2, "response": RESPONSE}


@pytest.mark.parametrize("stream, whole", [
    (_events(CREATED, DELTA, COMPLETED), True),
    (_events(CREATED, DELTA), False),  # the engine went away before the end
    (_events(CREATED, DELTA, COMPLETED, DELTA), False),  # events after the end
    (_events(CREATED) + b"event: x\ndata: {\"type\": \"bad\\nevent: injected\"}\n\n", False),  # a type that would frame
    (_events(CREATED) + b"data: not json\n\n", False),
])
def test_a_stream_ends_with_its_completed_event_only_when_whole(two_engines, stream: bytes, whole: bool) -> None:
    tiers, decode = two_engines
    decode.answer[wire.RESPONSES] = (200, stream)
    with run_sidecar(_config(tiers, decode)) as sidecar:
        resp = requests.post(sidecar.url + wire.RESPONSES, json={**VALID, "stream": True}, timeout=30)
        assert resp.status_code == 200
        blocks = [b.split("\n") for b in resp.text.strip().split("\n\n")]
        names = [b[0].removeprefix("event: ") for b in blocks]
        datas = [json.loads(b[1].removeprefix("data: ")) for b in blocks]
        assert names == [d["type"] for d in datas]
        if whole:
            assert names == ["response.created", "response.output_text.delta", "response.completed"]
            return
        assert names[0] == "response.created" and names[-1] == "error" and "response.completed" not in names
        error = datas[-1]
        assert set(error) == {"type", "code", "message", "param", "sequence_number"}
        assert error["sequence_number"] == datas[-2]["sequence_number"] + 1 and "Traceback" not in error["message"]


def test_prefill_cache_hits_become_the_answers_cached_tokens(two_engines) -> None:
    """A connector that reports the prefill engine's cache hits (NIXL): they are the answer's
    cached tokens, batch and in the stream's completed event, as for chat."""
    tiers, decode = two_engines
    tiers.answer[wire.GENERATE] = (200, json.dumps({
        "choices": [{"index": 0, "token_ids": [7]}],
        "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
                               "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 5600,
                               "remote_prefill_cached_tokens": 64}}).encode())
    config = _config(tiers, decode, kv_connector="NixlConnector")
    with run_sidecar(config) as sidecar:
        decode.answer[wire.RESPONSES] = (200, json.dumps(RESPONSE).encode())
        batch = requests.post(sidecar.url + wire.RESPONSES, json=VALID, timeout=30).json()
        assert batch["usage"]["input_tokens_details"]["cached_tokens"] == 64
        assert json.loads(decode.posts()[0].body)["kv_transfer_params"]["remote_engine_id"] == "e"
        decode.answer[wire.RESPONSES] = (200, _events(CREATED, COMPLETED))
        text = requests.post(sidecar.url + wire.RESPONSES, json={**VALID, "stream": True}, timeout=30).text
        completed = json.loads(text.strip().split("\n\n")[-1].split("\n")[1].removeprefix("data: "))
        assert completed["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 64
