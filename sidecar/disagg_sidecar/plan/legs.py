"""Per-leg rewrites of a ``GenerateRequest`` (pure functions over wire dicts).

The prefill leg only has to fill the KV cache: one token, no streaming, tokens mode, no parser
context, nothing a tokenizer-free pool would reject. The decode leg is the client's request
with the prefill's ``kv_transfer_params`` and the output mode the sidecar chose for it.
Client-supplied ``kv_transfer_params`` never reach an engine: they name hosts the engine would
connect to (an SSRF vector), so only the connector decides them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from disagg_sidecar import wire
from disagg_sidecar.connectors import KVConnector
from disagg_sidecar.plan import stops
from disagg_sidecar.plan.decisions import answered_mode
from disagg_sidecar.sse import dumps

# Fields a prefill leg must not carry: it returns one token nobody reads.
_PREFILL_DROP = (wire.CHAT_REQUEST, wire.PARSE_CONTEXT, "stream_options", "return_token_ids")
_PREFILL_SAMPLING_DROP = ("min_tokens", "logprobs", "prompt_logprobs")
# Need a tokenizer, which a --tokens-only pool lacks (400 or a failed grammar); the one token a
# prefill leg samples is thrown away, so dropping them changes nothing the client sees.
_TOKENS_ONLY_SAMPLING_DROP = (stops.STOP, "bad_words", "structured_outputs")
# The output mode whose stream writes each API's client chunks (``client_stream.api``).
_CLIENT_STREAM_MODE: dict[str, wire.OutputMode] = {"chat": "derender", "completions": "text"}


def _sampling_without_client_kv(sampling: Mapping[str, Any] | None) -> dict[str, Any]:
    sp = dict(sampling or {})
    extra = sp.get(wire.EXTRA_ARGS)
    if isinstance(extra, Mapping) and wire.KV_TRANSFER_PARAMS in extra:
        extra = {k: v for k, v in extra.items() if k != wire.KV_TRANSFER_PARAMS}
        if extra:
            sp[wire.EXTRA_ARGS] = extra
        else:
            sp.pop(wire.EXTRA_ARGS)
    return sp


def prefill_leg(gen: Mapping[str, Any], connector: KVConnector, *, tokens_only: bool = True) -> dict[str, Any]:
    """The prefill leg's body: ``max_tokens`` 1, ``n`` 1, tokens mode, no stream, connector KV params."""
    body = {k: v for k, v in gen.items() if k not in _PREFILL_DROP}
    sp = _sampling_without_client_kv(gen.get(wire.SAMPLING_PARAMS))
    for key in _PREFILL_SAMPLING_DROP:
        sp.pop(key, None)
    if tokens_only:
        for key in _TOKENS_ONLY_SAMPLING_DROP:
            sp.pop(key, None)
    sp["max_tokens"] = 1
    sp["n"] = 1
    body[wire.SAMPLING_PARAMS] = sp
    body["stream"] = False
    body[wire.OUTPUT_MODE] = "tokens"
    body[wire.KV_TRANSFER_PARAMS] = connector.prefill_params()
    return body


def prompt_logprobs_leg(gen: Mapping[str, Any]) -> dict[str, Any]:
    """A batch leg to the decode engine for a streamed request's prompt logprobs (a generate stream
    carries none; completions ``echo`` with ``logprobs`` shows them): one token, detokenized, so each
    entry has the engine's ``decoded_token``; no KV params (vLLM reads none for prompt logprobs)."""
    body = {k: v for k, v in gen.items() if k not in _PREFILL_DROP}
    sp = _sampling_without_client_kv(gen.get(wire.SAMPLING_PARAMS))
    for key in ("min_tokens", "logprobs", "stop", "bad_words", "structured_outputs"):
        sp.pop(key, None)
    sp.update(max_tokens=1, n=1, detokenize=True)
    body.update({wire.SAMPLING_PARAMS: sp, "stream": False, wire.OUTPUT_MODE: "tokens", wire.KV_TRANSFER_PARAMS: None})
    return body


def decode_leg(
    gen: Mapping[str, Any],
    kv_transfer_params: Mapping[str, Any] | None,
    *,
    output_mode: wire.OutputMode = "tokens",
    context: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The decode leg's body: the client's request + the prefill's KV params + the chosen mode.

    ``context`` is the parser context for ``output_mode="derender"``: ``{"chat_request": ...}``
    or ``{"parse_context": ...}``; it is dropped for the other modes.
    """
    body = {k: v for k, v in gen.items() if k not in (wire.CHAT_REQUEST, wire.PARSE_CONTEXT)}
    body[wire.SAMPLING_PARAMS] = _sampling_without_client_kv(gen.get(wire.SAMPLING_PARAMS))
    body[wire.KV_TRANSFER_PARAMS] = dict(kv_transfer_params) if kv_transfer_params else None
    body[wire.OUTPUT_MODE] = output_mode
    if output_mode == "derender" and context:
        body.update(context)
    return body


def client_decode_leg(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A ``GenerateRequest`` client's decode leg: its own output mode, and the parser context it
    sent kept for the engine to use (``derender``) or reject, as it would be sent directly."""
    context = {k: body[k] for k in (wire.CHAT_REQUEST, wire.PARSE_CONTEXT) if body.get(k) is not None}
    leg = decode_leg(body, kv_transfer_params, output_mode=answered_mode(body), context=context)
    leg.update(context)
    return leg


def decode_body(gen: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None, mode: wire.OutputMode,
                context: wire.ContextForm | None, chat_raw: bytes | None, stream_interval: int = 1,
                client: Mapping[str, Any] | None = None) -> bytes:
    """The decode leg of an OpenAI request, serialised; with ``derender``, the parser context is
    the client's request (spliced in as its own bytes) or render's ``parse_context``. A ``tokens``
    leg is detokenized only where its stop strings need it (``stops.Stops.detokenize``): the derender
    tier makes the text, and the decode engine's detokenizer would only cost its API process CPU per token.
    A streamed ``tokens`` leg sends at least ``stream_interval`` tokens per chunk (vLLM's
    ``SamplingParams.stream_interval``; the first token and the end at once). ``client``: a
    streamed ``derender``'s (``text``'s) chunks are to be the client's chat (completions) chunks
    (``client_stream``: the engine writes the client's header, the relay forwards the bytes)."""
    slim = {wire.PARSE_CONTEXT: gen.get(wire.PARSE_CONTEXT)} if context == "parse_context" else None
    leg = decode_leg(gen, kv_transfer_params, output_mode=mode, context=slim)
    sampling = leg[wire.SAMPLING_PARAMS]
    if mode == "tokens" and not stops.Stops.of(sampling).detokenize and sampling.get("prompt_logprobs") is None:
        sampling["detokenize"] = False  # prompt logprobs need it too: their decoded_token is the detokenizer's
    if mode == "tokens" and leg.get("stream") and stream_interval > 1:
        asked = sampling.get("stream_interval")
        sampling["stream_interval"] = max(asked if type(asked) is int else 1, stream_interval)
    if client is not None and leg.get("stream") and mode == _CLIENT_STREAM_MODE.get(client.get("api", "chat")):
        leg[wire.CLIENT_STREAM] = dict(client)
    body = dumps(leg)
    if mode == "derender" and context == "chat_request" and chat_raw is not None:
        body = with_raw_field(body, wire.CHAT_REQUEST, chat_raw)
    return body


def client_context(raw: bytes, body: Mapping[str, Any]) -> bytes:
    """The client's request as the decode leg's ``chat_request``, without the ``kv_transfer_params``
    a client may put into it (top level or ``vllm_xargs``): only the connector decides those. The
    bytes as they came when there are none (the usual case: no re-serialising)."""
    clean = _without_client_kv(body)
    return raw if clean is body else dumps(clean)


def with_kv_transfer_params(raw: bytes, body: Mapping[str, Any], kv: Mapping[str, Any] | None) -> bytes:
    """A client's request (``raw``, parsed: ``body``) for a decode engine that answers it on its own
    API route after a prefill leg (the Responses API): the client's ``kv_transfer_params`` out, the
    prefill's in."""
    if not kv:
        return client_context(raw, body)
    return dumps({**_without_client_kv(body), wire.KV_TRANSFER_PARAMS: dict(kv)})


def _without_client_kv(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """``body`` itself when it has no ``kv_transfer_params`` (top level or ``vllm_xargs``), else a copy without."""
    xargs = body.get("vllm_xargs")
    nested = isinstance(xargs, Mapping) and wire.KV_TRANSFER_PARAMS in xargs
    if wire.KV_TRANSFER_PARAMS not in body and not nested:
        return body
    clean = {k: v for k, v in body.items() if k != wire.KV_TRANSFER_PARAMS}
    if nested:
        clean["vllm_xargs"] = {k: v for k, v in xargs.items() if k != wire.KV_TRANSFER_PARAMS}
    return clean


def with_raw_field(body: bytes, key: str, raw: bytes) -> bytes:
    """``body`` (a serialised JSON object) with ``key: raw`` added, without re-serialising ``raw``."""
    assert body.endswith(b"}")
    return body[:-1] + b',"' + key.encode() + b'":' + raw + b"}"


# SamplingParams' own default, which render's serialisation leaves out when the client asked for it.
SAMPLING_DEFAULT_MAX_TOKENS = 16


def rendered(gen: Mapping[str, Any]) -> dict[str, Any]:
    """Render's answer with ``max_tokens`` explicit: render always sets it (from the client or the
    model's length) but omits a value equal to the default, and a generate server that is not
    given one uses the whole context instead."""
    sp = gen.get(wire.SAMPLING_PARAMS)
    if not isinstance(sp, Mapping) or "max_tokens" in sp:
        return dict(gen)
    return {**gen, wire.SAMPLING_PARAMS: {**sp, "max_tokens": SAMPLING_DEFAULT_MAX_TOKENS}}


def engine_request_id(request_id: str) -> str:
    """The id a generate server gives a request sent with ``X-Request-Id: request_id`` (for aborts)."""
    return wire.GENERATE_ID_PREFIX + request_id


_MESSAGE_SKELETON = ("role", "name", "tool_calls", "tool_call_id")


def parser_context(client_body: bytes, chain: str) -> bytes:
    """The client's request as derender's parser context, without what derender never reads, so
    a long prompt does not travel with each of a stream's derender calls:

    - ``stop``: the decode engine applies the stop strings and the sidecar cuts the text where
      they matched (``chained``); vLLM 0.33's streaming derender rejects a request that has them;
    - the conversation's text: the parser reads tools, tool choice, reasoning and template
      settings, and of the messages only their roles and earlier tool calls (for tool-call ids),
      so each message keeps those with empty content (all of it with ``continue_final_message``,
      where the answer repeats the last message);
    - a completions prompt, and ``echo``: the sidecar echoes the prompt itself (``derender.echo``);
    - ``return_tokens_as_token_ids``: the sidecar writes a chat answer's ``token_id:N`` tokens itself
      from the tokens the tier resolved as text (``fixes.chat_tokens_as_ids``: a sampled token keeps
      its text's bytes, as coupled writes it); vLLM 0.34's derender would write the placeholders with
      ``bytes: null``. A derender session puts it back (``sessions.open_line``): its chat generator
      writes them as coupled does.
    """
    body = json.loads(client_body)
    if not isinstance(body, dict):
        return client_body
    stops.without_stop_strings(body)
    body.pop("echo", None)
    body.pop("return_tokens_as_token_ids", None)
    keep_text = body.get("continue_final_message")
    if chain == "chat" and isinstance(body.get("messages"), list) and not keep_text:
        body["messages"] = [{**{k: m[k] for k in _MESSAGE_SKELETON if k in m}, "content": ""}
                            if isinstance(m, dict) else m for m in body["messages"]]
    elif chain == "completions" and not keep_text and "prompt" in body:
        body["prompt"] = "-"
    return dumps(body)


class DerenderLeg:
    """Derender-tier bodies for one request, built by splicing bytes.

    The parser context (the client's request without its text: ``parser_context``) and the prompt ids go into every
    streaming call; they are serialised once here, and the generate answers and chunks are
    spliced in as the bytes they arrived as where possible.
    """

    def __init__(self, chain: str, client_body: bytes, prompt_token_ids: list[int], model: str | None = None,
                 context: bytes | None = None):
        """``context``: the request's ``parser_context``, when made once for its prompts already."""
        self.chain = chain
        self.path = wire.CHAT_DERENDER if chain == "chat" else wire.COMPLETIONS_DERENDER
        self.context = parser_context(client_body, chain) if context is None else context
        n = len(prompt_token_ids)
        ids = dumps(prompt_token_ids)
        self._model = b'"model":' + dumps(model) + b"," if model else b""
        # The parts around the (shared) context, joined per call: a request's prompts hold one copy
        # of the context between them, not one per prompt and kind of call.
        context_key = b',"chat_request":' if chain == "chat" else b',"completion_request":'
        if chain == "chat":
            self._batch_ids = self._stream_ids = b',"prompt_tokens":%d,"prompt_token_ids":%s' % (n, ids)
        else:
            self._batch_ids = b'],"prompt_tokens":[%d],"prompt_token_ids":[%s]' % (n, ids)
            self._stream_ids = b',"prompt_tokens":%d,"prompt_token_ids":%s' % (n, ids)
        self._context_key = context_key

    @property
    def call_bytes(self) -> int:
        """What every streaming call carries whatever its chunk: the parser context and the prompt's ids."""
        return len(self.context) + len(self._stream_ids)

    def batch(self, generate_response: bytes) -> bytes:
        key = b'"generate_response":' if self.chain == "chat" else b'"generate_responses":['
        return b"".join((b"{", self._model, key, generate_response, self._batch_ids, self._context_key,
                         self.context, b"}"))

    def stream(self, generate_chunk: Mapping[str, Any], stream_state: Any) -> bytes:
        return b"".join((b'{"stream":true,', self._model, b'"generate_chunk":', dumps(generate_chunk),
                         b',"stream_state":', dumps(stream_state), self._stream_ids, self._context_key,
                         self.context, b"}"))
