"""The parity matrix: every field a chat or completions client can ask for, batch and
streamed, n 1 and 2, on every release's lane (``PARITY_LANES``), on the inline path (decode with
the engine extension) and the chained path (decode answering tokens, the derender tier making the
answer), and where stock vLLM streams derender itself (0.34) a chat stream through a stock decode
engine too (``stock-inline``), compared field by field with the
coupled server: content, reasoning, tool-call names and parsed arguments, finish_reason,
stop_reason, logprobs, token ids, prompt token ids and usage (``*_full_view``).

One coupled reference per (case, stream, n) serves both paths, and runs while the sidecar paths
are driven (``overlap``): the paths share the decode engine, the reference runs on another.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import requests

from tests.harness.forced import MULTIBYTE, OUTPUTS, Forcer
from tests.harness.openai_views import (
    chat_full_view,
    chat_stream_full_view,
    completion_full_view,
    completion_stream_full_view,
)
from tests.harness.overlap import in_background
from disagg_engine.testing.lanes import PARITY_LANES
from disagg_sidecar import vllm_releases, wire
from tests.sidecar.conftest import TOKENS_ONLY
from tests.sidecar.support import (
    CLIENT_MAX_LOGPROBS,
    LANE_VERSIONS,
    SERVED,
    recording_proxy,
    run_sidecar,
    sidecar_config,
)
from tests.sidecar.test_parity import (
    check_chat_shape,
    check_chat_stream_shape,
    check_path_taken,
    path_counters,
    post_raw,
)

pytestmark = [pytest.mark.engine, pytest.mark.parity,
              pytest.mark.parametrize("lane_set", PARITY_LANES, indirect=True)]
# Where stock vLLM streams derender itself (0.34), a stock decode engine is a third path for streams.
STOCK_INLINE = {lane for lane in PARITY_LANES
                if vllm_releases.release(LANE_VERSIONS[lane]).stock_streaming_derender}

Case = Callable[[Forcer], dict[str, Any]]


def _ids(forcer: Forcer, name: str) -> list[int]:
    return forcer.ids(OUTPUTS[name][0], eos=False)


def cut_inside_a_character(forcer: Forcer) -> int:
    """A ``max_tokens`` that ends the multi-byte output in the middle of a character."""
    ids = forcer.ids(MULTIBYTE, eos=False)
    return next(k for k in range(1, len(ids)) if forcer.tokenizer.decode(ids[:k]).endswith("\ufffd"))


def _chat(name: str, **extra: Any) -> Case:
    return lambda f: {**f.chat_body(name), **extra}


# name -> the request; several cases check more than one thing with one request.
CHAT_CASES: dict[str, Case] = {
    "plain": _chat("plain"),
    "reasoning": _chat("reasoning"),
    "one_tool_call": _chat("tool_call"),
    "several_tool_calls": _chat("two_tool_calls"),
    "reasoning_tool_call": _chat("reasoning_tool_call"),
    "multibyte": _chat("multibyte"),
    "stop_string": _chat("plain", stop=["France"]),
    # " is" + " Paris": the stop string starts and ends inside tokens; the first of several can miss
    "stop_straddling": _chat("plain", stop=["zzz", "is Par"]),
    "stop_straddling_kept": _chat("plain", stop=["is Par"], include_stop_str_in_output=True),
    "stop_at_the_start": _chat("plain", stop=["The"]),  # nothing kept
    "stop_at_the_start_of_reasoning": _chat("reasoning", stop=["<think>"]),
    "stop_after_min_tokens": _chat("plain", stop=["a"], min_tokens=3),  # "capital" has one too, unchecked
    "stop_in_reasoning_with_logprobs": _chat("reasoning", stop=["briefly"], logprobs=True, top_logprobs=2),
    "stop_inside_a_second_tool_call": _chat("two_tool_calls", stop=["Europe"]),  # the first call stays whole
    "stop_is_a_markup_token": _chat("reasoning_tool_call", stop=["<tool_call>"]),
    "stop_is_the_end_of_reasoning": _chat("reasoning_tool_call", stop=["</think>"], logprobs=True),
    "stop_token_ids": lambda f: {**f.chat_body("plain"), "stop_token_ids": [_ids(f, "plain")[4]]},
    "logprobs_top0_multibyte": _chat("multibyte", logprobs=True, top_logprobs=0),
    "logprobs_top5_tool_call": _chat("reasoning_tool_call", logprobs=True, top_logprobs=5),
    "logprobs_top20_token_ids": _chat("reasoning", logprobs=True, top_logprobs=20, return_token_ids=True),
    "return_token_ids_tool_call": _chat("reasoning_tool_call", return_token_ids=True),
    "max_tokens_inside_a_character": lambda f: {**f.chat_body("multibyte"), "max_tokens": cut_inside_a_character(f)},
    # 16 is SamplingParams' default, which render leaves out of its answer
    "max_tokens_inside_a_tool_call": _chat("tool_call", max_tokens=16),
    "max_completion_tokens_after_a_tool_call": lambda f: {
        **f.chat_body("reasoning_tool_call"), "max_completion_tokens": len(_ids(f, "reasoning_tool_call")) - 1},
    "parallel_tool_calls_false": _chat("tool_call", parallel_tool_calls=False),
    "include_reasoning_false": _chat("reasoning", include_reasoning=False, logprobs=True, return_token_ids=True),
    "continuous_usage_stats": _chat("reasoning_tool_call", continuous_usage=True),
}


def chat_request(forcer: Forcer, case: str, stream: bool, n: int) -> dict[str, Any]:
    body = {**CHAT_CASES[case](forcer), "stream": stream, "n": n}
    continuous = body.pop("continuous_usage", False)
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": continuous}
    return body


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_chat_matrix(lane_set, forcer, request, lane_inline_sidecar, lane_chained_sidecar, case: str, stream: bool,
                     n: int) -> None:
    body = chat_request(forcer, case, stream, n)
    request_id = f"matrix-{case}-{int(stream)}-{n}"
    reference = in_background(lambda: post_raw(lane_set.url("coupled"), "/v1/chat/completions", body, request_id))
    view = chat_stream_full_view if stream else chat_full_view
    got = {}
    for path, sidecar in (("inline", lane_inline_sidecar), ("chained", lane_chained_sidecar)):
        before = path_counters(sidecar)
        got[path] = post_raw(sidecar.url, "/v1/chat/completions", body, request_id)
        check_path_taken(before, path_counters(sidecar), path, "derender", stream)
    want = view(reference.result())
    if stream and lane_set.vllm_lane in STOCK_INLINE:  # its decode engine is the coupled one: after the reference
        stock = request.getfixturevalue("lane_stock_sidecar")
        before = path_counters(stock)
        got["stock-inline"] = post_raw(stock.url, "/v1/chat/completions", body, request_id)
        check_path_taken(before, path_counters(stock), "inline", "derender", stream)
    for path, answer in got.items():
        assert view(answer) == want, path
        if not stream:
            assert answer["id"] == reference.result()["id"], path  # chatcmpl-<X-Request-Id>
        if stream:
            check_chat_stream_shape([e for e in answer if e != "[DONE]"], request_id, n)
        else:
            check_chat_shape(answer, request_id, n)


def _completion(text: str, **extra: Any) -> Case:
    return lambda f: {"model": SERVED, "prompt": "Complete this:", "max_tokens": 200, "vllm_xargs": f.xargs(text),
                      **extra}


PLAIN = OUTPUTS["plain"][0]
COMPLETION_CASES: dict[str, Case] = {
    "plain": _completion(PLAIN),
    "multibyte": _completion(MULTIBYTE),
    "markup_stays_text": _completion(OUTPUTS["reasoning_tool_call"][0]),
    "stop_straddling": _completion(PLAIN, stop=["zzz", "is Par"]),
    "stop_straddling_kept": _completion(PLAIN, stop=["is Par"], include_stop_str_in_output=True),
    "stop_token_ids_and_token_ids": lambda f: {**_completion(PLAIN, return_token_ids=True)(f),
                                               "stop_token_ids": [_ids(f, "plain")[4]]},
    "max_tokens_inside_a_character": lambda f: {**_completion(MULTIBYTE)(f), "max_tokens": cut_inside_a_character(f)},
    "max_tokens_default_value": _completion(MULTIBYTE, max_tokens=16),
    "continuous_usage_stats": _completion(PLAIN, continuous_usage=True),
    # The sampled token and the top k per position (k + 1 candidates, or k when it is among them).
    "logprobs_0": _completion(MULTIBYTE, logprobs=0),
    "logprobs_5_token_ids": _completion(OUTPUTS["reasoning_tool_call"][0], logprobs=5, return_token_ids=True),
    "logprobs_20_the_most": _completion(MULTIBYTE, logprobs=CLIENT_MAX_LOGPROBS),  # the engines run with 21
}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
@pytest.mark.parametrize("case", list(COMPLETION_CASES))
def test_completions_matrix(lane_set, forcer, lane_inline_sidecar, lane_chained_sidecar, case: str, stream: bool,
                            n: int) -> None:
    body = {**COMPLETION_CASES[case](forcer), "stream": stream, "n": n}
    continuous = body.pop("continuous_usage", False)
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": continuous}
    reference = in_background(lambda: post_raw(lane_set.url("coupled"), "/v1/completions", body, f"matrix-{case}"))
    view = completion_stream_full_view if stream else completion_full_view
    got = {path: post_raw(sidecar.url, "/v1/completions", body, f"matrix-{case}")
           for path, sidecar in (("inline", lane_inline_sidecar), ("chained", lane_chained_sidecar))}
    want = view(reference.result())
    for path, answer in got.items():
        assert view(answer) == want, path


PAST = CLIENT_MAX_LOGPROBS + 1
TOO_MANY_LOGPROBS: dict[str, tuple[str, Case]] = {
    "chat_top_logprobs": ("/v1/chat/completions", _chat("plain", logprobs=True, top_logprobs=PAST)),
    "chat_prompt_logprobs": ("/v1/chat/completions", _chat("plain", prompt_logprobs=PAST)),
    "completions_logprobs": ("/v1/completions", _completion(PLAIN, logprobs=PAST)),
    "completions_prompt_logprobs": ("/v1/completions", _completion(PLAIN, prompt_logprobs=PAST)),
    "generate": ("/inference/v1/generate", lambda f: {"token_ids": f.ids("Hi", eos=False), "stream": False,
                                                      "sampling_params": {"max_tokens": 3, "logprobs": PAST}}),
}


@pytest.mark.parametrize("case", list(TOO_MANY_LOGPROBS))
def test_more_logprobs_than_the_server_allows_are_refused_as_coupled_does(
        lane_set, forcer, lane_inline_sidecar, lane_chained_sidecar, case: str) -> None:
    """The engines behind the sidecar allow one candidate more than coupled's (the sampled
    token's room); what a client may ask is still coupled's limit, refused in coupled's words."""
    path, make = TOO_MANY_LOGPROBS[case]
    body = make(forcer)
    want = requests.post(lane_set.url("coupled") + path, json=body, timeout=60)
    assert want.status_code == 400, want.text[:300]
    for sidecar in (lane_inline_sidecar, lane_chained_sidecar):
        got = requests.post(sidecar.url + path, json=body, timeout=60)
        assert (got.status_code, got.json()) == (400, want.json())


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
def test_derender_tier_never_gets_stop_strings(lane_set, forcer, stream: bool) -> None:
    """The decode engine applies the stop strings; the cut is the sidecar's (vLLM 0.33's streaming
    derender rejects ``stop``): no derender call carries them, nor the prompt's text, and the
    answer is still coupled's."""
    body = {**forcer.chat_body("plain", stream=stream, n=2), "stop": ["zzz", "is Par"]}
    reference = in_background(lambda: post_raw(lane_set.url("coupled"), "/v1/chat/completions", body, "no-stop"))
    with recording_proxy(lane_set.url("render")) as derender:
        config = sidecar_config(lane_set, decode={"capabilities": TOKENS_ONLY}, derender={"url": derender.url})
        with run_sidecar(config) as sidecar:
            got = post_raw(sidecar.url, "/v1/chat/completions", body, "no-stop")
    view = chat_stream_full_view if stream else chat_full_view
    assert view(got) == view(reference.result())
    contexts = [b.get("chat_request") or b.get("completion_request") for b in derender.bodies(wire.CHAT_DERENDER)
                + derender.bodies(wire.COMPLETIONS_DERENDER)]
    assert contexts and all(c is not None and "stop" not in c for c in contexts)
    # nor the conversation's text: the parser never reads it (legs.parser_context)
    question = body["messages"][-1]["content"]
    assert all(question not in json.dumps(c) for c in contexts)
    # the cut: one plain-text call per batch answer, one per held choice of a stream
    assert derender.count(wire.COMPLETIONS_DERENDER) == (2 if stream else 1)
