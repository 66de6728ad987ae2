"""SSE parsing, chunk merging and the chained-derender lanes (pure; the derender call is a
function passed in, here an in-memory one that records what it was given)."""

from __future__ import annotations

import asyncio
from typing import Any

import json

import pydantic_core
import pytest

from disagg_sidecar.plan import answers
from disagg_sidecar.sse import SSEParser, dumps, field, payload, sse_json
from disagg_sidecar.derender.stream import ChainedDerender, choice_index, merge_chunks


def test_sse_parser_handles_arbitrary_splits() -> None:
    stream = (b'data: {"a": 1}\r\n\r\n' b'data: {"b":\n' b'data: 2}\n\n' b": comment\n\n" b"event: x\r\ndata: [DONE]\r\n\r\n")
    for size in (1, 2, 3, 7, len(stream)):
        parser = SSEParser()
        out = []
        for i in range(0, len(stream), size):
            out += parser.feed(stream[i:i + size])
        out += parser.flush()
        assert out == [b'{"a": 1}', b'{"b":\n2}', b"[DONE]"], size


def test_sse_events_keep_their_fields_for_payload_and_field() -> None:
    """``events`` gives each event as written (a derender session's ``fed:`` beside its data)."""
    stream = b'fed: 3\r\ndata: {"a":1}\r\n\r\n' b"data: x\nfed:12\nfed: 4\n\n" b": comment\n\n"
    for size in (1, 2, 5, len(stream)):
        parser = SSEParser()
        events = [e for i in range(0, len(stream), size) for e in parser.events(stream[i:i + size])]
        assert [payload(e) for e in events] == [b'{"a":1}', b"x", None], size
        assert [field(e, b"fed") for e in events] == [b"3", b"12", None], size  # the first of a name
        assert field(events[0], b"fe") is None and field(events[0], b"data") == b'{"a":1}'


def test_sse_json_is_one_event() -> None:
    assert sse_json({"x": "é"}) == 'data: {"x":"é"}\n\n'.encode()


@pytest.mark.parametrize("value", [1e-05, -1.2345e-05, 1e-07, 0.1, -0.0, 2.0, 1e16, 1.5e300, 5e-324, -10.487662315368652,
                                   12345678.9, 1 / 3])
def test_dumps_writes_floats_as_vllms_pydantic(value: float) -> None:
    """vLLM writes its chunks with pydantic (``model_dump_json``): the sidecar's floats read the same."""
    assert dumps({"logprob": value}) == b'{"logprob":' + pydantic_core.to_json(value) + b"}"


@pytest.mark.parametrize("obj", [
    {"text": "é\u2028\x00\"\\", "ids": [1, -2], "ok": True, "none": None},  # escapes as json's
    {1: "int key", "2": [3.5]},  # non-str keys as json writes them
    {"big": 2**64},  # past orjson's ints: json writes it
])
def test_dumps_is_compact_utf8_json(obj: dict) -> None:
    assert dumps(obj) == json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b'{"a": Infinity}', b'{"a": 1', b'\xff{}', b'{"a": "\\ud800"}',
                                 b"[" * 2000 + b"]" * 2000])
def test_an_upstream_answer_is_json_strictly(raw: bytes) -> None:
    """Not JSON, ``NaN``/``Infinity``, not UTF-8, a lone surrogate or nesting past 1,024 levels: no answer."""
    with pytest.raises(answers.InvalidAnswer, match="not JSON"):
        answers.parse(raw)


def test_an_int_past_64_bits_is_no_token_id() -> None:
    """orjson reads it as a float: the checks that read ids refuse it as they refuse any non-int."""
    raw = b'{"choices": [{"index": 0, "token_ids": [18446744073709551616]}]}'
    with pytest.raises(answers.InvalidAnswer, match="token ids"):
        answers.generated(answers.parse(raw), 1)


def chunk(index: int, ids: list[int], finish: str | None = None, logprobs: list | None = None, **extra) -> dict:
    return {"request_id": "g", "usage": None, "output_mode": "tokens", **extra,
            "choices": [{"index": index, "finish_reason": finish, "stop_reason": None, "token_ids": ids,
                         "logprobs": {"content": logprobs} if logprobs is not None else None}]}


def test_merge_concatenates_tokens_and_logprobs_keeps_last_finish() -> None:
    merged = merge_chunks([chunk(1, [1], logprobs=[{"token_id": 1}], prompt_token_ids=[9, 9]),
                           chunk(1, [2, 3], logprobs=[{"token_id": 2}, {"token_id": 3}]),
                           chunk(1, [], finish="stop", logprobs=[])])
    c = merged["choices"][0]
    assert c["index"] == 1 and c["token_ids"] == [1, 2, 3] and c["finish_reason"] == "stop"
    assert c["logprobs"]["content"] == [{"token_id": 1}, {"token_id": 2}, {"token_id": 3}]
    assert merged["prompt_token_ids"] == [9, 9]
    assert merge_chunks([chunk(0, [4])]) == chunk(0, [4])


def test_choice_index() -> None:
    assert choice_index(chunk(3, [1])) == 3
    assert choice_index({"choices": [], "usage": {}}) is None


class FakeTier:
    """Derender stand-in: returns the token ids it got; ``gate`` holds each call until released."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, Any]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.called = asyncio.Event()  # set by the first call

    async def call(self, c: dict, state: Any) -> tuple[dict, Any]:
        self.calls.append((c, state))
        self.called.set()
        await self.gate.wait()
        if not c["choices"]:
            return {"choices": [], "usage": c["usage"]}, None
        ch = c["choices"][0]
        return {"choices": [{"index": ch["index"], "ids": ch["token_ids"], "finish": ch["finish_reason"]}]}, \
            (state or 0) + 1


@pytest.mark.parametrize("coalesce", [True, False])
async def test_lanes_coalesce_while_a_call_is_in_flight(coalesce: bool) -> None:
    tier = FakeTier()
    out: list[dict] = []

    async def emit(c: dict) -> None:
        out.append(c)

    merged_sizes: list[int] = []
    chained = ChainedDerender(tier.call, emit, coalesce=coalesce, on_call=merged_sizes.append)
    tier.gate.clear()
    chained.feed(chunk(0, [1]))
    await asyncio.wait_for(tier.called.wait(), 5)  # the first call starts at once, alone
    assert len(tier.calls) == 1
    for t in range(2, 10):
        chained.feed(chunk(0, [t]))
    chained.feed(chunk(1, [100]))
    chained.feed(chunk(0, [], finish="stop"))
    chained.feed(chunk(1, [101], finish="length"))
    chained.feed({"request_id": "g", "choices": [], "usage": {"completion_tokens": 12}})
    tier.gate.set()
    await chained.finish()
    ids = {i: [t for c in out for ch in c["choices"] if ch["index"] == i for t in ch["ids"]] for i in (0, 1)}
    assert ids == {0: list(range(1, 10)), 1: [100, 101]}
    finishes = {ch["index"]: ch["finish"] for c in out for ch in c["choices"] if ch["finish"]}
    assert finishes == {0: "stop", 1: "length"}
    assert out[-1] == {"choices": [], "usage": {"completion_tokens": 12}}, "usage goes last"
    assert tier.calls[-1][1] is None, "the usage chunk carries no stream_state"
    states = [s for c, s in tier.calls if c["choices"] and c["choices"][0]["index"] == 0]
    assert states == [None] + list(range(1, len(states))), "each call gets the state the previous one returned"
    if coalesce:
        # index 0: the first chunk alone, then everything that queued meanwhile in one call
        assert len(tier.calls) == 2 + 1 + 1 and sum(merged_sizes) == 13
    else:
        assert len(tier.calls) == 13 and set(merged_sizes) == {1}


async def test_min_tokens_makes_a_call_wait_for_that_many_tokens_or_the_end() -> None:
    """A call waits for ``min_tokens`` of its choice (not for the tier): each call of a 10-token
    choice carries 4, the last what is left at its finish; another choice's end sends its 1 token."""
    tier = FakeTier()
    out: list[dict] = []

    async def emit(c: dict) -> None:
        out.append(c)

    chained = ChainedDerender(tier.call, emit, coalesce=False, min_tokens=4)
    for t in range(1, 10):
        chained.feed(chunk(0, [t]))
        await asyncio.sleep(0)  # let a lane run (it must not call below 4 tokens)
    chained.feed(chunk(0, [10], finish="stop"))
    chained.feed(chunk(1, [100], finish="length"))
    await chained.finish()
    sizes = [(c["choices"][0]["index"], len(c["choices"][0]["token_ids"])) for c, _ in tier.calls]
    assert sorted(sizes) == [(0, 2), (0, 4), (0, 4), (1, 1)]
    ids = [t for c in out for ch in c["choices"] if ch["index"] == 0 for t in ch["ids"]]
    assert ids == list(range(1, 11))


async def test_a_failing_call_surfaces_in_feed_or_finish() -> None:
    async def call(c: dict, state: Any) -> tuple[dict, Any]:
        raise RuntimeError("derender down")

    async def emit(c: dict) -> None:
        pass

    chained = ChainedDerender(call, emit)
    chained.feed(chunk(0, [1]))
    with pytest.raises(RuntimeError, match="derender down"):
        await chained.finish()


async def test_hold_sends_each_choice_once_it_finished() -> None:
    """Stop strings: a lane waits for its choice's end and sends everything as one chunk."""
    tier = FakeTier()
    out: list[dict] = []

    async def emit(c: dict) -> None:
        out.append(c)

    chained = ChainedDerender(tier.call, emit, coalesce=False, hold=True)
    for t in (1, 2, 3):
        chained.feed(chunk(0, [t]))
    chained.feed(chunk(1, [7]))
    for _ in range(20):  # let the lanes run: they must not call before the end
        await asyncio.sleep(0)
    assert tier.calls == []
    chained.feed(chunk(0, [4], finish="stop"))
    chained.feed(chunk(1, [8], finish="length"))
    await chained.finish()
    assert sorted((c["choices"][0]["token_ids"], s) for c, s in tier.calls) == [([1, 2, 3, 4], None), ([7, 8], None)]
    assert {ch["index"]: ch["finish"] for c in out for ch in c["choices"]} == {0: "stop", 1: "length"}


async def test_hold_sends_what_arrived_when_the_stream_ends_without_a_finish() -> None:
    tier = FakeTier()
    out: list[dict] = []

    async def emit(c: dict) -> None:
        out.append(c)

    chained = ChainedDerender(tier.call, emit, hold=True)
    chained.feed(chunk(0, [1]))
    chained.feed(chunk(0, [2]))
    await chained.finish()
    assert [c["choices"][0]["token_ids"] for c, _ in tier.calls] == [[1, 2]]
