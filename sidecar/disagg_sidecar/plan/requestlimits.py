"""Work limits on one request (pure): ``n``, prompts per completions request, and the engine
work a request may start, each refused with a 400 naming the limit before any leg is sent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg_sidecar import wire
from disagg_sidecar.config import Limits
from disagg_sidecar.errors import bad_request


def prompt_count(prompt: Any) -> int:
    """Prompts in a completions ``prompt``: a string or a token list is one, a list of them each."""
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return 1


def rendered_prompts(body: Mapping[str, Any]) -> int:
    """The requests render makes of a completions request: one per prompt and per prompt embedding
    (vLLM's ``prompt_embeds``: one tensor, or a list of them)."""
    prompt, embeds = body.get("prompt"), body.get("prompt_embeds")
    count = prompt_count(prompt) if prompt is not None else 0
    if embeds is not None:
        count += len(embeds) if isinstance(embeds, list) else 1
    return max(count, 1)


def choices(api: str, body: Mapping[str, Any]) -> Any:
    if api in ("messages", "count_tokens", "responses"):
        return None  # one answer: vLLM's models of these APIs have no ``n`` (a client's is ignored)
    if api == "generate":
        sampling = body.get(wire.SAMPLING_PARAMS)
        return sampling.get("n") if isinstance(sampling, Mapping) else None
    return body.get("n")


def legs(prompts: int, n: int, rendered: bool) -> int:
    """1 render (not for generate clients) + per prompt one prefill leg and ``n`` decode sequences."""
    return int(rendered) + prompts * (1 + n)


def checked_n(api: str, body: Mapping[str, Any]) -> int:
    """The request's ``n`` (1 when absent); anything but a positive integer is refused."""
    n = choices(api, body)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise bad_request("n must be a positive integer", _n_param(api))
    return n or 1


def _n_param(api: str) -> str:
    return "n" if api != "generate" else f"{wire.SAMPLING_PARAMS}.n"


def check(api: str, body: Mapping[str, Any], limits: Limits) -> int:
    """``n`` checked and within the limits; returns it."""
    n = checked_n(api, body)
    within(api, body, n, limits)
    return n


def within(api: str, body: Mapping[str, Any], n: int, limits: Limits) -> None:
    """The request's work within the limits, for its checked ``n`` (``checked_n``)."""
    if n > limits.max_n:
        raise bad_request(f"n is {n}; this server allows at most {limits.max_n} (limits.max_n)", _n_param(api))
    prompts = rendered_prompts(body) if api == "completions" else 1
    if prompts > limits.max_prompts:
        raise bad_request(f"the request has {prompts} prompts; this server allows at most {limits.max_prompts} "
                          "per request (limits.max_prompts)", "prompt")
    total = legs(prompts, n, api != "generate")
    if total > limits.max_legs:
        raise bad_request(f"the request needs {total} engine legs (1 render + {prompts} prompt(s) x (1 prefill + "
                          f"{n} decode sequences)); this server allows at most {limits.max_legs} "
                          "(limits.max_legs)", "n")


def check_logprobs(sampling_params: Any, limit: int | None) -> None:
    """Refuse what vLLM's ``SamplingParams._validate_logprobs`` refuses past ``--max-logprobs``, with its
    message: the engines run with one candidate more than clients may ask for (config
    ``engine.max_logprobs``), so the client's limit is the sidecar's to apply. ``sampling_params`` is
    render's (or a GenerateRequest client's); -1 asks for the whole vocabulary, which vLLM names by
    its size and the sidecar cannot."""
    if limit is None or limit < 0 or not isinstance(sampling_params, Mapping):
        return
    for key, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        k = sampling_params.get(key)
        if type(k) is float and k.is_integer():
            k = int(k)  # what the engine's pydantic makes of 25.0
        if type(k) is int and (k > limit or k == -1):
            asked = "the whole vocabulary (-1)" if k == -1 else k
            raise bad_request(f"Requested {what} logprobs of {asked}, which is greater than max allowed: {limit} "
                              f"(parameter={key}, value={k})", key)
