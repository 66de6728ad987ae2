"""Every request option coupled vLLM accepts is carried to the leg that honours it or refused
with a 400 naming it (``plan/options.py``; on the Messages paths in Anthropic's error object),
checked against vLLM's own request models on every lane: a field a new vLLM release adds fails
here until the sidecar places it."""

from __future__ import annotations

import json

import pytest

from disagg_engine.testing.lanes import ALL_LANES
from disagg_sidecar import wire
from disagg_sidecar.derender import anthropic
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.plan import anthropic_request, options
from disagg_sidecar.plan.decisions import check_messages_request, check_openai_request, check_responses_request
from tests.harness.lane_code import run_in_lane

# vLLM's request models, named by the API the sidecar serves them on; the fields a client may
# send are their pydantic fields (by name and by alias).
MODELS = {"chat": ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
          "completions": ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
          "messages": ("vllm.entrypoints.anthropic.protocol", "AnthropicMessagesRequest"),
          "count_tokens": ("vllm.entrypoints.anthropic.protocol", "AnthropicCountTokensRequest"),
          "responses": ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest")}
# Fields each model has on every lane (the models were found and read).
CORE = {"chat": {"model", "stream", "n"}, "completions": {"model", "stream", "n"},
        "messages": {"model", "messages", "max_tokens", "stream"}, "count_tokens": {"model", "messages"},
        "responses": {"model", "input", "stream", "max_output_tokens"}}
_LIST_FIELDS = """
import importlib, json, sys
models = json.loads(sys.argv[1])
out = {}
for api, (module, name) in models.items():
    model = getattr(importlib.import_module(module), name)
    out[api] = sorted({n for f_name, f in model.model_fields.items() for n in (f_name, f.alias) if n})
print("FIELDS " + json.dumps(out))
"""


def vllm_request_fields(lane: str) -> dict[str, list[str]]:
    """The request fields of ``lane``'s vLLM (``run_in_lane``)."""
    return run_in_lane(lane, _LIST_FIELDS, MODELS, "FIELDS")


@pytest.mark.parity
@pytest.mark.parametrize("lane", ALL_LANES)  # 0.34 too: a new field cannot slip in there either
def test_every_vllm_request_field_is_carried_or_refused(lane: str) -> None:
    fields = vllm_request_fields(lane)
    assert set(fields) == set(MODELS) == set(options.CARRIED) == set(options.REFUSED)
    for api, names in fields.items():
        carried, refused = set(options.CARRIED[api]), set(options.REFUSED[api])
        assert not carried & refused, api
        unplaced = sorted(set(names) - carried - refused)
        assert not unplaced, f"vLLM {lane} {api} fields neither carried nor refused: {unplaced}"
        assert CORE[api] <= set(names)


def _refused_values(api: str) -> list[tuple[str, object]]:
    """Per refused field a value that asks for something (not one of its ``off`` values)."""
    cases = []
    for name, off in options.REFUSED[api].items():
        value = next(v for v in (True, 1, "none", {"a": 1}, [1]) if not any(v == o and type(v) is type(o) for o in off))
        cases.append((name, value))
    return cases


@pytest.mark.parametrize("api, name, value", [(api, n, v) for api in ("chat", "completions")
                                              for n, v in _refused_values(api)])
def test_a_refused_field_that_asks_for_something_is_a_400_naming_it(api: str, name: str, value: object) -> None:
    body = {"model": "m", "messages": []} if api == "chat" else {"model": "m", "prompt": "x"}
    with pytest.raises(SidecarError) as err:
        check_openai_request(api, {**body, name: value})
    error = json.loads(err.value.body)["error"]
    assert err.value.status == 400 and error["param"] == name and name in error["message"]
    assert error["type"] == "BadRequestError"
    for off in options.REFUSED[api][name]:  # the values that ask for nothing pass
        check_openai_request(api, {**body, name: off})


MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
MESSAGES_REFUSED = [("messages", n, v) for n, v in _refused_values("messages")]


def test_the_messages_refusals_are_the_legs_own() -> None:
    """What a Messages request may not carry: what no chat request through the legs may either
    (a client's transfer params, render's emptied features)."""
    assert set(options.REFUSED["messages"]) == {"kv_transfer_params", "ec_transfer_params", "mm_payload",
                                                "return_mm_kwargs"}
    assert options.REFUSED["messages"].items() <= options.REFUSED["chat"].items()
    assert options.REFUSED["count_tokens"] == {}


@pytest.mark.parametrize("name, value", _refused_values("responses"))
def test_a_refused_responses_field_is_a_400_naming_it(name: str, value: object) -> None:
    """The legs' own refusals (a client's transfer params, render's emptied features for the prefill
    leg); every other field reaches the decode engine's own Responses code as the client sent it."""
    assert options.REFUSED["responses"] == options.REFUSED["messages"]
    body = {"model": "m", "input": "Hi"}
    with pytest.raises(SidecarError) as err:
        check_responses_request({**body, name: value})
    error = json.loads(err.value.body)["error"]
    assert err.value.status == 400 and error["param"] == name and name in error["message"]
    for off in options.REFUSED["responses"][name]:  # the values that ask for nothing pass
        check_responses_request({**body, name: off})


@pytest.mark.parametrize("api, name, value", MESSAGES_REFUSED)
def test_a_refused_messages_field_is_a_400_in_anthropics_object_naming_it(api: str, name: str, value: object) -> None:
    with pytest.raises(SidecarError) as err:
        check_messages_request(api, {**MESSAGES, name: value})
    assert err.value.status == 400
    shaped = json.loads(anthropic.in_api_shape(wire.MESSAGES, 400, err.value.body))
    assert shaped["type"] == "error" and set(shaped["error"]) == {"type", "message"}
    assert shaped["error"]["message"].startswith(f"{name} is not supported")
    for off in options.REFUSED[api][name]:  # the values that ask for nothing pass
        check_messages_request(api, {**MESSAGES, name: off})


@pytest.mark.parametrize("body", [
    {**MESSAGES, "stream": True, "stop_sequences": ["x"], "top_k": 2, "metadata": {"user_id": "u"},
     "thinking": {"type": "enabled", "budget_tokens": 1024}, "min_tokens": 0, "mm_payload": "tensors",
     "tool_choice": {"type": "any"}, "output_config": {"effort": "low"}, "cache_salt": "s"},
    {**MESSAGES, "min_tokens": 3, "return_mm_kwargs": True, "kv_transfer_params": None},
])
def test_carried_messages_fields_pass_the_check(body: dict) -> None:
    check_messages_request("messages", body)
    check_messages_request("count_tokens", body)  # count_tokens refuses nothing; vLLM's model reads its own


def test_count_tokens_sends_render_exactly_its_carried_fields() -> None:
    """``count_tokens`` carries to render what ``AnthropicCountTokensRequest`` reads, and nothing a
    client sends beside it (coupled ignores the rest: stop sequences, sampling, transfer params)."""
    body = {name: f"v-{name}" for name in options.CARRIED["count_tokens"]}
    extra = {"stop_sequences": ["x"], "temperature": 0.5, "kv_transfer_params": {"remote_host": "evil"},
             "vllm_xargs": {"a": 1}, "min_tokens": 4}
    out = anthropic_request.count_render_body({**body, **extra})
    assert out == {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}


@pytest.mark.parametrize("sampling, reads", [
    ({"prompt_logprobs": 2, "skip_reading_prefix_cache": True}, False),  # render's answer for prompt_logprobs
    ({"skip_reading_prefix_cache": False}, True), ({}, True), (None, True),
])
def test_a_remote_prefill_is_sent_only_where_decode_reads_its_kv(sampling, reads) -> None:
    assert options.decode_reads_transferred_kv(sampling) is reads


def test_carried_fields_pass_the_check() -> None:
    check_openai_request("chat", {"messages": [], "tools": [], "logprobs": True, "top_logprobs": 2, "seed": 1})
    check_openai_request("completions", {"prompt": "x", "suffix": None, "logprobs": 2, "stop": ["a"]})
