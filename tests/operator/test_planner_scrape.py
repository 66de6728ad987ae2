"""The planner's default source: it scrapes the engines' /metrics itself. Real HTTP servers on
loopback addresses stand in for the pods (prometheus_client's exposition with vLLM's family names);
the Kubernetes side (EndpointSlice addresses, the scale calls) is a recording stand-in here and the
real API server in tests/operator/test_cluster_planner.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from disagg_operator.names import Role
from disagg_operator.planner import ModelState, tick
from tests.operator.builders import full_spec, plan_of
from tests.operator.cases import merged

PODS = {"qwen3-8b-prefill-a": "127.0.0.2", "qwen3-8b-prefill-b": "127.0.0.3", "qwen3-8b-decode-a": "127.0.0.4"}


class Engines:
    """One registry per pod address; /metrics answers with the registry of the address it was called on."""

    def __init__(self) -> None:
        self.registries: dict[str, CollectorRegistry] = {}
        self.waiting: dict[str, Gauge] = {}
        self.kv: dict[str, Gauge] = {}
        self.ttft: dict[str, Histogram] = {}
        for ip in PODS.values():
            r = self.registries[ip] = CollectorRegistry()
            self.waiting[ip] = Gauge("vllm:num_requests_waiting", "w", ["model_name", "engine"], registry=r)
            self.kv[ip] = Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name", "engine"], registry=r)
            self.ttft[ip] = Histogram("vllm:time_to_first_token_seconds", "t", ["model_name", "engine"],
                                      buckets=(0.1, 0.5, 1, 5), registry=r)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                registry = outer.registries.get(self.connection.getsockname()[0])
                body = generate_latest(registry) if registry is not None else b"starting"
                # An address without a registry is an engine still loading: 503, as vLLM answers then.
                self.send_response(503 if registry is None else 200 if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("0.0.0.0", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def engines() -> Iterator[Engines]:
    e = Engines()
    yield e
    e.server.shutdown()


class Api:
    """EndpointSlice addresses by Service, and the scale calls made."""

    def __init__(self, endpoints: dict[str, list[tuple[str, str]]]) -> None:
        self.endpoints = endpoints
        self.scaled: list[tuple[str, int]] = []

    def service_endpoints(self, namespace: str, service: str) -> list[tuple[str, str]]:
        return self.endpoints.get(service, [])

    def scale(self, namespace: str, deployment: str, replicas: int) -> None:
        self.scaled.append((deployment, replicas))

    def pods(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        return []  # no prefill pod marked to leave (tests/operator/test_retire.py)


def deployments(prefill: int, decode: int) -> dict[str, dict[str, Any]]:
    return {"qwen3-8b-prefill": {"spec": {"replicas": prefill}, "status": {"readyReplicas": prefill}},
            "qwen3-8b-decode": {"spec": {"replicas": decode}, "status": {"readyReplicas": decode}}}


def test_scraped_engines_drive_a_scale_up_and_a_dead_pod_is_reported(engines: Engines) -> None:
    spec = merged(full_spec(), {"engine": {"port": engines.port}, "autoscaling": {
        "prefill": {"maxReplicas": 6}, "decode": {"maxReplicas": 6}, "ratio": {"min": 0, "max": 100},
        "targets": {"waitingPerPrefillPod": 4, "ttftSeconds": 0.5, "decodeKvCacheUsage": 0.8}}})
    plan = plan_of(spec)
    prefill_pods = [(p, ip) for p, ip in PODS.items() if "prefill" in p]
    api = Api({"qwen3-8b-prefill": [*prefill_pods, ("qwen3-8b-prefill-gone", "127.0.0.9")],
               "qwen3-8b": [(p, ip) for p, ip in PODS.items() if "decode" in p]})
    for ip, waiting in (("127.0.0.2", 10), ("127.0.0.3", 14)):
        engines.waiting[ip].labels("m", "0").set(waiting)
    engines.kv["127.0.0.4"].labels("m", "0").set(0.4)
    # 127.0.0.9 answers 503 (an engine still loading): reported, the others still count.

    state = ModelState()
    result = tick(plan, deployments(2, 2), {}, api, state, now=0.0, stamp="2026-12-05T00:00:00Z")
    assert result is not None
    # 24 waiting over 2 prefill pods = 12 per pod against 4: 3x → 6 prefill pods; decode's KV at half its
    # target, but a fresh planner counts the sizes it found as recommended: decode is not shrunk yet.
    assert result.signals.waiting == 24 and result.signals.kv_usage == pytest.approx(0.4)
    assert result.signals.ttft_p90 is None  # a first reading has no interval to measure over
    assert api.scaled == [("qwen3-8b-prefill", 6)]
    assert [(m.pool, m.before, m.after) for m in result.moves] == [(Role.PREFILL, 2, 6)]
    assert result.events[0][0] == "ScaledUp" and "prefill 2 → 6" in result.events[0][1]
    assert result.status["pools"]["decode"] == {"current": 2, "desired": 2, "minReplicas": 1, "maxReplicas": 6,
                                                "managedBy": "planner", "reason": result.decision.reasons["decode"]}
    assert len(result.errors) == 1 and "qwen3-8b-prefill-gone" in result.errors[0]
    assert result.status["errors"] == list(result.errors) and result.status["source"] == "pods"

    # The next reading measures TTFT over the interval: 10 slow first tokens since the last one.
    for _ in range(10):
        engines.ttft["127.0.0.2"].labels("m", "0").observe(3.0)
    result = tick(plan, deployments(6, 2), {}, api, state, now=15.0, stamp="2026-12-05T00:00:15Z")
    assert result is not None and result.signals.ttft_p90 == pytest.approx(1 + 4 * 0.9)
