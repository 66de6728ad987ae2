"""One request's plan, made once, pure: ``plan_request`` reads the client's body (checked here,
once) with the decode engine's capabilities and the configuration, and the legs, the decode
call, the chained derender and the shapes read the frozen ``RequestPlan`` and decide nothing.

What it holds, and where the rule lives when it is not here:
- the API, ``stream``, ``n`` (checked with the work limits: ``requestlimits``);
- the decode leg's output mode and parser context (``decisions.decode_plan``), fitted to what
  render answered (``fitted``), and which answers need the derender tier (``chains``);
- the derender strategy of a chained stream: a session (``engine.derender_sessions``) or
  stateless calls, coalesced or not, and the tokens per decode chunk;
- the client's answer (``Answer``): model, logprob candidates, token ids, tool-call settings;
- per prompt, from render's ``sampling_params``: the logprob limit, the candidates the decode
  engine is asked for (``prompt_leg``) and the stop handling (``stops``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_sidecar import vllm_releases, wire
from disagg_sidecar.config import Capabilities, SidecarConfig
from disagg_sidecar.plan import decisions
from disagg_sidecar.plan import legs
from disagg_sidecar.plan import requestlimits
from disagg_sidecar.plan.decisions import Api, DecodePlan

# The answer modes the sidecar shapes as they are; any other answer goes through the derender tier.
SHAPED: dict[Api, tuple[wire.OutputMode, ...]] = {"chat": ("derender", "text"), "completions": ("text",)}


@dataclass(frozen=True)
class Answer:
    """What of the client's request its answer carries (the chained path and the shapes)."""

    model: str | None = None
    top_logprobs: int = 0  # chat: candidates per position the client asked for
    completion_logprobs: int | None = None  # completions: the client's `logprobs` (k)
    stream_logprobs: bool = False  # chat: logprob entries are resolved per streamed call
    hide_metadata: bool = False  # include_reasoning false: coupled shows no logprobs
    parallel_tool_calls: bool = True
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as ``token_id:N``
    tool_choice: Any = None
    echo: bool = False  # completions: the prompt first (``derender.echo``)

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Answer:
        logprobs = body.get("logprobs")
        return cls(model=body.get("model"), top_logprobs=int(body.get("top_logprobs") or 0),
                   completion_logprobs=logprobs if type(logprobs) is int else None,
                   stream_logprobs=bool(logprobs), hide_metadata=body.get("include_reasoning") is False,
                   parallel_tool_calls=body.get("parallel_tool_calls") is not False,
                   return_token_ids=bool(body.get("return_token_ids")),
                   tokens_as_ids=bool(body.get("return_tokens_as_token_ids")), tool_choice=body.get("tool_choice"),
                   echo=bool(body.get("echo")))


@dataclass(frozen=True)
class RequestPlan:
    api: Api
    stream: bool
    n: int
    decode: DecodePlan
    answer: Answer = Answer()
    sessions: bool = False  # a chained stream goes through a derender session where one is offered
    # A session writes the client's own chat (completions) chunks where its render offers it, relayed
    # as bytes: an OpenAI chat stream, a one-prompt completions stream without echo; never a plan
    # derived for another API, whose mapping reads the chunks.
    session_chunks: bool = False
    coalesce: bool = True  # stateless chained streams merge the chunks that queue behind a call
    # Tokens per chunk of a streamed tokens leg: a derender session splits them per token again,
    # so fewer, larger chunks cost the decode API and the sidecar less.
    stream_interval: int = 1
    derive_finish_reason: bool = True  # the derender tier does not make chat's finish_reason itself
    max_logprobs: int | None = None  # what clients may ask for (limits.max_logprobs)
    engine_max_logprobs: int = -1  # what the engines run with (engine.max_logprobs)

    def chains(self, answered: wire.OutputMode) -> bool:
        """Whether an answer (or chunk) in ``answered`` mode needs the derender tier: a ``tokens``
        answer always, and any the shapes cannot take (an engine that refused or ignored the mode)."""
        return answered not in SHAPED.get(self.api, wire.OUTPUT_MODES)

    def fitted(self, gen: Mapping[str, Any], release: vllm_releases.Release | None = None) -> RequestPlan:
        """The plan for render's answer and the decode engine's release (``decisions.fit_to_render``)."""
        decode = decisions.fit_to_render(self.decode, gen, release, tokens_as_ids=self.answer.tokens_as_ids)
        return self if decode == self.decode else dataclasses.replace(self, decode=decode)

    def prompt_leg(self, gen: Mapping[str, Any]) -> dict[str, Any]:
        """Render's answer (or a GenerateRequest client's) as the legs' ``GenerateRequest``: within
        the client's logprob limit (render does not check it; the engines would, but run with one
        candidate more) and, for completions, asking the decode engine for one candidate more
        (``with_candidate_headroom``)."""
        requestlimits.check_logprobs(gen.get(wire.SAMPLING_PARAMS), self.max_logprobs)
        if self.api == "generate":
            return dict(gen)
        gen = legs.rendered(gen)
        return with_candidate_headroom(gen, self.engine_max_logprobs) if self.api == "completions" else gen


def with_candidate_headroom(gen: Mapping[str, Any], engine_max: int) -> dict[str, Any]:
    """Render's answer for a completions prompt, asking the decode engine for one logprob candidate
    more than the client's k while that stays within the engines' ``--max-logprobs`` (``engine_max``,
    -1: any; the operator runs them with one more than clients may ask for).

    Coupled ``/v1/completions`` shows the sampled token and the top k: k + 1 candidates, or k when
    the sampled token is among the top k. vLLM 0.32's generate keeps only the first k candidates it
    was asked for (the sampled token first), so it is asked for k + 1 and ``completion_candidates``
    makes coupled's cut; on 0.33, which keeps them all, the same cut changes nothing.
    """
    sp = gen.get(wire.SAMPLING_PARAMS)
    k = sp.get("logprobs") if isinstance(sp, Mapping) else None
    if type(k) is not int or k < 0 or (engine_max >= 0 and k >= engine_max):
        return dict(gen)
    return {**gen, wire.SAMPLING_PARAMS: {**sp, "logprobs": k + 1}}


def plan_request(api: Api, body: Any, caps: Capabilities, config: SidecarConfig) -> RequestPlan:
    """The request's plan; a request the sidecar refuses raises its 400 here, before any leg.

    An Anthropic Messages request (and its ``count_tokens``) is checked here; the chat request
    vLLM's mapping derives from it after render gets its own plan (``derived_chat``)."""
    if api == "generate":
        n = decisions.check_generate_request(body)
    elif api == "messages" or api == "count_tokens":
        decisions.check_messages_request(api, body)
        n = 1
    elif api == "responses":
        decisions.check_responses_request(body)
        n = 1
    else:
        n = decisions.check_openai_request(api, body)
    requestlimits.within(api, body, n, config.limits)
    return _planned(api, body, n, caps, config)


def derived_chat(chat: Mapping[str, Any], caps: Capabilities, config: SidecarConfig) -> RequestPlan:
    """The plan of a chat request the sidecar derived from another API's (checked as that one):
    chat's decisions on the derived body, one choice. Its chunks are not the client's (another
    API's mapping reads them), so the decode engine writes them in the generate shape."""
    plan = _planned("chat", chat, 1, caps, config)
    return dataclasses.replace(plan, decode=dataclasses.replace(plan.decode, client_chunks=False), session_chunks=False)


def _session_chunks(api: Api, body: Mapping[str, Any]) -> bool:
    return api == "chat" or api == "completions" and decisions.completion_chunks_are_one_streams(body)


def _planned(api: Api, body: Mapping[str, Any], n: int, caps: Capabilities, config: SidecarConfig) -> RequestPlan:
    stream = bool(body.get("stream"))
    sessions = config.engine.derender_sessions
    chain_api: Api = "chat" if api in ("messages", "count_tokens") else api
    return RequestPlan(
        api=api, stream=stream, n=n, decode=decisions.decode_plan(chain_api, body, caps),
        answer=Answer.of(body) if api in ("chat", "completions") else Answer(),  # messages: ``derived_chat``'s
        sessions=sessions, session_chunks=sessions and stream and _session_chunks(api, body),
        coalesce=config.limits.coalesce,
        stream_interval=config.limits.session_stream_interval if sessions else 1,
        derive_finish_reason=not config.engine.features.derender_finish_reason,
        max_logprobs=config.limits.max_logprobs, engine_max_logprobs=config.engine.max_logprobs)
