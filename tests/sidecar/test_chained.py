"""The chained path's additions to the derender tier's answers (pure, and the tier calls they
make, recorded by an in-memory tier; the real tiers: test_parity_matrix.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from disagg_sidecar.derender import chained
from disagg_sidecar.derender import fixes
from disagg_sidecar.plan import legs
from disagg_sidecar.derender import shapes
from disagg_sidecar import wire
from disagg_sidecar.errors import SidecarError

PROMPT = [1, 2, 3]


def opts(**over: Any) -> chained.Options:
    body = {"model": "m", **over.pop("body", {})}
    gen = {"token_ids": PROMPT, "sampling_params": {"skip_special_tokens": False, **over.pop("sampling", {})}}
    return chained.Options.of(body, gen)


@pytest.mark.parametrize("text, stop, include, kept", [
    ("The capital of France is Paris.", "France", False, "The capital of "),
    ("The capital of France is Paris.", "is Par", False, "The capital of France "),  # straddles two tokens
    ("The capital of France is Paris.", "is Par", True, "The capital of France is Par"),
    ("abab", "b", False, "a"),  # the engine stopped at the first occurrence
    ("no match", "zzz", False, "no match"),
])
def test_stop_cut(text: str, stop: str, include: bool, kept: str) -> None:
    assert chained.stop_cut(text, stop, include) == kept


def test_stop_cut_skips_what_min_tokens_left_unchecked() -> None:
    # min_tokens: the engine checks no step before the first min_tokens tokens
    assert chained.stop_cut("The capital of France", "a", False, unchecked="The capital of") == "The capital of Fr"
    # a stop string may still start in the unchecked text and end after it
    assert chained.stop_cut("abcdef", "cde", False, unchecked="abcd") == "ab"


def test_only_a_stop_string_cuts_text() -> None:
    assert chained.cut_by_stop_string({"finish_reason": "stop", "stop_reason": "x"})
    assert not chained.cut_by_stop_string({"finish_reason": "stop", "stop_reason": 151645})  # a stop token
    assert not chained.cut_by_stop_string({"finish_reason": "stop", "stop_reason": None})  # EOS
    assert not chained.cut_by_stop_string({"finish_reason": "length", "stop_reason": None})


def test_trim_top_logprobs_keeps_the_first_k() -> None:
    entry = {"token": "a", "logprob": -1.0, "top_logprobs": [{"token": "a"}, {"token": "b"}]}
    assert fixes.trim_top_logprobs({"content": [entry]}, 0)["content"][0]["top_logprobs"] == []
    assert fixes.trim_top_logprobs({"content": [entry]}, 1)["content"][0]["top_logprobs"] == [{"token": "a"}]
    assert fixes.trim_top_logprobs(None, 3) is None


def test_stream_finish_reason_only_turns_stop_into_tool_calls() -> None:
    assert chained.stream_finish_reason("tool_calls", "length") == "length"
    assert chained.stream_finish_reason("tool_calls", "stop") == "tool_calls"
    assert chained.stream_finish_reason(None, None) is None


def test_logprob_body_puts_the_context_first() -> None:
    body = json.loads(chained.logprob_body([{"token_id": 9, "logprob": -1.0, "top_logprobs": []}], [7, 8]))
    choice = body["choices"][0]
    assert choice["token_ids"] == [7, 8, 9]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == [7, 8, 9]


def test_text_and_tokenize_bodies_decode_and_encode_as_the_engine_did() -> None:
    o = opts(sampling={"spaces_between_special_tokens": False})
    text = json.loads(chained.text_body([{"token_ids": [5, 6], "finish_reason": "stop", "stop_reason": "x"}], o))
    assert text["prompt_token_ids"] == [PROMPT] and text["generate_responses"][0]["choices"][0]["token_ids"] == [5, 6]
    assert text["completion_request"]["skip_special_tokens"] is False
    assert text["completion_request"]["spaces_between_special_tokens"] is False
    tok = json.loads(chained.tokenize_body(["a", "b"], o))
    assert tok["prompt"] == ["a", "b"] and tok["add_special_tokens"] is False


def _resolved(logprobs: Any) -> Any:
    """Entries with their token text, as derender resolves them (one character per id here)."""
    if not logprobs:
        return logprobs
    def one(e: dict) -> dict:
        return {"token": chr(96 + e["token_id"]), "logprob": e["logprob"]}
    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs") or []]}
                        for e in logprobs["content"]]}


class Tier:
    """Records every call; the derender tier echoes token ids as text (one character per id)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict, str]] = []

    async def __call__(self, tier: str, path: str, body: bytes, kind: str) -> Any:
        data = json.loads(body)
        self.calls.append((tier, path, data, kind))
        if path == wire.COMPLETIONS_DERENDER:
            return {"choices": [{"index": c["index"], "text": "".join(chr(96 + t) for t in c["token_ids"])}
                                for c in data["generate_responses"][0]["choices"]]}
        if path == wire.COMPLETIONS_RENDER:
            return [{"token_ids": [ord(ch) - 96 for ch in p]} for p in data["prompt"]]
        choices = data["generate_response"]["choices"]
        return {"choices": [{"index": c["index"], "finish_reason": c["finish_reason"], "stop_reason": c.get("stop_reason"),
                             "logprobs": _resolved(c.get("logprobs")), "token_ids": c["token_ids"],
                             "message": {"role": "assistant", "content": "".join(chr(96 + t) for t in c["token_ids"])}}
                            for c in choices]}


async def test_chat_batch_derenders_the_text_the_engine_kept() -> None:
    tier = Tier()
    out = {"request_id": "g", "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}, "choices": [
        {"index": 0, "token_ids": [1, 2, 3, 4, 5], "finish_reason": "stop", "stop_reason": "cd", "logprobs": None},
        {"index": 1, "token_ids": [1, 2, 9], "finish_reason": "length", "stop_reason": None, "logprobs": None}]}
    shape = shapes.Shape(id="chatcmpl-r", created=1, model="m", prompt_tokens=3, return_token_ids=True)
    leg = legs.DerenderLeg("chat", b"{}", PROMPT)
    result = await chained.chat_batch(out, leg, opts(sampling={"stop": ["cd"]}, body={"return_token_ids": True}),
                                      shape, tier)
    assert [c[1] for c in tier.calls] == [wire.COMPLETIONS_DERENDER, wire.COMPLETIONS_RENDER, wire.CHAT_DERENDER]
    assert tier.calls[1][2]["prompt"] == ["ab"]  # "abcde" cut before "cd"
    assert [c["message"]["content"] for c in result["choices"]] == ["ab", "abi"]
    assert [c["token_ids"] for c in result["choices"]] == [[1, 2, 3, 4, 5], [1, 2, 9]]  # the engine's
    assert result["prompt_token_ids"] == PROMPT and result["usage"]["completion_tokens"] == 5


async def test_chat_batch_without_stop_strings_is_one_call() -> None:
    tier = Tier()
    out = {"request_id": "g", "choices": [{"index": 0, "token_ids": [1, 2], "finish_reason": "stop",
                                           "stop_reason": None, "logprobs": None}]}
    shape = shapes.Shape(id="chatcmpl-r", created=1, model="m", prompt_tokens=3)
    await chained.chat_batch(out, legs.DerenderLeg("chat", b"{}", PROMPT), opts(), shape, tier)
    assert [c[3] for c in tier.calls] == ["batch"]
    assert tier.calls[0][2]["generate_response"]["choices"][0]["token_ids"] == [1], "EOS is not decoded"


class StreamTier(Tier):
    """Streaming derender stand-in: the parser path (no logprobs), state = the ids so far."""

    async def __call__(self, tier: str, path: str, body: bytes, kind: str) -> Any:
        data = json.loads(body)
        if data.get("stream"):
            self.calls.append((tier, path, data, kind))
            c = data["generate_chunk"]["choices"][0]
            state = data["stream_state"] or {"output_token_ids": []}
            out = {"index": c["index"], "delta": {"content": "".join(chr(96 + t) for t in c["token_ids"])},
                   "finish_reason": "tool_calls" if c["finish_reason"] else None, "token_ids": c["token_ids"]}
            return {"chunk": {"choices": [out]},
                    "stream_state": {"output_token_ids": state["output_token_ids"] + c["token_ids"]}}
        return await super().__call__(tier, path, body, kind)


def stream_chunk(ids: list[int], finish: str | None = None, stop_reason: Any = None) -> dict:
    entries = [{"token_id": t, "logprob": -1.0, "top_logprobs": [{"token_id": t, "logprob": -1.0}] * 2} for t in ids]
    return {"request_id": "g", "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish,
                                            "stop_reason": stop_reason, "logprobs": {"content": entries}}]}


async def test_chat_stream_adds_logprobs_engine_ids_and_the_engine_finish_reason() -> None:
    tier = StreamTier()
    call = chained.ChatStream(legs.DerenderLeg("chat", b"{}", PROMPT),
                              opts(body={"logprobs": True, "top_logprobs": 1, "return_token_ids": True}), tier,
                              logprobs=True)
    first, state = await call(stream_chunk([1, 2, 3, 4, 5]), None)
    assert first["prompt_token_ids"] == PROMPT
    last, _ = await call(stream_chunk([6, 7], finish="length"), state)
    choice = last["choices"][0]
    assert choice["finish_reason"] == "length", "a length cut stays length after a streamed call"
    assert choice["token_ids"] == [6, 7] and "prompt_token_ids" not in last
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["f", "g"]
    assert all(len(e["top_logprobs"]) == 1 for e in choice["logprobs"]["content"])
    # the logprob call carried the four ids before this chunk as context, then dropped them
    resolve = [c for c in tier.calls if c[3] == "logprobs"][-1][2]
    assert resolve["generate_response"]["choices"][0]["token_ids"] == [2, 3, 4, 5, 6, 7]


async def test_chat_stream_cuts_a_held_choice_at_its_stop_string() -> None:
    tier = StreamTier()
    call = chained.ChatStream(legs.DerenderLeg("chat", b"{}", PROMPT), opts(sampling={"stop": ["cd"]}), tier,
                              logprobs=False)
    assert call.hold
    out, _ = await call(stream_chunk([1, 2, 3, 4, 5], finish="stop", stop_reason="cd"), None)
    assert out["choices"][0]["delta"]["content"] == "ab" and out["choices"][0]["finish_reason"] == "tool_calls"
    assert out["choices"][0]["token_ids"] == [1, 2, 3, 4, 5]


async def test_nothing_kept_is_derendered_from_one_byte_that_decodes_to_nothing() -> None:
    tier = Tier()
    out = {"request_id": "g", "choices": [
        {"index": 0, "token_ids": [3, 4], "finish_reason": "stop", "stop_reason": "c", "logprobs": None}]}
    shape = shapes.Shape(id="chatcmpl-r", created=1, model="m", prompt_tokens=3)
    await chained.chat_batch(out, legs.DerenderLeg("chat", b"{}", PROMPT), opts(sampling={"stop": ["c"]}), shape, tier)
    assert tier.calls[1][2]["prompt"] == [chained.EMPTY_PROBE]
    probe_ids = [ord(ch) - 96 for ch in chained.EMPTY_PROBE]
    assert tier.calls[2][2]["generate_response"]["choices"][0]["token_ids"] == probe_ids[:1]


def _gen_with_candidates(ranks: list[int | None], candidates: int) -> dict:
    content = [{"token_id": 100 + i, "logprob": -1.0, "rank": r,
                "top_logprobs": [{"token_id": 100 + i, "logprob": -1.0, "rank": r}]
                + [{"token_id": j, "logprob": -2.0 - j, "rank": j} for j in range(1, candidates)]}
               for i, r in enumerate(ranks)]
    return {"choices": [{"index": 0, "token_ids": [100 + i for i in range(len(ranks))], "logprobs": {"content": content}}]}


def test_completion_candidates_are_the_sampled_token_and_the_top_k() -> None:
    # k = 2: a sampled token ranked 7 (or unranked) shows with the top 2; one ranked 1 or 2 is among them.
    gen = _gen_with_candidates([7, 1, 2, 3, None], candidates=4)
    cut = fixes.completion_candidates(gen, 2)
    assert [len(e["top_logprobs"]) for e in cut["choices"][0]["logprobs"]["content"]] == [3, 2, 2, 3, 3]
    assert fixes.completion_candidates(gen, None) == gen
    assert [len(e["top_logprobs"]) for e in fixes.completion_candidates(gen, 0)["choices"][0]["logprobs"]["content"]] == [1] * 5


def test_completions_ask_the_engine_for_one_candidate_more_while_the_engines_allow_it() -> None:
    gen = {"token_ids": [1], "sampling_params": {"logprobs": 2, "max_tokens": 5}}
    headroom = fixes.with_candidate_headroom
    assert headroom(gen, 21)["sampling_params"] == {"logprobs": 3, "max_tokens": 5}
    twenty = {**gen, "sampling_params": {"logprobs": 20}}
    assert headroom(twenty, 21)["sampling_params"]["logprobs"] == 21
    assert headroom(twenty, 20)["sampling_params"]["logprobs"] == 20  # engines at vLLM's default: no room
    assert headroom(twenty, -1)["sampling_params"]["logprobs"] == 21
    assert headroom({**gen, "sampling_params": {"logprobs": -1}}, 21)["sampling_params"]["logprobs"] == -1
    assert "logprobs" not in headroom({"sampling_params": {"max_tokens": 5}}, 21)["sampling_params"]
