"""Completions echo assembled as vLLM's completion serving does (``derender/echo.py``), table-style.
The expected values are written out from vLLM's rules (``_create_completion_logprobs``), not
computed by the code under test; the parity rows (test_parity_options.py) hold it to coupled."""

from __future__ import annotations

from disagg_sidecar.derender import echo

# A prompt [5, 6, 7]: the first position has no entry; then the prompt token first, candidates after.
PLP = [None,
       {"6": {"logprob": -1.5, "rank": 3, "decoded_token": "b"}, "9": {"logprob": -0.5, "rank": 1, "decoded_token": "x"},
        "8": {"logprob": -0.7, "rank": 2, "decoded_token": "y"}},
       {"7": {"logprob": float("-inf"), "rank": 9, "decoded_token": "cc"},
        "4": {"logprob": -0.1, "rank": 1, "decoded_token": "z"}, "3": {"logprob": -0.2, "rank": 2, "decoded_token": "z"}}]


def test_prompt_positions_as_completions_logprobs() -> None:
    part = echo.prompt_logprobs_part([5, 6, 7], PLP, "A", 1)
    assert part["tokens"] == ["A", "b", "cc"]
    assert part["token_logprobs"] == [None, -1.5, -9999.0]  # -inf as vLLM writes it
    assert part["text_offset"] == [0, 1, 2]
    # k = 1: the prompt token and the top 1 (ranks 0..k of the dict); equal keys keep the last value
    assert part["top_logprobs"] == [None, {"b": -1.5, "x": -0.5}, {"cc": -9999.0, "z": -0.1}]
    assert echo.prompt_logprobs_part([5, 6, 7], PLP, "A", 2)["top_logprobs"][2] == {"cc": -9999.0, "z": -0.2}
    assert echo.prompt_logprobs_part([5, 6, 7], PLP, "A", -1)["top_logprobs"][1] == {"b": -1.5, "x": -0.5, "y": -0.7}


def test_a_batch_choice_gets_the_prompt_before_its_output() -> None:
    e = echo.make({"logprobs": 0}, "Abcc", [5, 6, 7], PLP, "A")
    out = echo.choice({"index": 0, "text": "!?", "logprobs": {
        "tokens": ["!", "?"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [{"!": -1.0}, {"?": -2.0}],
        "text_offset": [0, 1]}}, e)
    assert out["text"] == "Abcc!?"
    assert out["logprobs"]["tokens"] == ["A", "b", "cc", "!", "?"]
    assert out["logprobs"]["text_offset"] == [0, 1, 2, 4, 5]  # the output's run on after the prompt's
    assert out["logprobs"]["top_logprobs"][:3] == [None, {"b": -1.5}, {"cc": -9999.0}]
    # without logprobs only the text; with return_token_ids coupled echoes no text; max_tokens 0: the prompt
    assert echo.choice({"text": "!", "logprobs": None}, echo.make({}, "Abcc", [5, 6, 7], None, None)) == \
        {"text": "Abcc!", "logprobs": None}
    assert echo.choice({"text": "!"}, echo.make({"return_token_ids": True}, "Abcc", [5], None, None))["text"] == "!"
    assert echo.choice({"text": "!"}, echo.make({"max_tokens": 0}, "Abcc", [5], None, None))["text"] == "Abcc"


def test_a_stream_echoes_on_each_choices_first_chunk_and_moves_later_offsets() -> None:
    first = echo.FirstChunks([5, 6, 7], echo.make({"logprobs": 0}, "Abcc", [5, 6, 7], PLP, "A"))
    lp = {"tokens": ["!"], "token_logprobs": [-1.0], "top_logprobs": [{"!": -1.0}], "text_offset": [0]}
    one = first({"choices": [{"index": 1, "text": "!", "logprobs": lp, "prompt_token_ids": None}]})["choices"][0]
    assert one["text"] == "Abcc!" and one["prompt_token_ids"] == [5, 6, 7] and one["logprobs"]["text_offset"] == [0, 1, 2, 4]
    later = {**lp, "text_offset": [1]}
    two = first({"choices": [{"index": 1, "text": "?", "logprobs": later, "prompt_token_ids": None}]})["choices"][0]
    assert two["text"] == "?" and two["prompt_token_ids"] is None and two["logprobs"]["text_offset"] == [5]
    other = first({"choices": [{"index": 0, "text": "?", "logprobs": lp}]})["choices"][0]
    assert other["text"] == "Abcc?"  # every choice index is echoed once
    # without echo, return_token_ids puts the prompt ids on the first chunk only, as coupled does
    ids = echo.FirstChunks([5, 6], return_token_ids=True)
    assert [ids({"choices": [{"index": 0, "text": t}]})["choices"][0].get("prompt_token_ids") for t in "ab"] == [[5, 6], None]
    assert echo.FirstChunks([5])(None) is None


def test_prompt_texts() -> None:
    assert echo.prompt_texts("hi", 1) == ["hi"]
    assert echo.prompt_texts(["a", "b"], 2) == ["a", "b"]
    assert echo.prompt_texts([1, 2], 1) == [None] and echo.prompt_texts([[1], [2]], 2) == [None, None]
