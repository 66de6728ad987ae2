"""Derender sessions on the render tier (engine/disagg_engine/sessions.py): the pure pieces, and
a real ``launch render`` with the extension (``session_renders``): bad input, the session count
after 200 concurrent sessions whose clients all went away."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import aiohttp
import pytest
import requests

from disagg_engine import vllm_compat
from disagg_engine.sessions import (
    CHAT_SESSION_PATH,
    COMPLETIONS_SESSION_PATH,
    Sessions,
    engine_outputs,
    fed_event,
    line_chunk,
    logprob_row,
    split_lines,
    tagged,
)
from disagg_operator import engine_args
from tests.engine.session_renders import live
from tests.harness.forced import OUTPUTS
from tests.sidecar.support import wait_for

# -- pure pieces -------------------------------------------------------------------------------


def test_the_operator_expects_sessions_exactly_where_the_engine_runs_them():
    """status.derender.strategy ``session`` is decided from engine.vllmVersion; the engine decides
    from the running vLLM: the two agree for the vLLM this lane runs."""
    assert engine_args.derender_sessions(vllm_compat.vllm_version()) is vllm_compat.DERENDER_SESSIONS


def test_split_lines_keeps_the_incomplete_rest():
    lines, rest = split_lines(b'{"a":1}\n{"b"', b':2}\n\n{"c"')
    assert lines == [b'{"a":1}', b'{"b":2}'] and rest == b'{"c"'


def test_logprob_row_rebuilds_the_engine_row():
    # sampled token ranked 2: the engine's row is [sampled, rank 1, rank 2 (= sampled), rank 3]
    entry = {"token_id": 7, "logprob": -0.5, "rank": 2,
             "top_logprobs": [{"token_id": 7, "logprob": -0.5, "rank": 2}, {"token_id": 3, "logprob": -0.1, "rank": 1},
                              {"token_id": 9, "logprob": -2.0, "rank": 3}]}
    assert logprob_row(entry) == ([7, 3, 7, 9], [-0.5, -0.1, -0.5, -2.0], 2)
    # a gap (the generate server cut the list) ends the row there
    entry["top_logprobs"] = entry["top_logprobs"][:1] + entry["top_logprobs"][2:]
    assert logprob_row(entry) == ([7], [-0.5], 2)


def test_engine_outputs_leave_a_stop_string_to_the_detokenizer():
    (out,) = engine_outputs("r", {"index": 0, "token_ids": [1, 2], "finish_reason": "stop", "stop_reason": "Par"})
    assert out.new_token_ids == [1, 2] and out.finish_reason is None and out.stop_reason is None
    (out,) = engine_outputs("r", {"index": 0, "token_ids": [5], "finish_reason": "stop", "stop_reason": 5})
    assert str(out.finish_reason) == "stop" and out.stop_reason == 5
    (out,) = engine_outputs("r", {"index": 0, "token_ids": [5], "finish_reason": "length"})
    assert str(out.finish_reason) == "length"


def test_engine_outputs_split_per_token_with_logprobs():
    entries = [{"token_id": t, "logprob": -1.0, "rank": 1,
                "top_logprobs": [{"token_id": t, "logprob": -1.0, "rank": 1}]} for t in (4, 5)]
    outs = engine_outputs("r", {"index": 0, "token_ids": [4, 5], "finish_reason": "length",
                                "logprobs": {"content": entries}})
    assert [o.new_token_ids for o in outs] == [[4], [5]]
    assert [o.finish_reason for o in outs][0] is None and str(outs[1].finish_reason) == "length"
    assert outs[0].new_logprobs.logprob_token_ids.tolist() == [[4, 4]]


def test_tagged_adds_the_lines_its_choice_consumed():
    event = tagged('{"request_id":"x","output_mode":"derender","choices":[{"index":1,"delta":{}}]}', [3, 5])
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:])["fed"] == 5
    usage = tagged('{"request_id":"x","choices":[],"usage":{"prompt_tokens":1}}', [3])
    assert "fed" not in json.loads(usage[6:])


def test_fed_event_puts_the_count_beside_the_clients_chunk():
    chunk = '{"id":"chatcmpl-' + "x" * 500 + '","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":1}]}'
    assert fed_event(chunk, [3, 5]) == f"fed: 5\ndata: {chunk}\n\n"  # the choice's count, however long the header
    usage = '{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{}}'
    assert fed_event(usage, [3]) == f"data: {usage}\n\n"
    error = json.dumps({"error": {"message": ',"choices":[{"index":0', "code": 500}})  # in a string: escaped
    assert fed_event(error, [3]) == f"data: {error}\n\n"


def test_idle_session_ends_with_an_error():
    sessions = Sessions(SimpleNamespace(renderer=SimpleNamespace(tokenizer=None)), None, idle_seconds=0.05)

    async def body():
        yield b'{"a":1}\n'
        await asyncio.Event().wait()  # a client that stops sending

    async def run():
        lines = sessions._lines(body())
        assert await anext(lines) == b'{"a":1}'
        with pytest.raises(TimeoutError, match="idle"):
            await anext(lines)

    asyncio.run(run())


def test_session_lines_are_chunks_or_the_sidecars_rows():
    from disagg_sidecar.derender.sessions import session_row

    chunk = {"request_id": "x", "choices": [{"index": 1, "token_ids": [5], "finish_reason": "stop", "stop_reason": 7,
                                             "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}]}}]}
    assert line_chunk(chunk) is chunk
    assert line_chunk(session_row(chunk)) == {"choices": chunk["choices"]}
    assert line_chunk([0, [5]]) == {"choices": [{"index": 0, "token_ids": [5]}]}
    for bad in ([], [0], [True, [5]], ["0", [5]], [0, 5], [0, [5], None, None, None, "extra"], "row", 3):
        with pytest.raises(ValueError, match="a session line is"):
            line_chunk(bad)


# -- a real render server ----------------------------------------------------------------------


def open_line(render_url: str, forcer) -> bytes:
    """The decode leg of a chat stream (render's answer) with the client's request."""
    chat = forcer.chat_body("plain", stream=True)
    gen = requests.post(render_url + "/v1/chat/completions/render", json=chat, timeout=60).json()
    return json.dumps({**gen, "stream": True, "output_mode": "derender", "chat_request": chat}).encode() + b"\n"


def chunk_line(forcer) -> bytes:
    ids = forcer.ids("The capital", eos=False)
    chunk = {"request_id": "x", "output_mode": "tokens", "choices": [{"index": 0, "token_ids": ids}]}
    return json.dumps(chunk).encode() + b"\n"


@pytest.mark.engine
@pytest.mark.parametrize("path, body, message", [
    (CHAT_SESSION_PATH, b"", "empty session body"),
    (CHAT_SESSION_PATH, b'{"token_ids": []}\n', "invalid session request"),
    (CHAT_SESSION_PATH, b'{"token_ids": [1], "sampling_params": {}}\n', "needs chat_request"),
    (COMPLETIONS_SESSION_PATH, b'{"token_ids": [1], "sampling_params": {}}\n', "needs completion_request"),
    (COMPLETIONS_SESSION_PATH, b'{"token_ids": [1], "sampling_params": {}, "completion_request": {"prompt": "-"}, '
                               b'"output_mode": "derender", "chat_request": {"messages": [{"role": "user", '
                               b'"content": ""}]}}\n', "and no chat_request"),
    (COMPLETIONS_SESSION_PATH, b'{"token_ids": [1], "completion_request": {"prompt": "-", "n": 0}}\n',
     "invalid session request"),
    # a completions session writes completions chunks (``client_stream`` of its API, on a streamed text leg)
    (COMPLETIONS_SESSION_PATH, b'{"token_ids": [1], "sampling_params": {}, "completion_request": {"prompt": "-"}, '
                               b'"stream": true, "output_mode": "derender", '
                               b'"client_stream": {"id": "cmpl-x", "created": 1, "model": "m"}}\n',
     "a completions derender session writes completions chunks, not client_stream api='chat'"),
    (COMPLETIONS_SESSION_PATH, b'{"token_ids": [1], "sampling_params": {}, "completion_request": {"prompt": "-"}, '
                               b'"stream": true, "client_stream": {"api": "completions", "id": "cmpl-x", '
                               b'"created": 1, "model": "m"}}\n',
     "client_stream with api='completions' is only read with output_mode='text'"),
])
def test_bad_session_openings_get_an_openai_error(session_renders, path: str, body: bytes, message: str):
    resp = requests.post(live(session_renders).url + path, data=body, timeout=30)
    assert resp.status_code == 400
    assert message in resp.json()["error"]["message"]


@pytest.mark.engine
def test_render_reports_sessions(session_renders):
    caps = live(session_renders).capabilities()
    assert caps["role"] == "render" and caps["derender_sessions"]["chat_path"] == CHAT_SESSION_PATH
    assert caps["derender_sessions"]["completions_path"] == COMPLETIONS_SESSION_PATH
    assert caps["derender_sessions"]["max_sessions"] >= 200
    assert caps["derender_sessions"]["client_streams"] == ["chat", "completions"]
    assert engine_args.derender_sessions(caps["vllm_version"])  # what the operator expects of this version


@pytest.mark.engine
def test_200_sessions_then_clients_gone_count_returns_to_zero(session_renders, forcer):
    render = live(session_renders)
    first, chunk = open_line(render.url, forcer), chunk_line(forcer)
    assert wait_for(lambda: render.live_sessions() == 0, timeout=60)

    async def client(http: aiohttp.ClientSession, ready: asyncio.Queue) -> None:
        async def body():
            yield first
            yield chunk
            await asyncio.Event().wait()  # the client never finishes: it goes away instead

        async with http.post(render.url + CHAT_SESSION_PATH, data=body()) as resp:
            assert resp.status == 200
            event = await resp.content.readuntil(b"\n\n")
            assert b'"delta"' in event
            await ready.put(1)
            await asyncio.Event().wait()

    async def run() -> int:
        ready: asyncio.Queue = asyncio.Queue()
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        tasks = [asyncio.create_task(client(http, ready)) for _ in range(200)]
        for _ in range(200):
            await asyncio.wait_for(ready.get(), 120)
        live = await asyncio.to_thread(render.live_sessions)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await http.close()
        return live

    assert asyncio.run(run()) == 200
    assert wait_for(lambda: render.live_sessions() == 0, timeout=60)


TOOL_CALL_ID = re.compile(rb"chatcmpl-tool-[0-9A-Za-z]+")


def session_answer(render_url: str, first: dict, rows: list[list], path: str = CHAT_SESSION_PATH) -> list[bytes]:
    """A whole session in one exchange: its events as written (the last one [DONE])."""
    body = b"".join(json.dumps(line).encode() + b"\n" for line in [first, *rows])
    resp = requests.post(render_url + path, data=body, timeout=120)
    assert resp.status_code == 200, resp.text[:500]
    events = resp.content.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]", resp.content[-300:]
    return events[:-1]


@pytest.mark.engine
def test_a_session_asked_for_the_clients_chunks_writes_them_with_fed_beside(session_renders, forcer):
    """With ``client_stream`` in the open line each event's data is the client's own chunk, under the
    header it names, and ``fed`` is a field before it; the chunks are the ones the same session writes
    without it (vLLM's own bytes from ``,"choices":[`` on, usage included, but for the random tool-call
    ids each parser draws), with the same counts."""
    render = live(session_renders)
    text, fields = OUTPUTS["reasoning_tool_call"]
    chat = forcer.chat_body("reasoning_tool_call", stream=True, n=2, return_token_ids=True,
                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    gen = requests.post(render.url + "/v1/chat/completions/render", json=chat, timeout=60).json()
    first = {**gen, "stream": True, "output_mode": "derender", "chat_request": chat}
    ids = forcer.ids(text)
    rows = [[i, [t]] + (["stop"] if k == len(ids) - 1 else []) for k, t in enumerate(ids) for i in (0, 1)]
    client = {"id": "chatcmpl-mine", "created": 1234, "model": "served-name", "return_token_ids": True}
    prefix = b'data: {"id":"chatcmpl-mine","object":"chat.completion.chunk","created":1234,"model":"served-name",' \
             b'"choices":['
    new, old = session_answer(render.url, {**first, "client_stream": client}, rows), session_answer(render.url, first, rows)
    same = lambda e: TOOL_CALL_ID.sub(b"chatcmpl-tool-*", e[e.index(b',"choices":['):])  # each session's own
    assert_client_events(new, old, prefix, len(ids), same)


def assert_client_events(new: list[bytes], old: list[bytes], prefix: bytes, tokens: int, same) -> None:
    """A session's events with ``client_stream`` (``new``) against the same session's without (``old``),
    two choices of ``tokens`` lines each: the same count, each data under the client's header (``prefix``)
    and ``same`` as the other's, ``fed`` a field before it with the other's count (none for usage)."""
    assert len(new) == len(old) > 2 * tokens
    last: dict[int, int] = {}
    for mine, theirs in zip(new[:-1], old[:-1]):
        fed, data = mine.split(b"\n") if mine.startswith(b"fed: ") else (None, mine)
        assert data.startswith(prefix), data[:200]
        assert same(data) == same(theirs)
        event = json.loads(theirs[len(b"data: "):])
        if event["choices"]:
            index = event["choices"][0]["index"]
            assert fed == b"fed: %d" % event["fed"] and event["fed"] >= last.get(index, 0)
            last[index] = event["fed"]
        else:
            assert fed is None and "fed" not in event and event["usage"]["completion_tokens"] == 2 * tokens
    assert last == {0: tokens, 1: tokens}  # each choice's every line, the last with its finish


@pytest.mark.engine
def test_a_completions_session_asked_for_the_clients_chunks_writes_them_with_fed_beside(session_renders, forcer):
    """A completions session with ``client_stream`` (``api: completions``) writes the client's own
    ``text_completion`` chunks under the header it names, ``fed`` a field before each: the chunks the
    same session writes without it (vLLM's own bytes from ``,"choices":[`` on, logprobs, token ids and
    usage included), with the same counts."""
    render = live(session_renders)
    text = OUTPUTS["plain"][0]
    body = {"model": "tiny-qwen3", "prompt": "The capital of France is", "stream": True, "n": 2, "logprobs": 2,
            "max_tokens": 64,
            "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    (gen,) = requests.post(render.url + "/v1/completions/render", json=body, timeout=60).json()
    first = {**gen, "stream": True, "completion_request": {**body, "prompt": "-"}}
    ids = forcer.ids(text)

    def logprobs(t: int) -> dict:  # as a decode engine streams them for logprobs=2: the sampled token, rank 1
        top = [{"token_id": t, "logprob": -0.5, "rank": 1}, {"token_id": 0, "logprob": -3.0, "rank": 2}]
        return {"content": [{"token_id": t, "logprob": -0.5, "rank": 1, "top_logprobs": top}]}
    rows = [[i, [t], "stop" if k == len(ids) - 1 else None, None, logprobs(t)] for k, t in enumerate(ids) for i in (0, 1)]
    client = {"api": "completions", "id": "cmpl-mine", "created": 1234, "model": "served-name",
              "return_token_ids": True}
    prefix = b'data: {"id":"cmpl-mine","object":"text_completion","created":1234,"model":"served-name","choices":['
    new = session_answer(render.url, {**first, "output_mode": "text", "client_stream": client}, rows,
                         COMPLETIONS_SESSION_PATH)
    old = session_answer(render.url, first, rows, COMPLETIONS_SESSION_PATH)
    assert_client_events(new, old, prefix, len(ids), lambda e: e[e.index(b',"choices":['):])
    assert json.loads(new[0].split(b"data: ", 1)[1])["choices"][0]["prompt_token_ids"] == gen["token_ids"]
