"""The vLLM 0.34 lane serves 0.34's own code: its stock coupled server (scripts/vllm-lane).

It answers as 0.34 (version, fingerprint, the message shape 0.34 changed), runs the forced-output
processor through 0.34's logits-processor interface, and streams ``output_mode: derender`` from
render's ``parse_context`` on a stock server, which 0.33 refused. A sidecar configured as the
operator configures a stock 0.34 decode (status.derender.strategy ``stock-inline``) has that
server derender its client's stream: no derender call, a chunk per engine step as coupled sends
them, every field equal to the coupled stream's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from disagg_engine.testing.server_set import ServerSet
from disagg_operator.engine_args import vllm_features
from tests.harness.forced import OUTPUTS, Forcer
from tests.harness.openai_views import chat_stream_full_view
from tests.sidecar.support import SERVED, RunningSidecar, recording_proxy, run_sidecar

pytestmark = pytest.mark.engine

VERSION = "0.34.0"
# reasoning_tool_call: "<think>\n{REASONING}\n</think>\n\n<tool_call>{get_weather, city 東京}</tool_call>"
REASONING = "\nI should look the weather up.\n"
TOOL = ("get_weather", {"city": "東京"})


@pytest.fixture(scope="module")
def coupled(engine_set_034) -> ServerSet:
    """The 0.34 set's coupled server (the harness's, shared with the parity modules' 0.34 lane)."""
    return engine_set_034


@pytest.fixture(scope="module")
def forcer(coupled: ServerSet) -> Forcer:
    return Forcer(coupled.model_dir)


def _sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _joined(deltas: list[dict]) -> dict:
    """Reasoning, content and tool calls (name, parsed arguments) of one choice's deltas."""
    out: dict = {"reasoning": "", "content": "", "tools": {}}
    for delta in deltas:
        out["reasoning"] += delta.get("reasoning") or ""
        out["content"] += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            tool = out["tools"].setdefault(call["index"], {"name": "", "arguments": ""})
            tool["name"] += (call.get("function") or {}).get("name") or ""
            tool["arguments"] += (call.get("function") or {}).get("arguments") or ""
    out["tools"] = [(t["name"], json.loads(t["arguments"])) for _, t in sorted(out["tools"].items())]
    return out


def test_the_server_is_vllm_034(coupled):
    assert httpx.get(coupled.url("coupled") + "/version", timeout=30).json() == {"version": VERSION}


def test_forced_chat_parses_reasoning_and_a_tool_call(coupled, forcer):
    assert OUTPUTS["reasoning_tool_call"][0].startswith("<think>" + REASONING + "</think>")
    resp = httpx.post(coupled.url("coupled") + "/v1/chat/completions",
                      json=forcer.chat_body("reasoning_tool_call", logprobs=True, top_logprobs=2), timeout=120)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["system_fingerprint"].startswith(f"vllm-{VERSION}-")
    choice = body["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning"] == REASONING
    assert message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [TOOL]
    # 0.34 omits a None `annotations` (0.32 and 0.33 write null).
    assert "annotations" not in message
    forced = forcer.ids(OUTPUTS["reasoning_tool_call"][0])
    assert body["usage"]["completion_tokens"] == len(forced)
    # Logprobs come from the standalone runner's own logprob code (the model's raw logits).
    entries = choice["logprobs"]["content"]
    assert entries and all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0.0 for e in entries)


def _chat_stream(coupled: ServerSet, forcer: Forcer, n: int) -> list[dict]:
    """Each choice's joined deltas of a streamed forced chat."""
    chunks = _sse(coupled.url("coupled") + "/v1/chat/completions",
                  forcer.chat_body("reasoning_tool_call", stream=True, n=n))
    return [_joined([c["choices"][0]["delta"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i])
            for i in range(n)]


def test_forced_chat_streams_reasoning_and_a_tool_call(coupled, forcer):
    for joined in _chat_stream(coupled, forcer, n=2):
        # The stream also carries the blank line between </think> and <tool_call> as content.
        assert (joined["reasoning"], joined["content"].strip(), joined["tools"]) == (REASONING, "", [TOOL])


def test_stock_generate_streams_derender_from_parse_context(coupled, forcer):
    url = coupled.url("coupled")
    rendered = httpx.post(url + "/v1/chat/completions/render",
                          json=forcer.chat_body("reasoning_tool_call"), timeout=60)
    assert rendered.status_code == 200, rendered.text
    request = rendered.json()
    assert request["parse_context"]["tools"][0]["function"]["name"] == TOOL[0]
    chunks = _sse(url + "/inference/v1/generate", {**request, "output_mode": "derender", "stream": True})
    assert {c["output_mode"] for c in chunks} == {"derender"}
    choices = [choice for c in chunks for choice in c["choices"]]
    assert choices[0]["delta"]["role"] == "assistant"
    # The same deltas as the coupled chat stream: one ChatStreamProcessor for both.
    assert _joined([c["delta"] for c in choices]) == _chat_stream(coupled, forcer, n=1)[0]
    assert _joined([c["delta"] for c in choices])["reasoning"] == REASONING
    assert [t for c in choices for t in c["token_ids"]] == forcer.ids(OUTPUTS["reasoning_tool_call"][0])
    assert choices[-1]["finish_reason"] == "tool_calls"


@pytest.fixture(scope="module")
def stock_decode(coupled: ServerSet) -> Iterator[tuple[RunningSidecar, object]]:
    """A sidecar whose decode engine is the stock 0.34 server (behind a recording proxy), which also
    renders (render and prefill local: one server), configured as the operator writes 0.34."""
    with recording_proxy(coupled.url("coupled")) as proxy:
        config = {"served_model_name": SERVED, "decode": {"url": proxy.url}, "render": {"mode": "local"},
                  "prefill": {"mode": "local"},
                  "engine": {"vllm_version": VERSION, "features": vllm_features(VERSION), "derender_sessions": False}}
        with run_sidecar(config) as sidecar:
            yield sidecar, proxy


STOCK_INLINE_CASES = {
    "reasoning_tool_call_n2_logprobs_token_ids": ("reasoning_tool_call", {
        "n": 2, "logprobs": True, "top_logprobs": 3, "return_token_ids": True,
        "stream_options": {"include_usage": True}}),
    "two_tool_calls_stop_inside_the_second": ("two_tool_calls", {"stop": ["Europe"]}),
    "multibyte_continuous_usage": ("multibyte", {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
}


def _events(url: str, body: dict) -> list:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


@pytest.mark.parity
@pytest.mark.parametrize("case", list(STOCK_INLINE_CASES))
def test_a_stock_034_decode_derenders_its_own_stream(coupled, forcer, stock_decode, case: str):
    sidecar, proxy = stock_decode
    name, extra = STOCK_INLINE_CASES[case]
    body = forcer.chat_body(name, stream=True, **extra)
    want = _events(coupled.url("coupled"), body)
    calls = lambda: sidecar.metric("disagg_sidecar_derender_calls_total", kind="stream")
    inline = lambda: sidecar.metric("disagg_sidecar_decode_output_mode_total", mode="derender")
    before, recorded = (calls(), inline()), len(proxy.calls)
    got = _events(sidecar.url, body)
    assert chat_stream_full_view(got) == chat_stream_full_view(want)
    assert (calls(), inline()) == (before[0], before[1] + 1)  # decode derendered it, nobody else
    [leg] = [c for c in proxy.calls[recorded:] if c.path == "/inference/v1/generate"]
    engine_chunks = [line for line in leg.response.split(b"\n\n") if line.startswith(b"data: {")]
    assert all(b'"output_mode":"derender"' in c.replace(b" ", b"") for c in engine_chunks)
    if body.get("return_token_ids"):  # coupled's chunks: one per step (a step's tokens sent apart)
        assert steps(got) == steps(want)


def steps(events: list) -> int:
    """A stream's chunks with the engine's merges undone: vLLM merges the outputs of several steps
    into one chunk while its API process lags (on the coupled server as on a decode engine)."""
    chunks = [e for e in events if e != "[DONE]"]
    return len(chunks) + sum(max(0, len(c.get("token_ids") or []) - 1) for e in chunks for c in e["choices"])
