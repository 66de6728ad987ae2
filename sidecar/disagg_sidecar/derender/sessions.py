"""The chained stream through a derender session (the engine side and its wire shape
are ``disagg_engine.sessions``).

A render endpoint that reports ``derender_sessions`` at ``GET /disagg/v1/capabilities`` keeps a
chat or completions stream's parser and detokenizer state for the stream's life: the sidecar
opens one session per streamed prompt on one endpoint (one HTTP exchange, so it stays pinned),
writes each generate chunk into its body as it arrives and relays the events it answers with
(chat: inline-derender events; completions: ``text_completion`` chunks). Per call nothing
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
client's output stays exact. A choice whose role chunk was delivered does not get a second one.
(Not covered: a request with stop strings whose session dies after part of a choice was
delivered: the stateless path cuts a stop string only over a whole choice, ``chained``.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import aiohttp

from disagg_sidecar.derender import chained
from disagg_sidecar import sse
from disagg_sidecar.derender import stream
from disagg_sidecar import wire
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


def api_of(stream_call: SessionStream) -> Api:
    return "chat" if isinstance(stream_call, chained.ChatStream) else "completions"


def open_line(stream_call: SessionStream, request_id: str) -> bytes:
    """The session's first line: the decode leg's request with the client's (parser context)."""
    context = json.loads(stream_call.leg.context)
    opts = stream_call.opts
    body = {"request_id": request_id, "token_ids": opts.prompt_token_ids, "sampling_params": dict(opts.sampling),
            "stream": True, "stream_options": context.get("stream_options")}
    if api_of(stream_call) == "chat":
        if opts.tokens_as_ids:  # taken out of the stateless calls' context (legs.parser_context)
            context["return_tokens_as_token_ids"] = True
        body.update(output_mode="derender", chat_request=context)
    else:
        body["completion_request"] = context
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

    def __init__(self, up: Upstream, stream_call: SessionStream, emit: stream.Emit, stateless: Stateless):
        self.up, self.stream_call, self._emit, self._stateless = up, stream_call, emit, stateless
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
        try:
            with self.up.pools["derender"].lease(url):
                await self._session(url + path)
        except (SessionFailed, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            self.up.pools["derender"].mark_failed(url)
            self.up.metrics.leg_errors.labels("derender", "session").inc()
            log.warning("derender session on %s failed, continuing statelessly: %s", url, exc)
            await self._resume()

    async def _session(self, url: str) -> None:
        async with self.up.session_stream(url, self._body(), {wire.REQUEST_ID: self.request_id}) as resp:
            if resp.status != 200:
                raise SessionFailed(f"status {resp.status}: {(await resp.read())[:300]!r}")
            await self._relay(resp.content)

    async def _body(self) -> AsyncIterator[bytes]:
        yield open_line(self.stream_call, self.request_id)
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

    async def _relay(self, content: aiohttp.StreamReader) -> None:
        parser = sse.SSEParser()
        async for data in content.iter_any():
            for payload in parser.feed(data):
                if payload.strip() == wire.SSE_DONE:
                    return
                event = json.loads(payload)
                if "error" in event:
                    raise SessionFailed(f"session error event: {str(event['error'])[:300]}")
                fed = event.pop("fed", None)
                for c in event.get("choices") or []:
                    index = c.get("index", 0)
                    self._started.add(index)
                    if isinstance(fed, int):
                        self._fed[index] = fed
                    if c.get("finish_reason") is not None:
                        self._finished.add(index)
                await self._emit(event)
        raise SessionFailed("the session's answer ended without [DONE]")

    # -- continuing without it -------------------------------------------------------------------

    async def _resume(self) -> None:
        """Each unfinished choice statelessly from the last line the client got the output of."""
        started = set(self._started)

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
        if self._usage is not None:
            chain.feed(self._usage)  # it came before the fallback took over; it still comes last


Stateless = Callable[[stream.Emit], stream.ChainedDerender]


def derender_chain(up: Upstream, stream_call: chained.StreamCall, emit: stream.Emit, sessions: bool,
                   stateless: Stateless) -> Any:
    """The chained stream's derender: a session where the plan says the derender tier may offer
    them (``RequestPlan.sessions``), else the stateless one."""
    if isinstance(stream_call, (chained.ChatStream, chained.CompletionStream)) and sessions:
        return SessionDerender(up, stream_call, emit, stateless)
    return stateless(emit)
