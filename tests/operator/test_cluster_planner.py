"""spec.autoscaling against the real control plane: the operator's planner scales a model's prefill
and decode Deployments through their scale subresource on the signals a Prometheus answers, within
the pools' bounds and the prefill:decode ratio (the ready pods' too, while the pools surge
together), scales back down only after the stabilisation window, takes the prefill pods it removes
out of the sidecars' selection (their KV-revision Service's EndpointSlices) before it shrinks the
pool, and explains each step (status.autoscaling, Events, the operator's metrics).

kwok's pods run no vLLM, so the signals come from a small real HTTP server answering Prometheus'
query API (``/api/v1/query``) with values the test sets: the one fault this test injects."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from disagg_operator import names, retire, signals as sig
from tests.harness.cluster import Cluster
from tests.harness.operator import OperatorProcess
from tests.operator.test_cluster import example, get

pytestmark = pytest.mark.cluster

INTERVAL = 5
DOWN_WINDOW = 20


class FakePrometheus:
    """Answers each of the planner's queries (signals.promql) with the value set for its signal."""

    def __init__(self) -> None:
        self.values: dict[str, float | None] = {"ttft_p90": None, "waiting": 0.0, "itl_p90": None, "kv_usage": 0.1}
        self.queries: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                url = urlparse(self.path)
                query = parse_qs(url.query).get("query", [""])[0]
                outer.queries.append(query)
                wanted = sig.promql("NS", "qwen3-8b", disaggregated=True)
                name = next((n for n, q in wanted.items() if _shape(q) == _shape(query)), None)
                if url.path != "/api/v1/query" or name is None:
                    body, code = {"status": "error", "error": f"unexpected query {query!r}"}, 400
                else:
                    value = outer.values[name]
                    result = [] if value is None else [{"metric": {}, "value": [time.time(), str(value)]}]
                    body, code = {"status": "success", "data": {"resultType": "vector", "result": result}}, 200
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


def _shape(query: str) -> str:
    """A query without its namespace (the test's namespace is only known later)."""
    import re
    return re.sub(r'namespace="[^"]*"', 'namespace=""', query)


@pytest.fixture(scope="module")
def prometheus() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    yield fake
    fake.server.shutdown()


def replicas(cluster: Cluster, ns: str) -> tuple[int, int]:
    """Both pools' sizes, read at once."""
    found = {d["metadata"]["name"]: d["spec"]["replicas"] for d in get(
        cluster, ns, "deployment", "qwen3-8b-prefill", "qwen3-8b-decode")["items"]}
    return found["qwen3-8b-prefill"], found["qwen3-8b-decode"]


def ready(cluster: Cluster, ns: str) -> tuple[int, int]:
    """Both pools' ready pods, read at once."""
    found = {d["metadata"]["name"]: (d.get("status") or {}).get("readyReplicas") or 0 for d in get(
        cluster, ns, "deployment", "qwen3-8b-prefill", "qwen3-8b-decode")["items"]}
    return found["qwen3-8b-prefill"], found["qwen3-8b-decode"]


def prefill_pods(cluster: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    selector = ",".join(f"{k}={v}" for k, v in names.selector("qwen3-8b", names.Role.PREFILL).items())
    return {p["metadata"]["name"]: p for p in get(cluster, ns, "pods", "-l", selector)["items"]}


def sidecar_selection(cluster: Cluster, ns: str) -> set[str]:
    """The prefill pods the sidecars can choose: what their KV-revision Service's EndpointSlices list."""
    services = [s["metadata"]["name"] for s in get(cluster, ns, "services", "-l", f"{names.INSTANCE}=qwen3-8b")["items"]
                if s["metadata"]["name"].startswith("qwen3-8b-kv")]
    assert len(services) == 1, services
    out = cluster.kubectl("get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={services[0]}",
                          "-o", "json")
    return {e["targetRef"]["name"] for s in json.loads(out.stdout)["items"] for e in s.get("endpoints") or []
            if e.get("targetRef")}


def events(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "events", "-n", ns, "--field-selector", "involvedObject.kind=DisaggregatedModel",
                          "-o", "json")
    return json.loads(out.stdout)["items"]


def test_the_planner_scales_within_bounds_and_ratio_and_back_after_the_window(
        cluster: Cluster, operator: OperatorProcess, prometheus: FakePrometheus, ns: str) -> None:
    doc = example()
    doc["spec"]["pools"]["render"] = {"replicas": 0}
    doc["spec"]["autoscaling"] = {
        "prefill": {"minReplicas": 1, "maxReplicas": 3}, "decode": {"minReplicas": 1, "maxReplicas": 4},
        "ratio": {"min": 0.5, "max": 1}, "targets": {"waitingPerPrefillPod": 4, "decodeKvCacheUsage": 0.8},
        "stabilization": {"scaleUpSeconds": 0, "scaleDownSeconds": DOWN_WINDOW}, "intervalSeconds": INTERVAL,
        "prometheus": {"url": prometheus.url},
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))

    # Idle: at the minima, the status says why.
    status = cluster.wait_for(lambda: get(cluster, ns, "dm", "qwen3-8b").get("status", {}).get("autoscaling"),
                              "status.autoscaling", timeout=120)
    assert status["source"] == "prometheus" and status["signals"]["waitingRequests"] == 0
    assert replicas(cluster, ns) == (1, 1)
    assert any(f'namespace="{ns}"' in q and "vllm:num_requests_waiting" in q for q in prometheus.queries)

    # Load: 40 waiting on 1 prefill pod against 4 per pod → prefill to its max 3; decode's own signal
    # (KV 10%) wants 1, the ratio (at most 1 prefill per decode pod) raises it to 3.
    # Both pools surge together: each grows only as far as the other's ready pods keep 0.5-1.
    prometheus.values["waiting"] = 40.0
    seen: set[tuple[int, int]] = set()

    def scaled_up() -> bool:
        now_ready = ready(cluster, ns)
        assert 0.5 <= now_ready[0] / now_ready[1] <= 1, f"ready prefill:decode {now_ready} out of the ratio"
        seen.add(current := replicas(cluster, ns))
        return current == (3, 3) and now_ready == (3, 3)
    cluster.wait_for(scaled_up, "prefill and decode scaled up to 3", timeout=120)
    assert all(1 <= p <= 3 and 1 <= d <= 4 for p, d in seen)
    assert (1, 2) in seen and (2, 2) in seen, f"no steps: {sorted(seen)}"  # decode first: ratio min 0.5
    status = get(cluster, ns, "dm", "qwen3-8b")["status"]["autoscaling"]
    assert status["pools"]["prefill"]["desired"] == 3 and "waiting" in status["pools"]["prefill"]["reason"]
    assert "ratio" in status["pools"]["decode"]["reason"] and status["ratioHeld"] is True
    reasons = [e["reason"] for e in events(cluster, ns)]
    assert "ScaledUp" in reasons and "RatioHeld" in reasons
    scaled_up_at = time.monotonic()

    # Idle again: nothing shrinks for the scale-down window, then both return to 1; the two prefill
    # pods that go leave the sidecars' selection first, and only those are deleted.
    before = set(prefill_pods(cluster, ns))
    assert sidecar_selection(cluster, ns) == before and len(before) == 3
    prometheus.values["waiting"] = 0.0
    idle_at = time.monotonic()
    left_selection: dict[str, float] = {}  # marked pod -> when first seen out of the EndpointSlices
    shrunk_at: dict[int, float] = {}  # prefill's size -> when first seen
    seen = set()

    def scaled_down() -> bool:
        current = replicas(cluster, ns)
        pods, selection, now = prefill_pods(cluster, ns), sidecar_selection(cluster, ns), time.monotonic()
        if current != (3, 3):
            assert now - idle_at >= DOWN_WINDOW - INTERVAL - 1, f"shrank early: {current}"
        for name, pod in pods.items():
            if retire.marked(pod) and name not in selection:
                left_selection.setdefault(name, now)
            if pod["metadata"].get("deletionTimestamp"):
                assert name not in selection, f"{name} is being removed and still selectable"
        # Each pool shrinks only as far as the other's size keeps the ratio 0.5-1 (prefill first: decode
        # waits while prefill's pods leave the selection).
        assert 0.5 <= current[0] / current[1] <= 1, f"prefill:decode {current} out of the ratio"
        seen.add(current)
        shrunk_at.setdefault(current[0], now)
        return current == (1, 1) and len(pods) == 1
    cluster.wait_for(scaled_down, "prefill and decode back to 1", timeout=DOWN_WINDOW + 90)
    assert time.monotonic() - scaled_up_at >= DOWN_WINDOW - INTERVAL
    gone = before - set(prefill_pods(cluster, ns))
    assert set(left_selection) == gone and len(gone) == 2, (left_selection, gone)
    assert seen >= {(2, 3), (2, 2), (1, 2)}, f"no steps: {sorted(seen)}"
    # One pod per step, each out of the selection before the pool shrank past it.
    assert [at < shrunk_at[size] for at, size in zip(sorted(left_selection.values()), (2, 1))] == [True, True], (
        left_selection, shrunk_at)
    (kept,) = prefill_pods(cluster, ns).values()
    assert not retire.marked(kept) and sidecar_selection(cluster, ns) == {kept["metadata"]["name"]}
    reasons = [e["reason"] for e in events(cluster, ns)]
    assert "ScaledDown" in reasons and "PrefillDeselected" in reasons
    metrics = operator.metrics()
    assert metrics.get('disagg_operator_planner_decisions_total{outcome="scaled_up"}', 0) >= 1
    assert metrics.get('disagg_operator_planner_decisions_total{outcome="scaled_down"}', 0) >= 1
    assert any(k.startswith("disagg_operator_planner_desired_replicas") and f'namespace="{ns}"' in k for k in metrics)



def test_a_users_hpa_keeps_its_pool_and_the_planner_plans_the_other(
        cluster: Cluster, operator: OperatorProcess, prometheus: FakePrometheus, ns: str) -> None:
    doc = example()
    doc["spec"]["pools"]["render"] = {"replicas": 0}
    doc["spec"]["autoscaling"] = {
        "prefill": {"minReplicas": 1, "maxReplicas": 2}, "decode": {"minReplicas": 2, "maxReplicas": 4},
        "targets": {"waitingPerPrefillPod": 4}, "intervalSeconds": INTERVAL, "prometheus": {"url": prometheus.url},
    }
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "mine"},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen3-8b-decode"},
                    "minReplicas": 1, "maxReplicas": 3,
                    "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                        "type": "Utilization", "averageUtilization": 80}}}]}}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                    "items": [hpa, doc]}))
    prometheus.values["waiting"] = 40.0

    def planned() -> dict[str, Any] | None:
        pools = get(cluster, ns, "dm", "qwen3-8b").get("status", {}).get("autoscaling", {}).get("pools", {})
        return pools if pools.get("prefill", {}).get("current") == 2 else None
    pools = cluster.wait_for(planned, "prefill planned up to its max", timeout=120)
    assert pools["decode"]["managedBy"] == "HorizontalPodAutoscaler/mine"
    assert pools["prefill"]["managedBy"] == "planner"
    # The planner's minimum of 2 decode pods was not imposed: the pool is the HPA's (which, without a
    # metrics server here, leaves the Deployment's 1).
    assert get(cluster, ns, "deployment", "qwen3-8b-decode")["spec"]["replicas"] == 1
    assert (pools["decode"]["current"], pools["decode"]["desired"]) == (1, 1)


def test_removing_autoscaling_puts_prefill_pods_it_had_marked_back(
        cluster: Cluster, operator: OperatorProcess, prometheus: FakePrometheus, ns: str) -> None:
    doc = example()
    doc["spec"]["pools"]["render"] = {"replicas": 0}
    doc["spec"]["pools"]["prefill"]["replicas"] = 2
    # One decision, then none for 10 minutes: the pod marked below stays marked until the spec changes.
    doc["spec"]["autoscaling"] = {"prefill": {"minReplicas": 2, "maxReplicas": 2}, "decode": {"maxReplicas": 2},
                                  "targets": {"waitingPerPrefillPod": 4}, "intervalSeconds": 600,
                                  "prometheus": {"url": prometheus.url}}
    prometheus.values["waiting"] = 0.0
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
    cluster.wait_for(lambda: get(cluster, ns, "dm", "qwen3-8b").get("status", {}).get("autoscaling"),
                     "a first decision", timeout=120)
    pods = cluster.wait_for(lambda: p if len(p := prefill_pods(cluster, ns)) == 2 else None, "two prefill pods",
                            timeout=120)
    name, pod = sorted(pods.items())[0]
    revision = pod["metadata"]["labels"][names.KV_REVISION]
    # Marked as the planner marks a pod it is about to scale away.
    cluster.kubectl("patch", "pod", name, "-n", ns, "--type", "merge", "-p", json.dumps(retire.mark_patch(pod)))
    cluster.wait_for(lambda: name not in sidecar_selection(cluster, ns), "the marked pod out of the selection",
                     timeout=30)

    del doc["spec"]["autoscaling"]
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
    cluster.wait_for(lambda: name in sidecar_selection(cluster, ns), "the pod back in the sidecars' selection",
                     timeout=60)
    back = prefill_pods(cluster, ns)[name]["metadata"]
    assert back["labels"][names.KV_REVISION] == revision and not retire.marked({"metadata": back})
    assert retire.DELETION_COST not in (back.get("annotations") or {})
    assert "PrefillReselected" in [e["reason"] for e in events(cluster, ns)]
    # The planner's status goes with it (it would still say managedBy: planner).
    cluster.wait_for(lambda: "autoscaling" not in get(cluster, ns, "dm", "qwen3-8b").get("status", {}),
                     "status.autoscaling removed", timeout=30)
