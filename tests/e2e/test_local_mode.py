"""Local mode end to end: ``disagg up examples/local-tiny.yaml`` driven with the official openai SDK.

The deployment is the one ``make demo --keep`` left running (``local_tiny``, tests/harness/engine.py):
the demo brings it up with ``disagg up --detach``, these tests use it, and test_local_down.py takes it
down after every other test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from openai import OpenAI

from tests.harness.engine import disagg
from tests.harness.agent_apis import agent_views
from tests.harness.coupled import forced_views

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local-tiny.yaml"


@pytest.fixture(scope="module")
def client(local_tiny) -> OpenAI:
    return OpenAI(base_url=local_tiny.endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_status_lists_every_pool_healthy(local_tiny):
    out = disagg("status", "--json", "--state-dir", str(local_tiny.state))
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
    got_view, want = forced_views(engine_set, forcer, client, "reasoning_tool_call", stream)
    assert got_view == want
    assert want["choices"][0]["tool_calls"] == [("get_weather", {"city": "東京"})]


@pytest.mark.parity
def test_responses_and_messages_through_their_sdks_equal_the_coupled_reference(engine_set, forcer, local_tiny):
    assert agent_views(local_tiny.endpoint, forcer) == agent_views(engine_set.url("coupled"), forcer)


@pytest.mark.cluster
def test_invalid_spec_is_rejected_with_the_crd_admission_message(cluster, tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["source"] = "/models/tiny"
    doc["spec"]["pools"]["decode"]["replicas"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    local = disagg("up", str(bad), "--state-dir", str(tmp_path / "state"))
    assert local.returncode == 2
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/disaggregatedmodels.disagg.dev")
    admission = cluster.kubectl("apply", "--dry-run=server", "-n", "default", "-f", str(bad), check=False)
    assert admission.returncode != 0
    message = "pools.decode.replicas must be at least 1: decode serves every request"
    assert message in admission.stderr
    assert message in local.stderr
