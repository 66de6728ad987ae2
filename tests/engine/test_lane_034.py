"""The vLLM 0.34 lane serves 0.34's own code: one stock coupled server on it (scripts/vllm-lane).

It answers as 0.34 (version, fingerprint, the message shape 0.34 changed), runs the forced-output
processor through 0.34's logits-processor interface, and streams ``output_mode: derender`` from
render's ``parse_context`` on a stock server, which 0.33 refused.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from disagg_engine.testing.server_set import ServerSet, start_server_set
from tests.harness.forced import OUTPUTS, Forcer

pytestmark = pytest.mark.engine

LANE = "0.34"
VERSION = "0.34.0"
# reasoning_tool_call: "<think>\n{REASONING}\n</think>\n\n<tool_call>{get_weather, city 東京}</tool_call>"
REASONING = "\nI should look the weather up.\n"
TOOL = ("get_weather", {"city": "東京"})


@pytest.fixture(scope="module")
def coupled() -> Iterator[ServerSet]:
    sset = start_server_set(Path(tempfile.mkdtemp(prefix="disagg-lane034-")), roles=("coupled",), lane=LANE)
    yield sset
    sset.stop()


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
