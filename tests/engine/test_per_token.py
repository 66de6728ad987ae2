"""Merged stream outputs split back per token (engine/disagg_engine/per_token.py), with vLLM's own
parts and no server: the engine's output processor makes a request's outputs one token per step
(what the coupled server's chat generator gets when it keeps up); the same steps queued behind
a slow consumer are merged by vLLM's ``RequestOutputCollector``; the split must give back the
per-step outputs exactly, and vLLM's streaming parsers then answer the same as for the per-step ones."""

from __future__ import annotations

import pytest

from disagg_engine.per_token import PerToken
from disagg_engine.testing import tiny_model
from disagg_engine.vllm_compat import (
    EngineCoreOutput,
    FinishReason,
    LogprobsLists,
    OutputProcessor,
    RequestOutputCollector,
    RequestOutputKind,
    SamplingParams,
    engine_request,
)
from tests.harness.forced import MULTIBYTE, OUTPUTS

PROMPT = [9707, 11, 1879, 0]  # replaced by the tokenizer's ids of PROMPT_TEXT below
PROMPT_TEXT = "Hello, world!"


@pytest.fixture(scope="module")
def tokenizer():
    from vllm.tokenizers.registry import get_tokenizer

    tok = get_tokenizer(str(tiny_model.ensure_model()))
    PROMPT[:] = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    return tok


def _params(**kw) -> SamplingParams:
    params = SamplingParams(max_tokens=256, **kw)
    params.output_kind = RequestOutputKind.DELTA
    return params


def _step(token: int, last: bool, finish: FinishReason | None, logprobs: bool) -> EngineCoreOutput:
    lists = None
    if logprobs:
        import numpy as np

        lists = LogprobsLists(np.array([[token, 7]]), np.array([[-0.5, -1.5]], dtype=np.float32), np.array([1]))
    return EngineCoreOutput(request_id="r", new_token_ids=[token], new_logprobs=lists,
                            finish_reason=finish if last else None)


def run(tokenizer, ids: list[int], params: SamplingParams, groups: list[int], finish: FinishReason | None,
        logprobs: bool = False) -> list:
    """The request's outputs, the steps of each group queued before the consumer takes them."""
    processor = OutputProcessor(tokenizer, log_stats=False)
    queue = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    processor.add_request(engine_request("r", PROMPT, params.clone()), None, None, 0, queue)
    outs, i = [], 0
    for size in groups:
        for token in ids[i:i + size]:
            i += 1
            if "r" in processor.request_states:  # a stop string ends it early
                processor.process_outputs([_step(token, i == len(ids), finish, logprobs)])
        if (out := queue.get_nowait()) is not None:
            outs.append(out)
        if i >= len(ids):
            break
    return outs


def view(out) -> tuple:
    [c] = out.outputs
    lps = [sorted((t, round(lp.logprob, 3)) for t, lp in pos.items()) for pos in c.logprobs] if c.logprobs else None
    return c.text, list(c.token_ids), lps, c.finish_reason, c.stop_reason, out.finished


def split_all(tokenizer, outs: list, params: SamplingParams) -> list:
    splitter = PerToken(tokenizer, "r", PROMPT, params)
    return [piece for out in outs for piece in splitter.split(out)]


CASES = {
    "multibyte": (MULTIBYTE, {}, FinishReason.LENGTH),
    "two_tool_calls_eos": (OUTPUTS["two_tool_calls"][0], {}, FinishReason.STOP),
    "stop_string_in_a_merge": (OUTPUTS["two_tool_calls"][0], {"stop": ["Europe"]}, FinishReason.LENGTH),
    "stop_string_kept": (OUTPUTS["two_tool_calls"][0], {"stop": ["Europe"], "include_stop_str_in_output": True},
                         FinishReason.LENGTH),
    "special_tokens_shown": (OUTPUTS["reasoning_tool_call"][0], {"skip_special_tokens": False}, FinishReason.STOP),
}


@pytest.mark.parametrize("logprobs", [False, True], ids=["text", "logprobs"])
@pytest.mark.parametrize("case", list(CASES))
def test_split_gives_back_each_step(tokenizer, case: str, logprobs: bool) -> None:
    text, kw, finish = CASES[case]
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = _params(logprobs=1 if logprobs else None, **kw)
    steps = run(tokenizer, ids, params, [1] * len(ids), finish, logprobs)
    # merges of every size, from the first step on and in the middle, up to the end
    groups = [3, 1, 1, 5, 2, 1, 7] + [4] * len(ids)
    merged = run(tokenizer, ids, params, groups, finish, logprobs)
    assert len(merged) < len(steps) and any(len(o.outputs[0].token_ids) > 1 for o in merged)
    assert [view(o) for o in split_all(tokenizer, merged, params)] == [view(o) for o in steps]


def test_outputs_of_one_token_pass_unchanged(tokenizer) -> None:
    ids = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    steps = run(tokenizer, ids, _params(), [1] * len(ids), FinishReason.STOP)
    assert [id(o) for o in split_all(tokenizer, steps, _params())] == [id(o) for o in steps]


def test_a_merge_that_does_not_add_up_stays_merged(tokenizer) -> None:
    """The safety net: a shadow that disagrees with the engine's text (here: other stop strings than
    the engine's) leaves the merge as it is, and that choice is not split again."""
    ids = tokenizer.encode(OUTPUTS["plain"][0], add_special_tokens=False)
    merged = run(tokenizer, ids, _params(), [3, 3] + [1] * len(ids), FinishReason.STOP)
    pieces = split_all(tokenizer, merged, _params(stop=["capital"]))
    assert [view(o) for o in pieces] == [view(o) for o in merged]


def test_the_hermes_parser_answers_a_split_stream_as_a_per_token_one(tokenizer) -> None:
    """Why the split exists: vLLM's tool parser, through vLLM's chat stream generator, on the
    merged outputs, the split ones and the per-step ones (the coupled server's)."""
    text = OUTPUTS["two_tool_calls"][0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = _params(stop=["Europe"])
    steps = run(tokenizer, ids, params, [1] * len(ids), FinishReason.LENGTH)
    # a consumer that lagged 19 steps, from the first call's name through its end markup
    merged = run(tokenizer, ids, params, [1, 1, 1, 19] + [1] * len(ids), FinishReason.LENGTH)
    answers = {name: tool_arguments(tokenizer, outs)
               for name, outs in (("steps", steps), ("merged", merged), ("split", split_all(tokenizer, merged, params)))}
    assert answers["split"] == answers["steps"] == ['{"city": "Paris"}', '{"tz": "']
    assert answers["merged"] != answers["steps"]  # the defect the split removes


def tool_arguments(tokenizer, outs: list) -> list[str]:
    """Each tool call's streamed arguments, as the chat stream generator gets them from vLLM's
    parser (qwen3 reasoning + hermes tools, the test servers' flags)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": OUTPUTS["two_tool_calls"][1]["tools"]})
    parser_cls = ParserManager.get_parser(tool_parser_name="hermes", reasoning_parser_name="qwen3",
                                          enable_auto_tools=True, tokenizer=tokenizer)
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs={})
    calls: dict[int, str] = {}
    for out in outs:
        [c] = out.outputs
        delta = parser.parse_delta(delta_text=c.text, delta_token_ids=list(c.token_ids), request=request,
                                   prompt_token_ids=PROMPT, finished=c.finish_reason is not None)
        for call in (delta.tool_calls if delta else None) or []:
            calls[call.index] = calls.get(call.index, "") + ((call.function.arguments or "") if call.function else "")
    return [calls[i] for i in sorted(calls)]
