"""Derender sessions on the render tier: one stream's parser state on one render
process for the stream's life, fed the decode engine's token chunks as they arrive.

Wire shape: ``POST /disagg/v1/derender/sessions/chat`` (or ``.../completions``) with a streamed
body of JSON lines (``application/x-ndjson``), answered while it is still being sent (one HTTP
exchange pins the session to the process that accepted it; nothing is keyed or looked up):

- line 1, the open: the decode leg's ``GenerateRequest`` for the stream (``token_ids``,
  ``sampling_params``, ``stream_options``) with ``chat_request``: the client's chat request, the
  body an inline ``output_mode="derender"`` decode leg gets (completions: ``completion_request``,
  the client's completions request for this one prompt; its text is not read). Refused with an
  OpenAI-style error (400 malformed, 503 over the per-process cap) before the answer starts;
- every further line: one choice's tokens from the decode engine's ``/inference/v1/generate``
  stream in ``tokens`` mode, as they arrived, either as that stream's chunk (one choice, or usage
  only) or as a row ``[index, token_ids, finish_reason, stop_reason, logprobs]`` with trailing
  nulls left out (the sidecar's form: a token costs a few bytes, not the chunk's ~250); several
  chunks merged into one line are fine (``streaming.merge_chunks`` on the sidecar);
- end of the body: the stream is over.

The answer is ``text/event-stream``: exactly the events the inline derender (``serving.py``)
sends for those tokens (completions: the ``text_completion`` chunks a coupled server sends), each
with ``fed``: how many lines of its choice the session had consumed when it was made (a client
that loses the session resumes the stateless way from there), then ``[DONE]``. With the open
line's ``client_stream`` (its ``api`` the session's; the render reports ``client_streams``), each
event's data is the client's own chunk, written as ``serving.py`` writes it for the decode leg's
``client_stream`` (chat: ``shapes.client_stream_event``; completions: vLLM's generator under the
client's header, as ``_client_completions``), and ``fed`` is an SSE field of its own before the data
(``fed: 3``), so a proxy relays the data as it is; without it, ``fed`` is the event's first key. The events come
from vLLM's own code: the engine's output processor (incremental detokenizer with the request's
stop strings, logprob tokens, n > 1 fan-out) turns the chunks into ``RequestOutput``s, and
``OpenAIServingChat.chat_completion_stream_generator`` (``OpenAIServingCompletion.
completion_stream_generator``) turns those into deltas, as in the coupled server.

A session ends with its body, when the client disconnects, after ``DISAGG_SESSION_IDLE_SECONDS``
without a line (an error event), and at most ``DISAGG_MAX_SESSIONS`` run per process. Memory per
session, measured as a render process's RSS with sessions open: ~40 KiB (200 sessions) plus
~60 bytes per generated token (100 sessions of 1,000 tokens): the parser, detokenizer and
generator per choice, and each choice's output token ids and text.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncIterator
from copy import copy
from typing import Any, Literal

from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from disagg_engine.protocol import DisaggGenerateRequest
from disagg_engine.shapes import client_stream_event, derender_stream_event, with_cached_tokens
from disagg_engine.vllm_compat import (
    CompletionRequest,
    EngineCoreOutput,
    FinishReason,
    LogprobsLists,
    OpenAIServingChat,
    OpenAIServingCompletion,
    OutputProcessor,
    ParentRequest,
    RequestOutputCollector,
    RequestOutputKind,
    RequestResponseMetadata,
    chat_with_history,
    effective_chat_template_kwargs,
    engine_request,
)
from disagg_sidecar.wire import SESSION_FED

CHAT_SESSION_PATH = "/disagg/v1/derender/sessions/chat"
COMPLETIONS_SESSION_PATH = "/disagg/v1/derender/sessions/completions"
SessionApi = Literal["chat", "completions"]
MAX_LINE_BYTES = 32 * 1024 * 1024  # the open line carries the client's whole chat request
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
_INDEX = re.compile(r',"choices":\[\{"index":(\d+)')


ROW_FIELDS = ("index", "token_ids", "finish_reason", "stop_reason", "logprobs")


def line_chunk(line: Any) -> dict[str, Any]:
    """A session line (a generate chunk, or a row of ``ROW_FIELDS``) as a generate chunk."""
    if isinstance(line, dict):
        return line
    if isinstance(line, list) and 2 <= len(line) <= len(ROW_FIELDS) and type(line[0]) is int \
            and isinstance(line[1], list):
        return {"choices": [dict(zip(ROW_FIELDS, line))]}
    raise ValueError(f"a session line is a generate chunk or a row {list(ROW_FIELDS)}, not {str(line)[:100]}")


class SessionRequest(DisaggGenerateRequest):
    """The open line: the decode leg's request with the client's chat or completions request."""

    completion_request: CompletionRequest | None = None


class SessionError(Exception):
    """A session that cannot start: the status and message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# -- pure pieces -----------------------------------------------------------------------------

def split_lines(buffer: bytes, data: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines in ``buffer + data`` and the incomplete rest."""
    *lines, rest = (buffer + data).split(b"\n")
    return [line for line in lines if line.strip()], rest


def logprob_row(entry: dict[str, Any]) -> tuple[list[int], list[float], int]:
    """A generate logprob entry as the engine's row for its position: the sampled token, then the
    candidates by rank 1, 2, ... (the generate server lists the engine's per-position dict, which
    keeps the sampled token first and a candidate of the same id only once)."""
    by_rank = {c["rank"]: c for c in entry.get("top_logprobs") or [] if isinstance(c.get("rank"), int)}
    ids, logprobs = [entry["token_id"]], [entry["logprob"]]
    rank = 1
    while rank in by_rank:
        ids.append(by_rank[rank]["token_id"])
        logprobs.append(by_rank[rank]["logprob"])
        rank += 1
    return ids, logprobs, entry.get("rank") or 0


def engine_outputs(request_id: str, choice: dict[str, Any]) -> list[EngineCoreOutput]:
    """One generate chunk's choice as the engine-core outputs that made it (one per token when
    it carries logprobs, whose rows may differ in width).

    A stop *string* end is not passed on: the session's detokenizer finds it in the text, as the
    decode engine's did, and reports it (``Session.feed`` makes sure it does)."""
    import numpy as np

    ids = list(choice.get("token_ids") or [])
    finish = _FINISH.get(choice.get("finish_reason") or "")
    stop_reason = choice.get("stop_reason")
    if isinstance(stop_reason, str):
        finish, stop_reason = None, None
    entries = ((choice.get("logprobs") or {}).get("content")) or []
    if not entries:
        return [EngineCoreOutput(request_id=request_id, new_token_ids=ids, finish_reason=finish,
                                 stop_reason=stop_reason)]
    outs = []
    for i, (token, entry) in enumerate(zip(ids, entries)):
        row_ids, row_lps, rank = logprob_row(entry)
        lists = LogprobsLists(np.array([row_ids]), np.array([row_lps], dtype=np.float32), np.array([rank]))
        last = i == len(ids) - 1
        outs.append(EngineCoreOutput(request_id=request_id, new_token_ids=[token], new_logprobs=lists,
                                     finish_reason=finish if last else None, stop_reason=stop_reason if last else None))
    return outs


def tagged(payload: str, fed: list[int]) -> str:
    """An inline-derender event (its JSON) with ``fed``: the lines its choice had consumed."""
    if (match := _INDEX.search(payload, 0, 400)) is None:
        return f"data: {payload}\n\n"  # usage or error
    index = int(match.group(1))
    return 'data: {"fed":%d,%s\n\n' % (fed[index] if index < len(fed) else 0, payload[1:])


def fed_event(payload: str, fed: list[int]) -> str:
    """A client's chunk (its JSON) as a session event: ``fed`` of its choice in a field of its own, the
    data unchanged. The first ``,"choices":[{"index":`` is the chunk's own (no JSON string holds its
    unescaped quotes), however long the id and model before it."""
    if (match := _INDEX.search(payload)) is None:
        return f"data: {payload}\n\n"  # usage or error
    index = int(match.group(1))
    return f"{SESSION_FED}: {fed[index] if index < len(fed) else 0}\ndata: {payload}\n\n"


# -- one session -----------------------------------------------------------------------------

class Session:
    """The decode engine's request replayed through vLLM's output processor, one chunk at a time."""

    def __init__(self, request: DisaggGenerateRequest, tokenizer: Any, prompt: str | None = None):
        params = request.sampling_params.clone()
        params.output_kind = RequestOutputKind.DELTA
        params.detokenize = True
        self.request_id = request.request_id
        self.processor = OutputProcessor(tokenizer, log_stats=False)
        self.queue = RequestOutputCollector(RequestOutputKind.DELTA, self.request_id)
        parent = engine_request(self.request_id, list(request.token_ids), params)
        self.fed = [0] * params.n
        if params.n == 1:
            self.ids = [self.request_id]
            self.processor.add_request(parent, prompt, None, 0, self.queue)
            return
        fan_out = ParentRequest(parent)  # as AsyncLLM.add_request fans out n > 1
        self.ids = []
        for index in range(params.n):
            child_id, child_params = fan_out.get_child_info(index)
            child = copy(parent)
            child.request_id, child.sampling_params = child_id, child_params
            self.ids.append(child_id)
            self.processor.add_request(child, prompt, fan_out, index, self.queue)

    def feed(self, chunk: dict[str, Any]) -> Any:
        """Process one generate chunk; the ``RequestOutput`` it makes (None if nothing)."""
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            if not 0 <= index < len(self.ids):
                raise ValueError(f"choice index {index} out of range for n={len(self.ids)}")
            self.processor.process_outputs(engine_outputs(self.ids[index], choice))
            if choice.get("finish_reason") and self.ids[index] in self.processor.request_states:
                # The decode engine ended it (a stop string this detokenizer did not see cut): end it too.
                end = EngineCoreOutput(request_id=self.ids[index], new_token_ids=[],
                                       finish_reason=_FINISH.get(choice["finish_reason"], FinishReason.STOP),
                                       stop_reason=choice.get("stop_reason"))
                self.processor.process_outputs([end])
            self.fed[index] += 1
        return self.queue.get_nowait()

    async def outputs(self, lines: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for line in lines:
            out = self.feed(line_chunk(json.loads(line)))
            if out is not None:
                yield out


# -- the process's sessions ------------------------------------------------------------------

class Sessions:
    """The sessions of one render process."""

    def __init__(self, chat: OpenAIServingChat, completion: OpenAIServingCompletion, max_sessions: int | None = None,
                 idle_seconds: float | None = None):
        self.chat, self.completion = chat, completion
        self.tokenizer = chat.renderer.tokenizer
        self.max_sessions = max_sessions or int(os.environ.get("DISAGG_MAX_SESSIONS", "1024"))
        self.idle_seconds = idle_seconds or float(os.environ.get("DISAGG_SESSION_IDLE_SECONDS", "60"))
        self.live = 0

    def capability(self) -> dict[str, Any]:
        return {"chat_path": CHAT_SESSION_PATH, "completions_path": COMPLETIONS_SESSION_PATH,
                "max_sessions": self.max_sessions, "idle_timeout_seconds": self.idle_seconds,
                "client_streams": ["chat", "completions"]}  # the APIs whose sessions write the client's chunks (``fed_event``)

    async def open(self, body: AsyncIterator[bytes], api: SessionApi) -> tuple[SessionRequest, AsyncIterator[bytes]]:
        """Read and check the open line; the request and the rest of the lines."""
        lines = self._lines(body)
        try:
            first = await anext(lines)
        except StopAsyncIteration:
            raise SessionError(400, "empty session body: the first line must be the stream's request") from None
        try:
            request = SessionRequest.model_validate_json(first)
        except ValidationError as exc:
            raise SessionError(400, f"invalid session request: {exc.errors(include_url=False)}") from exc
        if api == "chat" and request.chat_request is None:
            raise SessionError(400, "a chat derender session needs chat_request (the client's chat request)")
        if api == "completions" and (request.completion_request is None or request.chat_request is not None):
            raise SessionError(400, "a completions derender session needs completion_request (the client's "
                                    "completions request) and no chat_request")
        if request.client_stream is not None and request.client_stream.api != api:
            raise SessionError(400, f"a {api} derender session writes {api} chunks, not "
                                    f"client_stream api={request.client_stream.api!r}")
        if self.live >= self.max_sessions:
            raise SessionError(503, f"this render process runs its maximum of {self.max_sessions} derender "
                                    "sessions; use the stateless derender endpoint")
        return request, lines

    async def stream(self, request: SessionRequest, lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
        self.live += 1
        try:
            if request.completion_request is not None:
                async for event in self._completions(request, lines):
                    yield event
                return
            session = Session(request, self.tokenizer)
            ctx = request.model_copy(update={"output_mode": "derender", "stream": True}).chat_context()
            chat = chat_with_history(self.chat, request.history_tool_calls())
            events = chat.chat_completion_stream_generator(
                ctx, session.outputs(lines), request.request_id, "", [], self.tokenizer,
                RequestResponseMetadata(request_id=request.request_id),
                chat_template_kwargs=effective_chat_template_kwargs(self.chat, ctx))
            client = request.client_stream
            async for event in events:
                if not event.startswith("data: {"):
                    yield event
                elif client is not None:  # the client's own chunk, as the inline derender writes it
                    yield fed_event(client_stream_event(event[6:].strip(), client.id, client.created, client.model,
                                                        client.cached_tokens), session.fed)
                else:
                    yield tagged(derender_stream_event(event[6:].strip(), request.request_id), session.fed)
        finally:
            self.live -= 1

    async def _completions(self, request: SessionRequest, lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
        """A completions session's events: vLLM's completions stream generator fed the session's
        outputs for the one prompt; with ``client_stream`` under the client's header (the client's own
        ``text_completion`` chunks, as ``serving.py`` writes them for a decode leg's), else tagged."""
        assert request.completion_request is not None
        session = Session(request, self.tokenizer, prompt="")  # the text is not read (no echo)
        client = request.client_stream
        head = (client.id, client.created, client.model) if client is not None else \
            (request.request_id, int(time.time()), "")
        events = self.completion.completion_stream_generator(
            request.completion_request, [], _first_prompt(session.outputs(lines)), *head, 1, self.tokenizer,
            RequestResponseMetadata(request_id=request.request_id))
        async for event in events:
            if not event.startswith("data: {"):
                yield event
            elif client is None:
                yield tagged(event[6:].strip(), session.fed)
            else:
                payload = event[6:].strip()
                if client.cached_tokens is not None:
                    payload = with_cached_tokens(payload, client.cached_tokens)
                yield fed_event(payload, session.fed)

    async def _lines(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        buffer = b""
        chunks = aiter(body)
        while True:
            try:
                async with asyncio.timeout(self.idle_seconds):  # per line: no task, unlike wait_for
                    data = await anext(chunks)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise TimeoutError(f"derender session idle for {self.idle_seconds:g}s") from None
            except ClientDisconnect:
                return
            lines, buffer = split_lines(buffer, data)
            if len(buffer) > MAX_LINE_BYTES:
                raise ValueError(f"a session line is longer than {MAX_LINE_BYTES} bytes")
            for line in lines:
                yield line
        if buffer.strip():
            yield buffer


async def _first_prompt(outputs: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    """A session's outputs as the completions generator takes them: (prompt index, output)."""
    async for out in outputs:
        yield 0, out
