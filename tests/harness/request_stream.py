"""A bounded background stream of forced chats through a deployment's endpoint, to count failed
requests while pods are replaced underneath it.

Each worker (one by default) sends one request at a time (batch and streamed in turn) with the
openai SDK and no retries: a request counts as failed unless it answers 200 with exactly the
forced text and ``finish_reason: stop`` (with ``max_tokens``: its first tokens and ``length``).
Every answer records when it was sent, the ``X-Request-Id`` it carried (unique: the sidecar's
access line names it) and the sidecar's ``x-disagg-prefill`` outcome (remote, fallback, ...). A test
with other requests and checks passes ``request`` (worker, number -> prefill outcome, error or None;
raising counts as failed).
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai import OpenAI

from tests.harness.forced import OUTPUTS, Forcer

PREFILL_HEADER = "x-disagg-prefill"


@dataclass(frozen=True)
class Answer:
    sent: float  # time.monotonic()
    prefill: str | None  # the sidecar's prefill outcome header
    error: str | None = None
    request_id: str | None = None  # the X-Request-Id it was sent with (None: a test's own ``request``)


@dataclass
class RequestStream:
    url: str  # the deployment's OpenAI base, http://host:port
    forcer: Forcer
    workers: int = 1  # one request always in flight; more would only slow the engines starting beside it
    # Repeats of " and more words" in each prompt: 60 make it longer than a KV block (128 tokens on CPU),
    # so that the sidecar sends it to prefill; 0 leaves it short: decode prefills it itself ("skipped").
    prompt_words: int = 60
    max_tokens: int | None = None  # None: the whole forced answer; n: its first n tokens (finish "length")
    max_requests: int = 5000
    max_seconds: float = 1200.0
    request: Callable[[int, int], tuple[str | None, str | None]] | None = None
    answers: list[Answer] = field(default_factory=list)
    _run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> RequestStream:
        deadline = time.monotonic() + self.max_seconds
        for worker in range(self.workers):
            thread = threading.Thread(target=self._run, args=(worker, deadline), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)
        assert not any(t.is_alive() for t in self._threads), "a request of the stream never ended"

    # -- what it saw -------------------------------------------------------------------------------

    def snapshot(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)

    def failed(self) -> list[Answer]:
        return [a for a in self.snapshot() if a.error is not None]

    def served(self, since: float = 0.0, prefill: str | None = None) -> int:
        """Answers (not failures) to requests sent at or after ``since``, with that prefill outcome if given."""
        return sum(1 for a in self.snapshot()
                   if a.error is None and a.sent >= since and (prefill is None or a.prefill == prefill))

    def outcomes(self) -> Counter[str | None]:
        return Counter(a.prefill for a in self.snapshot() if a.error is None)

    def summary(self) -> str:
        answers = self.snapshot()
        failed = [a.error for a in answers if a.error is not None]
        return (f"{len(failed)} failed / {len(answers)} requests; prefill outcomes {dict(self.outcomes())}"
                + (f"; first failures: {failed[:5]}" if failed else ""))

    # -- the workers ---------------------------------------------------------------------------

    def _run(self, worker: int, deadline: float) -> None:
        client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        want, finish_want = OUTPUTS["plain"][0], "stop"
        if self.max_tokens is not None:
            want = self.forcer.tokenizer.decode(self.forcer.ids(want, eos=False)[:self.max_tokens])
            finish_want = "length"
        n = 0
        while not self._stop.is_set() and time.monotonic() < deadline and len(self.answers) < self.max_requests:
            n += 1
            sent = time.monotonic()
            request_id = None if self.request is not None else f"stream-{self._run_id}-{worker}-{n}"
            try:
                if self.request is not None:
                    prefill, error = self.request(worker, n)
                else:
                    prefill, text, finish = self._one(client, worker, n, request_id, stream=n % 2 == 0)
                    error = None if (text, finish) == (want, finish_want) else f"answer {text!r} finish {finish!r}"
            except Exception as exc:  # noqa: BLE001 - every failure is what the stream counts
                prefill, error = None, f"{type(exc).__name__}: {exc}"[:300]
            with self._lock:
                self.answers.append(Answer(sent, prefill, error, request_id))

    def _one(self, client: OpenAI, worker: int, n: int, request_id: str | None,
             stream: bool) -> tuple[str | None, str, str | None]:
        body = self.forcer.chat_body("plain")
        body["messages"][0]["content"] += f" Request {worker}.{n}:" + " and more words" * self.prompt_words
        kwargs: dict[str, Any] = {
            "model": body["model"], "messages": body["messages"], "max_tokens": self.max_tokens or body["max_tokens"],
            "extra_body": {"vllm_xargs": body["vllm_xargs"], "chat_template_kwargs": body["chat_template_kwargs"]},
            "extra_headers": {"X-Request-Id": request_id} if request_id else None}
        if not stream:
            raw = client.chat.completions.with_raw_response.create(**kwargs)
            choice = raw.parse().choices[0]
            return raw.headers.get(PREFILL_HEADER), choice.message.content or "", choice.finish_reason
        raw = client.chat.completions.with_raw_response.create(**kwargs, stream=True)
        text, finish = [], None
        for chunk in raw.parse():
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return raw.headers.get(PREFILL_HEADER), "".join(text), finish
