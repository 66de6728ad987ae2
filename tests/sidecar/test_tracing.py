"""Trace spans (``tracing.otlp_endpoint``): one trace per request with the client's trace id, a
span per leg, sent to a real OTLP/HTTP receiver in the test (``tests/harness/otlp.py``, which
decodes what OpenTelemetry's exporter sends).

The engine tests put recording proxies in front of the real vLLM servers, so each leg span is
matched with the request the engine received: the engine got the leg span's own ``traceparent``
(same trace id, the span as parent). The others run the sidecar in front of a fake engine: the
configuration, failed legs, a receiver that is down.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import requests
from pydantic import ValidationError

from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.tracing import Tracing
from tests.harness.otlp import Receiver, Span, otlp_receiver
from tests.sidecar.conftest import TOKENS_ONLY
from tests.sidecar.support import (
    RecordingProxy, RunningSidecar, fake_config, fake_engine, recording_proxy, run_sidecar, sidecar_config, wait_for,
)

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
ERROR = 2  # Status.StatusCode
GENERATE = "/inference/v1/generate"
LEGS = ("render", "prefill", "decode", "derender")


def tracing(receiver: Receiver) -> dict:
    return {"otlp_endpoint": receiver.url, "export_delay_seconds": 0.05,
            "resource_attributes": {"k8s.namespace.name": "team-a"}}


def new_traceparent(sampled: bool = True) -> tuple[str, str, str]:
    trace, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace}-{parent}-{'01' if sampled else '00'}", trace, parent


def request_spans(receiver: Receiver, trace: str, timeout: float = 30) -> list[Span]:
    """The trace's spans once its request span is in: it ends after every leg, and the batch
    processor exports spans in the order they ended."""
    assert wait_for(lambda: any(s.kind == SERVER for s in receiver.trace(trace)), timeout), (
        f"no request span of {trace}; received {len(receiver.spans)} spans, refused {receiver.refused}")
    return receiver.trace(trace)


def the_request_span(spans: list[Span]) -> Span:
    (span,) = [s for s in spans if s.kind == SERVER]
    return span


def sent_traceparents(proxies: dict[str, RecordingProxy], trace: str) -> list[tuple[str, str, str]]:
    """(proxy, path, traceparent) of every call the engines got in ``trace``."""
    return [(name, c.path, tp) for name, p in proxies.items() for c in p.calls
            if (tp := {k.lower(): v for k, v in c.headers.items()}.get("traceparent", "")).split("-")[1:2] == [trace]]


# -- against the real vLLM servers -------------------------------------------------------------

@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced(engine_set, forcer, receiver) -> Iterator[tuple[RunningSidecar, dict[str, RecordingProxy]]]:
    """A chained sidecar (every answer through the derender tier: all four legs) whose render,
    prefill and decode legs go through recording proxies, with tracing on."""
    with recording_proxy(engine_set.url("render")) as render, recording_proxy(engine_set.url("prefill")) as prefill, \
            recording_proxy(engine_set.url("decode")) as decode:
        config = sidecar_config(engine_set, render={"url": render.url},
                                decode={"url": decode.url, "capabilities": TOKENS_ONLY},
                                prefill={"discovery": {"kind": "static", "urls": [prefill.url]}},
                                tracing=tracing(receiver))
        with run_sidecar(config) as sidecar:
            yield sidecar, {"render": render, "prefill": prefill, "decode": decode}


def check_legs(spans: list[Span], proxies: dict[str, RecordingProxy], trace: str) -> dict[str, list[Span]]:
    """Every leg span is a child of the request span, and each is the parent named in exactly one
    call an engine received (the pool, the endpoint and the path the span says)."""
    root = the_request_span(spans)
    legs = [s for s in spans if s is not root]
    assert all(s.kind == CLIENT and s.parent_span_id == root.span_id for s in legs), legs
    assert all(root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns for s in legs)
    by_parent = {tp.split("-")[2]: (name, path) for name, path, tp in sent_traceparents(proxies, trace)}
    assert len(by_parent) == len(sent_traceparents(proxies, trace)), "one leg span per engine call"
    assert set(by_parent) == {s.span_id for s in legs}, (by_parent, legs)
    for span in legs:
        proxy_name, path = by_parent[span.span_id]
        proxy = proxies[proxy_name]
        assert span.attributes["disagg.pool"] == span.name
        assert span.attributes["url.full"] == proxy.url + path
        assert f"{span.attributes['server.address']}:{span.attributes['server.port']}" == proxy.url.split("//")[1]
        assert span.attributes["http.response.status_code"] == 200 and span.status_code != ERROR
        # derender legs go to the render tier's endpoints (no derender tier configured)
        assert proxy_name == ("render" if span.name == "derender" else span.name)
    named: dict[str, list[Span]] = {}
    for span in legs:
        named.setdefault(span.name, []).append(span)
    return named


@pytest.mark.engine
def test_a_traced_chat_is_one_trace_with_a_span_per_leg(traced, receiver, forcer) -> None:
    sidecar, proxies = traced
    traceparent, trace, parent = new_traceparent()
    resp = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=60,
                         headers={"traceparent": traceparent, "tracestate": "vendor=1", "X-Request-Id": "traced-1"})
    assert resp.status_code == 200, resp.text
    spans = request_spans(receiver, trace)
    root = the_request_span(spans)
    assert root.parent_span_id == parent, "the request span continues the client's trace"
    assert root.name == "POST /v1/chat/completions"
    assert root.attributes["http.response.status_code"] == 200 and root.status_code != ERROR
    assert root.attributes["disagg.request_id"] == "traced-1" and root.attributes["disagg.prefill"] == "remote"
    assert root.resource["service.name"] == "disagg-sidecar" and root.resource["k8s.namespace.name"] == "team-a"
    assert root.resource["gen_ai.request.model"] == "tiny-qwen3"
    legs = check_legs(spans, proxies, trace)
    assert sorted(legs) == sorted(LEGS)
    assert [len(legs[n]) for n in ("render", "prefill", "decode")] == [1, 1, 1]
    assert legs["decode"][0].attributes["url.full"] == proxies["decode"].url + GENERATE
    # the client's tracestate goes on with its trace
    for name, _, _ in sent_traceparents(proxies, trace):
        assert all({k.lower(): v for k, v in c.headers.items()}.get("tracestate") == "vendor=1"
                   for c in proxies[name].calls if trace in c.headers.get("traceparent", ""))


@pytest.mark.engine
def test_a_stream_without_a_traceparent_starts_its_own_trace(traced, receiver, forcer) -> None:
    sidecar, proxies = traced
    for p in proxies.values():
        p.calls.clear()
    with requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("reasoning", stream=True),
                       timeout=60, stream=True, headers={"X-Request-Id": "traced-2"}) as resp:
        assert resp.status_code == 200
        assert b"data: [DONE]" in b"".join(resp.iter_content(None))
    (render_call,) = [c for c in proxies["render"].calls if c.path.endswith("/render")]
    trace = render_call.headers["traceparent"].split("-")[1]
    spans = request_spans(receiver, trace)
    root = the_request_span(spans)
    assert root.parent_span_id == "" and root.attributes["disagg.request_id"] == "traced-2"
    legs = check_legs(spans, proxies, trace)
    assert sorted(legs) == sorted(LEGS)
    assert len(legs["derender"]) >= 1  # per chunk, coalesced


@pytest.mark.engine
def test_an_unsampled_client_trace_is_carried_but_not_recorded(traced, receiver, forcer) -> None:
    sidecar, proxies = traced
    unsampled, dropped, _ = new_traceparent(sampled=False)
    resp = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=60,
                         headers={"traceparent": unsampled})
    assert resp.status_code == 200
    sent = sent_traceparents(proxies, dropped)
    assert {name for name, _, _ in sent} == {"render", "prefill", "decode"}
    assert all(tp.endswith("-00") for _, _, tp in sent), "the client's decision not to sample goes on"
    # A sampled request after it: once its spans are in, the unsampled one's would be too.
    sampled, trace, _ = new_traceparent()
    assert requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=60,
                         headers={"traceparent": sampled}).status_code == 200
    request_spans(receiver, trace)
    assert receiver.trace(dropped) == []


@pytest.mark.engine
def test_a_failed_prefill_leg_is_an_error_span_and_the_fallback_is_on_the_request(engine_set, forcer,
                                                                                  receiver) -> None:
    with recording_proxy(engine_set.url("prefill")) as gone:
        gone.stop()  # its port refuses connections
        config = sidecar_config(engine_set, prefill={"discovery": {"kind": "static", "urls": [gone.url]}},
                                tracing=tracing(receiver))
        with run_sidecar(config) as sidecar:
            traceparent, trace, _ = new_traceparent()
            resp = requests.post(sidecar.url + "/v1/chat/completions", json=forcer.chat_body("plain"), timeout=60,
                                 headers={"traceparent": traceparent})
            assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "fallback"
            spans = request_spans(receiver, trace)
    root = the_request_span(spans)
    assert root.attributes["disagg.prefill"] == "fallback" and root.status_code != ERROR
    prefill = [s for s in spans if s.name == "prefill"]
    assert len(prefill) == 2, "the attempt and its retry (one endpoint: the same one)"
    for span in prefill:
        assert span.status_code == ERROR and span.attributes["error.type"] == "connect"
        assert span.attributes["url.full"] == gone.url + GENERATE and "http.response.status_code" not in span.attributes
    (decode,) = [s for s in spans if s.name == "decode"]
    assert decode.status_code != ERROR and decode.attributes["http.response.status_code"] == 200


# -- without engines -----------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["file:///tmp/spans", "http://collector", "collector:4318", ""])
def test_an_otlp_endpoint_must_be_an_http_url_with_a_port(endpoint) -> None:
    with pytest.raises(ValidationError, match="otlp_endpoint"):
        SidecarConfig.model_validate({"decode": {"url": "http://127.0.0.1:8200"}, "tracing": {"otlp_endpoint": endpoint}})


def test_without_tracing_a_leg_carries_the_clients_headers_unchanged() -> None:
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "X-Request-Id": "a"}
    tracer = Tracing(None)
    assert not tracer.enabled
    with tracer.leg("prefill", "http://127.0.0.1:1", GENERATE, headers) as (_, sent):
        assert sent == headers


def test_a_5xx_leg_is_an_error_span_and_the_request_span_has_the_clients_status() -> None:
    with otlp_receiver() as receiver, fake_engine() as engine:
        engine.answer["/v1/chat/completions/render"] = (503, b'{"error": "busy"}')
        with run_sidecar(fake_config(engine, tracing=tracing(receiver))) as sidecar:
            traceparent, trace, parent = new_traceparent()
            resp = requests.post(sidecar.url + "/v1/chat/completions", timeout=30, headers={"traceparent": traceparent},
                                 json={"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}]})
            spans = request_spans(receiver, trace)
    root = the_request_span(spans)
    assert root.parent_span_id == parent
    assert root.attributes["http.response.status_code"] == resp.status_code >= 500 and root.status_code == ERROR
    render = [s for s in spans if s.kind == CLIENT]
    assert [s.name for s in render] == ["render", "render"], "the attempt and its retry"
    assert all(s.attributes["http.response.status_code"] == 503 and s.status_code == ERROR for s in render)
    calls = [c for c in engine.posts() if c.path == "/v1/chat/completions/render"]
    assert sorted(c.headers["traceparent"].split("-")[2] for c in calls) == sorted(s.span_id for s in render)


def test_requests_are_served_while_the_receiver_is_down() -> None:
    with otlp_receiver() as receiver:
        down = receiver.url
    with fake_engine() as engine:
        config = fake_config(engine, tracing={"otlp_endpoint": down, "export_delay_seconds": 0.05,
                                              "export_timeout_seconds": 1})
        with run_sidecar(config) as sidecar:
            for _ in range(3):
                resp = requests.post(sidecar.url + "/v1/chat/completions", timeout=30,
                                     json={"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}]})
                assert resp.status_code == 400 and resp.json()["error"]["code"] == 400  # the fake engine's answer
            assert requests.get(sidecar.url + "/health", timeout=5).status_code == 200
