"""The chained streaming derender with chunk coalescing, and merging generate chunks.

Chained streaming: every generate chunk goes to the derender tier with the ``stream_state`` the
previous call returned for the same choice index; the usage chunk too; ``[DONE]`` never. The
derender tier replays a choice's whole output on every call, so its cost grows with calls² ×
tokens. Coalescing bounds the number of calls by the tier's speed instead of the token count:
each choice index has one lane that sends the first chunk at once and, while that call is in flight, collects what arrives and sends it as
one merged chunk next. Merging is exact: the state records merged chunks as one. With ``hold``
(a request with stop strings, whose cut can reach back into text already decoded) a lane sends
its choice once it finished, as one chunk (``chained``).

This module does no I/O itself: the derender call and the client write are passed in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from disagg_sidecar.sse import Chunk


# -- merging generate chunks -----------------------------------------------------------------

def choice_index(chunk: Chunk) -> int | None:
    """The index of a chunk's one choice; None for a usage-only chunk (``choices: []``)."""
    choices = chunk.get("choices") or []
    return choices[0].get("index", 0) if choices else None


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """One generate chunk equal to ``chunks`` (same choice index) sent in a row.

    Token ids and logprob entries are concatenated; finish_reason, stop_reason, usage and the
    rest come from the last chunk; prompt_token_ids from the first that has them.
    """
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    choices = [c["choices"][0] for c in chunks]
    choice = dict(choices[-1])
    choice["token_ids"] = [t for c in choices for t in (c.get("token_ids") or [])]
    entries = [c["logprobs"] for c in choices if c.get("logprobs")]
    if entries:
        choice["logprobs"] = {**entries[-1], "content": [e for lp in entries for e in (lp.get("content") or [])]}
    merged = {**last, "choices": [choice]}
    prompt_ids = next((c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids") is not None), None)
    if prompt_ids is not None:
        merged["prompt_token_ids"] = prompt_ids
    return merged


def per_token(chunk: Chunk) -> list[Chunk]:
    """A one-choice generate chunk as one chunk per token (``merge_chunks`` undone): the end and
    its reasons go with the last token, each logprob entry with its token."""
    [choice] = chunk["choices"]
    ids = choice.get("token_ids") or []
    entries = (choice.get("logprobs") or {}).get("content") or []
    if len(ids) < 2 or (entries and len(entries) != len(ids)):
        return [chunk]
    pieces = []
    for i, token in enumerate(ids):
        end = {k: choice.get(k) for k in ("finish_reason", "stop_reason")} if i == len(ids) - 1 else {}
        piece = {**choice, "token_ids": [token], "finish_reason": None, "stop_reason": None, **end}
        if entries:
            piece["logprobs"] = {**choice["logprobs"], "content": [entries[i]]}
        pieces.append({**chunk, "choices": [piece]})
    return pieces


# -- the chained streaming derender ----------------------------------------------------------

DerenderCall = Callable[[Chunk, Any], Awaitable[tuple[Chunk, Any]]]
Emit = Callable[[Chunk], Awaitable[None]]


class _Lane:
    def __init__(self) -> None:
        self.pending: list[Chunk] = []
        self.wake = asyncio.Event()
        self.closed = False
        self.state: Any = None
        self.task: asyncio.Task | None = None


class ChainedDerender:
    """Feeds generate chunks through ``call`` (one derender call) and hands results to ``emit``.

    ``feed`` never waits for the derender tier, so the decode stream keeps being read while
    calls are in flight; that is what gives the lanes something to coalesce.
    """

    def __init__(self, call: DerenderCall, emit: Emit, *, coalesce: bool = True, hold: bool = False,
                 min_tokens: int = 1, on_call: Callable[[int], None] = lambda merged: None):
        self._call = call
        self._emit = emit
        self._coalesce = coalesce
        self._hold = hold  # send a choice only once it finished, as one merged chunk (stop strings)
        # Tokens a call waits for (a choice's end, or the stream's, sends what there is): bounds what
        # the calls of a stream carry (``decisions.tokens_per_derender_call``).
        self._min_tokens = min_tokens
        self._on_call = on_call  # called with the number of generate chunks in each call
        self._lanes: dict[int, _Lane] = {}
        self._tail: list[Chunk] = []  # usage-only chunks: sent after every lane is done
        self._error: BaseException | None = None

    def feed(self, chunk: Chunk) -> None:
        self._raise_if_failed()
        index = choice_index(chunk)
        if index is None:
            self._tail.append(chunk)
            return
        lane = self._lanes.get(index)
        if lane is None:
            lane = self._lanes[index] = _Lane()
            lane.task = asyncio.create_task(self._run(lane))
        lane.pending.append(chunk)
        lane.wake.set()

    def resume(self, index: int, state: Any) -> None:
        """Continue choice ``index`` from ``state`` (the ``stream_state`` of what came before)."""
        lane = self._lanes[index] = _Lane()
        lane.state = state
        lane.task = asyncio.create_task(self._run(lane))

    async def finish(self) -> None:
        """Wait for every lane, then derender the usage chunk(s); raises a lane's failure."""
        for lane in self._lanes.values():
            lane.closed = True
            lane.wake.set()
        await self._join()
        for chunk in self._tail:
            out, _ = await self._call(chunk, None)
            self._on_call(1)
            await self._emit(out)

    async def cancel(self) -> None:
        for lane in self._lanes.values():
            if lane.task:
                lane.task.cancel()
        await asyncio.gather(*(lane.task for lane in self._lanes.values() if lane.task), return_exceptions=True)

    async def _join(self) -> None:
        tasks = [lane.task for lane in self._lanes.values() if lane.task]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            await self.cancel()
            raise

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    async def _run(self, lane: _Lane) -> None:
        try:
            while True:
                await lane.wake.wait()
                lane.wake.clear()
                while lane.pending:
                    waits = self._hold or _tokens(lane.pending) < self._min_tokens
                    if waits and not lane.closed and not any(_finished(c) for c in lane.pending):
                        break
                    if self._hold or self._coalesce or self._min_tokens > 1:
                        batch, lane.pending = lane.pending, []
                    else:
                        batch = [lane.pending.pop(0)]
                    out, lane.state = await self._call(merge_chunks(batch), lane.state)
                    self._on_call(len(batch))
                    await self._emit(out)
                if lane.closed:
                    return
        except BaseException as exc:
            self._error = exc
            raise


def _tokens(chunks: list[Chunk]) -> int:
    return sum(len(c.get("token_ids") or ()) for chunk in chunks for c in chunk.get("choices") or ())


def _finished(chunk: Chunk) -> bool:
    return any(c.get("finish_reason") is not None for c in chunk.get("choices") or [])
