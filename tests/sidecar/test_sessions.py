"""Derender sessions end to end: a stock decode engine (tokens), the sidecar, and render
processes that run the engine extension's sessions, against the coupled server.

The render processes are the demo's (with the extension) and one of the session tests' own, which
one test kills (``tests/engine/session_renders.py``); decode, prefill and coupled come from the
shared set.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from disagg_engine.servers import pid_alive, signal_group
from disagg_engine.testing.lanes import MAIN
from disagg_sidecar import wire

from tests.engine.session_renders import Render
from tests.harness.openai_views import (
    chat_full_view,
    chat_stream_full_view,
    completion_full_view,
    completion_stream_full_view,
    sse_events,
)
from tests.harness.overlap import in_background
from tests.sidecar.conftest import TOKENS_ONLY
from tests.sidecar.support import RunningSidecar, long_body, recording_proxy, run_sidecar, sidecar_config, wait_for
from tests.sidecar.test_messages_parity import CASES as MESSAGES_CASES
from tests.sidecar.test_messages_parity import post as post_messages
from tests.sidecar.test_messages_parity import stream_view as messages_stream_view
from tests.sidecar.test_parity import post_raw
from tests.sidecar.test_parity_matrix import CHAT_CASES, COMPLETION_CASES, chat_request

pytestmark = [pytest.mark.engine]


def session_config(sset, renders: list[Render], **overrides: Any) -> dict[str, Any]:
    """A stock decode engine (tokens only); the derender tier: the session renders."""
    engine = {"derender_sessions": True, **overrides.pop("engine", {})}
    return sidecar_config(sset, decode={"capabilities": TOKENS_ONLY}, engine=engine,
                          derender={"urls": [r.url for r in renders if r.alive()]}, **overrides)


@pytest.fixture(scope="module")
def lane_session_sidecar(request, lane_set) -> Iterator[RunningSidecar]:
    """Each vLLM lane's set behind a sidecar whose derender tier runs sessions: on 0.32 the session
    tests' own renders, on 0.33 its set's render (which has the extension)."""
    if lane_set.vllm_lane == MAIN:
        renders = request.getfixturevalue("session_renders")
    else:
        renders = [Render(lane_set.url("render"), lane_set.servers["render"].pid)]
    with run_sidecar(session_config(lane_set, renders)) as sidecar:
        yield sidecar


def stateless_calls(sidecar) -> float:
    return sidecar.metric("disagg_sidecar_derender_calls_total", kind="stream")


def stream_equals_coupled(sset, sidecar, path: str, body: dict[str, Any], request_id: str, view) -> None:
    """The stream through ``sidecar`` equals coupled's (run beside it) and made no stateless derender call."""
    reference = in_background(lambda: post_raw(sset.url("coupled"), path, body, request_id))
    before = stateless_calls(sidecar)
    got = post_raw(sidecar.url, path, body, request_id)
    assert view(got) == view(reference.result())
    assert stateless_calls(sidecar) == before


# A stop string inside the second tool call: vLLM's hermes streaming parser answers it differently
# when the first call's closing tokens come in one delta rather than one by one, and under load
# coupled's own output collector merges them at times (seen: coupled's first call's arguments ended
# in `}\n</tool_`). The session feeds one token at a time, as an unloaded coupled server does: its
# reference is a coupled answer with a token per chunk (test_chunking_sensitive_case_...).
CHUNKING_SENSITIVE = {"stop_inside_a_second_tool_call"}


@pytest.mark.parity
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("case", [c for c in CHAT_CASES if c not in CHUNKING_SENSITIVE])
def test_chat_stream_matrix_through_sessions(lane_set, forcer, lane_session_sidecar, case: str, n: int) -> None:
    """The parity matrix's chat cases, streamed, through the session path equal the coupled server
    on each vLLM lane, with no stateless derender call. (A batch answer is one stateless call
    whatever ``derender_sessions`` says: test_parity_matrix.py's chained path is that path;
    ``test_batch_answers_take_the_stateless_endpoints`` checks it here.)"""
    body = chat_request(forcer, case, True, n)
    stream_equals_coupled(lane_set, lane_session_sidecar, "/v1/chat/completions", body, f"session-{case}-{n}",
                          chat_stream_full_view)


def token_per_chunk_reference(sset, body: dict[str, Any], request_id: str, attempts: int = 5) -> list[Any]:
    """Coupled's stream for ``body`` (with ``return_token_ids``, so each chunk names its tokens) in
    which no chunk carries more than one token: an answer whose collector merged tokens under load
    is asked for again, at most ``attempts`` times."""
    for _ in range(attempts):
        events = post_raw(sset.url("coupled"), "/v1/chat/completions", body, request_id)
        if all(len(c.get("token_ids") or []) <= 1 for e in events if e != "[DONE]" for c in e.get("choices") or []):
            return events
    pytest.fail(f"coupled merged tokens into one chunk in each of {attempts} answers")


@pytest.mark.parity
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("case", sorted(CHUNKING_SENSITIVE))
def test_chunking_sensitive_case_through_sessions_equals_coupled_a_token_a_chunk(
        lane_set, forcer, lane_session_sidecar, case: str, n: int) -> None:
    body = {**chat_request(forcer, case, True, n), "return_token_ids": True}
    want = token_per_chunk_reference(lane_set, body, f"session-{case}-{n}")
    before = stateless_calls(lane_session_sidecar)
    got = post_raw(lane_session_sidecar.url, "/v1/chat/completions", body, f"session-{case}-{n}")
    assert chat_stream_full_view(got) == chat_stream_full_view(want)
    assert stateless_calls(lane_session_sidecar) == before


@pytest.mark.parity
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("case", list(COMPLETION_CASES))
def test_completions_stream_matrix_through_sessions(lane_set, forcer, lane_session_sidecar, case: str, n: int) -> None:
    """The parity matrix's completions cases, streamed, through the session path equal the coupled
    server on each vLLM lane, with no stateless derender call."""
    body = {**COMPLETION_CASES[case](forcer), "stream": True, "n": n}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": body.pop("continuous_usage", False)}
    stream_equals_coupled(lane_set, lane_session_sidecar, "/v1/completions", body, f"session-completions-{case}-{n}",
                          completion_stream_full_view)


@pytest.mark.parity
def test_decode_sends_tokens_in_fours_and_the_client_still_gets_coupleds_chunks(lane_set, forcer) -> None:
    """``limits.session_stream_interval`` (4): the decode engine sends up to 4 tokens per chunk
    (fewer events through its API process and the sidecar); the session takes them one token a
    line, so the client gets a chunk per token, as from coupled, with the same content."""
    body = forcer.chat_body("reasoning_tool_call", stream=True, logprobs=True, top_logprobs=2, return_token_ids=True)
    want = token_per_chunk_reference(lane_set, body, "fours")
    render = Render(lane_set.url("render"), lane_set.servers["render"].pid)
    with recording_proxy(lane_set.url("decode")) as decode:
        config = sidecar_config(lane_set, decode={"url": decode.url, "capabilities": TOKENS_ONLY},
                                engine={"derender_sessions": True}, derender={"urls": [render.url]})
        with run_sidecar(config) as sidecar:
            assert sidecar.config.limits.session_stream_interval == 4
            got = post_raw(sidecar.url, "/v1/chat/completions", body, "fours")
    [leg] = [c for c in decode.calls if c.path == wire.GENERATE]
    assert leg.body["sampling_params"]["stream_interval"] == 4
    sizes = [len(e["choices"][0]["token_ids"]) for e in sse_events(bytes(leg.response).splitlines())
             if e != "[DONE]" and e.get("choices")]
    assert max(sizes) == 4 and sum(sizes) > 2 * len(sizes)  # the first token comes alone, then fours
    assert chat_stream_full_view(got) == chat_stream_full_view(want)
    assert len(got) == len(want)  # one event per token (and the role, finish and [DONE] ones) as coupled


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_batch_answers_take_the_stateless_endpoints(lane_set, forcer, lane_session_sidecar, api: str) -> None:
    """Batch answers take the stateless endpoints of the same render processes: one call, no session."""
    if api == "chat":
        path, body, view = "/v1/chat/completions", forcer.chat_body("reasoning_tool_call", stream=False, n=2), chat_full_view
    else:
        path, body, view = "/v1/completions", {**COMPLETION_CASES["plain"](forcer), "n": 2}, completion_full_view
    reference = in_background(lambda: post_raw(lane_set.url("coupled"), path, body, f"batch-{api}"))
    batch_calls = lambda: lane_session_sidecar.metric("disagg_sidecar_derender_calls_total", kind="batch")
    before = batch_calls()
    got = post_raw(lane_session_sidecar.url, path, body, f"batch-{api}")
    assert view(got) == view(reference.result())
    assert batch_calls() == before + 1


def test_a_derender_tier_configured_without_sessions_is_never_asked(engine_set, forcer, session_renders) -> None:
    """``engine.derender_sessions: false`` (what the operator writes for a render tier without
    them): a chat stream takes the stateless path although these renders offer sessions."""
    body = forcer.chat_body("reasoning_tool_call", stream=True)
    reference = in_background(lambda: post_raw(engine_set.url("coupled"), "/v1/chat/completions", body, "no-sessions"))
    with run_sidecar(session_config(engine_set, session_renders, engine={"derender_sessions": False})) as sidecar:
        got = post_raw(sidecar.url, "/v1/chat/completions", body, "no-sessions")
        assert stateless_calls(sidecar) > 0
    assert chat_stream_full_view(got) == chat_stream_full_view(reference.result())


def _session_relayed(engine_set, api: str, body: dict, request_id: str) -> tuple[dict, list, list]:
    """A streamed request through a sidecar whose render (behind a recording proxy) runs sessions:
    the session's open line, the client's events and coupled's. The client's stream is the session's
    answer byte for byte, each event's ``fed:`` field left out, [DONE] included, under the header the
    open line's ``client_stream`` named, and no stateless derender call was made."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    reference = in_background(lambda: post_raw(engine_set.url("coupled"), path, body, request_id))
    render = engine_set.url("render")
    with recording_proxy(render) as proxy:
        with run_sidecar(session_config(engine_set, [Render(proxy.url, engine_set.servers["render"].pid)])) as sidecar:
            before = stateless_calls(sidecar)
            resp = requests.post(sidecar.url + path, json=body, timeout=120, headers={"X-Request-Id": request_id})
            assert resp.status_code == 200, resp.text
            assert stateless_calls(sidecar) == before
    session_path = Render(render, 0).capabilities()["derender_sessions"][f"{api}_path"]
    (call,) = [c for c in proxy.calls if c.path == session_path]
    first = json.loads(bytes(call.body).split(b"\n", 1)[0])
    client = first["client_stream"]
    assert client["api"] == api and client["model"] == body["model"]
    assert client["return_token_ids"] is bool(body.get("return_token_ids"))
    events = bytes(call.response).split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    with_choices = [e for e in events if b',"choices":[{' in e]
    assert with_choices and all(e.startswith(b"fed: ") and e.count(b"\n") == 1 for e in with_choices)
    assert resp.content == b"".join(e.split(b"\n")[-1] + b"\n\n" for e in events[:-1])
    got = list(sse_events(resp.content.splitlines()))
    assert all(e["id"] == client["id"] and e["created"] == client["created"] for e in got[:-1])
    return first, got, reference.result()


@pytest.mark.parity
@pytest.mark.parametrize("name, options", [
    ("reasoning_tool_call", {}),
    ("multibyte", {"n": 2, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
], ids=["tool-call", "n2-logprobs-ids-usage"])
def test_a_session_chat_stream_is_the_sessions_bytes(engine_set, forcer, name: str, options: dict) -> None:
    """The render's session (``client_streams``) is asked for the client's own chunks (the open
    line's ``client_stream``: the chat stream's id, created and model), and the client's stream is
    the session's answer byte for byte (``_session_relayed``); its deltas are coupled's."""
    request_id = f"session-bytes-{name}"
    first, got, reference = _session_relayed(engine_set, "chat", forcer.chat_body(name, stream=True, **options),
                                             request_id)
    assert first["client_stream"]["id"] == f"chatcmpl-{request_id}" and first["output_mode"] == "derender"
    assert chat_stream_full_view(got) == chat_stream_full_view(reference)


@pytest.mark.parity
@pytest.mark.parametrize("case, options", [
    ("multibyte", {}),
    ("logprobs_5_token_ids", {"n": 2, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
], ids=["plain", "n2-logprobs-ids-usage"])
def test_a_session_completions_stream_is_the_sessions_bytes(engine_set, forcer, case: str, options: dict) -> None:
    """A one-prompt completions stream: the render's session is asked for the client's own
    ``text_completion`` chunks (``client_stream`` with ``api: completions`` on a ``text`` open line), and
    the client's stream is the session's answer byte for byte (``_session_relayed``), usage included;
    its chunks are coupled's."""
    body = {**COMPLETION_CASES[case](forcer), "stream": True, **options}
    first, got, reference = _session_relayed(engine_set, "completions", body, f"session-bytes-completions-{case}")
    assert first["output_mode"] == "text" and {e["object"] for e in got[:-1]} == {"text_completion"}
    assert completion_stream_full_view(got) == completion_stream_full_view(reference)


@pytest.mark.reliability
def test_pinned_render_killed_mid_stream(engine_set, forcer, session_renders) -> None:
    """The render process a stream's session is pinned to dies mid-stream: the stream goes on
    statelessly on the other one (the demo's render) from the last delivered chunk; the client's
    output equals coupled. Runs last in this module: it kills the session tests' own render."""
    body = long_body(forcer, 3000, stream=True, logprobs=True, top_logprobs=2, return_token_ids=True,
                     stream_options={"include_usage": True})
    reference = in_background(lambda: post_raw(engine_set.url("coupled"), "/v1/chat/completions", body, "killed"))
    killable, *_ = session_renders
    # A new sidecar's first derender pick among idle endpoints is the first listed: the killable one.
    with run_sidecar(session_config(engine_set, session_renders)) as sidecar:
        failures = lambda: sidecar.metric("disagg_sidecar_leg_errors_total", leg="derender", kind="session")
        before = failures()
        resp = requests.post(sidecar.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "killed"},
                             stream=True, timeout=120)
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
        got = [next(events) for _ in range(20)]  # the session answers
        assert [r.url for r in session_renders if r.live_sessions() == 1] == [killable.url]
        signal_group(killable.pid, signal.SIGKILL)
        assert wait_for(lambda: not pid_alive(killable.pid), timeout=30)
        got += list(events)
        assert failures() == before + 1
    assert got[-1] == "[DONE]" and not any("error" in e for e in got[:-1])
    assert chat_stream_full_view(got) == chat_stream_full_view(reference.result())


@pytest.mark.parity
@pytest.mark.parametrize("case", [c for c in MESSAGES_CASES if c != "stop_sequence_inside_a_second_tool_call"])
def test_messages_streams_through_sessions(lane_set, forcer, lane_session_sidecar, case: str) -> None:
    """The Messages matrix's cases, streamed, through the session path (the chat legs under vLLM's
    mapping) equal the coupled server's ``/v1/messages`` stream, with no stateless derender call.
    (The stop sequence inside a second tool call is chunking-sensitive, as for chat above.)"""
    body = MESSAGES_CASES[case](forcer, True)
    reference = in_background(lambda: post_messages(lane_set.url("coupled"), body, f"session-messages-{case}"))
    before = stateless_calls(lane_session_sidecar)
    got = post_messages(lane_session_sidecar.url, body, f"session-messages-{case}")
    assert messages_stream_view(got) == messages_stream_view(reference.result())
    assert stateless_calls(lane_session_sidecar) == before
