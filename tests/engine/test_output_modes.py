"""Engine extension (RFC seed 004): ``output_mode`` tokens | text | derender on
``/inference/v1/generate``, batch and streaming, equal to the coupled endpoints and to
``/derender(generate(tokens))`` for the same forced tokens."""

from __future__ import annotations

import json

import pytest
import requests

from tests.harness.forced import NO_THINKING, OUTPUTS, TOOLS
from disagg_sidecar.derender_fixes import generate_for_derender, normalise_chat_response
from tests.harness.openai_views import (
    chat_stream_view,
    chat_view,
    completion_stream_view,
    completion_view,
    sse_events,
)

pytestmark = [pytest.mark.engine, pytest.mark.parity]
TIMEOUT = 120

# name -> (forced text, extra chat fields)
CASES: dict[str, tuple[str, dict]] = {
    "plain": OUTPUTS["plain"],
    "reasoning": (OUTPUTS["reasoning"][0], {}),
    "reasoning_hidden": (OUTPUTS["reasoning"][0], {"include_reasoning": False}),
    "tool_call": (OUTPUTS["tool_call"][0], {"tools": TOOLS}),
    "two_tool_calls": (OUTPUTS["two_tool_calls"][0], {"tools": TOOLS}),
    "tool_choice_required": (
        json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}}]), {"tools": TOOLS, "tool_choice": "required"}),
    "tool_choice_named": (
        json.dumps({"city": "Paris"}), {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    "parallel_tool_calls_false": (OUTPUTS["tool_call"][0], {"tools": TOOLS, "parallel_tool_calls": False}),
    "stop_string": ("Alpha beta STOP gamma delta", {"stop": ["STOP"], **NO_THINKING}),
    "multibyte": OUTPUTS["multibyte"],
    "logprobs": (OUTPUTS["reasoning_tool_call"][0], {"tools": TOOLS, "logprobs": True, "top_logprobs": 5}),
}


def _post(url: str, body: dict, stream: bool = False) -> requests.Response:
    resp = requests.post(url, json=body, timeout=TIMEOUT, stream=stream)
    assert resp.status_code == 200, f"{url}: {resp.status_code} {resp.text[:1500]}"
    return resp


def _chat(forcer, name: str, stream: bool, n: int) -> dict:
    text, extra = CASES[name]
    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": f"case {name}"}],
            "max_tokens": 200, "n": n, "vllm_xargs": forcer.xargs(text), "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _events(resp: requests.Response) -> list:
    return list(sse_events(resp.iter_lines()))


def _logprob_view(resp: dict) -> dict:
    return {c["index"]: [(e["token"], round(e["logprob"], 4), [t["token"] for t in e["top_logprobs"]])
                         for e in (c.get("logprobs") or {}).get("content") or []]
            for c in resp["choices"]}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_batch_derender_equals_coupled_and_chained(engine_set, forcer, name, n):
    chat = _chat(forcer, name, stream=False, n=n)
    coupled = _post(engine_set.url("coupled") + "/v1/chat/completions", chat).json()
    gen = _post(engine_set.url("render") + "/v1/chat/completions/render", chat).json()
    inline = _post(engine_set.url("decode") + "/inference/v1/generate",
                   {**gen, "output_mode": "derender", "chat_request": chat}).json()
    assert inline["output_mode"] == "derender"
    tokens = _post(engine_set.url("decode") + "/inference/v1/generate", gen).json()
    chained = _post(engine_set.url("render") + "/v1/chat/completions/derender",
                    {"generate_response": generate_for_derender(tokens), "prompt_tokens": len(gen["token_ids"]),
                     "prompt_token_ids": gen["token_ids"], "chat_request": chat}).json()
    assert chat_view(inline) == chat_view(coupled)
    chained_view = chat_view(normalise_chat_response(chained, tokens["usage"], chat.get("tool_choice")))
    if name != "stop_string":  # derender re-decodes every token: the stop string comes back
        assert chained_view == chat_view(coupled)
    if name == "logprobs":
        assert _logprob_view(inline) == _logprob_view(coupled)
        assert all(len(e["top_logprobs"]) == 5 for e in inline["choices"][0]["logprobs"]["content"])
    hidden = CASES[name][1].get("include_reasoning") is False  # vLLM hides ids with the reasoning
    for choice in inline["choices"]:
        assert (choice["token_ids"] is None) if hidden else choice["token_ids"]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_streamed_derender_equals_coupled_and_chained(engine_set, forcer, name, n):
    chat = _chat(forcer, name, stream=True, n=n)
    coupled = _events(_post(engine_set.url("coupled") + "/v1/chat/completions", chat, stream=True))
    gen = _post(engine_set.url("render") + "/v1/chat/completions/render", chat).json()
    inline = _events(_post(engine_set.url("decode") + "/inference/v1/generate",
                           {**gen, "output_mode": "derender", "chat_request": chat}, stream=True))
    assert inline[-1] == "[DONE]"
    assert all(e["output_mode"] == "derender" for e in inline if e != "[DONE]")
    assert chat_stream_view(inline) == chat_stream_view(coupled)
    # Every choice gets the role on its first chunk and tool-call ids stay stable across chunks.
    first_delta = {}
    ids: dict[tuple[int, int], set] = {}
    for e in inline:
        if e == "[DONE]":
            continue
        for c in e["choices"]:
            first_delta.setdefault(c["index"], c["delta"])
            for tc in c["delta"].get("tool_calls") or []:
                if tc.get("id"):
                    ids.setdefault((c["index"], tc["index"]), set()).add(tc["id"])
    assert set(first_delta) == set(range(n)) and all(d.get("role") == "assistant" for d in first_delta.values())
    assert all(len(v) == 1 for v in ids.values())
    if name == "stop_string":
        return  # streaming derender cannot cut text it already sent (0.33 rejects stop there)
    tokens = _events(_post(engine_set.url("decode") + "/inference/v1/generate", gen, stream=True))
    derender = engine_set.url("render") + "/v1/chat/completions/derender"
    states: dict = {}
    chained = []
    for event in tokens[:-1]:
        index = event["choices"][0]["index"] if event["choices"] else None
        out = _post(derender, {"stream": True, "generate_chunk": generate_for_derender(event),
                               "stream_state": states.get(index),
                               "prompt_tokens": len(gen["token_ids"]), "prompt_token_ids": gen["token_ids"],
                               "chat_request": chat}).json()
        if index is not None:
            states[index] = out["stream_state"]
        chained.append(out["chunk"])
    assert chat_stream_view(chained + ["[DONE]"]) == chat_stream_view(coupled)


COMPLETION_CASES = {
    "plain": (OUTPUTS["plain"][0], {}),
    "stop_string": ("Alpha beta STOP gamma delta", {"stop": ["STOP"]}),
    "multibyte": (OUTPUTS["multibyte"][0], {}),
    "markup_stays_text": (OUTPUTS["reasoning_tool_call"][0], {}),
}


def _completion(forcer, name: str, stream: bool, n: int) -> dict:
    text, extra = COMPLETION_CASES[name]
    body = {"model": "tiny-qwen3", "prompt": f"Complete this ({name}):", "max_tokens": 200, "n": n,
            "vllm_xargs": forcer.xargs(text), "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", list(COMPLETION_CASES))
def test_text_mode_equals_coupled_completions(engine_set, forcer, name, n, stream):
    body = _completion(forcer, name, stream, n)
    (gen,) = _post(engine_set.url("render") + "/v1/completions/render", body).json()
    url = engine_set.url("decode") + "/inference/v1/generate"
    coupled_resp = _post(engine_set.url("coupled") + "/v1/completions", body, stream=stream)
    inline_resp = _post(url, {**gen, "output_mode": "text"}, stream=stream)
    if stream:
        inline_events = _events(inline_resp)
        got = completion_stream_view(inline_events)
        want = completion_stream_view(_events(coupled_resp))
    else:
        inline = inline_resp.json()
        got, want = completion_view(inline), completion_view(coupled_resp.json())
    assert got == want
    if stream:
        return
    tokens = _post(url, gen).json()
    # Completions decode with special tokens skipped, so the stop token needs no stripping here.
    chained = _post(engine_set.url("render") + "/v1/completions/derender",
                    {"generate_responses": [tokens], "prompt_tokens": [len(gen["token_ids"])],
                     "prompt_token_ids": [gen["token_ids"]], "completion_request": body}).json()
    chained_view = completion_view(chained)
    if name == "stop_string":
        for i, choice in got["choices"].items():
            assert chained_view["choices"][i]["text"].startswith(choice["text"])
    else:
        assert chained_view == got

