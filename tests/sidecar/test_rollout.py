"""A model rolling from vLLM 0.33 to 0.34 under a continuous request stream: 0 failed requests, and
every answer equal to the coupled server's of the release whose decode pod answered.

The local harness stands in for the cluster (docs/development.md, "The rolling upgrade"): the 0.33
and 0.34 lanes' servers are the pods of both releases; ``disagg sidecar`` processes are the decode
pods' sidecars, three deployments of each release (decode with the engine extension: inline
derender; decode configured tokens-only: the stateless chained path through the derender tier; a
stock decode engine: derender sessions on the render tier on 0.33, stock inline derender on 0.34);
``tests.harness.services`` stands in for the Services: the render/derender ClusterIP that
kube-proxy balances per connection (pods of both releases behind it mid-rollout), the prefill
endpoints of each KV revision (a 0.34 decode never prefills with a 0.33 prefill pod:
tests/operator/test_pairing.py), and the client Service, which says which decode pod answered.

The rollout, step by step, each step taken once the stream has been served through the previous:
a 0.34 render pod joins the render Service; 0.34 decode pods (and their prefill) take traffic; the
0.33 prefill pod leaves (its decode pods prefill locally: ``x-disagg-prefill: fallback``); the
0.33 render pod leaves (its connections cut); the 0.33 decode pods' sidecars get SIGTERM and drain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from disagg_sidecar import wire
from tests.harness.forced import MULTIBYTE, Forcer
from tests.harness.openai_views import chat_full_view, chat_stream_full_view, completion_stream_full_view, sse_events
from tests.harness.request_stream import PREFILL_HEADER, RequestStream
from tests.harness.services import BACKEND_HEADER, ClusterIP, Gateway
from tests.sidecar.conftest import TOKENS_ONLY
from tests.sidecar.support import (
    CLIENT_MAX_LOGPROBS,
    SERVED,
    SidecarProcess,
    sidecar_config,
    sidecar_process,
    wait_for,
)

pytestmark = [pytest.mark.engine, pytest.mark.parity, pytest.mark.reliability]

OLD, NEW = "0.33", "0.34"
# inline: decode with the engine extension; chained: decode configured tokens-only, the stateless
# chained path; stock: a stock decode image (derender sessions on 0.33, stock inline on 0.34).
PATHS = ("inline", "chained", "stock")
# Long enough for a remote prefill leg (shorter prompts skip it: ExampleConnector's block).
PADDING = " and more words" * 60
PER_STEP = 6  # answers served through each step before the next
STEP_SECONDS = 300


def _chat(forcer: Forcer, name: str, stream: bool) -> dict[str, Any]:
    body = forcer.chat_body(name, stream=stream)
    body["messages"][0]["content"] += PADDING
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _completion(forcer: Forcer) -> dict[str, Any]:
    # A plain stream: its derender calls carry the decode window (derender.window), with logprobs.
    return {"model": SERVED, "prompt": "Complete this:" + PADDING, "max_tokens": 200, "logprobs": 1, "stream": True,
            "stream_options": {"include_usage": True}, "vllm_xargs": forcer.xargs(MULTIBYTE)}


# name -> (path, body, view)
Case = tuple[str, Callable[[Forcer], dict[str, Any]], Callable[[Any], Any]]
CASES: dict[str, Case] = {
    "reasoning_batch": (wire.CHAT, lambda f: _chat(f, "reasoning", False), chat_full_view),
    "reasoning_tool_call_stream": (wire.CHAT, lambda f: _chat(f, "reasoning_tool_call", True), chat_stream_full_view),
    "two_tool_calls_batch": (wire.CHAT, lambda f: _chat(f, "two_tool_calls", False), chat_full_view),
    "plain_stream": (wire.CHAT, lambda f: _chat(f, "plain", True), chat_stream_full_view),
    "completion_multibyte_stream": (wire.COMPLETIONS, _completion, completion_stream_full_view),
}


def _post(url: str, path: str, body: dict[str, Any], request_id: str) -> tuple[requests.Response, Any]:
    resp = requests.post(url + path, json=body, headers={"X-Request-Id": request_id}, stream=bool(body.get("stream")),
                         timeout=120)
    if resp.status_code != 200:
        return resp, resp.text[:300]
    return resp, list(sse_events(resp.iter_lines())) if body.get("stream") else resp.json()


@dataclass(frozen=True)
class Served:
    sent: float
    release: str
    path: str
    case: str
    prefill: str | None


@dataclass
class Rollout:
    """Both deployments' client Services, and what each answer was (the stream counts failures)."""

    forcer: Forcer
    gateways: dict[str, Gateway]
    wanted: dict[tuple[str, str], Any]  # (release, case) -> coupled's view
    served: list[Served]

    def request(self, worker: int, n: int) -> tuple[str | None, str | None]:
        name = list(CASES)[(n + worker) % len(CASES)]
        deployment = PATHS[(n // len(CASES) + worker) % len(PATHS)]
        path, make, view = CASES[name]
        resp, answer = _post(self.gateways[deployment].url, path, make(self.forcer), f"rollout-{worker}-{n}")
        if resp.status_code != 200:
            return None, f"{deployment} {name}: {resp.status_code} {answer}"
        release = resp.headers[BACKEND_HEADER].split("/")[0]
        self.served.append(Served(time.monotonic(), release, deployment, name, resp.headers.get(PREFILL_HEADER)))
        got, want = view(answer), self.wanted[(release, name)]
        return resp.headers.get(PREFILL_HEADER), None if got == want else f"{deployment} {release} {name}: {got} != {want}"

    def count(self, since: float, release: str | None = None, prefill: str | None = None) -> int:
        return sum(1 for s in list(self.served) if s.sent >= since and release in (None, s.release)
                   and prefill in (None, s.prefill))


def _through(stream: RequestStream, rollout: Rollout, step: str, release: str | None = None,
             prefill: str | None = None) -> None:
    """Wait until the stream was served ``PER_STEP`` times since now (by ``release``, with ``prefill``)."""
    since = time.monotonic()
    assert wait_for(lambda: rollout.count(since, release, prefill) >= PER_STEP or bool(stream.failed()),
                    STEP_SECONDS, interval=0.2), f"{step}: {stream.summary()}"
    assert not stream.failed(), f"{step}: {stream.summary()}"


@pytest.fixture(scope="module")
def forcer(engine_set_033) -> Forcer:
    forcer = Forcer(engine_set_033.model_dir)
    forcer.tokenizer  # noqa: B018 - loaded before the stream's threads need it
    return forcer


def _sidecar(stack: ExitStack, sset, tmp_path: Path, name: str, render: str, prefill: str,
             path: str) -> SidecarProcess:
    config = sidecar_config(sset, render={"url": render}, prefill={"discovery": {"kind": "static", "urls": [prefill]}},
                            limits={"deregister_seconds": 2, "drain_seconds": 60})
    if path == "chained":
        config["decode"] = {**config["decode"], "capabilities": TOKENS_ONLY}
    if path == "stock":  # the coupled server is a stock decode engine (no KV connector: it prefills itself)
        config.update(decode={"url": sset.url("coupled")}, prefill={"mode": "local"},
                      engine={**config["engine"], "extension": False, "derender_sessions": True,
                              "max_logprobs": CLIENT_MAX_LOGPROBS})
    (tmp_path / name).mkdir()
    return stack.enter_context(sidecar_process(config, tmp_path / name))


def _metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_rolling_upgrade_from_033_to_034_fails_no_request_and_answers_as_coupled(
        engine_set_033, engine_set_034, forcer: Forcer, tmp_path: Path) -> None:
    sets = {OLD: engine_set_033, NEW: engine_set_034}
    wanted = {}
    for release, sset in sets.items():
        for name, (path, make, view) in CASES.items():
            resp, answer = _post(sset.url("coupled"), path, make(forcer), f"rollout-{name}")
            assert resp.status_code == 200, answer
            wanted[(release, name)] = view(answer)

    with ExitStack() as stack:
        render = ClusterIP([sets[OLD].url("render")])
        stack.callback(render.close)
        prefills = {release: ClusterIP([sset.url("prefill")]) for release, sset in sets.items()}
        for p in prefills.values():
            stack.callback(p.close)

        def deploy(release: str) -> dict[str, SidecarProcess]:
            return {path: _sidecar(stack, sets[release], tmp_path, f"{release}-{path}", render.url, prefills[release].url,
                                   path) for path in PATHS}
        sidecars = {OLD: deploy(OLD)}
        gateways = {path: Gateway({f"{OLD}/{path}": sidecars[OLD][path].url}) for path in PATHS}
        for g in gateways.values():
            stack.callback(g.close)
        rollout = Rollout(forcer, gateways, wanted, [])
        stream = RequestStream("unused", forcer, workers=3, request=rollout.request)
        started = time.monotonic()
        with stream:
            _through(stream, rollout, "0.33 only", OLD, "remote")

            render.add(sets[NEW].url("render"))
            _through(stream, rollout, "a 0.34 render pod joined", OLD)

            sidecars[NEW] = deploy(NEW)
            for path, g in gateways.items():
                g.set({f"{release}/{path}": sidecars[release][path].url for release in (OLD, NEW)})
            _through(stream, rollout, "0.34 decode pods take traffic", NEW, "remote")

            prefills[OLD].remove(sets[OLD].url("prefill"))
            _through(stream, rollout, "the 0.33 prefill pod left", OLD, "fallback")

            render.remove(sets[OLD].url("render"))
            _through(stream, rollout, "the 0.33 render pod left")

            for sidecar in sidecars[OLD].values():
                sidecar.proc.terminate()  # the pod is deleted: SIGTERM, and its endpoint goes
            for path, g in gateways.items():
                g.set({f"{NEW}/{path}": sidecars[NEW][path].url})
            assert wait_for(lambda: all(s.proc.poll() is not None for s in sidecars[OLD].values()), 90, interval=0.2)
            assert [s.proc.returncode for s in sidecars[OLD].values()] == [0] * len(PATHS)
            _through(stream, rollout, "0.33 decode pods drained", NEW)
        took = time.monotonic() - started
        replays = sum(_metric(s.url, 'disagg_sidecar_derender_calls_total{kind="replay"}')
                      for s in sidecars[NEW].values())

    assert not stream.failed(), stream.summary()
    served = rollout.served
    kinds = {(s.release, s.path, s.case) for s in served}
    assert {(r, p) for r, p, _ in kinds} == {(r, p) for r in (OLD, NEW) for p in PATHS}, kinds
    assert {c for _, _, c in kinds} == set(CASES)
    print(f"rollout: {len(served)} answers in {took:.0f}s, 0 failed; by release {dict(_by(served, 'release'))}; "
          f"prefill outcomes {dict(_by(served, 'prefill'))}; render connections {render.connections}; "
          f"window replays on the 0.34 sidecars {replays:.0f}")


def _by(served: list[Served], attr: str) -> Iterator[tuple[Any, int]]:
    values = [getattr(s, attr) for s in served]
    return ((v, values.count(v)) for v in sorted(set(values), key=str))
