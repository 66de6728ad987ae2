"""A streamed request's outputs one token at a time, as the coupled server sends them when its
API process keeps up with the engine.

vLLM's ``RequestOutputCollector`` merges a request's delta outputs while their consumer lags (a
busy API process). The chat generator then hands several tokens in one delta to the streaming
tool and reasoning parsers, which answer them differently from the same tokens one by one: a
Hermes call's arguments take the start of the closing markup along (``{"city": "Paris"}}\\n</tool_``).
The streamed ``derender`` path undoes the merge, so what a client gets depends on the tokens only,
not on the engine's load (``sessions`` and ``disagg_sidecar.derender.stream.per_token`` do the same
for the chained paths).

The text of each token is the engine's own: a shadow of its detokenizer (vLLM's
``IncrementalDetokenizer``, the same prompt and sampling parameters) is created at a choice's first
merge by replaying the choice's earlier tokens, then fed each token as the engine was, one step
at a time. A merge whose pieces do not add up to the merged text (not seen; a safety net) goes on
merged, and that choice is not split again.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from disagg_engine.vllm_compat import IncrementalDetokenizer, SamplingParams, engine_request


class _Choice:
    """One choice's tokens so far and, once it was merged, the shadow detokenizer."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.shadow: IncrementalDetokenizer | None = None
        self.given_up = False


class PerToken:
    """Splits one request's merged delta outputs (see the module docstring)."""

    def __init__(self, tokenizer: Any, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.choices: dict[int, _Choice] = {}

    def split(self, out: Any) -> list[Any]:
        """``out`` as one output per token and choice (``out`` itself when there is nothing to split)."""
        if len(out.outputs) == 1 and len(out.outputs[0].token_ids) <= 1:
            self._follow(out.outputs[0])
            return [out]
        pieces: list[Any] = []
        for n, completion in enumerate(out.outputs):
            last_choice = n == len(out.outputs) - 1
            for text, ids, logprobs, end in self._pieces(completion):
                last = last_choice and end
                piece = copy.copy(out)
                piece.outputs = [dataclasses.replace(
                    completion, text=text, token_ids=ids, logprobs=logprobs,
                    finish_reason=completion.finish_reason if end else None,
                    stop_reason=completion.stop_reason if end else None)]
                piece.finished = out.finished and last
                if not last:
                    piece.kv_transfer_params = None
                pieces.append(piece)
        return pieces

    def _follow(self, completion: Any) -> None:
        """A choice's output that needs no split: its tokens go through the shadow, if there is one."""
        choice = self.choices.setdefault(completion.index, _Choice())
        if choice.shadow is not None and not choice.given_up:
            self._step_all(choice.shadow, list(completion.token_ids), completion)
        choice.ids.extend(completion.token_ids)

    def _pieces(self, completion: Any) -> list[tuple[str, list[int], Any, bool]]:
        ids = list(completion.token_ids)
        choice = self.choices.setdefault(completion.index, _Choice())
        whole = [(completion.text, ids, completion.logprobs, True)]
        if len(ids) <= 1 or choice.given_up:
            self._follow(completion)
            return whole
        if choice.shadow is None:
            choice.shadow = self._shadow(choice.ids)
        texts = self._step_all(choice.shadow, ids, completion)
        choice.ids.extend(ids)
        logprobs = completion.logprobs
        if "".join(texts) != completion.text or (logprobs and len(logprobs) != len(ids)):
            choice.given_up = True
            return whole
        return [(text, [token], logprobs[i:i + 1] if logprobs else logprobs, i == len(ids) - 1)
                for i, (text, token) in enumerate(zip(texts, ids))]

    def _shadow(self, earlier: list[int]) -> IncrementalDetokenizer:
        shadow = IncrementalDetokenizer.from_new_request(
            self.tokenizer, engine_request(self.request_id, self.prompt_token_ids, self.params))
        for token in earlier:
            shadow.update([token], False)
            shadow.get_next_output_text(False, True)
        return shadow

    @staticmethod
    def _step_all(shadow: IncrementalDetokenizer, ids: list[int], completion: Any) -> list[str]:
        """Each token's text, as the engine's output processor made it: one ``update`` per step, the
        end (and a stop token's skipped text) with the last."""
        finished = completion.finish_reason is not None
        stop_token = completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str)
        texts = []
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            shadow.update([token], last and stop_token)
            texts.append(shadow.get_next_output_text(last and finished, True))
        return texts


async def per_token_outputs(outputs: AsyncGenerator, splitter: PerToken) -> AsyncGenerator:
    async with aclosing(outputs):  # closed with this one: vLLM aborts the request at once
        async for out in outputs:
            for piece in splitter.split(out):
                yield piece
