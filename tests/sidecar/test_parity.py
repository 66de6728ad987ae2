"""Parity through the official ``openai`` SDK and what the parity matrix shares: the sidecar
(render -> prefill -> decode -> derender) answers like the coupled ``vllm serve`` for the forced
outputs on the inline path (engine extension), the chained path (derender tier) and a stock decode
engine. The case-by-case matrix (every field, batch and streamed, n 1 and 2) is
``test_parity_matrix.py``."""

from __future__ import annotations

import re
from typing import Any

import openai
import pytest
import requests

from disagg_engine.testing.lanes import PARITY_LANES
from tests.harness.forced import OUTPUTS
from tests.harness.openai_views import (
    chat_full_view,
    chat_stream_full_view,
    chat_stream_view,
    chat_view,
    completion_stream_view,
    completion_view,
    sse_events,
)
from tests.harness.overlap import in_background
from tests.sidecar.support import SERVED, RunningSidecar, run_sidecar, sidecar_config

pytestmark = [pytest.mark.engine, pytest.mark.parity,
              pytest.mark.parametrize("lane_set", PARITY_LANES, indirect=True)]

TOOL_CALL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16,}$")
SDK_CHAT_FIELDS = {"model", "messages", "max_tokens", "n", "stream", "stream_options", "tools", "tool_choice",
                   "stop", "logprobs", "top_logprobs", "temperature"}
SDK_COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "n", "stream", "stream_options", "stop", "logprobs"}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _split(body: dict[str, Any], fields: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    return {k: v for k, v in body.items() if k in fields}, {k: v for k, v in body.items() if k not in fields}


def sdk_chat(url: str, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any] | list[dict[str, Any]]:
    kwargs, extra = _split(body, SDK_CHAT_FIELDS)
    headers = {"X-Request-Id": request_id} if request_id else None
    result = client(url).chat.completions.create(**kwargs, extra_body=extra, extra_headers=headers)
    if body.get("stream"):
        return [chunk.model_dump() for chunk in result]
    return result.model_dump()


def sdk_completion(url: str, body: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
    kwargs, extra = _split(body, SDK_COMPLETION_FIELDS)
    result = client(url).completions.create(**kwargs, extra_body=extra)
    if body.get("stream"):
        return [chunk.model_dump() for chunk in result]
    return result.model_dump()


def post_raw(url: str, path: str, body: dict[str, Any], request_id: str) -> Any:
    """The answer as sent (every field kept): a JSON object, or the SSE events and ``[DONE]``."""
    resp = requests.post(url + path, json=body, headers={"X-Request-Id": request_id}, stream=bool(body.get("stream")),
                         timeout=120)
    assert resp.status_code == 200, resp.text[:1000]
    return list(sse_events(resp.iter_lines())) if body.get("stream") else resp.json()


def check_chat_shape(resp: dict[str, Any], request_id: str, n: int) -> None:
    assert resp["id"] == f"chatcmpl-{request_id}" and resp["object"] == "chat.completion"
    assert resp["model"] == SERVED and isinstance(resp["created"], int)
    assert sorted(c["index"] for c in resp["choices"]) == list(range(n))
    for c in resp["choices"]:
        for call in c["message"].get("tool_calls") or []:
            assert TOOL_CALL_ID.match(call["id"]), call["id"]


def check_chat_stream_shape(chunks: list[dict[str, Any]], request_id: str, n: int) -> None:
    assert {c["id"] for c in chunks} == {f"chatcmpl-{request_id}"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["created"] for c in chunks}) == 1 and {c["model"] for c in chunks} == {SERVED}
    first_delta: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            first_delta.setdefault(c["index"], c["delta"])
            for call in c["delta"].get("tool_calls") or []:
                assert call.get("id") is None or TOOL_CALL_ID.match(call["id"]), call["id"]
    assert sorted(first_delta) == list(range(n))
    assert all(d["role"] == "assistant" for d in first_delta.values())
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"], "usage comes last, on its own"


MODES = ("derender", "text", "tokens")
PATH_COUNTERS = [*(("decode_output_mode", "mode", m) for m in MODES),
                 *(("output_mode_fallbacks", "requested", m) for m in MODES),
                 *(("derender_calls", "kind", k) for k in ("batch", "stream"))]


def path_counters(sidecar: RunningSidecar) -> dict[tuple[str, str], float]:
    """The sidecar's counters that say which decode path a request took."""
    return {(name, value): sidecar.metric(f"disagg_sidecar_{name}_total", **{label: value})
            for name, label, value in PATH_COUNTERS}


def check_path_taken(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], path: str,
                     inline_mode: str, stream: bool) -> None:
    """One decode leg; inline: in ``inline_mode``, no fallback, no derender call; chained: tokens,
    then the derender tier (one batch call, or at least one for a stream), no fallback."""
    delta = {k: after[k] - before[k] for k in before}
    expected = dict.fromkeys(delta, 0.0)
    expected[("decode_output_mode", inline_mode if path == "inline" else "tokens")] = 1.0
    if path == "chained":
        calls = ("derender_calls", "stream" if stream else "batch")
        assert delta[calls] >= 1, delta
        expected[calls] = delta[calls] if stream else 1.0
    assert delta == expected


COMPLETION_CASES = {
    "plain": OUTPUTS["plain"][0],
    "multibyte": OUTPUTS["multibyte"][0],
    "markup_stays_text": OUTPUTS["reasoning_tool_call"][0],
}


def completion_body(forcer, name: str, stream: bool, n: int, prompt: Any = None) -> dict[str, Any]:
    body = {"model": SERVED, "prompt": prompt or f"Complete this ({name}):", "max_tokens": 200, "n": n,
            "vllm_xargs": forcer.xargs(COMPLETION_CASES[name]), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
def test_completions_with_two_prompts(lane_set, forcer, lane_path_sidecar, stream: bool) -> None:
    # One render answer per prompt, one prefill and decode leg each; choices indexed prompt * n + i.
    body = completion_body(forcer, "plain", stream, 2, prompt=["First prompt here:", "A second prompt:"])
    reference = in_background(lambda: sdk_completion(lane_set.url("coupled"), body))
    got = sdk_completion(lane_path_sidecar.url, body)
    want = reference.result()
    view = completion_stream_view if stream else completion_view
    assert view(got) == view(want)
    assert sorted(view(got)["choices"]) == [0, 1, 2, 3]


def test_completions_logprobs_go_through_the_derender_tier(lane_set, forcer, lane_inline_sidecar) -> None:
    # Completions logprobs only have their shape on /v1/completions/derender: chained even inline.
    body = {**completion_body(forcer, "plain", False, 1), "logprobs": 2}
    reference = in_background(lambda: requests.post(lane_set.url("coupled") + "/v1/completions", json=body,
                                                   timeout=60).json())
    before = lane_inline_sidecar.metric("disagg_sidecar_derender_calls_total", kind="batch")
    got = requests.post(lane_inline_sidecar.url + "/v1/completions", json=body, timeout=60).json()
    want = reference.result()
    assert completion_view(got) == completion_view(want)
    lp, want_lp = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert lp[key] == want_lp[key], key
    # The sampled token and the top k, as coupled shows them (chained.completion_candidates).
    assert lp["top_logprobs"] == want_lp["top_logprobs"]
    assert any(len(top) == 3 for top in lp["top_logprobs"])
    assert lane_inline_sidecar.metric("disagg_sidecar_derender_calls_total", kind="batch") == before + 1


STOCK_CASES = {
    "tool_call_logprobs_token_ids": ("reasoning_tool_call", {"logprobs": True, "top_logprobs": 5, "return_token_ids": True}),
    "stop_straddling_kept": ("plain", {"stop": ["zzz", "is Par"], "include_stop_str_in_output": True}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
@pytest.mark.parametrize("case", list(STOCK_CASES))
def test_stock_decode_engine_is_chained(lane_set, forcer, lane_stock_sidecar, case: str, stream: bool) -> None:
    """A decode engine without the extension: the sidecar sees no capabilities and chains, except
    where stock generate derenders the answer itself with render's parse_context (batch from vLLM
    0.33 on, streamed from 0.34 on); every field equals coupled (the decode engine is the coupled
    one: not overlapped)."""
    name, extra = STOCK_CASES[case]
    body = forcer.chat_body(name, stream=stream, n=2, **extra)
    want = post_raw(lane_set.url("coupled"), "/v1/chat/completions", body, f"stock-{case}")
    metric = lane_stock_sidecar.metric
    calls = lambda: metric("disagg_sidecar_derender_calls_total", kind="stream" if stream else "batch")
    inline = lambda: metric("disagg_sidecar_decode_output_mode_total", mode="derender")
    before = calls(), inline()
    got = post_raw(lane_stock_sidecar.url, "/v1/chat/completions", body, f"stock-{case}")
    view = chat_stream_full_view if stream else chat_full_view
    assert view(got) == view(want)
    features = lane_stock_sidecar.config.engine.features
    by_stock_generate = features.generate_streaming_derender if stream else features.generate_output_mode_derender
    assert (calls() == before[0]) if by_stock_generate else (calls() > before[0])
    assert inline() == before[1] + (1 if by_stock_generate else 0)


def test_stream_ends_with_done_and_carries_the_headers(lane_set, forcer, lane_path_sidecar) -> None:
    resp = requests.post(lane_path_sidecar.url + "/v1/chat/completions", json=forcer.chat_body("reasoning", stream=True),
                         headers={"X-Request-Id": "sse-check"}, stream=True, timeout=60)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["X-Request-Id"] == "sse-check" and resp.headers["x-disagg-prefill"] == "remote"
    events = list(sse_events(resp.iter_lines()))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert all(e["id"] == "chatcmpl-sse-check" for e in events[:-1])


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
def test_engine_rejecting_derender_falls_back_to_chaining(lane_set, forcer, stream: bool) -> None:
    """Configured as extended but not probed: a stock vLLM 0.32 answers output_mode=derender with
    400; the sidecar chains instead, counts it, and the client sees no difference."""
    config = sidecar_config(lane_set, decode={"url": lane_set.url("coupled"), "probe_capabilities": False})
    body = forcer.chat_body("reasoning_tool_call", stream=stream)
    want = sdk_chat(lane_set.url("coupled"), body)  # decode is the coupled engine: not overlapped
    with run_sidecar(config) as sidecar:
        got = sdk_chat(sidecar.url, body)
        assert sidecar.metric("disagg_sidecar_output_mode_fallbacks_total", requested="derender") == 1
    view = chat_stream_view if stream else chat_view
    assert view(got) == view(want)
