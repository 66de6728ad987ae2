"""Parity rows for request options outside the main matrix (issue #45): prompt logprobs,
``return_tokens_as_token_ids`` and completions ``echo``, compared field by field with the coupled
server on the inline path, the stateless chained path, a stock decode engine and, streamed, the
derender sessions.

The coupled reference runs beside the inline and chained paths (other engines: ``overlap``); the
stock path's decode engine is the coupled server itself, so it runs after the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.harness.forced import MULTIBYTE, OUTPUTS, Forcer
from tests.harness.openai_views import (
    chat_full_view,
    chat_stream_full_view,
    completion_full_view,
    completion_stream_full_view,
)
from tests.harness.overlap import in_background
from tests.sidecar.support import SERVED
from tests.sidecar.test_parity import post_raw
from tests.sidecar.test_sessions import lane_session_sidecar  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.engine, pytest.mark.parity]

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
    names = ["inline", "chained", "stock"] + (["session"] if stream else [])
    return {name: request.getfixturevalue(f"lane_{name}_sidecar") for name in names}


@pytest.mark.parametrize("case, stream, n", _rows(CHAT_ROWS))
def test_chat_options_equal_coupled(request, lane_set, forcer, case: str, stream: bool, n: int) -> None:
    body = _stream_options({**CHAT_ROWS[case][0](forcer), "stream": stream, "n": n})
    _compare(lane_set, _sidecars(request, stream), "/v1/chat/completions", body, f"options-{case}-{int(stream)}-{n}",
             chat_stream_full_view if stream else chat_full_view)


@pytest.mark.parametrize("case, stream, n", _rows(COMPLETION_ROWS))
def test_completions_options_equal_coupled(request, lane_set, forcer, case: str, stream: bool, n: int) -> None:
    body = _stream_options({**COMPLETION_ROWS[case][0](forcer), "stream": stream, "n": n})
    _compare(lane_set, _sidecars(request, stream), "/v1/completions", body, f"options-{case}-{int(stream)}-{n}",
             completion_stream_full_view if stream else completion_full_view)
