"""Local mode end to end: ``disagg up examples/local-tiny.yaml`` driven with the official openai SDK.

The deployment is the one ``make demo --keep`` left running (``local_tiny``, tests/harness/engine.py):
the demo brings it up with ``disagg up --detach``, these tests use it and take it down."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import requests
import yaml
from openai import OpenAI

from disagg_engine.servers import pid_alive, port_in_use
from tests.harness.engine import DISAGG
from tests.harness.openai_views import chat_stream_view, chat_view, sse_events

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local-tiny.yaml"


def _disagg(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*DISAGG, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)


@pytest.fixture(scope="module")
def client(local_tiny) -> OpenAI:
    return OpenAI(base_url=local_tiny.endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_status_lists_every_pool_healthy(local_tiny):
    out = _disagg("status", "--json", "--state-dir", str(local_tiny.state))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["endpoint"] == local_tiny.endpoint
    assert set(report["pools"]) == {"prefill", "decode", "render", "sidecar"}
    for members in report["pools"].values():
        for m in members:
            assert m["healthy"] and m["pid"] > 0 and m["url"].startswith("http://127.0.0.1:")


def test_chat_non_stream_and_stream(client):
    resp = client.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=8, temperature=0)
    assert resp.object == "chat.completion" and resp.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_completions(client):
    resp = client.completions.create(model="tiny-qwen3", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert resp.object == "text_completion" and resp.usage.completion_tokens == 6
    assert isinstance(resp.choices[0].text, str)


@pytest.mark.parity
@pytest.mark.parametrize("stream", [False, True])
def test_forced_reasoning_tool_call_equals_the_coupled_reference(engine_set, forcer, client, stream):
    body = forcer.chat_body("reasoning_tool_call", stream=stream)
    coupled = requests.post(engine_set.url("coupled") + "/v1/chat/completions", json=body, timeout=120, stream=stream)
    extra = {"vllm_xargs": body.pop("vllm_xargs")}
    kwargs = {k: v for k, v in body.items() if k not in ("model", "messages")}
    got = client.chat.completions.create(model="tiny-qwen3", messages=body["messages"], extra_body=extra, **kwargs)
    if stream:
        want = chat_stream_view(sse_events(coupled.iter_lines()))
        got_view = chat_stream_view([c.model_dump() for c in got] + ["[DONE]"])
    else:
        want = chat_view(coupled.json())
        got_view = chat_view(got.model_dump())
    assert got_view == want
    assert want["choices"][0]["tool_calls"] == [("get_weather", {"city": "東京"})]


@pytest.mark.cluster
def test_invalid_spec_is_rejected_with_the_crd_admission_message(cluster, tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["source"] = "/models/tiny"
    doc["spec"]["pools"]["decode"]["replicas"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    local = _disagg("up", str(bad), "--state-dir", str(tmp_path / "state"))
    assert local.returncode == 2
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/disaggregatedmodels.disagg.dev")
    admission = cluster.kubectl("apply", "--dry-run=server", "-n", "default", "-f", str(bad), check=False)
    assert admission.returncode != 0
    message = "pools.decode.replicas must be at least 1: decode serves every request"
    assert message in admission.stderr
    assert message in local.stderr


def test_down_leaves_no_process_and_no_port(local_tiny, demo_run):
    report = json.loads(_disagg("status", "--json", "--state-dir", str(local_tiny.state)).stdout)
    members = [m for ms in report["pools"].values() for m in ms]
    down = _disagg("down", "--state-dir", str(local_tiny.state))
    assert down.returncode == 0, down.stderr
    assert down.stdout.startswith(f"stopped {len(members)} processes: "), down.stdout
    for m in members:
        assert not pid_alive(m["pid"]), m
    deadline = time.monotonic() + 10
    ports = [int(m["url"].rsplit(":", 1)[1]) for m in members]
    while any(port_in_use(p) for p in ports):
        assert time.monotonic() < deadline, "ports still in use"
        time.sleep(0.1)
    assert not any(local_tiny.state.glob("*/state.json"))
    # Nothing the demo started survives, not even a process `disagg status` does not list (an
    # engine core, a tokenizer worker): they all inherited the demo's environment mark.
    assert [pid for pid in _processes_with(demo_run.mark) if pid_alive(pid)] == []


def _processes_with(mark: str) -> list[int]:
    """Pids whose environment carries ``mark`` (every descendant of the demo inherits it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return found
