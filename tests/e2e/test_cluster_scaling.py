"""spec.autoscaling on examples/cluster-tiny.yaml in real pods (the real node): the operator's planner
scrapes the engines' /metrics itself (source "pods"), a load through the decode Service raises the
prefill engines' TTFT and the decode engines' inter-token latency past their targets, and prefill
and decode scale up within their bounds and the prefill:decode ratio (decode first: at most one
prefill pod per decode pod); the load stops and, after the scale-down window, both go back, prefill
first (its pod leaves the sidecars' selection before the Deployment shrinks), while a trickle of
requests that leaves the signals at 0 keeps flowing through the decode Service. No request fails;
status.autoscaling and the model's Events explain each step. Then spec.autoscaling is removed and
the example is as it was for tests/e2e/test_cluster_tiny.py, which runs after this module on the
same deployment (tests/harness/cluster_tiny.py) and takes it down at its end.

The targets (TARGETS) are below what one request costs these engines on this CPU, so that any load
crosses them and only a quiet interval (latency 0) falls under them: on a shared 2-core machine a
target between one request's latency and a load's would make the test as noisy as the machine. The
trickle's requests have short prompts (decode prefills them itself: no prefill leg) and one output
token (no inter-token latency), so its signals are 0 too.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from disagg_engine.testing.tiny_model import ensure_model
from tests.harness.cluster import Cluster
from tests.harness.cluster_tiny import MODEL, READY_TIMEOUT, Deployed, cluster_tiny, get, pods, ready, tiny  # noqa: F401
from tests.harness.forced import Forcer
from tests.harness.request_stream import RequestStream

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

INTERVAL = 5  # the shortest the rules allow
DOWN_WINDOW = 20
MAX = 2  # per pool: each vLLM pod takes about 1 GB
RATIO = (0.5, 1.0)  # prefill pods per decode pod
# Under the load here the prefill engines' TTFT p90 reads 0.07 s and the decode engines' ITL p90 0.009 s
# (all under 10 ms: vLLM's lowest ITL bucket); idle, both read 0.
TARGETS = {"ttftSeconds": 0.01, "itlSeconds": 0.005}
AUTOSCALING = {
    "prefill": {"minReplicas": 1, "maxReplicas": MAX}, "decode": {"minReplicas": 1, "maxReplicas": MAX},
    "ratio": {"min": RATIO[0], "max": RATIO[1]}, "targets": TARGETS,
    "stabilization": {"scaleUpSeconds": 0, "scaleDownSeconds": DOWN_WINDOW}, "intervalSeconds": INTERVAL,
}
ENGINE_PORT = 8200  # the example's engine.port (the default)


@pytest.fixture(scope="module")
def forcer() -> Forcer:
    """The model's tokenizer only: this module needs no engine set of the harness."""
    return Forcer(ensure_model())


def dm(cluster: Cluster, ns: str) -> dict[str, Any]:
    return get(cluster, "dm", MODEL, "-n", ns)


def sizes(cluster: Cluster, ns: str) -> dict[str, tuple[int, int]]:
    """Prefill's and decode's (replicas, ready pods), from one read of their Deployments."""
    found = get(cluster, "deployments", "-n", ns, "-l", f"app.kubernetes.io/instance={MODEL}")["items"]
    by_pool = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in found}
    return {pool: (by_pool[pool]["spec"]["replicas"], (by_pool[pool].get("status") or {}).get("readyReplicas") or 0)
            for pool in ("prefill", "decode")}


def within(now: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """Asserts the planner's sizes are within the bounds and the ratio, and so are the ready pods
    (while both pools have one); returns the sizes."""
    (p, p_ready), (d, d_ready) = now["prefill"], now["decode"]
    assert 1 <= p <= MAX and 1 <= d <= MAX, now
    assert RATIO[0] <= p / d <= RATIO[1], f"prefill:decode {p}:{d} out of the ratio"
    if p_ready and d_ready:
        assert RATIO[0] <= p_ready / d_ready <= RATIO[1], f"ready prefill:decode {p_ready}:{d_ready} out of the ratio"
    return p, d


def events(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    items = get(cluster, "events", "-n", ns, "--field-selector",
                f"involvedObject.kind=DisaggregatedModel,involvedObject.name={MODEL}")["items"]
    return sorted(items, key=lambda e: (e.get("firstTimestamp") or e.get("eventTime") or "", e["metadata"]["name"]))


def messages(cluster: Cluster, ns: str, reason: str) -> list[str]:
    return [e["message"] for e in events(cluster, ns) if e["reason"] == reason]


def served(pod: dict[str, Any]) -> float:
    """Requests the pod's engine finished (vllm:request_success_total over its label sets)."""
    text = requests.get(f"http://{pod['status']['podIP']}:{ENGINE_PORT}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def uids(cluster: Cluster, ns: str, pool: str) -> set[str]:
    return {p["metadata"]["uid"] for p in pods(cluster, ns, pool)}


@pytest.fixture
def autoscaled(cluster: Cluster, tiny: Deployed) -> Iterator[tuple[Deployed, dict[str, set[str]]]]:
    """The example with spec.autoscaling, and each pool's pods before it was set; removed again however
    the test ends (the test asserts what the removal does), with one pod per pool left as the next
    module expects."""
    before = {pool: uids(cluster, tiny.ns, pool) for pool in ("prefill", "decode", "render")}
    cluster.kubectl("patch", "dm", MODEL, "-n", tiny.ns, "--type=merge",
                    "-p", json.dumps({"spec": {"autoscaling": AUTOSCALING}}))
    yield tiny, before
    if "autoscaling" in dm(cluster, tiny.ns)["spec"]:
        cluster.kubectl("patch", "dm", MODEL, "-n", tiny.ns, "--type=json",
                        "-p", '[{"op": "remove", "path": "/spec/autoscaling"}]')
    cluster.wait_for(lambda: all(len([p for p in pods(cluster, tiny.ns, pool) if ready(p)]) == 1
                                 and len(pods(cluster, tiny.ns, pool)) == 1 for pool in ("prefill", "decode")),
                     "one pod per pool again", timeout=300, interval=1)


def test_a_load_scales_prefill_and_decode_up_within_bounds_and_ratio_and_idle_scales_them_back(
    cluster: Cluster, autoscaled: tuple[Deployed, dict[str, set[str]]], forcer: Forcer
) -> None:
    (deployed, before), t0 = autoscaled, time.monotonic()
    ns = deployed.ns
    assert all(len(u) == 1 for u in before.values()), before

    # Quiet: the planner reads every engine (latency 0: no request in the interval) and keeps 1 and 1.
    def quiet_status() -> dict[str, Any] | None:
        status = dm(cluster, ns).get("status", {}).get("autoscaling")
        signals = (status or {}).get("signals", {})
        return status if {"ttftP90Seconds", "itlP90Seconds"} <= set(signals) else None
    status = cluster.wait_for(quiet_status, "the planner's first signals", timeout=120, interval=1)
    assert status["source"] == "pods" and "errors" not in status, status
    assert status["signals"]["ttftP90Seconds"] == 0 and status["signals"]["itlP90Seconds"] == 0, status
    for pool in ("prefill", "decode"):
        assert status["pools"][pool] | {"reason": ""} == {
            "current": 1, "desired": 1, "minReplicas": 1, "maxReplicas": MAX, "managedBy": "planner", "reason": ""}
    assert within(sizes(cluster, ns)) == (1, 1)
    assert {pool: uids(cluster, ns, pool) for pool in before} == before, "setting spec.autoscaling replaced pods"

    # A load of long prompts through the decode Service (3 requests in flight): decode grows first
    # (1 prefill pod allows at most 2 decode pods), prefill once the new decode pod is ready.
    seen = [(1, 1)]  # the planner's sizes, each change in turn
    held_for_decode: list[str] = []
    loaded = time.monotonic()
    with RequestStream(deployed.url, forcer, workers=3) as load:
        def scaled_up() -> bool:
            now = sizes(cluster, ns)
            if seen[-1] != (step := within(now)):
                seen.append(step)
            pools = dm(cluster, ns).get("status", {}).get("autoscaling", {}).get("pools", {})
            reason = pools.get("prefill", {}).get("reason", "")
            if "1 until the other pool's new pods are ready (ratio)" in reason:
                held_for_decode.append(reason)
            return now == {"prefill": (MAX, MAX), "decode": (MAX, MAX)}
        cluster.wait_for(scaled_up, "prefill and decode scaled up to 2, every pod ready", timeout=READY_TIMEOUT,
                         interval=1)
        up = time.monotonic()
        assert seen == [(1, 1), (1, 2), (2, 2)], seen
        assert held_for_decode, "prefill was never held for decode's new pod"
        # The new pods serve: the new decode pod is behind the Service, the new prefill pod in the
        # sidecars' selection.
        new = {pool: [p for p in pods(cluster, ns, pool) if p["metadata"]["uid"] not in before[pool]]
               for pool in ("prefill", "decode")}
        assert all(len(n) == 1 for n in new.values()), new
        cluster.wait_for(lambda: all(served(n[0]) >= 1 for n in new.values()), "the new pods serving",
                         timeout=120, interval=1)
        status = dm(cluster, ns)["status"]["autoscaling"]
        assert status["pools"]["prefill"]["desired"] == MAX and status["pools"]["decode"]["desired"] == MAX
        assert "lastScaleTime" in status and "errors" not in status, status
        # The signals are the engines' own, past their targets (the reasons say which and by how much).
        assert status["signals"]["ttftP90Seconds"] > TARGETS["ttftSeconds"], status
        assert status["signals"]["itlP90Seconds"] > TARGETS["itlSeconds"], status
        loaded_signals = status["signals"]
        scaled_up_messages = messages(cluster, ns, "ScaledUp")
        assert any(m.startswith("decode 1 → 2: ITL p90") for m in scaled_up_messages), scaled_up_messages
        assert any(m.startswith("prefill 1 → 2: TTFT p90") for m in scaled_up_messages), scaled_up_messages

        # The load stops; a trickle that leaves both signals at 0 keeps going through the decode
        # Service while the pools shrink: short prompts (no prefill leg), one token each.
        with RequestStream(deployed.url, forcer, prompt_words=0, max_tokens=1) as trickle:
            load.stop()
            quiet = time.monotonic()
            [going] = new["prefill"]
            shrinking: list[float] = []
            held_for_prefill: list[str] = []

            def scaled_down() -> bool:
                now = sizes(cluster, ns)
                step = within(now)
                if seen[-1] != step:
                    seen.append(step)
                    shrinking.append(time.monotonic())
                pools = dm(cluster, ns).get("status", {}).get("autoscaling", {}).get("pools", {})
                reason = pools.get("decode", {}).get("reason", "")
                if "2 until the other pool has shrunk (ratio)" in reason:
                    held_for_prefill.append(reason)
                return step == (1, 1) and all(len(pods(cluster, ns, pool)) == 1 for pool in ("prefill", "decode"))
            cluster.wait_for(scaled_down, "prefill and decode back to 1, the other pods gone",
                             timeout=DOWN_WINDOW + 300, interval=1)
            down = time.monotonic()
            trickle_count = len(trickle.snapshot())
        assert not trickle.failed(), trickle.summary()
        assert trickle.outcomes().keys() == {"skipped"} and trickle_count >= 10, trickle.summary()
    assert not load.failed(), load.summary()
    assert load.outcomes()["remote"] >= 10, load.summary()

    # Not before the scale-down window (counted from the last decision that still saw the load).
    assert shrinking[0] - quiet >= DOWN_WINDOW - INTERVAL - 1, (shrinking[0] - quiet)
    assert seen[-3:] == [(2, 2), (1, 2), (1, 1)], seen  # prefill first: at most one prefill pod per decode pod
    assert held_for_prefill, "decode was never held for prefill"
    # The prefill pod that went is the one that came (the newest), out of the sidecars' selection first.
    assert {p["metadata"]["uid"] for p in pods(cluster, ns, "prefill")} == before["prefill"]
    name = going["metadata"]["name"]
    assert any(name in m and "before prefill 2 → 1" in m for m in messages(cluster, ns, "PrefillDeselected"))
    scaled_down_messages = messages(cluster, ns, "ScaledDown")
    assert any(m.startswith("prefill 2 → 1: TTFT p90 0s") for m in scaled_down_messages), scaled_down_messages
    assert any(m.startswith("decode 2 → 1: ITL p90 0s") for m in scaled_down_messages), scaled_down_messages
    status = dm(cluster, ns)["status"]["autoscaling"]
    assert {pool: (status["pools"][pool]["current"], status["pools"][pool]["desired"])
            for pool in ("prefill", "decode")} == {"prefill": (1, 1), "decode": (1, 1)}
    assert status["signals"]["ttftP90Seconds"] == 0 and status["signals"]["itlP90Seconds"] == 0, status

    # Without spec.autoscaling the Deployments follow pools.*.replicas again (1 each), the status
    # says nothing of a planner, and no pod was replaced by any of this.
    cluster.kubectl("patch", "dm", MODEL, "-n", ns, "--type=json", "-p", '[{"op": "remove", "path": "/spec/autoscaling"}]')
    cluster.wait_for(lambda: "autoscaling" not in dm(cluster, ns).get("status", {}), "status.autoscaling removed",
                     timeout=60, interval=1)
    assert within(sizes(cluster, ns)) == (1, 1)
    doc = dm(cluster, ns)
    [cond] = [c for c in doc["status"]["conditions"] if c["type"] == "Ready"]
    assert cond["status"] == "True", cond
    assert uids(cluster, ns, "render") == before["render"]
    print(f"module {time.monotonic() - t0:.0f}s; scaled up {up - loaded:.0f}s after the load began, down {down - quiet:.0f}s after it ended "
          f"(first step {shrinking[0] - quiet:.0f}s); signals under the load {loaded_signals}; load: {load.summary()}; "
          f"trickle: {trickle.summary()}")
