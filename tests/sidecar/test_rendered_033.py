"""A GenerateRequest client on vLLM 0.33: ``/render``'s output, which on 0.33 always carries
``parse_context``, sent to the sidecar unchanged is accepted on every leg (prefill, decode) and
answers as the coupled server does, batch and streamed, in tokens and derender mode."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from disagg_operator.engine_args import vllm_features
from tests.harness.forced import OUTPUTS
from tests.harness.openai_views import chat_stream_view, chat_view, sse_events
from tests.sidecar.support import RunningSidecar, recording_proxy, run_sidecar, sidecar_config

pytestmark = [pytest.mark.engine, pytest.mark.parity]
GENERATE = "/inference/v1/generate"
VERSION = "0.33.0"


@pytest.fixture(scope="module")
def sidecar_033(engine_set_033, forcer) -> Iterator[tuple[RunningSidecar, dict]]:
    sset = engine_set_033
    with recording_proxy(sset.url("prefill")) as prefill, recording_proxy(sset.url("decode")) as decode:
        config = sidecar_config(sset, decode={"url": decode.url},
                                prefill={"discovery": {"kind": "static", "urls": [prefill.url]}},
                                engine={"vllm_version": VERSION, "features": vllm_features(VERSION)})
        with run_sidecar(config) as sidecar:
            yield sidecar, {"prefill": prefill, "decode": decode}


@pytest.mark.parametrize(("mode", "stream"), [("tokens", False), ("derender", False), ("derender", True)])
def test_a_rendered_request_is_accepted_unchanged_on_every_leg(engine_set_033, forcer, sidecar_033, mode, stream):
    sidecar, proxies = sidecar_033
    for proxy in proxies.values():
        proxy.calls.clear()
    chat = forcer.chat_body("reasoning_tool_call", stream=stream)
    gen = requests.post(engine_set_033.url("render") + "/v1/chat/completions/render", json=chat, timeout=60).json()
    assert gen["parse_context"]["tools"], "vLLM 0.33's render emits the parse context"
    resp = requests.post(sidecar.url + GENERATE, json={**gen, "output_mode": mode}, stream=stream, timeout=120)
    assert resp.status_code == 200, resp.text
    (prefill_leg,) = proxies["prefill"].bodies(GENERATE)
    assert prefill_leg["output_mode"] == "tokens" and prefill_leg["sampling_params"]["max_tokens"] == 1
    (decode_leg,) = proxies["decode"].bodies(GENERATE)
    assert decode_leg["parse_context"] == gen["parse_context"] and decode_leg["output_mode"] == mode
    assert resp.headers.get("x-disagg-prefill") != "fallback", "the prefill leg was refused"
    coupled = requests.post(engine_set_033.url("coupled") + "/v1/chat/completions", json=chat, stream=stream,
                            timeout=60)
    if mode == "tokens":
        assert [c["token_ids"] for c in resp.json()["choices"]] == [forcer.ids(OUTPUTS["reasoning_tool_call"][0])]
    elif stream:
        events = list(sse_events(resp.iter_lines()))
        assert chat_stream_view(events) == chat_stream_view(list(sse_events(coupled.iter_lines())))
    else:
        assert chat_view(resp.json()) == chat_view(coupled.json())
