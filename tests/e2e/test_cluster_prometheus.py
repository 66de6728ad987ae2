"""A real Prometheus (scripts/prometheus-bin, built from the Go module proxy) scrapes
examples/cluster-tiny.yaml's pods on the real node through the PodMonitors the operator wrote.

The Prometheus Operator does not run here (it would need its own images, a StatefulSet and a config
reloader), so Prometheus runs as a host process with the scrape configuration that operator generates
from the monitors: `disagg scrape-config` of the monitors as the API server lists them
(operator/disagg_operator/scrape_configs.py), with the pod discovery through the test cluster's
kubeconfig (its admin's: least privilege is not the point of a test-only Prometheus). Pod IPs are
reachable from the host on the real node, and Prometheus listens on the node's address, so the
operator's pod reaches it too: the planner (spec.autoscaling.prometheus) reads its signals from it.

Runs before tests/e2e/test_cluster_scaling.py and test_cluster_tiny.py on the same deployment
(tests/harness/cluster_tiny.py) and leaves it as it found it (the monitors' interval and
spec.autoscaling put back).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from disagg_cli.cluster.node_config import NODE_IP
from disagg_engine.processes import pid_alive
from disagg_engine.testing.tiny_model import ensure_model
from disagg_operator import names, signals
from tests.harness.cluster import Cluster
from tests.harness.cluster_tiny import MODEL, Deployed, cluster_tiny, get, pods, tiny  # noqa: F401
from tests.harness.forced import Forcer
from tests.harness.prometheus import Prometheus
from tests.harness.request_stream import RequestStream
from tests.operator.monitor_cluster import monitors

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

INTERVAL = "1s"
ENGINE_PORT, SIDECAR_PORT = 8200, 8000  # the example's engine.port and the sidecar's (defaults)
REQUESTS = 3
SERVED = 'disagg_sidecar_requests_total{api="chat",code="200"}'  # counted once per client request


def disagg(*args: str, input: str) -> str:
    return subprocess.run([sys.executable, "-m", "disagg_cli.main", *args], input=input, capture_output=True,
                          text=True, check=True, timeout=60).stdout


@dataclass
class Scraped:
    deployed: Deployed
    prometheus: Prometheus
    jobs: list[dict[str, Any]]  # scrape_configs from the monitors the operator wrote


@pytest.fixture(scope="module")
def scraped(cluster: Cluster, tiny: Deployed, prometheus_bin: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    ns, t0 = tiny.ns, time.monotonic()
    cluster.kubectl("patch", "dm", MODEL, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"monitoring": {"interval": INTERVAL}}}))
    try:
        def rewritten() -> dict[str, dict[str, Any]] | None:
            found = monitors(cluster, ns)
            intervals = {ep.get("interval") for m in found.values() for ep in m["spec"]["podMetricsEndpoints"]}
            return found if len(found) == 2 and intervals == {INTERVAL} else None
        written = cluster.wait_for(rewritten, f"the operator's two PodMonitors at {INTERVAL}", timeout=60, interval=0.5)
        assert set(written) == {names.engine_monitor(MODEL), names.sidecar_monitor(MODEL)}
        listed = cluster.kubectl("get", "podmonitors.monitoring.coreos.com", "-n", ns, "-o", "yaml").stdout
        jobs = yaml.safe_load(disagg("scrape-config", "-", "--kubeconfig-file", str(cluster.kubeconfig),
                                     input=listed))["scrape_configs"]
        state = tmp_path_factory.mktemp("prometheus")
        config = {"global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL,
                             "query_log_file": str(state / "queries.log")}, "scrape_configs": jobs}
        prometheus = Prometheus(prometheus_bin, config, state, NODE_IP)
        print(f"monitors at {INTERVAL} and Prometheus ready {time.monotonic() - t0:.1f}s after the example was Ready")
        try:
            yield Scraped(tiny, prometheus, jobs)
        finally:
            t1 = time.monotonic()
            prometheus.stop()
            assert not pid_alive(prometheus.proc.pid), "Prometheus outlived its stop"
            print(f"Prometheus stopped in {time.monotonic() - t1:.1f}s")
    finally:
        cluster.kubectl("patch", "dm", MODEL, "-n", ns, "--type=json",
                        "-p", '[{"op": "remove", "path": "/spec/monitoring/interval"}]', check=False)


def series(prometheus: Prometheus, expr: str) -> dict[tuple[str, str], float]:
    """(pod, role) -> value of an instant query whose series carry both."""
    return {(s["metric"]["pod"], s["metric"]["role"]): float(s["value"][1]) for s in prometheus.query(expr)}


def test_every_pools_pod_is_a_target_up_with_its_model_pool_role_and_revision(cluster: Cluster, scraped: Scraped) -> None:
    t0, ns, prometheus = time.monotonic(), scraped.deployed.ns, scraped.prometheus
    expected: dict[tuple[str, str], dict[str, str]] = {}
    for pod in pods(cluster, ns):
        labels = pod["metadata"]["labels"]
        for role in ("engine", "sidecar") if labels[names.POOL] == "decode" else ("engine",):
            expected[(pod["metadata"]["name"], role)] = {
                "namespace": ns, "pod": pod["metadata"]["name"], "model": MODEL, "pool": labels[names.POOL],
                "role": role, "revision": labels[names.REVISION]}
    assert {labels["pool"] for labels in expected.values()} == {"prefill", "decode", "render"}

    def all_up() -> dict[tuple[str, str], dict[str, Any]] | None:
        found = {(s["metric"]["pod"], s["metric"]["role"]): s for s in prometheus.query(f'up{{namespace="{ns}"}}')}
        return found if set(found) == set(expected) and all(s["value"][1] == "1" for s in found.values()) else None
    up = prometheus.wait_for(all_up, "every pod's engine and the decode pod's sidecar scraped and up", timeout=60)
    for key, s in up.items():
        assert {k: s["metric"][k] for k in expected[key]} == expected[key]
        port = SIDECAR_PORT if key[1] == "sidecar" else ENGINE_PORT
        pod = next(p for p in pods(cluster, ns) if p["metadata"]["name"] == key[0])
        assert s["metric"]["instance"] == f"{pod['status']['podIP']}:{port}"
    # Prometheus's own view of the targets: the monitors' jobs, nothing dropped that should be scraped.
    active = prometheus.api("targets", state="active")["activeTargets"]
    assert {t["scrapePool"] for t in active} == {j["job_name"] for j in scraped.jobs}
    assert all(t["health"] == "up" for t in active), [t for t in active if t["health"] != "up"]
    # The configuration rendered from the model's spec is the one from the monitors the operator wrote.
    dm = cluster.kubectl("get", "dm", MODEL, "-n", ns, "-o", "yaml").stdout
    assert yaml.safe_load(disagg("scrape-config", "-", "--kubeconfig-file", str(cluster.kubeconfig),
                                 input=dm))["scrape_configs"] == scraped.jobs
    print(f"targets up {time.monotonic() - t0:.1f}s after the check began")


def own_count(pod: dict[str, Any]) -> float:
    """The sidecar's requests counter as its own /metrics says it (0 before its first request)."""
    text = requests.get(f"http://{pod['status']['podIP']}:{SIDECAR_PORT}/metrics", timeout=30).text
    name, labels = SERVED.split("{")
    wanted = set(labels.rstrip("}").split(","))
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and wanted <= set(line.split("{", 1)[1].split("}", 1)[0].split(",")))


def test_the_planners_signals_are_series_per_pod_and_a_counter_follows_the_pods_own(
        cluster: Cluster, scraped: Scraped) -> None:
    t0, ns, prometheus = time.monotonic(), scraped.deployed.ns, scraped.prometheus
    [prefill], [decode] = pods(cluster, ns, "prefill"), pods(cluster, ns, "decode")
    sel = f'namespace="{ns}",model="{MODEL}"'
    prometheus.wait_for(lambda: series(prometheus, f'up{{{sel},pod="{decode["metadata"]["name"]}"}}') == {
        (decode["metadata"]["name"], "engine"): 1.0, (decode["metadata"]["name"], "sidecar"): 1.0},
        "the decode pod scraped", timeout=60)
    before = own_count(decode)
    counted = f'sum by (pod, role) ({SERVED.replace("{", "{" + sel + ",")})'
    assert series(prometheus, counted).get((decode["metadata"]["name"], "sidecar"), 0.0) == before

    # Chats through the decode Service, long enough for a prefill leg (the prefill engine's TTFT).
    with RequestStream(scraped.deployed.url, Forcer(ensure_model()), max_requests=REQUESTS) as stream:
        cluster.wait_for(lambda: len(stream.snapshot()) >= REQUESTS, f"{REQUESTS} chats answered", timeout=120)
    assert not stream.failed() and stream.outcomes() == {"remote": REQUESTS}, stream.summary()

    # The counter rose by exactly those requests, in Prometheus as on the pod, read one after the other.
    def same() -> float | None:
        own = own_count(decode)
        scraped_value = series(prometheus, counted).get((decode["metadata"]["name"], "sidecar"))
        return own if scraped_value == own == before + REQUESTS else None
    prometheus.wait_for(same, f"{SERVED} at {before + REQUESTS} in Prometheus and on the pod", timeout=30, interval=0.25)

    # The families the planner reads (signals.py), per engine pod of its pool, and the sidecar's leg latency.
    per_pod = {
        signals.WAITING: (prefill, "engine"), signals.KV_USAGE[0]: (decode, "engine"),
        f"{signals.TTFT}_bucket": (prefill, "engine"), f"{signals.ITL}_bucket": (decode, "engine"),
        "disagg_sidecar_leg_seconds_bucket": (decode, "sidecar"),
    }
    for family, (pod, role) in per_pod.items():
        found = series(prometheus, f'count by (pod, role) ({family}{{{sel}}})')
        assert (pod["metadata"]["name"], role) in found, (family, found)
    # The prompts' first tokens came from the prefill engine: its TTFT histogram counted them (once
    # Prometheus scraped the prefill pod after them: its targets are scraped apart from the decode pod's).
    def prefilled() -> dict[tuple[str, str], float] | None:
        ttft = series(prometheus, f'sum by (pod, role) ({signals.TTFT}_count{{{sel},pool="prefill"}})')
        return ttft if ttft.get((prefill["metadata"]["name"], "engine"), 0.0) >= REQUESTS else None
    prometheus.wait_for(prefilled, f"the prefill engine's TTFT count at {REQUESTS} in Prometheus", timeout=30)

    # The planner's own queries (signals.promql, what spec.autoscaling.prometheus asks) answer from it:
    # the latencies of these requests (once the engines' next scrape is in), nothing waiting, a KV usage.
    def read() -> tuple[signals.Signals, dict[str, list[float]]] | None:
        results = {name: [float(s["value"][1]) for s in prometheus.query(q)]
                   for name, q in signals.promql(ns, MODEL, disaggregated=True).items()}
        got = signals.from_query_results(results)
        return (got, results) if (got.ttft_p90 or 0) > 0 and (got.itl_p90 or 0) > 0 else None
    got, results = prometheus.wait_for(read, "the planner's TTFT and ITL p90 from Prometheus", timeout=30)
    assert got.waiting == 0 and got.kv_usage is not None and 0 <= got.kv_usage <= 1, (got, results)
    assert not any(math.isnan(v) for name in ("waiting", "kv_usage") for v in results[name]), results
    print(f"signals from Prometheus {got}; module part {time.monotonic() - t0:.1f}s")


def test_the_planner_reads_its_signals_from_this_prometheus(cluster: Cluster, scraped: Scraped) -> None:
    t0, ns, prometheus = time.monotonic(), scraped.deployed.ns, scraped.prometheus
    # Bounds of 1 and a target nothing reaches: the planner reads and decides, nothing scales.
    autoscaling = {"prefill": {"minReplicas": 1, "maxReplicas": 1}, "decode": {"minReplicas": 1, "maxReplicas": 1},
                   "targets": {"ttftSeconds": 1000}, "intervalSeconds": 5, "prometheus": {"url": prometheus.url}}
    cluster.kubectl("patch", "dm", MODEL, "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"autoscaling": autoscaling}}))
    try:
        def decided() -> dict[str, Any] | None:
            status = get(cluster, "dm", MODEL, "-n", ns).get("status", {}).get("autoscaling") or {}
            keys = {"ttftP90Seconds", "waitingRequests", "itlP90Seconds", "decodeKVCacheUsage"}
            return status if keys <= set(status.get("signals", {})) else None
        status = cluster.wait_for(decided, "the planner's signals", timeout=60, interval=0.5)
        assert status["source"] == "prometheus" and "errors" not in status, status
        # Asked by the operator's pod, over the pod network (Prometheus's query log names the client).
        [operator] = get(cluster, "pods", "-n", scraped.deployed.operator_ns, "-l",
                         f"app.kubernetes.io/instance={scraped.deployed.release}")["items"]
        queries = signals.promql(ns, MODEL, disaggregated=True)
        log = [json.loads(line) for line in (prometheus.config_path.parent / "queries.log").read_text().splitlines()]
        asked = {entry["params"]["query"] for entry in log
                 if entry.get("httpRequest", {}).get("clientIP") == operator["status"]["podIP"]}
        assert set(queries.values()) <= asked, (asked, queries)
    finally:
        cluster.kubectl("patch", "dm", MODEL, "-n", ns, "--type=json", "-p", '[{"op": "remove", "path": "/spec/autoscaling"}]')
        cluster.wait_for(lambda: "autoscaling" not in get(cluster, "dm", MODEL, "-n", ns).get("status", {}),
                         "status.autoscaling removed", timeout=60, interval=0.5)
    print(f"the planner read Prometheus {time.monotonic() - t0:.1f}s after spec.autoscaling was set")
