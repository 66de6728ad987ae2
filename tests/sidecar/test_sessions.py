"""Derender sessions end to end: a stock decode engine (tokens), the sidecar, and render
processes that run the engine extension's sessions, against the coupled server.

The render processes are the session tests' own (``tests/engine/session_renders.py``); decode,
prefill and coupled come from the shared set.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest
import requests

from disagg_engine.servers import pid_alive, signal_group

from tests.engine.session_renders import Render
from tests.harness.openai_views import chat_full_view, chat_stream_full_view, sse_events
from tests.harness.overlap import in_background
from tests.sidecar.conftest import TOKENS_ONLY
from tests.sidecar.support import long_body, run_sidecar, sidecar_config, wait_for
from tests.sidecar.test_parity import post_raw
from tests.sidecar.test_parity_matrix import CHAT_CASES, chat_request

pytestmark = [pytest.mark.engine]


def session_config(engine_set, renders: list[Render], **overrides: Any) -> dict[str, Any]:
    """A stock decode engine (tokens only); the derender tier: the session renders."""
    return sidecar_config(engine_set, decode={"capabilities": TOKENS_ONLY},
                          derender={"urls": [r.url for r in renders if r.alive()]}, **overrides)


@pytest.fixture(scope="module")
def session_sidecar(engine_set, session_renders):
    with run_sidecar(session_config(engine_set, session_renders)) as sidecar:
        yield sidecar


def stateless_calls(sidecar) -> float:
    return sidecar.metric("disagg_sidecar_derender_calls_total", kind="stream")


@pytest.mark.parity
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_chat_matrix_through_sessions(engine_set, forcer, session_sidecar, case: str, stream: bool, n: int) -> None:
    """The parity matrix's chat cases through the session path equal the coupled server; a
    stream makes no stateless derender call (batch answers stay one stateless call)."""
    body = chat_request(forcer, case, stream, n)
    request_id = f"session-{case}-{int(stream)}-{n}"
    reference = in_background(lambda: post_raw(engine_set.url("coupled"), "/v1/chat/completions", body, request_id))
    before = stateless_calls(session_sidecar)
    got = post_raw(session_sidecar.url, "/v1/chat/completions", body, request_id)
    view = chat_stream_full_view if stream else chat_full_view
    assert view(got) == view(reference.result())
    if stream:
        assert stateless_calls(session_sidecar) == before


def test_stateless_derender_tier_still_works(engine_set, forcer, session_sidecar) -> None:
    """Batch answers take the stateless endpoints of the same render processes (no session)."""
    body = forcer.chat_body("reasoning_tool_call", stream=False)
    reference = in_background(lambda: post_raw(engine_set.url("coupled"), "/v1/chat/completions", body, "stateless"))
    got = post_raw(session_sidecar.url, "/v1/chat/completions", body, "stateless")
    assert chat_full_view(got) == chat_full_view(reference.result())


def test_a_derender_tier_configured_without_sessions_is_never_asked(engine_set, forcer, session_renders) -> None:
    """``engine.derender_sessions: false`` (what the operator writes for a render tier without
    them): a chat stream takes the stateless path although these renders offer sessions."""
    body = forcer.chat_body("reasoning_tool_call", stream=True)
    reference = in_background(lambda: post_raw(engine_set.url("coupled"), "/v1/chat/completions", body, "no-sessions"))
    with run_sidecar(session_config(engine_set, session_renders, engine={"derender_sessions": False})) as sidecar:
        got = post_raw(sidecar.url, "/v1/chat/completions", body, "no-sessions")
        assert stateless_calls(sidecar) > 0
    assert chat_stream_full_view(got) == chat_stream_full_view(reference.result())


@pytest.mark.reliability
def test_pinned_render_killed_mid_stream(engine_set, forcer, session_renders) -> None:
    """The render process a stream's session is pinned to dies mid-stream: the stream goes on
    statelessly on the other one from the last delivered chunk; the client's output equals coupled.
    Runs last in this module: it kills one of the module's own render processes."""
    body = long_body(forcer, 3000, stream=True, logprobs=True, top_logprobs=2, return_token_ids=True,
                     stream_options={"include_usage": True})
    reference = in_background(lambda: post_raw(engine_set.url("coupled"), "/v1/chat/completions", body, "killed"))
    with run_sidecar(session_config(engine_set, session_renders)) as sidecar:
        failures = lambda: sidecar.metric("disagg_sidecar_leg_errors_total", leg="derender", kind="session")
        before = failures()
        resp = requests.post(sidecar.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "killed"},
                             stream=True, timeout=120)
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
        got = [next(events) for _ in range(20)]  # the session answers
        (pinned,) = [r for r in session_renders if r.alive() and r.live_sessions() == 1]
        signal_group(pinned.pid, signal.SIGKILL)
        assert wait_for(lambda: not pid_alive(pinned.pid), timeout=30)
        got += list(events)
        assert failures() == before + 1
    assert got[-1] == "[DONE]" and not any("error" in e for e in got[:-1])
    assert chat_stream_full_view(got) == chat_stream_full_view(reference.result())
