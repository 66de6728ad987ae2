"""The harness itself: forced outputs on the real engine, and the hand-driven disaggregated path
(render -> prefill -> decode -> derender) equal to the coupled endpoint."""

from __future__ import annotations

import re
import time
import uuid

import pytest
import requests

from tests.harness.forced import MULTIBYTE, OUTPUTS
from tests.harness.openai_views import chat_stream_view, chat_view, tool_call_ids
from tests.harness.overlap import in_background
from tests.harness.pipeline import ManualPipeline, coupled_chat

pytestmark = [pytest.mark.engine, pytest.mark.parity]

NAMES = ["plain", "reasoning", "tool_call", "two_tool_calls", "reasoning_tool_call", "multibyte"]


def test_coupled_chat_emits_the_forced_plain_answer_exactly(engine_set, forcer):
    resp = coupled_chat(engine_set, forcer.chat_body("plain"))
    choice = resp["choices"][0]
    assert choice["message"]["content"] == OUTPUTS["plain"][0]
    assert choice["finish_reason"] == "stop"
    assert resp["usage"]["completion_tokens"] == len(forcer.ids(OUTPUTS["plain"][0]))


def test_multibyte_text_is_split_inside_characters(forcer):
    # The point of the multibyte case: some tokens hold only part of a character's UTF-8 bytes.
    partial = [i for i in forcer.ids(MULTIBYTE, eos=False) if "\ufffd" in forcer.tokenizer.decode([i])]
    assert len(partial) >= 2


def test_forced_tool_call_is_parsed_by_the_coupled_server(engine_set, forcer):
    view = chat_view(coupled_chat(engine_set, forcer.chat_body("reasoning_tool_call")))["choices"][0]
    assert view["reasoning"].strip() == "I should look the weather up."
    assert view["tool_calls"] == [("get_weather", {"city": "東京"})]
    assert view["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("name", NAMES)
def test_batch_disaggregated_path_equals_coupled(engine_set, forcer, name):
    body = forcer.chat_body(name)
    reference = in_background(lambda: coupled_chat(engine_set, body))
    disagg = ManualPipeline(engine_set).chat(body)
    coupled = reference.result()
    assert chat_view(disagg) == chat_view(coupled)
    for call_id in tool_call_ids(coupled) + tool_call_ids(disagg):
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16,}", call_id)


LONG = 4096


def test_a_4096_token_answer_is_the_same_on_both_paths(engine_set, forcer):
    """A long output: 4,096 forced tokens (short reasoning, then a long answer with multi-byte
    text early on), cut by ``max_tokens``, through the coupled endpoint and the disaggregated path."""
    lines = [f"Step {i}: 東京 🚀 is far from Paris.\n" if i < 20 else f"Step {i}: and then north.\n" for i in range(450)]
    answer = "".join(lines)
    text = f"<think>\nA long plan.\n</think>\n\n{answer}"
    ids = forcer.ids(text, eos=False)
    assert len(ids) > LONG
    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "A long answer, please."}],
            "max_tokens": LONG, "vllm_xargs": {"forced_token_ids": ids}}
    reference = in_background(lambda: coupled_chat(engine_set, body))
    disagg = ManualPipeline(engine_set).chat(body)
    coupled = reference.result()
    assert chat_view(disagg) == chat_view(coupled)
    choice = chat_view(coupled)["choices"][0]
    assert choice["finish_reason"] == "length" and coupled["usage"]["completion_tokens"] == LONG
    assert choice["reasoning"].strip() == "A long plan."
    # The answer is the forced text up to the 4,096th token (an ASCII line: nothing split there).
    want = forcer.tokenizer.decode(ids[:LONG]).split("</think>", 1)[1]
    assert choice["content"].strip() == want.strip() and len(want) > len(answer) // 2


@pytest.mark.parametrize("name", NAMES)
def test_streamed_disaggregated_path_equals_coupled(engine_set, forcer, name):
    body = forcer.chat_body(name, stream=True)
    reference = in_background(lambda: chat_stream_view(coupled_chat(engine_set, body)))
    got = chat_stream_view(ManualPipeline(engine_set).chat(body))
    want = reference.result()
    assert got == want
    assert want["done"] and want["choices"][0]["finish_reason"]


def _decode_counters(engine_set) -> dict[str, float]:
    """The decode engine's own Prometheus counters (log lines of earlier requests can land late;
    the counters are recorded before a request's last output reaches its client)."""
    text = requests.get(engine_set.url("decode") + "/metrics", timeout=10).text
    wanted = {"vllm:external_prefix_cache_hits_total": "hits", "vllm:request_success_total": "done"}
    totals = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def _decode_delta(engine_set, send) -> dict[str, float]:
    """The change in decode's counters that ``send()`` (one decode request) caused."""
    before = _decode_counters(engine_set)
    send()
    deadline = time.monotonic() + 10
    while (after := _decode_counters(engine_set))["done"] < before["done"] + 1:
        assert time.monotonic() < deadline, "decode never counted the request as finished"
        time.sleep(0.1)
    return {k: after[k] - before[k] for k in after}


def _nonce_body(forcer, text: str) -> dict:
    body = forcer.chat_body("plain")
    # The nonce leads (no local prefix-cache hit); the prompt spans several KV blocks because the
    # connector only loads whole blocks (a one-block prompt "hits" with 0 tokens).
    body["messages"][0]["content"] = f"{time.time_ns()} {text}" + " and then some more words" * 100
    return body


def test_decode_reports_an_external_kv_hit_for_the_prefilled_prompt(engine_set, forcer):
    pipe = ManualPipeline(engine_set)
    gen = pipe.render_chat(_nonce_body(forcer, "is a prompt nobody sent before"))
    request_id = uuid.uuid4().hex
    prefilled = pipe.prefill(gen, request_id)
    delta = _decode_delta(engine_set, lambda: pipe.decode(gen, prefilled, request_id))
    assert delta["hits"] > 0


def test_decode_without_prefill_reports_no_external_hit(engine_set, forcer):
    # The counter-check: a prompt that never went through prefill has nothing to load.
    gen = ManualPipeline(engine_set).render_chat(_nonce_body(forcer, "is a decode-only prompt"))

    def send():
        resp = requests.post(engine_set.url("decode") + "/inference/v1/generate", json=gen, timeout=60)
        assert resp.status_code == 200, resp.text

    assert _decode_delta(engine_set, send)["hits"] == 0
