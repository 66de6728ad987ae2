"""The OpenAI Responses API through the legs, against the coupled server's ``/v1/responses`` on the
same engines: render and prefill by the tiers, the answer by the decode engine's own Responses code
(docs/protocol.md), on the inline path (decode with the engine extension) and a stock decode engine
(the coupled server as decode). Every output item and every event is compared; ids are random on
both sides (checked for shape), sequence numbers checked to count from 0, consecutive deltas of one
item merged (under load vLLM hands its output over in merged steps, on either side). The prompt's
KV is the prefill engine's: the decode engine reports it as an external cache hit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import requests

from disagg_engine.testing.lanes import PARITY_LANES
from tests.harness.forced import OUTPUTS, Forcer
from tests.harness.overlap import in_background
from tests.sidecar.support import (GENERATED, SERVED, check_engine_stopped, engine_metric, long_body, named_events,
                                   post_named, wait_for)

pytestmark = [pytest.mark.engine, pytest.mark.parity,
              pytest.mark.parametrize("lane_set", PARITY_LANES, indirect=True)]

RESPONSES = "/v1/responses"
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in OUTPUTS["tool_call"][1]["tools"]]
# Instructions that make every prompt longer than a KV block (128 tokens on CPU), so the decode engine
# loads prefill's KV (the ExampleConnector transfers whole blocks).
PREAMBLE = "You answer questions about the weather and the time, briefly and exactly. " * 10


def responses_body(forcer: Forcer, name: str, stream: bool, **extra: Any) -> dict[str, Any]:
    """A Responses request that makes the engine emit ``OUTPUTS[name]``."""
    text, fields = OUTPUTS[name]
    body: dict[str, Any] = {"model": SERVED, "max_output_tokens": 256, "stream": stream, "instructions": PREAMBLE,
                            "input": f"Please answer ({name}).", "vllm_xargs": forcer.xargs(text)}
    if "tools" in fields:
        body["tools"] = RESPONSES_TOOLS
    if "chat_template_kwargs" in fields:
        body["chat_template_kwargs"] = fields["chat_template_kwargs"]
    body.update(extra)
    return body


TOOL_TURNS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": "call_01", "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
    {"type": "function_call_output", "call_id": "call_01", "output": "18 C, sunny"},
    {"role": "user", "content": [{"type": "input_text", "text": "And now Tokyo?"}]},
]

Case = Callable[[Forcer, bool], dict[str, Any]]


def _case(name: str, **extra: Any) -> Case:
    return lambda f, stream: responses_body(f, name, stream, **extra)


CASES: dict[str, Case] = {
    "plain": _case("plain"),
    "reasoning": _case("reasoning"),
    "one_tool_call": _case("tool_call"),
    "several_tool_calls": _case("two_tool_calls"),
    "reasoning_tool_call": _case("reasoning_tool_call"),
    "multibyte": _case("multibyte"),
    "stop_sequence": _case("plain", stop=["France"]),
    "max_output_tokens_inside_a_tool_call": _case("tool_call", max_output_tokens=16),
    "max_output_tokens_in_reasoning": _case("reasoning", max_output_tokens=5),
    "tool_choice_required": _case("tool_call", tool_choice="required"),
    "logprobs": _case("plain", top_logprobs=2, include=["message.output_text.logprobs"]),
    "multi_turn_with_a_tool_result": lambda f, stream: {**responses_body(f, "reasoning_tool_call", stream),
                                                        "input": TOOL_TURNS},
}


def post(url: str, body: dict[str, Any], request_id: str) -> Any:
    return post_named(url + RESPONSES, body, request_id)


RANDOM = ("id", "item_id", "call_id", "created_at")
END_OF_TURN = "<|im_end|>"
# Cache counts depend on what each engine's prefix cache held before (checked on their own).
CACHE = ("cached_tokens", "cache_write_tokens")


def without_random(value: Any) -> Any:
    """``value`` with its ids and cache counts out (each id checked to be a string)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in RANDOM and item is not None:
                assert isinstance(item, (str, int)), (key, item)
            elif key not in CACHE:
                out[key] = without_random(item)
        return out
    if isinstance(value, list):
        return [without_random(v) for v in value]
    return value


def response_view(resp: dict[str, Any]) -> dict[str, Any]:
    assert resp["object"] == "response" and resp["id"].startswith("resp_")
    return without_random(resp)


def stream_view(events: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """The events without ids and sequence numbers (checked to count from 0), consecutive deltas of
    one item and part merged."""
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    out: list[Any] = []
    for name, data in events:
        data = without_random({k: v for k, v in data.items() if k != "sequence_number"})
        if name.endswith(".delta") and out and out[-1][0] == name:
            last = out[-1][1]
            if all(last.get(k) == data.get(k) for k in ("output_index", "content_index")):
                last["delta"] += data["delta"]
                if "logprobs" in data:
                    last["logprobs"] = last.get("logprobs", []) + data["logprobs"]
                continue
        out.append((name, data))
    # vLLM streams (and then sums up in the .done events) the end-of-turn token's logprobs only when a
    # merged step carries it with text: the end token alone makes an empty delta, which it does not
    # send. Merges differ from run to run on either side, so that entry is left out of the view.
    return [(name, _without_end_logprobs(data)) for name, data in out]


def _without_end_logprobs(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: ([e for e in v if e.get("token") != END_OF_TURN] if k == "logprobs" and isinstance(v, list)
                    else _without_end_logprobs(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_end_logprobs(v) for v in value]
    return value


def item_ids_match(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Each delta names the item its output index added."""
    added = {d["output_index"]: d["item"]["id"] for n, d in events if n == "response.output_item.added"}
    assert all(d["item_id"] == added[d["output_index"]] for n, d in events if "item_id" in d)


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_responses_matrix(lane_set, forcer, lane_inline_sidecar, lane_stock_sidecar, case: str, stream: bool) -> None:
    body = CASES[case](forcer, stream)
    request_id = f"responses-{case}-{int(stream)}"
    reference = in_background(lambda: post(lane_set.url("coupled"), body, request_id))
    got = {path: post(sidecar.url, body, request_id)
           for path, sidecar in (("inline", lane_inline_sidecar), ("stock", lane_stock_sidecar))}
    view = stream_view if stream else response_view
    want = view(reference.result())
    for path, answer in got.items():
        assert view(answer) == want, path
        if stream:
            item_ids_match(answer)


def test_the_matrix_covers_every_status_and_item(lane_set, forcer, lane_inline_sidecar) -> None:
    """The cases reach each status and output item kind (so the matrix can fail on each): checked
    on the coupled answers."""
    statuses, items = set(), set()
    for case in CASES:
        answer = post(lane_set.url("coupled"), CASES[case](forcer, False), f"cover-{case}")
        statuses.add(answer["status"])
        items |= {item["type"] for item in answer["output"]}
    assert statuses == {"completed", "incomplete"}
    assert items == {"message", "reasoning", "function_call"}


EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


def test_the_prompt_kv_comes_from_prefill_and_cached_tokens_say_so(lane_set, forcer, lane_inline_sidecar) -> None:
    """The decode engine loads the prompt the prefill engine computed (an external cache hit for
    every full block of it) and reports those tokens as cached; the answer names the prefill."""
    # Instructions no engine has seen: no local prefix cache hit comes first.
    body = responses_body(forcer, "plain", False, instructions=f"Session {time.time_ns()}. {PREAMBLE}")
    hits = engine_metric(lane_set.url("decode"), EXTERNAL_HITS)
    resp = requests.post(lane_inline_sidecar.url + RESPONSES, json=body, timeout=120)
    assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "remote"
    loaded = engine_metric(lane_set.url("decode"), EXTERNAL_HITS) - hits
    usage = resp.json()["usage"]
    assert loaded >= 128 and usage["input_tokens_details"]["cached_tokens"] == loaded
    assert loaded <= usage["input_tokens"]


REFUSALS: dict[str, Callable[[Forcer], dict[str, Any]]] = {
    "unknown_model": lambda f: {**responses_body(f, "plain", False), "model": "no-such-model"},
    "no_input": lambda f: {k: v for k, v in responses_body(f, "plain", False).items() if k != "input"},
    "tool_choice_not_in_tools": lambda f: {**responses_body(f, "tool_call", False),
                                           "tool_choice": {"type": "function", "name": "nope"}},
    "max_output_tokens_past_the_model": lambda f: {**responses_body(f, "plain", False), "max_output_tokens": 10**6},
    "unknown_role": lambda f: {**responses_body(f, "plain", False), "input": [{"role": "robot", "content": "x"}]},
    "temperature_as_text": lambda f: {**responses_body(f, "plain", False), "temperature": "hot"},
    # what reads vLLM's response store, which Disagg's engines run without (as vLLM's default)
    "previous_response_id": lambda f: {**responses_body(f, "plain", False), "previous_response_id": "resp_123"},
    "background": lambda f: {**responses_body(f, "plain", False), "background": True},
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_coupleds(lane_set, forcer, lane_inline_sidecar, case: str) -> None:
    body = REFUSALS[case](forcer)
    want = requests.post(lane_set.url("coupled") + RESPONSES, json=body, timeout=60)
    got = requests.post(lane_inline_sidecar.url + RESPONSES, json=body, timeout=60)
    assert 400 <= want.status_code < 500, want.text
    assert (got.status_code, got.json()) == (want.status_code, want.json())


def test_stored_responses_on_two_decode_pods(lane_set, forcer, lane_inline_sidecar, lane_stock_sidecar) -> None:
    """Disagg serves Responses without vLLM's response store (vLLM's default; docs/protocol.md): a
    response made through one decode pod's sidecar is found by neither pod's, a follow-up by its id
    is refused, its cancel too, each exactly as a coupled server without the store answers for its
    own response: never another pod's answer, never a 500."""
    body = {**responses_body(forcer, "plain", False), "store": True}
    made = {"coupled": requests.post(lane_set.url("coupled") + RESPONSES, json=body, timeout=60).json()["id"],
            "pd": requests.post(lane_inline_sidecar.url + RESPONSES, json=body, timeout=60).json()["id"]}

    def asked(base: str, response_id: str) -> list[tuple[int, Any]]:
        answers = [requests.get(f"{base}{RESPONSES}/{response_id}", timeout=60),
                   requests.post(f"{base}{RESPONSES}/{response_id}/cancel", timeout=60),
                   requests.post(base + RESPONSES, json={**body, "previous_response_id": response_id}, timeout=60)]
        return [(a.status_code, json.loads(a.text.replace(response_id, "ID"))) for a in answers]

    want = asked(lane_set.url("coupled"), made["coupled"])
    assert [status for status, _ in want] == [404, 404, 404]
    for sidecar in (lane_inline_sidecar, lane_stock_sidecar):
        assert asked(sidecar.url, made["pd"]) == want


def test_the_openai_sdk(lane_set, forcer, lane_inline_sidecar, lane_stock_sidecar) -> None:
    """The real client's ``responses.create``, batch and streamed, reads what coupled's gives it."""
    import openai

    body = responses_body(forcer, "reasoning_tool_call", False)
    kwargs = {"model": body["model"], "input": body["input"], "instructions": body["instructions"],
              "tools": body["tools"], "max_output_tokens": body["max_output_tokens"],
              "extra_body": {"vllm_xargs": body["vllm_xargs"]}}

    def items(response: Any) -> list[Any]:
        return [(i.type, getattr(i, "name", None), getattr(i, "arguments", None),
                 [c.text for c in (getattr(i, "content", None) or [])]) for i in response.output]

    def run(url: str) -> tuple[Any, list[str], Any]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        batch = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        return batch, kinds, final

    want, want_kinds, want_final = run(lane_set.url("coupled"))
    assert [i[0] for i in items(want)] == ["reasoning", "function_call"]
    for sidecar in (lane_inline_sidecar, lane_stock_sidecar):
        batch, kinds, final = run(sidecar.url)
        assert items(batch) == items(want) and batch.status == want.status == "completed"
        assert batch.usage.output_tokens == want.usage.output_tokens
        assert items(final) == items(want_final) and final.usage.output_tokens == want_final.usage.output_tokens
        assert set(kinds) == set(want_kinds) and kinds[0] == "response.created" and kinds[-1] == "response.completed"


RUNNING = "vllm:num_requests_running"


def test_a_client_that_goes_away_stops_the_engine(lane_set, forcer, lane_inline_sidecar) -> None:
    """Abort on disconnect, as for chat: the decode engine stops, the answer unfinished."""
    decode = lane_set.url("decode")
    assert wait_for(lambda: engine_metric(decode, RUNNING) == 0, timeout=30), "decode busy before the test"
    chat_body = long_body(forcer, 8000)
    body = {**responses_body(forcer, "plain", True), "vllm_xargs": chat_body["vllm_xargs"],
            "max_output_tokens": chat_body["max_tokens"]}
    resp = requests.post(lane_inline_sidecar.url + RESPONSES, json=body, stream=True, timeout=120)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    assert [line for line in (next(lines) for _ in range(16)) if line.startswith(b"event: response.output_text.delta")]
    assert engine_metric(decode, RUNNING) == 1
    generated = engine_metric(decode, GENERATED)
    resp.close()
    check_engine_stopped(decode, generated, 8000)
