"""The chained stream through a derender session (the engine side and its wire shape
are ``disagg_engine.sessions``).

A render endpoint that reports ``derender_sessions`` at ``GET /disagg/v1/capabilities`` keeps a
chat or completions stream's parser and detokenizer state for the stream's life: the sidecar
opens one session per streamed prompt on one endpoint (one HTTP exchange, so it stays pinned),
writes each generate chunk into its body as it arrives and relays the events it answers with
(chat: inline-derender events; completions: ``text_completion`` chunks). A chat stream's session
(a one-prompt completions stream's without echo) on a render that reports ``client_streams`` for
its API is asked for the client's own chunks (``client_stream`` in the open line, the plan's
``session_chunks``; completions: on a ``text`` leg, the engine's check): each event whose data starts
as the client's chunk (``shapes.Shape.client_prefix``) goes to the client as written, once checked
as any session event is (``answers``: JSON, its choices within ``n``; a choice's ``fed`` in the
event's ``fed:`` field, within the lines sent), and any other event is shaped as before, so a
render pod without it (a rollout) answers as it did. Per call nothing
is replayed, so no coalescing is needed to bound the cost. Each token is its own line, also when
the decode engine sent several in one chunk (``limits.session_stream_interval`` asks it to, to
spare its API process and the sidecar events) or several chunks queued behind a slow write (they
go out in one write): vLLM's streaming tool parsers answer several tokens in one delta
differently from the same tokens one by one, and coupled sends a delta per token.

Only a derender tier that may offer sessions is asked (the plan's ``sessions``: ``engine.derender_sessions``,
which the operator sets from the spec). If the session cannot be opened (no endpoint offers sessions, the
cap is reached) the stream takes today's stateless path (``stream.ChainedDerender``) from its
start. If it fails mid-stream, each unfinished choice continues statelessly on another endpoint:
one stateless call replays the lines the session had answered (``fed``; its output was delivered
already and is dropped) to get their ``stream_state``, then the rest follows as usual, so the
client's output stays exact. A choice whose role chunk was delivered does not get a second one
(a chunk with the role alone delivers no line's output, so its ``fed`` is not taken). A session
answer that fails its checks is a failed session (nothing of it reaches the client); one that
ended a choice's every line without its finish reason cannot be continued exactly: a 502.
(Not covered: a request with stop strings whose session dies after part of a choice was
delivered: the stateless path cuts a stop string only over a whole choice, ``chained``.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal

import aiohttp

from disagg_sidecar.derender import chained
from disagg_sidecar import sse
from disagg_sidecar.derender import stream
from disagg_sidecar import wire
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.plan import answers
from disagg_sidecar.upstream.client import Upstream

log = logging.getLogger(__name__)



class SessionFailed(Exception):
    """The session cannot go on (refused, an error event, cut short)."""


Api = Literal["chat", "completions"]
SessionStream = chained.ChatStream | chained.CompletionStream


def session_path(capabilities: Any, api: Api) -> str | None:
    """The session path for ``api`` a render endpoint's capabilities offer, if any."""
    if not isinstance(capabilities, dict):
        return None
    sessions = capabilities.get("derender_sessions")
    path = sessions.get(f"{api}_path") if isinstance(sessions, dict) else None
    return path if isinstance(path, str) and path.startswith("/") else None


def client_streams(capabilities: Any, api: Api) -> bool:
    """Whether a render endpoint's ``api`` sessions write the client's own chunks when asked."""
    sessions = capabilities.get("derender_sessions") if isinstance(capabilities, dict) else None
    offered = sessions.get("client_streams") if isinstance(sessions, dict) else None
    return isinstance(offered, list) and api in offered


def api_of(stream_call: SessionStream) -> Api:
    return "chat" if isinstance(stream_call, chained.ChatStream) else "completions"


def open_line(stream_call: SessionStream, request_id: str, client: Mapping[str, Any] | None = None) -> bytes:
    """The session's first line: the decode leg's request with the client's (parser context);
    ``client``: the chunks' header (``shapes.Shape.client_stream``), to write the client's own."""
    context = json.loads(stream_call.leg.context)
    opts = stream_call.opts
    body = {"request_id": request_id, "token_ids": opts.prompt_token_ids, "sampling_params": dict(opts.sampling),
            "stream": True, "stream_options": context.get("stream_options")}
    chat = api_of(stream_call) == "chat"
    if opts.tokens_as_ids and (chat or client is not None):  # taken out of the stateless calls' context
        context["return_tokens_as_token_ids"] = True  # (legs.parser_context): the session writes them as coupled
    if chat:
        body.update(output_mode="derender", chat_request=context)
    else:
        body["completion_request"] = context
        if client is not None:
            body["output_mode"] = "text"  # what a completions client_stream is read with (the engine's check)
    if client is not None:
        body[wire.CLIENT_STREAM] = dict(client)
    return sse.dumps(body) + b"\n"


def session_row(chunk: dict[str, Any]) -> list[Any]:
    """A one-choice generate chunk as the session's compact line (``disagg_engine.sessions``):
    ``[index, token_ids, finish_reason, stop_reason, logprobs]`` without trailing nulls."""
    [choice] = chunk["choices"]
    row = [choice.get("index", 0), choice.get("token_ids") or [], choice.get("finish_reason"),
           choice.get("stop_reason"), choice.get("logprobs")]
    while len(row) > 2 and row[-1] is None:
        row.pop()
    return row


_FED = wire.SESSION_FED.encode()


def event_fed(raw: bytes, event: dict[str, Any], client: bool) -> Any:
    """The ``fed`` of a session event: the ``fed:`` field of a client's chunk, else its ``fed`` key
    (taken out: the client does not get it)."""
    if not client:
        return event.pop("fed", None)
    value = sse.field(raw, _FED)
    return int(value) if value is not None and value.isdigit() else None


def role_only(choice: Mapping[str, Any]) -> bool:
    """A choice's first chunk with its role and nothing of a line's output (vLLM sends it before the
    first line's delta, with that line already read)."""
    delta = choice.get("delta")
    return isinstance(delta, dict) and "role" in delta and set(delta) <= {"role", "content"} and not delta.get("content") \
        and choice.get("finish_reason") is None and not choice.get("token_ids") and choice.get("logprobs") is None


def without_role(chunk: dict[str, Any], started: set[int]) -> dict[str, Any]:
    """A stateless chunk for choices whose role chunk the client already got: no second role."""
    for c in chunk.get("choices") or []:
        if c.get("index", 0) in started and isinstance(c.get("delta"), dict) and "role" in c["delta"]:
            c["delta"] = {k: v for k, v in c["delta"].items() if k != "role"}
    return chunk


async def endpoint_with_sessions(up: Upstream, api: Api) -> tuple[str, str] | None:
    """A derender endpoint that runs ``api`` sessions and its session path (``Upstream`` asks each
    endpoint once per TTL)."""
    tried: list[str] = []
    while (url := up.pools["derender"].pick(exclude=tried)) is not None:
        tried.append(url)
        if path := session_path(await up.endpoint_capabilities(url), api):
            return url, path
    return None


class SessionDerender:
    """``stream.ChainedDerender``'s interface (feed / finish / cancel) over one session."""

    def __init__(self, up: Upstream, stream_call: SessionStream, emit: stream.Emit, stateless: Stateless,
                 write: Write | None = None):
        self.up, self.stream_call, self._emit, self._stateless = up, stream_call, emit, stateless
        self._write = write  # the client's stream, for chunks that are the client's already
        shape = stream_call.client if write is not None else None
        api = api_of(stream_call)
        self._client = shape.client_stream(api) if shape is not None else None
        self._prefix = shape.client_prefix(api) if self._client is not None else None
        sampling_n = stream_call.opts.sampling.get("n")
        self._n = sampling_n if type(sampling_n) is int and sampling_n > 0 else 1
        self._usage_out = False  # the session's usage chunk went out (the stateless path sends none then)
        self.request_id = ""
        self._pending: list[stream.Chunk] = []
        self._wake = asyncio.Event()
        self._closed = False
        self._lines: dict[int, list[stream.Chunk]] = {}  # per choice: the lines sent, in order
        self._fed: dict[int, int] = {}  # per choice: lines whose output the client got
        self._started: set[int] = set()  # choices the client got a chunk of
        self._finished: set[int] = set()
        self._fallback: stream.ChainedDerender | None = None
        self._usage: stream.Chunk | None = None  # decode's usage chunk, for a stateless fallback
        self._task = asyncio.create_task(self._run())

    # -- the interface -------------------------------------------------------------------------

    def feed(self, chunk: stream.Chunk) -> None:
        if self._fallback is not None:
            self._fallback.feed(chunk)
            return
        self.request_id = self.request_id or str(chunk.get("request_id") or "")
        if stream.choice_index(chunk) is None:
            self._usage = chunk  # a session counts usage itself; the stateless path relays this one
            return
        self._pending.append(chunk)
        self._wake.set()

    async def finish(self) -> None:
        self._closed = True
        self._wake.set()
        await self._task
        if self._fallback is not None:
            await self._fallback.finish()

    async def cancel(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._fallback is not None:
            await self._fallback.cancel()

    # -- the session -----------------------------------------------------------------------------

    async def _run(self) -> None:
        picked = await endpoint_with_sessions(self.up, api_of(self.stream_call))
        if picked is None:
            return await self._resume()  # nothing delivered: the stateless path from the start
        url, path = picked
        client = self._client if client_streams(await self.up.endpoint_capabilities(url), api_of(self.stream_call)) \
            else None
        try:
            with self.up.pools["derender"].lease(url):
                await self._session(url + path, client)
        except (SessionFailed, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            self.up.pools["derender"].mark_failed(url)
            self.up.metrics.leg_errors.labels("derender", "session").inc()
            log.warning("derender session on %s failed, continuing statelessly: %s", url, exc)
            await self._resume()

    async def _session(self, url: str, client: Mapping[str, Any] | None) -> None:
        async with self.up.session_stream(url, self._body(client), {wire.REQUEST_ID: self.request_id}) as resp:
            if resp.status != 200:
                raise SessionFailed(f"status {resp.status}: {(await resp.read())[:300]!r}")
            await self._relay(resp.content, self._prefix if client is not None else None)

    async def _body(self, client: Mapping[str, Any] | None) -> AsyncIterator[bytes]:
        yield open_line(self.stream_call, self.request_id, client)
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            if batch:
                yield self._rows(batch)
            if self._closed and not self._pending:
                return

    def _rows(self, batch: list[stream.Chunk]) -> bytes:
        """One line per token (see the module docstring), written together. Recorded before they
        are written: a line not answered yet is resent if the session fails."""
        out = []
        for chunk in batch:
            for line in stream.per_token(chunk):
                self._lines.setdefault(stream.choice_index(line) or 0, []).append(line)
                out.append(sse.dumps(session_row(line)) + b"\n")
        return b"".join(out)

    async def _relay(self, content: aiohttp.StreamReader, prefix: bytes | None) -> None:
        """The session's events to the client: those starting with ``prefix`` (the client's chunk)
        as written, one write per read; the others shaped (``emit``). Each is checked first."""
        parser = sse.SSEParser()
        relayed: list[bytes] = []
        try:
            async for data in content.iter_any():
                for raw in parser.events(data):
                    payload = sse.payload(raw)
                    if payload is None:
                        continue
                    if payload.strip() == wire.SSE_DONE:
                        if unfinished := sorted(set(self._lines) - self._finished):
                            raise SessionFailed(f"the session's answer ended without finishing choice {unfinished[0]}")
                        return
                    client = prefix is not None and payload.startswith(prefix)
                    event = self._checked(raw, payload, client)
                    if client:
                        relayed.append(sse.sse(payload))
                        continue
                    await self._flush(relayed)
                    await self._emit(event)
                await self._flush(relayed)
        finally:
            await self._flush(relayed)  # checked and counted as delivered before a later event failed
        raise SessionFailed("the session's answer ended without [DONE]")

    async def _flush(self, relayed: list[bytes]) -> None:
        if relayed and self._write is not None:
            out = b"".join(relayed)
            relayed.clear()
            await self._write(out)

    def _checked(self, raw: bytes, payload: bytes, client: bool) -> dict[str, Any]:
        """A session event, checked and recorded (``fed``, choices started and finished)."""
        try:
            event = answers.parse(payload)
            if isinstance(event, dict) and "error" in event:
                raise SessionFailed(f"session error event: {str(event['error'])[:300]}")
            fed = event_fed(raw, event, client) if isinstance(event, dict) else None
            answers.generated(event, self._n, "a derender session event")
        except answers.InvalidAnswer as exc:
            raise SessionFailed(f"invalid session event ({exc})") from None
        choices = event.get("choices") or []
        for c in choices:
            index = c.get("index", 0)
            if fed is None and client:
                raise SessionFailed("a session's client chunk without its fed count")
            if isinstance(fed, int) and not role_only(c):
                if not self._fed.get(index, 0) <= fed <= len(self._lines.get(index, ())):
                    raise SessionFailed(f"a session event's fed count {fed} is not within the lines sent")
                self._fed[index] = fed
        for c in choices:
            index = c.get("index", 0)
            self._started.add(index)
            if c.get("finish_reason") is not None:
                self._finished.add(index)
        if not choices and event.get("usage") is not None:
            self._usage_out = True
        return event

    # -- continuing without it -------------------------------------------------------------------

    async def _resume(self) -> None:
        """Each unfinished choice statelessly from the last line the client got the output of."""
        started = set(self._started)
        if self._closed:  # the decode stream is over: each unfinished choice needs a line to finish on
            waiting = {stream.choice_index(c) for c in self._pending}
            if stuck := sorted(i for i, lines in self._lines.items() if i not in self._finished and i not in waiting
                               and self._fed.get(i, 0) >= len(lines)):
                raise SidecarError(502, "The derender tier answered with an invalid answer (a derender session "
                                        f"answered every line of choice {stuck[0]} without finishing it)",
                                   type_="BadGatewayError", done=False)

        async def emit(chunk: stream.Chunk) -> None:
            await self._emit(without_role(chunk, started))

        chain = self._stateless(emit)
        backlog: list[stream.Chunk] = []
        for index, lines in sorted(self._lines.items()):
            if index in self._finished:
                continue
            fed = self._fed.get(index, 0)
            if fed:  # its output was delivered: only the state is kept
                _, state = await self.stream_call(stream.merge_chunks(lines[:fed]), None)
                chain.resume(index, state)
            backlog.extend(lines[fed:])
        # Chunks that arrived meanwhile are in `_pending` until the chain takes over.
        backlog.extend(c for c in self._pending if stream.choice_index(c) not in self._finished)
        self._pending = []
        self._fallback = chain
        for chunk in backlog:
            chain.feed(chunk)
        if self._usage is not None and not self._usage_out:
            chain.feed(self._usage)  # it came before the fallback took over; it still comes last


Stateless = Callable[[stream.Emit], stream.ChainedDerender]
Write = Callable[[bytes], Awaitable[None]]


def derender_chain(up: Upstream, stream_call: chained.StreamCall, emit: stream.Emit, sessions: bool,
                   stateless: Stateless, write: Write | None = None) -> Any:
    """The chained stream's derender: a session where the plan says the derender tier may offer
    them (``RequestPlan.sessions``), else the stateless one. ``write``: the client's stream, for
    the chunks a session writes as the client's own (``ChatStream.client``)."""
    if isinstance(stream_call, (chained.ChatStream, chained.CompletionStream)) and sessions:
        return SessionDerender(up, stream_call, emit, stateless, write)
    return stateless(emit)
