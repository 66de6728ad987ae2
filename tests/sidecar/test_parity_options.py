"""Parity rows for request options outside the main matrix (issue #45): prompt logprobs,
``return_tokens_as_token_ids`` and completions ``echo``, compared field by field with the coupled
server on the inline path, the stateless chained path, a stock decode engine and, streamed, the
derender sessions (on the releases that have them), on every release's lane (``PARITY_LANES``).

The coupled reference runs beside the inline and chained paths (other engines: ``overlap``); the
stock path's decode engine is the coupled server itself, so it runs after the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from disagg_engine.testing.lanes import PARITY_LANES
from disagg_sidecar import vllm_releases
from tests.harness.forced import MULTIBYTE, OUTPUTS, Forcer
from tests.harness.openai_views import (
    chat_full_view,
    chat_stream_full_view,
    completion_full_view,
    completion_stream_full_view,
)
from tests.harness.overlap import in_background
from tests.sidecar.support import LANE_VERSIONS, SERVED
from tests.sidecar.test_parity import post_raw
from tests.sidecar.test_sessions import lane_session_sidecar  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.engine, pytest.mark.parity,
              pytest.mark.parametrize("lane_set", PARITY_LANES, indirect=True)]

Case = Callable[[Forcer], dict[str, Any]]
BATCH, BOTH = (False,), (False, True)
# A prompt that the byte-level BPE splits inside characters: its prompt logprobs have tokens that
# decode to "" and ones vLLM repairs from the preceding tokens.
MULTIBYTE_PROMPT = "Grüße 🦙🧬 — complete this:"


def _chat(name: str, **extra: Any) -> Case:
    return lambda f: {**f.chat_body(name), **extra}


def _completion(text: str, prompt: str = MULTIBYTE_PROMPT, **extra: Any) -> Case:
    return lambda f: {"model": SERVED, "prompt": prompt, "max_tokens": 200, "vllm_xargs": f.xargs(text), **extra}


PLAIN = OUTPUTS["plain"][0]
# name -> (the request, the stream values it is asked with); vLLM refuses prompt logprobs streamed.
CHAT_ROWS: dict[str, tuple[Case, tuple[bool, ...]]] = {
    "prompt_logprobs": (_chat("plain", prompt_logprobs=3), BATCH),
    "prompt_logprobs_and_logprobs": (_chat("multibyte", prompt_logprobs=1, logprobs=True, top_logprobs=2), BATCH),
    "return_tokens_as_token_ids": (_chat("multibyte", logprobs=True, top_logprobs=3, return_tokens_as_token_ids=True),
                                   BOTH),
    "return_tokens_as_token_ids_tool_call": (
        _chat("reasoning_tool_call", logprobs=True, top_logprobs=0, return_tokens_as_token_ids=True), BOTH),
}
COMPLETION_ROWS: dict[str, tuple[Case, tuple[bool, ...]]] = {
    "prompt_logprobs": (_completion(PLAIN, prompt_logprobs=2), BATCH),
    "prompt_logprobs_and_logprobs": (_completion(MULTIBYTE, prompt_logprobs=0, logprobs=1), BATCH),
    "prompt_logprobs_two_prompts": (_completion(PLAIN, prompt=["Hi 🦙", "Grüße"], prompt_logprobs=1), BATCH),
    "echo": (_completion(PLAIN, echo=True), BOTH),
    "echo_logprobs": (_completion(MULTIBYTE, echo=True, logprobs=2), BOTH),
    "echo_logprobs_two_prompts": (_completion(PLAIN, prompt=["🦙 first", "Grüße"], echo=True, logprobs=0), BOTH),
    "echo_token_prompt_logprobs": (lambda f: {**_completion(PLAIN, echo=True, logprobs=1)(f),
                                              "prompt": f.ids(MULTIBYTE_PROMPT, eos=False)}, BOTH),
    "echo_return_token_ids": (_completion(PLAIN, echo=True, return_token_ids=True), BOTH),
    "echo_stop_string": (_completion(PLAIN, echo=True, logprobs=1, stop=["is Par"]), BOTH),
}


def _rows(table: dict[str, tuple[Case, tuple[bool, ...]]]) -> list[Any]:
    return [pytest.param(case, stream, n, id=f"{case}-{'stream' if stream else 'batch'}-{n}")
            for case, (_, streams) in table.items() for stream in streams for n in (1, 2)]


def _stream_options(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream_options": {"include_usage": True}} if body.get("stream") else body


def _compare(lane_set, sidecars: dict[str, Any], path: str, body: dict[str, Any], request_id: str, view) -> None:
    reference = in_background(lambda: post_raw(lane_set.url("coupled"), path, body, request_id))
    got = {name: post_raw(s.url, path, body, request_id) for name, s in sidecars.items() if name != "stock"}
    want = view(reference.result())
    if "stock" in sidecars:  # its decode engine is the coupled server: after the reference
        got["stock"] = post_raw(sidecars["stock"].url, path, body, request_id)
    for name, answer in got.items():
        assert view(answer) == want, name


def _sidecars(request, stream: bool) -> dict[str, Any]:
    lane = request.getfixturevalue("lane_set").vllm_lane
    sessions = stream and vllm_releases.release(LANE_VERSIONS[lane]).derender_sessions
    names = ["inline", "chained", "stock"] + (["session"] if sessions else [])
    return {name: request.getfixturevalue(f"lane_{name}_sidecar") for name in names}


@pytest.mark.parametrize("case, stream, n", _rows(CHAT_ROWS))
def test_chat_options_equal_coupled(request, lane_set, forcer, case: str, stream: bool, n: int) -> None:
    body = _stream_options({**CHAT_ROWS[case][0](forcer), "stream": stream, "n": n})
    _compare(lane_set, _sidecars(request, stream), "/v1/chat/completions", body, f"options-{case}-{int(stream)}-{n}",
             chat_stream_full_view if stream else chat_full_view)


def _echoes_logprobs(body: dict[str, Any]) -> bool:
    return bool(body.get("echo")) and body.get("logprobs") is not None


@pytest.mark.parametrize("case, stream, n", _rows(COMPLETION_ROWS))
def test_completions_options_equal_coupled(request, lane_set, forcer, case: str, stream: bool, n: int) -> None:
    body = _stream_options({**COMPLETION_ROWS[case][0](forcer), "stream": stream, "n": n})
    request_id = f"options-{case}-{int(stream)}-{n}"
    if stream and n > 1 and _echoes_logprobs(body):
        return _streamed_echo_with_logprobs_equals_coupled_batch(request, lane_set, body, request_id)
    _compare(lane_set, _sidecars(request, stream), "/v1/completions", body, request_id,
             completion_stream_full_view if stream else completion_full_view)


def _streamed_echo_with_logprobs_equals_coupled_batch(request, lane_set, body: dict[str, Any], request_id: str) -> None:
    """Coupled vLLM (0.32) streams ``echo`` with ``logprobs`` and n > 1 only when the choices' first
    outputs come in one engine output: its stream generator takes the prompt's logprobs from the
    first ``RequestOutput`` alone, and a choice starting in a later one fails (``KeyError``, an error
    event). So the reference per choice is coupled's batch answer for the same request: the text,
    logprobs, finish and stop reasons a stream's chunks add up to."""
    fields = ("text", "logprobs", "finish_reason", "stop_reason")
    reference = in_background(lambda: post_raw(lane_set.url("coupled"), "/v1/completions",
                                               {k: v for k, v in body.items() if k not in ("stream", "stream_options")},
                                               request_id))
    got = {name: completion_stream_full_view(post_raw(s.url, "/v1/completions", body, request_id))
           for name, s in _sidecars(request, True).items() if name != "stock"}
    want = completion_full_view(reference.result())
    got["stock"] = completion_stream_full_view(post_raw(request.getfixturevalue("lane_stock_sidecar").url,
                                                        "/v1/completions", body, request_id))
    assert len(want["choices"]) == body["n"] * len(echo_prompts(body))
    for name, view in got.items():
        assert {i: {f: c[f] for f in fields} for i, c in view["choices"].items()} == \
            {i: {f: c[f] for f in fields} for i, c in want["choices"].items()}, name
        assert view["usage"] == want["usage"], name


def echo_prompts(body: dict[str, Any]) -> list[Any]:
    prompt = body["prompt"]
    return prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
