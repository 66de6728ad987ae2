"""Completions ``echo``: the prompt put before each choice's output, as vLLM's
``OpenAIServingCompletion`` assembles it (``request_output_to_completion_response`` and
``completion_stream_generator``, vLLM 0.32 and 0.33). Pure functions over the client's answer.

What the legs give: the prompt's text (the client's string; a token-id prompt's from the render
tier's ``/detokenize``, the renderer's own decode that coupled's prompt text comes from), its ids
(render's), and with ``logprobs`` its logprobs (the decode engine's ``prompt_logprobs``, which render
asks for when echo and logprobs meet: ``CompletionRequest.to_sampling_params``) with the text of its
first token, which has no logprob entry (``/detokenize`` of that one id: coupled's
``tokenizer.decode(token_id)``). Coupled then writes:
- text: prompt text + output text (the prompt text is "" with ``return_token_ids``; with
  ``max_tokens`` 0 the prompt text alone);
- logprobs: the prompt's positions first (the first one's token with null logprob and candidates),
  each with the sampled prompt token's ``decoded_token`` and up to k + 1 candidates
  (``_create_completion_logprobs``), then the output's; ``text_offset`` runs on over both;
- streamed: all of that on each choice's first chunk, with ``prompt_token_ids``; the output's
  offsets on later chunks move by the prompt's length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FLOOR = -9999.0  # vLLM's JSON stand-in for -inf


@dataclass(frozen=True)
class Echo:
    text: str  # what goes before the output text
    prompt_token_ids: list[int]
    logprobs: dict[str, list[Any]] | None = None  # the prompt's positions, completions-shaped
    only_prompt: bool = False  # max_tokens 0: the prompt alone

    @property
    def offset(self) -> int:
        """Where the output's ``text_offset`` starts: after the prompt's tokens."""
        if not self.logprobs or not self.logprobs["tokens"]:
            return 0
        return self.logprobs["text_offset"][-1] + len(self.logprobs["tokens"][-1])


def prompt_logprobs_part(prompt_token_ids: list[int], prompt_logprobs: list[Any], first_token: str,
                         k: int) -> dict[str, list[Any]]:
    """The prompt's positions in completions logprobs for ``logprobs: k`` (vLLM's
    ``_create_completion_logprobs`` over the engine's ``prompt_logprobs``: the prompt token first,
    then the top ones; dict keys are the decoded tokens, so equal strings keep the first place and
    the last value, as a dict comprehension does)."""
    out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for i, token_id in enumerate(prompt_token_ids):
        step = prompt_logprobs[i] if i < len(prompt_logprobs) else None
        if step is None:
            token, logprob, top = first_token, None, None
        else:
            entry = step[str(token_id)]
            token, logprob = entry.get("decoded_token") or "", max(entry["logprob"], FLOOR)
            top = {}
            for rank, candidate in enumerate(step.values()):
                if k == -1 or k >= rank:
                    top[candidate.get("decoded_token") or ""] = max(candidate["logprob"], FLOOR)
        out["text_offset"].append(offset)
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        offset += len(token)
    return out


def _joined(prompt: Mapping[str, list[Any]], output: Any, shift: int) -> dict[str, Any]:
    output = output if isinstance(output, Mapping) else {}
    joined = {k: list(prompt[k]) + list(output.get(k) or []) for k in ("tokens", "token_logprobs", "top_logprobs")}
    joined["text_offset"] = list(prompt["text_offset"]) + [o + shift for o in output.get("text_offset") or []]
    return {**output, **joined}


def shifted(logprobs: Any, shift: int) -> Any:
    """A later chunk's output logprobs, its ``text_offset`` after the echoed prompt."""
    if not isinstance(logprobs, Mapping) or not shift or not logprobs.get("text_offset"):
        return logprobs
    return {**logprobs, "text_offset": [o + shift for o in logprobs["text_offset"]]}


def choice(c: Mapping[str, Any], echo: Echo) -> dict[str, Any]:
    """A batch choice (or a choice's first chunk) with the prompt echoed before its output."""
    out = dict(c)
    if echo.only_prompt:
        out["text"] = echo.text
        out["logprobs"] = dict(echo.logprobs) if echo.logprobs is not None else c.get("logprobs")
        return out
    out["text"] = echo.text + (c.get("text") or "")
    if echo.logprobs is not None:
        out["logprobs"] = _joined(echo.logprobs, c.get("logprobs"), echo.offset)
    return out


def prompt_texts(prompt: Any, count: int) -> list[str | None]:
    """Each prompt's text as the client sent it; None for a token-id prompt (render decodes it)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [None] * count


def make(body: Mapping[str, Any], prompt_text: str, prompt_token_ids: list[int], prompt_logprobs: Any,
         first_token: str | None) -> Echo:
    """One prompt's echo for the client's completions request ``body``."""
    k = body.get("logprobs")
    logprobs = None
    if type(k) is int:
        logprobs = prompt_logprobs_part(prompt_token_ids, prompt_logprobs or [], first_token or "", k)
    return Echo(text="" if body.get("return_token_ids") else prompt_text, prompt_token_ids=list(prompt_token_ids),
                logprobs=logprobs, only_prompt=body.get("max_tokens") == 0)


@dataclass
class FirstChunks:
    """A streamed prompt's client chunks: each choice's first one carries ``prompt_token_ids`` (with
    echo or ``return_token_ids``, as coupled's) and the echo; later ones their offsets moved."""

    prompt_token_ids: list[int]
    echo: Echo | None = None
    return_token_ids: bool = False
    started: set[int] = field(default_factory=set)

    def __call__(self, chunk: dict[str, Any] | None) -> dict[str, Any] | None:
        if chunk is not None:
            chunk["choices"] = [self._choice(c) for c in chunk.get("choices") or []]
        return chunk

    def _choice(self, c: dict[str, Any]) -> dict[str, Any]:
        if c["index"] in self.started:
            return {**c, "logprobs": shifted(c.get("logprobs"), self.echo.offset)} if self.echo else c
        self.started.add(c["index"])
        if self.echo is not None:
            return {**choice(c, self.echo), "prompt_token_ids": self.prompt_token_ids}
        return {**c, "prompt_token_ids": self.prompt_token_ids} if self.return_token_ids else c
