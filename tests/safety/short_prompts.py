"""The requests that used to kill engines (docs/protocol.md §5), and the checks that none did.

Completions with one prompt and with a list of three, and chat, at 1, 2, 15 and 17 tokens (chat:
that many tokens of message content; the template adds its own), each sent twice; completions also
at the ExampleConnector's boundaries on CPU engines (block size 128): 129 tokens (the longest
prompt decode prefills itself), 130 (the shortest sent to prefill) and 257 (``2 * 128 + 1``: vLLM's
connector matched fewer tokens than decode's own prefix cache holds once it is repeated).
"""

from __future__ import annotations

from dataclasses import dataclass

import requests

LENGTHS = (1, 2, 15, 17)
BOUNDARIES = (129, 130, 257)
GENERATE = "/inference/v1/generate"


@dataclass(frozen=True)
class Sent:
    what: str
    status: int
    prefill: str | None  # x-disagg-prefill
    prompt_tokens: int | None
    body: str

    @property
    def ok(self) -> bool:
        return self.status == 200


def _ids(n: int, offset: int = 0) -> list[int]:
    return [1000 + offset + i for i in range(n)]


def requests_to_send(model: str) -> list[tuple[str, str, dict]]:
    """(label, path, body) of every request, each once (callers send the list twice)."""
    out: list[tuple[str, str, dict]] = [("completions 'Hello'", "/v1/completions",
                                         {"model": model, "prompt": "Hello", "max_tokens": 4})]
    for n in LENGTHS:
        out.append((f"completions {n} tokens", "/v1/completions", {"model": model, "prompt": _ids(n), "max_tokens": 2}))
        out.append((f"completions 3 x {n} tokens", "/v1/completions",
                    {"model": model, "prompt": [_ids(n, k * 50) for k in range(3)], "max_tokens": 2}))
        out.append((f"chat {n} content tokens", "/v1/chat/completions",
                    {"model": model, "messages": [{"role": "user", "content": "Hi" + " a" * (n - 1)}], "max_tokens": 2}))
    for n in BOUNDARIES:
        out.append((f"completions {n} tokens", "/v1/completions", {"model": model, "prompt": _ids(n), "max_tokens": 2}))
    return out


def send_all(url: str, model: str) -> list[Sent]:
    sent = []
    for _ in range(2):
        for label, path, body in requests_to_send(model):
            resp = requests.post(url + path, json=body, timeout=120)
            usage = resp.json().get("usage") if resp.headers.get("content-type", "").startswith("application/json") else None
            sent.append(Sent(label, resp.status_code, resp.headers.get("x-disagg-prefill"),
                             (usage or {}).get("prompt_tokens"), resp.text[:300]))
    return sent


def engine_answers(url: str) -> bool:
    """The engine still serves a real request (not only /health)."""
    health = requests.get(url + "/health", timeout=10)
    answer = requests.post(url + GENERATE, json={"token_ids": _ids(4, 7), "sampling_params": {"max_tokens": 1}},
                           timeout=60)
    return health.status_code == 200 and answer.status_code == 200


def check(sent: list[Sent], min_prompt_tokens: int) -> None:
    """Every request answered 200, and single prompts took the route their length calls for."""
    failed = [s for s in sent if not s.ok]
    print(f"\n{len(sent) - len(failed)}/{len(sent)} short-prompt requests answered 200")
    assert not failed, failed
    for s in sent:
        if s.prompt_tokens is not None and "3 x" not in s.what:
            want = "skipped" if s.prompt_tokens < min_prompt_tokens else "remote"
            assert s.prefill == want, s
