"""The request planner (disagg_sidecar/plan/request.py), a pure function: one frozen plan per
request, every decision the legs, the decode call and the chained path read."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from disagg_sidecar.config import Capabilities, Decode, Engine, Limits, SidecarConfig
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.plan.decisions import DecodePlan
from disagg_sidecar import vllm_releases
from disagg_sidecar.plan.request import Answer, RequestPlan, derived_chat, plan_request
from disagg_sidecar.plan.stops import Stops

ALL = ("tokens", "text", "derender")
EXT = Capabilities(output_modes=ALL, streaming_output_modes=ALL)
STOCK = Capabilities()  # tokens, text
STOCK_033 = Capabilities(output_modes=ALL, derender_context_forms=("parse_context",))


def config(**over: Any) -> SidecarConfig:
    return SidecarConfig(decode=Decode(url="http://127.0.0.1:8200"), **over)


@pytest.mark.parametrize("api, body, caps, cfg, expected", [
    ("chat", {"messages": []}, EXT, config(),
     RequestPlan("chat", False, 1, DecodePlan("derender", "chat", "chat_request"), sessions=True, stream_interval=4,
                 max_logprobs=None, engine_max_logprobs=20)),
    ("chat", {"messages": [], "stream": True, "n": 2}, STOCK, config(engine=Engine(derender_sessions=False)),
     RequestPlan("chat", True, 2, DecodePlan("tokens", "chat"), sessions=False, stream_interval=1,
                 engine_max_logprobs=20)),
    ("completions", {"prompt": "x", "logprobs": 2, "stream": True}, EXT,
     config(limits=Limits(coalesce=False, session_stream_interval=8, max_logprobs=5), engine=Engine(max_logprobs=6)),
     RequestPlan("completions", True, 1, DecodePlan("tokens", "completions"),
                 answer=Answer(completion_logprobs=2, stream_logprobs=True), sessions=True, session_chunks=True,
                 coalesce=False,
                 stream_interval=8, max_logprobs=5, engine_max_logprobs=6)),
    ("generate", {"token_ids": [1], "sampling_params": {"n": 3}, "output_mode": "text", "stream": True}, EXT,
     config(), RequestPlan("generate", True, 3, DecodePlan("text", None), sessions=True, stream_interval=4,
                           engine_max_logprobs=20)),
])
def test_one_plan_per_request(api: str, body: dict, caps: Capabilities, cfg: SidecarConfig,
                              expected: RequestPlan) -> None:
    assert plan_request(api, body, caps, cfg) == expected


@pytest.mark.parametrize("body, expected", [
    ({}, Answer()),
    ({"model": "m", "logprobs": True, "top_logprobs": 3}, Answer(model="m", top_logprobs=3, stream_logprobs=True)),
    ({"logprobs": 0}, Answer(completion_logprobs=0)),  # completions k = 0: no chat entries resolved
    ({"include_reasoning": False, "parallel_tool_calls": False, "return_token_ids": True, "tool_choice": "required"},
     Answer(hide_metadata=True, parallel_tool_calls=False, return_token_ids=True, tool_choice="required")),
    ({"echo": True, "return_tokens_as_token_ids": True}, Answer(echo=True, tokens_as_ids=True)),
])
def test_the_answer_is_what_the_client_asked_for(body: dict, expected: Answer) -> None:
    assert Answer.of(body) == expected


@pytest.mark.parametrize("api, answered, chains", [
    ("chat", "tokens", True), ("chat", "derender", False), ("chat", "text", False),
    ("completions", "tokens", True), ("completions", "derender", True), ("completions", "text", False),
    ("generate", "tokens", False), ("generate", "derender", False),  # passed through as it comes
])
def test_which_answers_need_the_derender_tier(api: str, answered: str, chains: bool) -> None:
    assert RequestPlan(api, False, 1, DecodePlan("text", None)).chains(answered) is chains


@pytest.mark.parametrize("api, body, param, words", [
    ("chat", {"messages": [], "n": 0}, "n", "positive integer"),
    ("chat", {"messages": [], "n": 9}, "n", "limits.max_n"),
    ("generate", {"token_ids": [1], "sampling_params": {"n": "2"}}, "sampling_params.n", "positive integer"),
    ("completions", {"prompt": ["a"] * 5}, "prompt", "limits.max_prompts"),
    ("completions", {"prompt": [1, 2 ** 63]}, "prompt", "prompt token ids"),
    ("messages", {"messages": [], "stream": "yes"}, "stream", "boolean"),
    ("count_tokens", [], None, "JSON object"),
])
def test_a_refused_request_is_refused_by_the_planner(api: str, body: dict, param: str, words: str) -> None:
    with pytest.raises(SidecarError) as err:
        plan_request(api, body, EXT, config(limits=Limits(max_n=8, max_prompts=4)))
    assert err.value.status == 400 and words in err.value.message
    assert json.loads(err.value.body)["error"].get("param") == param


def test_an_inline_derender_with_renders_parse_context_falls_back_to_the_chain_without_one() -> None:
    plan = plan_request("chat", {"messages": []}, STOCK_033, config())
    assert plan.decode == DecodePlan("derender", "chat", "parse_context")
    assert plan.fitted({"parse_context": {"x": 1}}) is plan
    assert plan.fitted({}) == dataclasses.replace(plan, decode=DecodePlan("tokens", "chat"))


def test_the_fit_to_render_takes_the_decode_engines_release() -> None:
    plan = plan_request("chat", {"messages": []}, STOCK_033, config())
    ids = {"parse_context": {"tools": None, "return_tokens_as_token_ids": True}}
    assert plan.fitted(ids, vllm_releases.release("0.34.0")) is plan
    assert plan.fitted(ids, vllm_releases.release("0.33.0")).decode == DecodePlan("tokens", "chat")
    assert plan.fitted(ids) is plan  # the engine has not said its version: the configured plan


def test_a_messages_request_is_checked_once_and_its_derived_chat_request_planned_as_chat() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "top_logprobs": "not chat's"}
    plan = plan_request("messages", body, EXT, config())
    assert (plan.api, plan.n, plan.stream, plan.answer) == ("messages", 1, True, Answer())
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True,
            "top_logprobs": 2}
    derived = derived_chat(chat, STOCK, config())
    assert derived.api == "chat" and derived.stream and derived.decode == DecodePlan("tokens", "chat")
    assert derived.answer == Answer(model="m", top_logprobs=2, stream_logprobs=True)


@pytest.mark.parametrize("api, body, cfg, expected", [
    ("chat", {"messages": [], "stream": True}, config(), True),
    ("chat", {"messages": [], "stream": True, "n": 2}, config(), True),
    ("chat", {"messages": []}, config(), False),  # a batch answer: one stateless call, no session
    ("chat", {"messages": [], "stream": True}, config(engine=Engine(derender_sessions=False)), False),
    ("completions", {"prompt": "x", "stream": True}, config(), True),
    ("completions", {"prompt": [1, 2], "stream": True, "n": 2, "logprobs": 1}, config(), True),  # one token prompt
    ("completions", {"prompt": "x"}, config(), False),
    ("completions", {"prompt": ["x", "y"], "stream": True}, config(), False),  # several prompts: shaped
    ("completions", {"prompt": "x", "stream": True, "echo": True}, config(), False),  # the echo: the render's text
    ("completions", {"prompt": "x", "stream": True}, config(engine=Engine(derender_sessions=False)), False),
    ("generate", {"token_ids": [1], "stream": True}, config(), False),
])
def test_a_session_writes_the_clients_chunks_for_an_openai_chat_or_one_prompt_completions_stream(
        api, body, cfg, expected) -> None:
    assert plan_request(api, body, STOCK, cfg).session_chunks is expected


def test_a_derived_chat_streams_session_chunks_are_the_mappings_to_read() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert plan_request("chat", chat, STOCK, config()).session_chunks
    assert not derived_chat(chat, STOCK, config()).session_chunks  # Messages: vLLM's mapping reads the chunks


def test_a_prompts_leg_is_checked_and_gets_its_logprob_candidates() -> None:
    cfg = config(limits=Limits(max_logprobs=5), engine=Engine(max_logprobs=6))
    completions = plan_request("completions", {"prompt": "x"}, EXT, cfg)
    chat = plan_request("chat", {"messages": []}, EXT, cfg)
    generate = plan_request("generate", {"token_ids": [1]}, EXT, cfg)
    rendered = {"token_ids": [1], "sampling_params": {"logprobs": 5}}
    # completions ask the engine for one more (the sampled token's room), with max_tokens explicit
    assert completions.prompt_leg(rendered)["sampling_params"] == {"logprobs": 6, "max_tokens": 16}
    assert chat.prompt_leg(rendered)["sampling_params"] == {"logprobs": 5, "max_tokens": 16}
    assert generate.prompt_leg(rendered) == rendered  # a GenerateRequest client's goes as it came
    for plan in (completions, chat, generate):
        with pytest.raises(SidecarError) as err:
            plan.prompt_leg({"token_ids": [1], "sampling_params": {"logprobs": 6}})
        assert "greater than max allowed: 5" in err.value.message


@pytest.mark.parametrize("sampling, expected, hold", [
    (None, Stops(), False),
    ({"stop": [], "min_tokens": None}, Stops(), False),
    ({"stop": ["\n"], "include_stop_str_in_output": True, "min_tokens": 3}, Stops(True, True, 3), True),
    ({"stop_token_ids": [7]}, Stops(), False),  # stop tokens are ids: no text to cut, nothing held
])
def test_stop_handling_comes_from_renders_sampling_params(sampling: dict | None, expected: Stops, hold: bool) -> None:
    stops = Stops.of(sampling)
    assert stops == expected and stops.hold is hold and stops.detokenize is hold
