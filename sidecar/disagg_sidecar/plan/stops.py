"""Stop strings and stop tokens, pure: the one place that knows how a request's stops shape its
legs and its answer.

- The decode engine applies them (render's ``sampling_params`` carry ``stop``, ``min_tokens``,
  ``include_stop_str_in_output``): a ``tokens`` leg needs its detokenizer only for stop strings.
- A stop *token* (EOS or a stop token id) is an id the engine ended on: derender would decode it
  as text, so it is dropped from the ids first (unless ``include_stop_str_in_output``), as the
  engine's own detokenizer does (vLLM 0.32; 0.33's derender does this itself).
- A stop *string* ends a choice mid-token: the engine reports it as ``stop_reason`` and the
  sidecar cuts the text where it matched (``chained``); a streamed choice is held until it
  finished, as the cut can reach back into text already decoded.
- Legs that never apply them do not carry them: the derender tier's parser context (vLLM 0.33's
  streaming derender rejects ``stop``) and a tokenizer-free prefill leg.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STOP = "stop"  # the sampling (and OpenAI request) field with the stop strings


@dataclass(frozen=True)
class Stops:
    """A prompt's stop handling, from render's ``sampling_params`` (what the engine applies)."""

    strings: bool = False  # the request has stop strings
    include: bool = False  # include_stop_str_in_output
    min_tokens: int = 0  # the first min_tokens tokens are not checked for stop strings

    @classmethod
    def of(cls, sampling: Mapping[str, Any] | None) -> Stops:
        sampling = sampling or {}
        return cls(strings=bool(sampling.get(STOP)), include=bool(sampling.get("include_stop_str_in_output")),
                   min_tokens=int(sampling.get("min_tokens") or 0))

    @property
    def hold(self) -> bool:
        """A streamed choice goes to the derender tier once it finished (the cut may reach back)."""
        return self.strings

    @property
    def detokenize(self) -> bool:
        """Whether a ``tokens`` leg needs the decode engine's detokenizer (stop strings do)."""
        return self.strings


def stop_cut(text: str, stop: str, include: bool, unchecked: str = "") -> str:
    """The text the engine keeps for a choice that ``stop`` ended.

    The engine checks each step's new text (with ``len(stop) - 1`` characters before it) for its
    stop strings, stops at the first match and truncates there (before it, or after it with
    ``include_stop_str_in_output``). ``stop`` is the string it reported as ``stop_reason``, so
    locating it is all that is left: its first occurrence in the checked text, which starts after
    ``unchecked`` (the text of the first ``min_tokens`` tokens, whose steps are not checked).
    """
    at = text.find(stop, max(0, len(unchecked) + 1 - len(stop)) if unchecked else 0)
    if at < 0:
        return text
    return text[: at + len(stop)] if include else text[:at]


def cut_by_stop_string(choice: Mapping[str, Any]) -> bool:
    return choice.get("finish_reason") == "stop" and isinstance(choice.get("stop_reason"), str)


def ended_on_stop_token(choice: Mapping[str, Any]) -> bool:
    """EOS (``stop_reason`` None) or a stop token id (int) ended it; a stop *string* is text."""
    return choice.get("finish_reason") == "stop" and (
        choice.get("stop_reason") is None or isinstance(choice.get("stop_reason"), int)
    )


def without_stop_token(choice: Mapping[str, Any], include_stop_str_in_output: bool = False) -> dict[str, Any]:
    """A generate choice (or stream chunk choice) whose final stop token will not be decoded.

    Its logprob entry stays: coupled reports one for every sampled token, the stop token too,
    and derender resolves the entries independently of the ids it decodes."""
    out = dict(choice)
    ids = out.get("token_ids") or []
    if ids and not include_stop_str_in_output and ended_on_stop_token(out):
        out["token_ids"] = ids[:-1]
    return out


def generate_for_derender(gen_response: Mapping[str, Any], include_stop_str_in_output: bool = False) -> dict[str, Any]:
    """A generate response (or stream chunk) ready for ``/derender``."""
    return {**gen_response,
            "choices": [without_stop_token(c, include_stop_str_in_output) for c in gen_response.get("choices", [])]}


def without_stop_strings(body: dict[str, Any]) -> dict[str, Any]:
    """A client's request (in place) as a context for a leg that never applies its stop strings."""
    body.pop(STOP, None)
    return body
