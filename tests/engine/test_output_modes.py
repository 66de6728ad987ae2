"""Engine extension (docs/protocol.md §2): ``output_mode`` tokens | text | derender on
``/inference/v1/generate``, batch and streaming, equal to the coupled endpoints and to
``/derender(generate(tokens))`` for the same forced tokens, on each vLLM lane.

vLLM's own derender endpoints changed between the lanes, and these tests pin what each does: 0.32's
decodes the engine's final stop token and reports chat finish reasons its own way (the sidecar's
``derender.fixes`` mend both), ignores stop strings (the text runs past them); 0.33's equals the
coupled endpoint for the raw generate answer, cuts at stop strings in batch and refuses them when
streaming."""

from __future__ import annotations

import json

import pytest
import requests

from tests.harness.forced import NO_THINKING, OUTPUTS, TOOLS
from disagg_sidecar.derender.fixes import generate_for_derender, normalise_chat_response
from tests.harness.openai_views import (
    chat_stream_view,
    chat_view,
    completion_stream_view,
    completion_view,
    sse_events,
)
from tests.harness.overlap import in_background

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


def _legacy_derender(lane_set) -> bool:
    """Whether the lane's derender needs the sidecar's ``derender.fixes`` (vLLM 0.32)."""
    return lane_set.vllm_lane == "0.32"


def _for_derender(lane_set, gen_response: dict) -> dict:
    return generate_for_derender(gen_response) if _legacy_derender(lane_set) else gen_response


def _logprob_view(resp: dict) -> dict:
    return {c["index"]: [(e["token"], round(e["logprob"], 4), [t["token"] for t in e["top_logprobs"]])
                         for e in (c.get("logprobs") or {}).get("content") or []]
            for c in resp["choices"]}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_batch_derender_equals_coupled_and_chained(lane_set, forcer, name, n):
    chat = _chat(forcer, name, stream=False, n=n)
    reference = in_background(lambda: _post(lane_set.url("coupled") + "/v1/chat/completions", chat).json())
    gen = _post(lane_set.url("render") + "/v1/chat/completions/render", chat).json()
    inline = _post(lane_set.url("decode") + "/inference/v1/generate",
                   {**gen, "output_mode": "derender", "chat_request": chat}).json()
    assert inline["output_mode"] == "derender"
    tokens = _post(lane_set.url("decode") + "/inference/v1/generate", gen).json()
    chained = _post(lane_set.url("render") + "/v1/chat/completions/derender",
                    {"generate_response": _for_derender(lane_set, tokens), "prompt_tokens": len(gen["token_ids"]),
                     "prompt_token_ids": gen["token_ids"], "chat_request": chat}).json()
    coupled = reference.result()
    assert chat_view(inline) == chat_view(coupled)
    if _legacy_derender(lane_set):
        chained = normalise_chat_response(chained, tokens["usage"], chat.get("tool_choice"))
    chained_view = chat_view(chained)
    if name == "stop_string" and _legacy_derender(lane_set):
        _assert_extends(chained_view, chat_view(inline))
    else:
        assert chained_view == chat_view(coupled)
    if name == "logprobs":
        assert _logprob_view(inline) == _logprob_view(coupled)
        assert all(len(e["top_logprobs"]) == 5 for e in inline["choices"][0]["logprobs"]["content"])
    hidden = CASES[name][1].get("include_reasoning") is False  # vLLM hides ids with the reasoning
    for choice in inline["choices"]:
        assert (choice["token_ids"] is None) if hidden else choice["token_ids"]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_streamed_derender_equals_coupled_and_chained(lane_set, forcer, name, n):
    chat = _chat(forcer, name, stream=True, n=n)
    reference = in_background(lambda: _events(_post(lane_set.url("coupled") + "/v1/chat/completions", chat,
                                                     stream=True)))
    gen = _post(lane_set.url("render") + "/v1/chat/completions/render", chat).json()
    inline = _events(_post(lane_set.url("decode") + "/inference/v1/generate",
                           {**gen, "output_mode": "derender", "chat_request": chat}, stream=True))
    assert inline[-1] == "[DONE]"
    assert all(e["output_mode"] == "derender" for e in inline if e != "[DONE]")
    coupled = reference.result()
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
    tokens = _events(_post(lane_set.url("decode") + "/inference/v1/generate", gen, stream=True))
    url = lane_set.url("render") + "/v1/chat/completions/derender"
    if name == "stop_string" and not _legacy_derender(lane_set):
        _assert_refuses_stop(url, tokens[0], gen, {"chat_request": chat})
        return
    # 0.32's chat derender decodes every id it gets: the engine's final stop token is dropped first.
    chained = _chained_stream(url, [_for_derender(lane_set, e) for e in tokens[:-1]], gen, {"chat_request": chat})
    if name == "stop_string":  # 0.32's streaming derender cannot cut text it already sent
        _assert_extends(chat_stream_view(chained), chat_stream_view(inline))
    else:
        assert chat_stream_view(chained) == chat_stream_view(coupled)


def _chained_stream(url: str, chunks: list, gen: dict, request: dict) -> list:
    """Each generate(tokens) chunk through streaming ``/derender`` with its choice's state."""
    states: dict = {}
    chained = []
    for chunk in chunks:
        index = chunk["choices"][0]["index"] if chunk["choices"] else None
        out = _post(url, {"stream": True, "generate_chunk": chunk, "stream_state": states.get(index),
                          "prompt_tokens": len(gen["token_ids"]), "prompt_token_ids": gen["token_ids"], **request}).json()
        if index is not None:
            states[index] = out["stream_state"]
        chained.append(out["chunk"])
    return chained + ["[DONE]"]


def _assert_refuses_stop(url: str, chunk: dict, gen: dict, request: dict) -> None:
    """vLLM 0.33's streaming derender refuses stop strings (the sidecar must not send them)."""
    resp = requests.post(url, json={"stream": True, "generate_chunk": chunk, "stream_state": None,
                                    "prompt_tokens": len(gen["token_ids"]), "prompt_token_ids": gen["token_ids"],
                                    **request}, timeout=TIMEOUT)
    assert resp.status_code == 400 and "stop strings are not supported by streaming derender" in resp.text, resp.text


def _assert_extends(chained: dict, inline: dict) -> None:
    """Derender re-decodes every token, so the stop string and what follows come back: the
    chained content starts with the inline content and differs only after it."""
    for i, choice in inline["choices"].items():
        assert choice["content"] and chained["choices"][i]["content"].startswith(choice["content"])
        assert chained["choices"][i]["content"] != choice["content"]


COMPLETION_CASES = {
    "plain": (OUTPUTS["plain"][0], {}),
    "stop_string": ("Alpha beta STOP gamma delta", {"stop": ["STOP"]}),
    "multibyte": (OUTPUTS["multibyte"][0], {}),
    "markup_stays_text": (OUTPUTS["reasoning_tool_call"][0], {}),
    "logprobs": (OUTPUTS["multibyte"][0], {"logprobs": 5}),
}


def _completion(forcer, name: str, stream: bool, n: int) -> dict:
    text, extra = COMPLETION_CASES[name]
    body = {"model": "tiny-qwen3", "prompt": f"Complete this ({name}):", "max_tokens": 200, "n": n,
            "vllm_xargs": forcer.xargs(text), "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _choices(resp: dict | list) -> list[dict]:
    """Every choice of a batch answer or of every chunk of a stream, in order."""
    events = resp if isinstance(resp, list) else [resp]
    return [c for e in events if e != "[DONE]" for c in e.get("choices", [])]


def _generate_text_logprobs(resp: dict | list) -> dict[int, list]:
    """generate(text) logprobs per choice: (token, logprob, bytes, top [(token, logprob)])."""
    out: dict[int, list] = {}
    for c in _choices(resp):
        for e in (c.get("logprobs") or {}).get("content") or []:
            out.setdefault(c["index"], []).append((e["token"], round(e["logprob"], 4), bytes(e["bytes"]),
                                                   [(t["token"], round(t["logprob"], 4)) for t in e["top_logprobs"]]))
    return out


def _completion_logprobs(resp: dict | list) -> dict[int, list]:
    """/v1/completions logprobs per choice: (token, logprob, top {token: logprob})."""
    out: dict[int, list] = {}
    for c in _choices(resp):
        lp = c.get("logprobs") or {}
        for token, logprob, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []):
            out.setdefault(c["index"], []).append((token, round(logprob, 4), {k: round(v, 4) for k, v in top.items()}))
    return out


def _assert_text_logprobs_match(inline: dict | list, coupled: dict | list, coupled_ids: dict | list,
                                texts: dict[int, str], cut: int | None) -> None:
    """``coupled_ids`` is the coupled answer with ``return_tokens_as_token_ids``: its top-logprob
    keys are unique, where token strings collide (partial UTF-8 tokens all decode to ""). ``cut``:
    how many candidates generate keeps (0.32: the requested count; 0.33: every candidate the
    engine returned, the sampled token first, which completions shows too)."""
    got, want, want_ids = _generate_text_logprobs(inline), _completion_logprobs(coupled), _completion_logprobs(coupled_ids)
    assert set(got) == set(want) == set(want_ids) == set(texts)
    ids: dict[int, list[int]] = {}
    for c in _choices(inline):
        ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    for i, entries in got.items():
        assert [(t, lp) for t, lp, _, _ in entries] == [(t, lp) for t, lp, _ in want[i]]
        assert [int(t.removeprefix("token_id:")) for t, _, _ in want_ids[i]] == ids[i]
        for (_, _, _, top), (_, _, want_top) in zip(entries, want_ids[i]):
            # vLLM lists the sampled token, then the top ones.
            candidates = list(want_top.values())[:cut]
            assert len(top) == len(candidates) >= 5 and [lp for _, lp in top] == candidates
        # The bytes of the chosen tokens rebuild the text (multi-byte characters split across tokens).
        decoded = b"".join(b for _, _, b, _ in entries).decode()
        assert decoded.startswith(texts[i]) and decoded[len(texts[i]):] in ("", "<|im_end|>")


def _texts(view: dict) -> dict[int, str]:
    return {i: c["text"] for i, c in view["choices"].items()}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", list(COMPLETION_CASES))
def test_text_mode_equals_coupled_completions(lane_set, forcer, name, n, stream):
    body = _completion(forcer, name, stream, n)
    (gen,) = _post(lane_set.url("render") + "/v1/completions/render", body).json()
    url = lane_set.url("decode") + "/inference/v1/generate"
    view = completion_stream_view if stream else completion_view
    answer = _events if stream else (lambda resp: resp.json())
    reference = in_background(lambda: answer(_post(lane_set.url("coupled") + "/v1/completions", body,
                                                   stream=stream)))
    inline = answer(_post(url, {**gen, "output_mode": "text"}, stream=stream))
    coupled = reference.result()
    assert all(e["output_mode"] == "text" for e in (inline if stream else [inline]) if e != "[DONE]")
    got = view(inline)
    assert got == view(coupled)
    if name == "logprobs":
        coupled_ids = answer(_post(lane_set.url("coupled") + "/v1/completions",
                                   {**body, "return_tokens_as_token_ids": True}, stream=stream))
        _assert_text_logprobs_match(inline, coupled, coupled_ids, _texts(got), 5 if _legacy_derender(lane_set) else None)
    # Chained: generate(tokens) -> /v1/completions/derender. Completions decode with special tokens
    # skipped, so the stop token needs no stripping here.
    derender = lane_set.url("render") + "/v1/completions/derender"
    tokens = answer(_post(url, gen, stream=stream))
    if name == "stop_string" and stream and not _legacy_derender(lane_set):
        _assert_refuses_stop(derender, tokens[0], gen, {"completion_request": body})
        return
    if stream:
        chained = completion_stream_view(_chained_stream(derender, tokens[:-1], gen, {"completion_request": body}))
    else:
        chained = completion_view(_post(derender, {
            "generate_responses": [tokens], "prompt_tokens": [len(gen["token_ids"])],
            "prompt_token_ids": [gen["token_ids"]], "completion_request": body}).json())
    if name == "stop_string" and _legacy_derender(lane_set):
        # 0.32's derender re-decodes every token: it starts with the inline text and differs after it.
        for i, text in _texts(got).items():
            assert chained["choices"][i]["text"].startswith(text) and chained["choices"][i]["text"] != text
    else:
        assert chained == got
