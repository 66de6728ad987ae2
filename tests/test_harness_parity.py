"""The harness itself: forced outputs on the real engine, and the hand-driven disaggregated path
(render -> prefill -> decode -> derender) equal to the coupled endpoint."""

from __future__ import annotations

import re
import time

import pytest
import requests

from tests.harness.forced import MULTIBYTE, OUTPUTS
from tests.harness.openai_views import chat_stream_view, chat_view, tool_call_ids
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
    coupled = coupled_chat(engine_set, body)
    disagg = ManualPipeline(engine_set).chat(body)
    assert chat_view(disagg) == chat_view(coupled)
    for call_id in tool_call_ids(coupled) + tool_call_ids(disagg):
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16,}", call_id)


@pytest.mark.parametrize("name", NAMES)
def test_streamed_disaggregated_path_equals_coupled(engine_set, forcer, name):
    body = forcer.chat_body(name, stream=True)
    want = chat_stream_view(coupled_chat(engine_set, body))
    got = chat_stream_view(ManualPipeline(engine_set).chat(body))
    assert got == want
    assert want["done"] and want["choices"][0]["finish_reason"]


def test_decode_reports_an_external_kv_hit_for_the_prefilled_prompt(engine_set, forcer):
    log = engine_set.servers["decode"].log_path
    before = log.read_text(errors="replace").count("External Cache Hit")
    body = forcer.chat_body("plain")
    # The nonce leads: the connector matches block-aligned prompt prefixes.
    body["messages"][0]["content"] = f"{time.time_ns()} is a prompt nobody sent before"
    ManualPipeline(engine_set).chat(body)
    deadline = time.monotonic() + 10
    while log.read_text(errors="replace").count("External Cache Hit") <= before:
        assert time.monotonic() < deadline, "decode never reported an external KV cache hit"
        time.sleep(0.1)


def test_decode_without_prefill_reports_no_external_hit(engine_set, forcer):
    # The counter-check: a prompt that never went through prefill has nothing to load.
    log = engine_set.servers["decode"].log_path
    body = forcer.chat_body("plain")
    body["messages"][0]["content"] = f"{time.time_ns()} is a decode-only prompt"
    pipe = ManualPipeline(engine_set)
    gen = pipe.render_chat(body)
    before = log.read_text(errors="replace").count("External Cache Hit")
    resp = requests.post(engine_set.url("decode") + "/inference/v1/generate", json=gen, timeout=60)
    assert resp.status_code == 200
    assert log.read_text(errors="replace").count("External Cache Hit") == before
