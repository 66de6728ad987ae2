"""A chained stream whose derender calls reach render pods of two vLLM releases (derender.window):
an answer that ignored the stream's decode window is replaced by a replay from the choice's start.

The answers below are shaped as vLLM 0.33's and 0.34's ``/v1/completions/derender`` stream answers
(recorded from the lanes' render servers for the multi-byte output "Grüße 🦙").
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from disagg_sidecar.derender import chained, window
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.plan import legs

LEG = legs.DerenderLeg("completions", b'{"prompt":"x"}', [1, 2])
OLD_STATE = {"prev_tokens": ["\u00c3\u00bc"], "prefix_offset": 0, "read_offset": 1, "role_sent": False,
             "logprob_context_token_ids": [6464, 2391], "logprob_text_offset": 3}
NEW_FORM = {"prev_token_ids": [23455], "prefix_offset": 0, "read_offset": 1, "role_sent": False,
            "logprob_context_token_ids": [23455], "logprob_text_offset": 2}


def _chunk(ids: list[int], logprobs: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "token_ids": ids, "finish_reason": None, "stop_reason": None}
    if logprobs:
        choice["logprobs"] = {"content": [{"token_id": t, "logprob": -10.0, "top_logprobs": []} for t in ids]}
    return {"request_id": "r", "usage": None, "choices": [choice]}


def _answer(text: str, state: dict, logprobs: dict | None = None) -> dict[str, Any]:
    return {"chunk": {"choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}]},
            "stream_state": state}


def _tier(answer):
    calls: list[dict] = []

    async def tier(leg_name: str, path: str, body: bytes, kind: str) -> Any:
        calls.append({**json.loads(body), "kind": kind})
        return answer(calls[-1])
    return tier, calls


def test_an_answer_that_kept_the_window_is_used_as_it_is() -> None:
    good = _answer("\u00dfe", {**OLD_STATE, "prev_tokens": ["\u00c3\u0141e"]})
    tier, calls = _tier(lambda body: good)
    assert asyncio.run(window.stream_derender(tier, LEG, _chunk([23455]), OLD_STATE, [6464, 2391])) == good
    assert len(calls) == 1


def test_an_answer_from_a_release_that_ignored_the_window_is_replayed_from_the_choice_start() -> None:
    """Sent 0.33's window (strings), answered by 0.34 (it keeps ids): the text of "Gr" + "ü" + "ße"
    from scratch, minus the "Grü" already streamed; logprob entries of the new token only."""
    new_state = {**NEW_FORM, "prev_token_ids": [23455], "logprob_text_offset": 5}

    def answer(body: dict) -> dict:
        if body["stream_state"] is not None:
            return _answer("e", NEW_FORM)  # decoded without the window: what must not be streamed
        ids = body["generate_chunk"]["choices"][0]["token_ids"]
        if ids == [6464, 2391]:
            return _answer("Gr\u00fc", {**NEW_FORM, "prev_token_ids": [2391]})
        assert ids == [6464, 2391, 23455]
        return _answer("Gr\u00fc\u00dfe", new_state, {"text_offset": [0, 2, 3], "token_logprobs": [0.0, 0.0, -10.0],
                                                      "tokens": ["Gr", "\u00fc", "\u00dfe"],
                                                      "top_logprobs": [{}, {}, {"\u00dfe": -10.0}]})
    tier, calls = _tier(answer)
    got = asyncio.run(window.stream_derender(tier, LEG, _chunk([23455], logprobs=True), OLD_STATE, [6464, 2391]))
    assert got["stream_state"] == new_state
    [choice] = got["chunk"]["choices"]
    assert choice["text"] == "\u00dfe"
    assert choice["logprobs"] == {"text_offset": [3], "token_logprobs": [-10.0], "tokens": ["\u00dfe"],
                                  "top_logprobs": [{"\u00dfe": -10.0}]}
    assert [c["kind"] for c in calls] == ["stream", "replay", "replay"]
    replays = calls[1:]
    assert all(c["stream_state"] is None for c in replays)
    through = replays[1]["generate_chunk"]["choices"][0]
    # The earlier ids' entries are placeholders; the new one is the engine's.
    assert [e["token_id"] for e in through["logprobs"]["content"]] == [6464, 2391, 23455]
    assert through["logprobs"]["content"][-1]["logprob"] == -10.0
    assert "logprobs" not in replays[0]["generate_chunk"]["choices"][0]


def test_a_replay_that_does_not_continue_the_streamed_text_is_refused() -> None:
    def answer(body: dict) -> dict:
        if body["stream_state"] is not None:
            return _answer("e", NEW_FORM)
        ids = body["generate_chunk"]["choices"][0]["token_ids"]
        return _answer("Gr\u00fc" if len(ids) == 2 else "Xy\u00dfe", NEW_FORM)
    tier, _ = _tier(answer)
    with pytest.raises(SidecarError) as refused:
        asyncio.run(window.stream_derender(tier, LEG, _chunk([23455]), OLD_STATE, [6464, 2391]))
    assert refused.value.status == 502 and "does not line up" in refused.value.message


@pytest.mark.parametrize("through_delta, role_sent, want", [
    ({"role": "assistant", "content": "Hello there"}, True, {"role": None, "content": " there"}),
    ({"role": "assistant", "content": "Hello there"}, False, {"role": "assistant", "content": " there"}),
    ({"role": None, "content": "Hello"}, True, {"role": None, "content": None}),  # nothing new yet
])
def test_a_chat_delta_is_spliced_without_a_second_role(through_delta, role_sent, want) -> None:
    through = {"chunk": {"choices": [{"index": 0, "delta": through_delta,
                                      "logprobs": {"content": [{"token": "a"}, {"token": "b"}]}}]},
               "stream_state": {}}
    before = {"chunk": {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hello"}}]}}
    got = window.spliced(through, before, new=1, earlier=1, role_sent=role_sent)["chunk"]["choices"][0]
    assert got["delta"] == want and got["logprobs"] == {"content": [{"token": "b"}]}


def test_logprob_entries_that_do_not_count_every_token_are_refused() -> None:
    through = _answer("ab", {}, {"text_offset": [0], "token_logprobs": [0.0], "tokens": ["b"], "top_logprobs": [{}]})
    with pytest.raises(ValueError):
        window.spliced(through, _answer("a", {}), new=1, earlier=1, role_sent=False)


def test_a_completions_stream_replays_every_id_its_choice_sent_before() -> None:
    """The ids a choice sent across calls (merged chunks included), per choice index, start over
    with a choice that starts again (state None: a session's stateless restart)."""
    seen: list[tuple[Any, list[int]]] = []

    def answer(body: dict) -> dict:
        ids = body["generate_chunk"]["choices"][0]["token_ids"]
        seen.append((body["stream_state"], ids))
        lost = body["stream_state"] is not None and "prev_tokens" in body["stream_state"] and len(seen) == 3
        return _answer("x" * len(ids), NEW_FORM if lost or body["stream_state"] is None else OLD_STATE)
    tier, calls = _tier(answer)
    stream_call = chained.CompletionStream(LEG, chained.Options(model=None, prompt_token_ids=[1, 2], sampling={}), tier)
    asyncio.run(stream_call(_chunk([5, 6]), None))
    asyncio.run(stream_call(_chunk([7]), OLD_STATE))
    out, _ = asyncio.run(stream_call(_chunk([8]), OLD_STATE))  # the third call: answered without the window
    assert sorted(ids for state, ids in seen[3:]) == [[5, 6, 7], [5, 6, 7, 8]]
    assert out["choices"][0]["text"] == "x"
    asyncio.run(stream_call(_chunk([9]), None))
    assert stream_call.sent.before(_chunk([10]), OLD_STATE) == [9]


def test_a_final_chunk_counts_the_entry_of_the_stop_token_its_ids_leave_out() -> None:
    final = _chunk([8], logprobs=True)
    final["choices"][0]["logprobs"]["content"].append({"token_id": 151645, "logprob": -1.0, "top_logprobs": []})
    assert (window.sent_ids(final), window.sent_entries(final)) == ([8], 2)
    assert window.sent_entries(_chunk([8, 9])) == 2
    through = _answer("ab.", {}, {"text_offset": [0, 1, 2], "token_logprobs": [0.0, -2.0, -1.0],
                                  "tokens": ["a", "b", ""], "top_logprobs": [{}, {}, {}]})
    got = window.spliced(through, _answer("a", {}), new=2, earlier=1, role_sent=False)["chunk"]["choices"][0]
    assert got["text"] == "b." and got["logprobs"]["tokens"] == ["b", ""]
