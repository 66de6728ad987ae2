"""A render outage against real vLLM servers (``render.failure_policy``): the only render replica
is SIGKILLed while streams run and a stream of requests keeps coming. Under ``decode`` no request
fails and every answer equals the coupled server's; under ``fail`` the 503s say why. The victim is
this module's own ``launch render`` server (``outage_render``), started in the background while
other tests run; the shared set's servers are never killed.
"""

from __future__ import annotations

import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from disagg_engine.servers import ManagedServer, pid_alive, signal_group, start_all, stop_all
from disagg_engine.testing.server_set import role_specs
from disagg_engine.testing.tiny_model import ensure_model
from tests.harness.engine import early_fixture
from tests.harness.openai_views import chat_stream_view, chat_view, completion_view, sse_events
from tests.sidecar.conftest import TOKENS_ONLY
from tests.sidecar.support import SERVED, chat, long_body, run_sidecar, sidecar_config, wait_for
from tests.sidecar.test_messages_parity import message_view, messages_body, stream_view
from tests.sidecar.test_messages_parity import post as post_messages

pytestmark = [pytest.mark.engine, pytest.mark.reliability]


@dataclass
class OutageRender:
    server: ManagedServer

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        stop_all([self.server])


def start_outage_render() -> OutageRender:
    kv = Path(tempfile.mkdtemp(prefix="disagg-kv-"))
    [spec] = role_specs(("render",), ensure_model(), kv, name_prefix="outage-")
    [server] = start_all([spec], Path(tempfile.mkdtemp(prefix="disagg-outage-logs-")), timeout=900)
    return OutageRender(server)


# Started in the background while the control-plane tests run (tests/harness/engine.py).
outage_render = early_fixture("outage_render", start_outage_render)


class Traffic:
    """Requests one after another on a thread until stopped, each answer kept with its view."""

    def __init__(self, url: str, body: dict, stream: bool) -> None:
        self.url, self.body, self.stream = url, body, stream
        self.results: list[tuple[int, str | None, dict | str]] = []  # status, x-disagg-render, view or text
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            resp = chat(self.url, self.body, stream=self.stream)
            if resp.status_code != 200:
                view: dict | str = resp.text
            elif self.stream:
                view = chat_stream_view(list(sse_events(resp.iter_lines())))
            else:
                view = chat_view(resp.json())
            self.results.append((resp.status_code, resp.headers.get("x-disagg-render"), view))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(180)
        assert not self.thread.is_alive(), "a request hung"


def test_killing_the_only_render_replica(engine_set, forcer, outage_render: OutageRender) -> None:
    coupled = engine_set.url("coupled")
    batch = forcer.chat_body("reasoning_tool_call")
    streamed = forcer.chat_body("reasoning_tool_call", stream=True)
    long = long_body(forcer, 120)
    want = chat_view(chat(coupled, batch).json())
    want_stream = chat_stream_view(list(sse_events(chat(coupled, streamed, stream=True).iter_lines())))
    want_long = chat_stream_view(list(sse_events(chat(coupled, long, stream=True).iter_lines())))
    # No coalescing: one event per token, so a stream is surely still running after its 5th.
    limits = {"health_interval_seconds": 0.2, "coalesce": False}
    render = {"url": outage_render.url, "failure_policy": "decode"}
    degrade = sidecar_config(engine_set, render=render, limits=limits)
    chained = sidecar_config(engine_set, render=render, limits=limits, decode={"capabilities": TOKENS_ONLY})
    fail = sidecar_config(engine_set, render={"url": outage_render.url}, limits=limits)
    with run_sidecar(degrade) as a, run_sidecar(chained) as c, run_sidecar(fail) as b:
        for sidecar in (a, b, c):  # through the tiers while render is up
            resp = chat(sidecar.url, batch)
            assert resp.status_code == 200 and "x-disagg-render" not in resp.headers, resp.text
            assert chat_view(resp.json()) == want
        running = {s.url: chat(s.url, long, stream=True) for s in (a, c)}
        lines = {url: resp.iter_lines() for url, resp in running.items()}
        seen: dict[str, list] = {url: [] for url in running}
        for url, it in lines.items():
            for event in sse_events(it):
                seen[url].append(event)
                if len(seen[url]) == 5:
                    break
        traffic = [Traffic(a.url, batch, stream=False), Traffic(a.url, streamed, stream=True)]
        assert wait_for(lambda: all(len(t.results) >= 2 for t in traffic), timeout=120)
        before = sum(len(t.results) for t in traffic)

        signal_group(outage_render.server.pid, signal.SIGKILL)
        assert wait_for(lambda: not pid_alive(outage_render.server.pid), timeout=30)

        # The streams already running: decode with the extension needs no render tier any more, so
        # the answer is whole; the chained one needs the derender tier (the render pool): its answer
        # is whole or ends with an error event in OpenAI's shape, never a hang or a short [DONE].
        rest = {url: list(sse_events(it)) for url, it in lines.items()}
        assert chat_stream_view(seen[a.url] + rest[a.url]) == want_long
        events = seen[c.url] + rest[c.url]
        assert events[-1] == "[DONE]", events[-3:]
        if "error" in events[-2]:
            assert events[-2]["error"]["message"].startswith("The derender tier is unavailable"), events[-2]
        else:
            assert chat_stream_view(events) == want_long

        # New requests keep coming: each is answered by the decode engine itself, as coupled answers it.
        assert wait_for(lambda: sum(len(t.results) for t in traffic) >= before + 6, timeout=180)
        for t in traffic:
            t.stop()
        results = [r for t in traffic for r in t.results]
        assert all(status == 200 for status, _, _ in results), [r for r in results if r[0] != 200][:3]
        assert [v for t in traffic if not t.stream for _, _, v in t.results] == \
            [want] * len(traffic[0].results)
        assert [v for t in traffic if t.stream for _, _, v in t.results] == \
            [want_stream] * len(traffic[1].results)
        assert all(t.results[-1][1] == "decode" for t in traffic), "the last ones answered by decode itself"
        assert a.metric("disagg_sidecar_decode_answered_total", reason="tier down") \
            + a.metric("disagg_sidecar_decode_answered_total", reason="leg failed") >= 4

        # The other APIs, batch and streamed, as coupled answers them.
        for body in (messages_body(forcer, "reasoning_tool_call", False), messages_body(forcer, "reasoning_tool_call", True)):
            mine, theirs = post_messages(a.url, body, "outage"), post_messages(coupled, body, "outage")
            if body["stream"]:
                assert stream_view(mine) == stream_view(theirs)
            else:
                assert message_view(mine) == message_view(theirs)
        completion = {"model": SERVED, "prompt": ["one", "two"], "max_tokens": 8, "temperature": 0}
        got = requests.post(a.url + "/v1/completions", json=completion, timeout=120)
        assert got.status_code == 200 and got.headers["x-disagg-render"] == "decode", got.text
        assert completion_view(got.json()) == completion_view(
            requests.post(coupled + "/v1/completions", json=completion, timeout=120).json())

        # Ready, the render tier reported as degraded; the chained sidecar too, answering itself.
        health = requests.get(a.url + "/health", timeout=5)
        assert health.status_code == 200 and "render unreachable" in health.json().get("degraded", []), health.text
        resp = chat(c.url, batch)
        assert resp.status_code == 200 and resp.headers["x-disagg-render"] == "decode"
        assert chat_view(resp.json()) == want

        # fail: an OpenAI-shaped 503 that says why, and not ready.
        resp = chat(b.url, batch)
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1", resp.text
        assert resp.json()["error"]["message"] == "The render tier is unavailable (connect)"
        assert wait_for(lambda: "render unreachable" in requests.get(b.url + "/health", timeout=5).json()
                        .get("reasons", []), timeout=10)
