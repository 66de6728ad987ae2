"""The chained path (a decode engine answering ``tokens``, the derender tier making the answer)
made equal to the coupled endpoint where the derender endpoints alone are not.

What vLLM's derender endpoints leave out (checked on vLLM 0.32), and how it is put back:
- stop strings: the decode engine applies them (render's ``sampling_params`` carry ``stop``) and
  reports the one that ended a choice as ``stop_reason``, but its token ids run to the end of the
  token that completed the match, and derender decodes them all. For such a choice the sidecar asks
  the derender tier for the plain text of those ids (``/v1/completions/derender``, vLLM's
  detokenizer with render's ``skip_special_tokens``), cuts it where the engine's stop matched, has
  the render tier tokenize the kept text (vLLM's tokenizer) and derenders those ids instead, so
  vLLM's parser sees exactly the text the coupled server parses. Nothing here needs the derender
  endpoint to know ``stop`` (vLLM 0.33's streaming derender rejects it): the derender calls never
  carry it as something to apply. A streamed choice is held until it finishes when the request has
  stop strings, as the cut can reach back into text already decoded.
- logprobs: the streaming parser path returns none, so each streamed call's entries are resolved
  by a batch derender call (with the preceding sampled ids as context, as vLLM's own U+FFFD repair
  needs); ``top_logprobs`` is cut to what the client asked (0.32's generate keeps at least one).
- token ids: the client gets the engine's (with the final stop token), and ``prompt_token_ids``.
- ``finish_reason``: the streaming derender says ``tool_calls`` for any end once a call streamed;
  coupled only turns ``stop`` into it (a ``length`` cut inside a call stays ``length``).
- ``parallel_tool_calls: false``: batch derender does not filter, coupled keeps the first call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from disagg_sidecar.plan import legs
from disagg_sidecar.plan.request import Answer
from disagg_sidecar.derender import shapes
from disagg_sidecar import sse
from disagg_sidecar import wire
from disagg_sidecar.derender.fixes import chat_tokens_as_ids, completion_candidates, trim_top_logprobs
from disagg_sidecar.plan.stops import Stops, cut_by_stop_string, generate_for_derender, stop_cut
from disagg_sidecar.derender.window import TierCall, sent_ids, stream_derender

EMPTY_PROBE = "\U0010FFFD"  # a private-use character: no tokenizer has it as one token
LOGPROB_CONTEXT = 4  # sampled ids vLLM's repair of byte-fallback logprob tokens looks back at


@dataclass(frozen=True)
class Options:
    """What of the client's request the chained path needs: the plan's ``Answer`` for one prompt."""

    model: str | None
    prompt_token_ids: list[int]
    sampling: Mapping[str, Any]  # render's sampling_params: what the decode engine applied
    top_logprobs: int = 0
    hide_metadata: bool = False  # include_reasoning false: coupled shows no logprobs
    parallel_tool_calls: bool = True
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as ``token_id:N``
    completion_logprobs: int | None = None  # a completions client's `logprobs` (k)
    stops: Stops = Stops()  # from render's sampling_params

    @classmethod
    def planned(cls, answer: Answer, gen: Mapping[str, Any]) -> Options:
        sampling = gen.get(wire.SAMPLING_PARAMS) or {}
        return cls(model=answer.model, prompt_token_ids=list(gen[wire.TOKEN_IDS]),
                   sampling=sampling, stops=Stops.of(sampling), top_logprobs=answer.top_logprobs,
                   hide_metadata=answer.hide_metadata, parallel_tool_calls=answer.parallel_tool_calls,
                   return_token_ids=answer.return_token_ids, tokens_as_ids=answer.tokens_as_ids,
                   completion_logprobs=answer.completion_logprobs)

    @classmethod
    def of(cls, body: Mapping[str, Any], gen: Mapping[str, Any]) -> Options:
        return cls.planned(Answer.of(body), gen)

    def cut(self, logprobs: Any) -> Any:
        """Chat logprobs with each position's candidates cut to the client's ``top_logprobs``: what
        goes to the derender tier, and what the client gets (the one place they are cut)."""
        return trim_top_logprobs(logprobs, self.top_logprobs)


# -- pure pieces ---------------------------------------------------------------------------------

def text_body(choices: list[Mapping[str, Any]], opts: Options) -> bytes:
    """``/v1/completions/derender``: the plain text of each choice's ids, decoded as the engine did."""
    request = {"prompt": "-", "skip_special_tokens": opts.sampling.get("skip_special_tokens", True),
               "spaces_between_special_tokens": opts.sampling.get("spaces_between_special_tokens", True)}
    if opts.model:
        request["model"] = opts.model
    # Reported as a length cut: vLLM 0.33's derender would otherwise drop the stop token and cut at
    # the stop string itself (without min_tokens); the sidecar cuts (stop_cut).
    gen = {"request_id": "stop-cut", "choices": [
        {"index": i, "token_ids": c.get("token_ids") or [], "finish_reason": "length", "stop_reason": None}
        for i, c in enumerate(choices)]}
    return sse.dumps({**({"model": opts.model} if opts.model else {}), "generate_responses": [gen],
                            "prompt_token_ids": [opts.prompt_token_ids], "completion_request": request})


def tokenize_body(texts: list[str], opts: Options) -> bytes:
    """``/v1/completions/render`` used as vLLM's tokenizer (no special tokens added)."""
    return sse.dumps({**({"model": opts.model} if opts.model else {}), "prompt": texts,
                            "add_special_tokens": False, "max_tokens": 1})


def chat_ready(gen: Mapping[str, Any], opts: Options) -> dict[str, Any]:
    """A generate answer (or chunk) ready for chat ``/derender``: without the stop token, and each
    position's candidates cut to the client's ``top_logprobs``. The chat cut keeps the first k
    (sampled token first), so this changes nothing derender returns; it keeps vLLM 0.33's derender
    from refusing the k + 1 candidates its generate reports (more than ``max_logprobs``)."""
    ready = generate_for_derender(gen, opts.stops.include)
    ready["choices"] = [{**c, "logprobs": opts.cut(c["logprobs"])} if c.get("logprobs") else c
                        for c in ready.get("choices") or []]
    return ready


def logprob_body(entries: list[Mapping[str, Any]], context_ids: list[int]) -> bytes:
    """A generate response whose batch derender resolves ``entries`` (after ``context_ids``)."""
    ctx = [{"token_id": t, "logprob": 0.0, "top_logprobs": []} for t in context_ids]
    choice = {"index": 0, "token_ids": [*context_ids, *(e["token_id"] for e in entries)],
              "logprobs": {"content": [*ctx, *entries]}, "finish_reason": "length"}
    return sse.dumps({"request_id": "logprobs", "choices": [choice]})


def stream_finish_reason(derendered: str | None, generated: str | None) -> str | None:
    """Coupled turns only ``stop`` into ``tool_calls``; another end is the engine's."""
    if generated is not None and generated != "stop":
        return generated
    return derendered


# -- tier calls ----------------------------------------------------------------------------------

async def kept_texts(choices: list[Mapping[str, Any]], opts: Options, tier: TierCall) -> list[str]:
    """For choices a stop string ended: the text the engine kept (one plain-text derender call)."""
    skip = opts.stops.min_tokens
    sent = [*choices, *({**c, "token_ids": (c.get("token_ids") or [])[:skip]} for c in choices if skip)]
    texts = [c["text"] for c in (await tier("derender", wire.COMPLETIONS_DERENDER, text_body(sent, opts), "stop"))["choices"]]
    unchecked = texts[len(choices):] if skip else [""] * len(choices)
    return [stop_cut(text, str(choice["stop_reason"]), opts.stops.include, before)
            for text, choice, before in zip(texts, choices, unchecked)]


async def cut_token_ids(choices: list[Mapping[str, Any]], opts: Options, tier: TierCall,
                        batch: bool = False) -> list[list[int]]:
    """For choices a stop string ended: token ids whose decoding is the text the engine kept.

    Nothing kept (the stop string starts the answer): a batch derender rejects empty ids, so it
    gets the first byte of a character the tokenizer splits into bytes, which decodes to nothing
    (vLLM's detokenizer waits for the rest) and the parser sees "" as on the coupled server."""
    kept = await kept_texts(choices, opts, tier)
    texts = [t if t or not batch else EMPTY_PROBE for t in kept]
    wanted = [t for t in texts if t]
    ids = iter(await tier("render", wire.COMPLETIONS_RENDER, tokenize_body(wanted, opts), "stop") if wanted else [])
    out = [next(ids)[wire.TOKEN_IDS] if t else [] for t in texts]
    return [i[:1] if t == EMPTY_PROBE and not k else i for i, t, k in zip(out, texts, kept)]


async def chat_batch(out: Mapping[str, Any], leg: legs.DerenderLeg, opts: Options, shape: shapes.Shape,
                     tier: TierCall) -> dict[str, Any]:
    """The client's answer for a batch ``tokens`` answer of the decode engine."""
    ready = chat_ready(out, opts)
    cut = [c for c in ready["choices"] if cut_by_stop_string(c)]
    if cut:
        ids = dict(zip((c.get("index", 0) for c in cut), await cut_token_ids(cut, opts, tier, batch=True)))
        ready["choices"] = [{**c, "token_ids": ids[c.get("index", 0)]} if c.get("index", 0) in ids else c
                            for c in ready["choices"]]
    resp = await tier("derender", leg.path, leg.batch(sse.dumps(ready)), "batch")
    result = shapes.chat_from_derender(resp, shape, out)
    result["prompt_token_ids"] = opts.prompt_token_ids if shape.return_token_ids else None
    entries = {c.get("index", 0): ((c.get("logprobs") or {}).get("content")) for c in ready["choices"]}
    for choice in result["choices"]:
        # include_reasoning false: coupled shows no per-token data that could reveal the reasoning
        choice["logprobs"] = None if opts.hide_metadata else opts.cut(choice.get("logprobs"))
        if opts.tokens_as_ids:
            choice["logprobs"] = chat_tokens_as_ids(choice["logprobs"], entries.get(choice["index"]))
        calls = choice["message"].get("tool_calls")
        if calls and not opts.parallel_tool_calls:
            choice["message"]["tool_calls"] = calls[:1]
    return result


async def completion_batch(out: Mapping[str, Any], leg: legs.DerenderLeg, opts: Options, tier: TierCall) -> Any:
    """A ``/v1/completions/derender`` answer for the engine's tokens, with the engine's token ids,
    usage (derender counts the ids it decoded) and stop-string cut."""
    ready = generate_for_derender(completion_candidates(out, opts.completion_logprobs), opts.stops.include)
    resp = await tier("derender", leg.path, leg.batch(sse.dumps(ready)), "batch")
    gen_choices = out.get("choices") or []
    cut = [c for c in gen_choices if cut_by_stop_string(c)]
    kept = dict(zip((c.get("index", 0) for c in cut), await kept_texts(cut, opts, tier))) if cut else {}
    for c in resp.get("choices", []):
        source = gen_choices[c["index"]] if c.get("index", 0) < len(gen_choices) else {}
        c["token_ids"] = source.get("token_ids")
        if source.get("index", 0) in kept:
            c["text"] = kept[source.get("index", 0)]
    resp["usage"] = out.get("usage") or resp.get("usage")
    return resp


class StreamCall(Protocol):
    """One streaming derender call (``stream.DerenderCall``) and whether choices are held whole."""

    hold: bool
    call_bytes: int  # what each call sends whatever its chunk (``legs.DerenderLeg.call_bytes``)

    async def __call__(self, chunk: Mapping[str, Any], state: Any) -> tuple[dict[str, Any], Any]: ...


class _Sent:
    """The ids each choice of a stream sent to the derender tier so far: what ``window`` replays
    when a render pod of another release answered without the stream's decode window."""

    def __init__(self) -> None:
        self._ids: dict[int, list[int]] = {}

    def before(self, ready: Mapping[str, Any], state: Any) -> list[int]:
        """The ids sent before ``ready`` (none when ``state`` starts the choice); ``record`` extends them."""
        choices = ready.get("choices") or []
        if not choices:
            return []
        index = choices[0].get("index", 0)
        if state is None:
            self._ids[index] = []
        return self._ids.setdefault(index, [])

    def record(self, ready: Mapping[str, Any], earlier: list[int]) -> None:
        """After the call: ``earlier`` (what ``before`` gave) extended in place, O(delta) per call."""
        earlier.extend(sent_ids(ready))


class ChatStream:
    """One streaming derender call per (merged) generate chunk, with what coupled adds to it."""

    def __init__(self, leg: legs.DerenderLeg, opts: Options, tier: TierCall, logprobs: bool,
                 client: shapes.Shape | None = None):
        self.leg, self.opts, self.tier, self.logprobs = leg, opts, tier, logprobs
        self.client = client  # a derender session may write the client's own chunks (``RequestPlan.session_chunks``)
        self.hold = opts.stops.hold
        self.call_bytes = leg.call_bytes * (2 if logprobs else 1)  # a logprobs call beside each chunk's
        self.sent = _Sent()

    async def __call__(self, chunk: Mapping[str, Any], state: Any) -> tuple[dict[str, Any], Any]:
        ready = chat_ready(chunk, self.opts)
        choices = ready.get("choices") or []
        gen_choice = (chunk.get("choices") or [{}])[0]
        if choices:
            sent = {k: v for k, v in choices[0].items() if k != "logprobs"}  # resolved below
            if self.opts.stops.strings and state is None and cut_by_stop_string(sent):
                sent["token_ids"] = (await cut_token_ids([sent], self.opts, self.tier))[0]
            ready = {**ready, "choices": [sent]}
        # Every entry, the stop token's too (coupled streams it), cut by ``chat_ready``.
        entries = ((choices[0].get("logprobs") if choices else None) or {}).get("content") if self.logprobs else None
        context = list((state or {}).get("output_token_ids") or [])[-LOGPROB_CONTEXT:]
        earlier = self.sent.before(ready, state)
        derendered, resolved = await asyncio.gather(
            stream_derender(self.tier, self.leg, ready, state, earlier),
            self._resolve(entries, context) if entries and not self.opts.hide_metadata else _none())
        self.sent.record(ready, earlier)
        out = derendered["chunk"]
        for c in out.get("choices") or []:
            c["finish_reason"] = stream_finish_reason(c.get("finish_reason"), gen_choice.get("finish_reason"))
            if c.get("token_ids") is not None:
                c["token_ids"] = gen_choice.get("token_ids") or []
            # A render tier without parsers resolves them itself.
            logprobs = c["logprobs"] if c.get("logprobs") is not None else resolved
            if logprobs is not None:
                c["logprobs"] = self.opts.cut(logprobs)
            if self.opts.tokens_as_ids:
                c["logprobs"] = chat_tokens_as_ids(c.get("logprobs"), entries)
        if self.opts.return_token_ids and state is None and choices:
            out["prompt_token_ids"] = self.opts.prompt_token_ids  # coupled: with a choice's first chunk
        return out, derendered["stream_state"]

    async def _resolve(self, entries: list[Mapping[str, Any]], context: list[int]) -> dict[str, Any]:
        resp = await self.tier("derender", self.leg.path, self.leg.batch(logprob_body(entries, context)), "logprobs")
        return {"content": resp["choices"][0]["logprobs"]["content"][len(context):]}


class CompletionStream:
    """Completions: the text of a choice a stop string ended is cut (the choice was held whole)."""

    def __init__(self, leg: legs.DerenderLeg, opts: Options, tier: TierCall, client: shapes.Shape | None = None):
        self.leg, self.opts, self.tier = leg, opts, tier
        self.client = client  # a derender session may write the client's own chunks (``RequestPlan.session_chunks``)
        self.hold = opts.stops.hold
        self.call_bytes = leg.call_bytes
        self.sent = _Sent()

    async def __call__(self, chunk: Mapping[str, Any], state: Any) -> tuple[dict[str, Any], Any]:
        ready = generate_for_derender(completion_candidates(chunk, self.opts.completion_logprobs), self.opts.stops.include)
        earlier = self.sent.before(ready, state)
        data = await stream_derender(self.tier, self.leg, ready, state, earlier)
        self.sent.record(ready, earlier)
        out = data["chunk"]
        gen_choice = (chunk.get("choices") or [{}])[0]
        for c in out.get("choices") or []:
            c["token_ids"] = gen_choice.get("token_ids")
        if self.opts.stops.strings and state is None and cut_by_stop_string(gen_choice):
            (kept,) = await kept_texts([gen_choice], self.opts, self.tier)
            for c in out.get("choices") or []:
                c["text"] = kept
        return out, data["stream_state"]


async def _none() -> None:
    return None
