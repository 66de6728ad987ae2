"""Prefill pods leave the sidecars' selection before the planner shrinks their pool (retire.py, and
its use in planner.tick with a recording stand-in for the API; the real API server:
tests/operator/test_cluster_planner.py)."""

from __future__ import annotations

from typing import Any

import pytest

from disagg_operator import names, retire
from disagg_operator.names import Role
from disagg_operator.plan import Plan
from disagg_operator.planner import ModelState, tick
from tests.operator.builders import full_spec, plan_of
from tests.operator.cases import merged

REV = "abcdef123456"


def pod(name: str, *, created: str = "2026-12-05T10:00:00Z", ready: bool = True, node: str | None = "n1",
        phase: str = "Running", leaving: bool = False, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "creationTimestamp": created,
                            "labels": {} if leaving else {names.KV_REVISION: REV},
                            "annotations": {retire.LEAVING: REV, retire.DELETION_COST: retire.LOWEST_COST} if leaving else {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-05T11:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_the_pods_to_go_are_those_a_replicaset_deletes_first() -> None:
    pods = [pod("old", created="2026-12-05T09:00:00Z"), pod("new", created="2026-12-05T10:30:00Z"),
            pod("unready", ready=False), pod("pending", phase="Pending", node="n1", ready=False),
            pod("unscheduled", node=None, phase="Pending", ready=False)]
    assert [p["metadata"]["name"] for p in retire.deletion_order(pods)] == [
        "unscheduled", "pending", "unready", "new", "old"]


@pytest.mark.parametrize("pods,current,desired,listed,want", [
    # Shrinking 3 → 1: the two newest are marked, nothing is scaled yet.
    ([pod("a", created="2026-12-05T09:00:00Z"), pod("b"), pod("c", created="2026-12-05T10:30:00Z")], 3, 1, {"a", "b", "c"},
     retire.Retirement(mark=("c", "b"), scale=False)),
    # Marked, but a Service still lists one: wait.
    ([pod("a"), pod("b", leaving=True), pod("c", leaving=True)], 3, 1, {"a", "c"},
     retire.Retirement(scale=False, waiting_for=("c",))),
    # Marked and no longer listed: scale.
    ([pod("a"), pod("b", leaving=True), pod("c", leaving=True)], 3, 1, {"a"}, retire.Retirement()),
    # The load came back: every marked pod is selected again.
    ([pod("a"), pod("b", leaving=True)], 2, 2, {"a"}, retire.Retirement(unmark=("b",))),
    ([pod("a"), pod("b", leaving=True)], 2, 3, {"a"}, retire.Retirement(unmark=("b",))),
    # Scaled down already, the ReplicaSet not done yet: the marked pods stay out.
    ([pod("a"), pod("b", leaving=True), pod("c", leaving=True)], 1, 1, {"a"}, retire.Retirement()),
    # Fewer to go than are marked (3 → 2 after 3 → 1 was marked): the one deleted last stays.
    ([pod("a"), pod("b", leaving=True, created="2026-12-05T10:30:00Z"), pod("c", leaving=True)], 3, 2, {"a"},
     retire.Retirement(unmark=("c",), scale=False)),
    # Pods being deleted already are not counted or marked.
    ([pod("a"), pod("b", created="2026-12-05T10:30:00Z"), pod("gone", deleting=True, created="2026-12-05T10:40:00Z")],
     2, 1, {"a", "b"}, retire.Retirement(mark=("b",), scale=False)),
])
def test_plan(pods, current, desired, listed, want) -> None:
    assert retire.plan(pods, current, desired, listed) == want


def test_marking_moves_the_revision_into_an_annotation_and_back() -> None:
    patch = retire.mark_patch(pod("a"))
    assert patch == {"metadata": {"labels": {names.KV_REVISION: None},
                                  "annotations": {retire.LEAVING: REV, retire.DELETION_COST: str(-(2**31))}}}
    back = retire.unmark_patch(pod("a", leaving=True))
    assert back == {"metadata": {"labels": {names.KV_REVISION: REV},
                                 "annotations": {retire.LEAVING: None, retire.DELETION_COST: None}}}


class Api:
    """The pods and EndpointSlices the planner reads, and what it patches and scales; patches applied."""

    def __init__(self, pods: list[dict[str, Any]], model: str) -> None:
        self.pods_ = {p["metadata"]["name"]: p for p in pods}
        self.model = model
        self.calls: list[tuple[str, ...]] = []

    def pods(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        assert selector == names.selector(self.model, Role.PREFILL)
        return list(self.pods_.values())

    def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.calls.append(("patch", name))
        meta = self.pods_[name]["metadata"]
        for part in ("labels", "annotations"):
            for key, value in patch["metadata"][part].items():
                if value is None:
                    meta[part].pop(key, None)
                else:
                    meta[part][key] = value

    def service_endpoints(self, namespace: str, service: str) -> list[tuple[str, str]]:
        # What the EndpointSlice controller does: the Service lists the ready pods carrying its revision.
        return [(n, "10.0.0.1") for n, p in self.pods_.items()
                if names.prefill_revision_service(self.model, p["metadata"]["labels"].get(names.KV_REVISION, "-")) == service]

    def scale(self, namespace: str, deployment: str, replicas: int) -> None:
        self.calls.append(("scale", deployment, str(replicas)))


def autoscaled(**extra: Any) -> Plan:
    """The full spec with the planner on (Prometheus as its source) and a KV revision."""
    plan = plan_of(merged(full_spec(), {"autoscaling": {
        "prefill": {"maxReplicas": 3}, "decode": {"maxReplicas": 3}, "targets": {"waitingPerPrefillPod": 4},
        "prometheus": {"url": "http://prometheus:9090"}, **extra}}))
    assert plan.kv_revision is not None
    return plan


def test_the_planner_shrinks_prefill_only_after_its_pods_left_the_sidecars_selection() -> None:
    plan = autoscaled(stabilization={"scaleDownSeconds": 0})
    revision = plan.kv_revision
    pods = [pod(f"p{i}", created=f"2026-12-05T10:0{i}:00Z") for i in range(3)]
    for p in pods:
        p["metadata"]["labels"][names.KV_REVISION] = revision
    api = Api(pods, plan.name)
    idle = '{"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, "0"]}]}}'
    deployments = {"qwen3-8b-prefill": {"spec": {"replicas": 3}, "status": {"readyReplicas": 3}},
                   "qwen3-8b-decode": {"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}}
    state = ModelState()
    history_seed = tick(plan, deployments, {}, api, state, fetch=lambda url: idle, now=0.0)
    assert history_seed is not None
    # Idle (0 waiting) for the whole (zero) window: prefill is to go to 1; the two newest are marked first.
    first = tick(plan, deployments, {}, api, state, fetch=lambda url: idle, now=15.0)
    assert first is not None and first.moves == ()
    assert api.calls == [("patch", "p2"), ("patch", "p1")]
    assert [r for r, _ in first.events] == ["PrefillDeselected"]
    assert state.stepping, "the next decision comes at the timer's pace"
    assert "waiting for p2, p1 to leave the sidecars' selection" in first.status["pools"]["prefill"]["reason"]
    assert [n for n, _ in api.service_endpoints("prod", names.prefill_revision_service(plan.name, revision))] == ["p0"]
    # The next tick finds them out of the Service: now the Deployment shrinks.
    api.calls.clear()
    second = tick(plan, deployments, {}, api, state, fetch=lambda url: idle, now=30.0)
    assert second is not None and api.calls == [("scale", "qwen3-8b-prefill", "1")]
    assert [(m.pool, m.before, m.after) for m in second.moves] == [(Role.PREFILL, 3, 1)]
    assert not state.stepping


@pytest.mark.parametrize("ratio,decode_with_prefill", [
    ({"min": 0.5, "max": 1}, False),  # decode follows at the decision after prefill's scale
    ({"min": 1, "max": 1}, True),  # a tight ratio: both in one decision, prefill's call first
])
def test_decode_shrinks_only_after_prefill_when_the_ratio_needs_it(ratio: dict, decode_with_prefill: bool) -> None:
    """Prefill's scale-down waits for its pods to leave the sidecars' selection; decode, which could
    shrink at once, waits too where 2 prefill pods on 1 decode pod would leave ratio.max."""
    plan = autoscaled(stabilization={"scaleDownSeconds": 0}, ratio=ratio,
                      targets={"waitingPerPrefillPod": 4, "itlSeconds": 0.05})
    pods = [pod(f"p{i}", created=f"2026-12-05T10:0{i}:00Z") for i in range(2)]
    for p in pods:
        p["metadata"]["labels"][names.KV_REVISION] = plan.kv_revision
    api = Api(pods, plan.name)
    idle = '{"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, "0"]}]}}'
    sizes = {"prefill": 2, "decode": 2}

    reasons: dict[str, str] = {}

    def step(now: float) -> list[tuple[str, ...]]:
        api.calls.clear()
        deployments = {f"qwen3-8b-{pool}": {"spec": {"replicas": n}, "status": {"readyReplicas": n}}
                       for pool, n in sizes.items()}
        result = tick(plan, deployments, {}, api, state, fetch=lambda url: idle, now=now)
        assert result is not None
        reasons.update({pool: entry["reason"] for pool, entry in result.status["pools"].items()})
        for call in api.calls:
            if call[0] == "scale":
                sizes[call[1].rsplit("-", 1)[1]] = int(call[2])
        return [c for c in api.calls if c[0] == "scale"]

    state = ModelState()
    step(0.0)  # the sizes found
    # Idle: both are to go to 1. The prefill pod to go is marked; decode stays for it.
    assert step(15.0) == [] and ("patch", "p1") in api.calls
    assert "2 until the other pool has shrunk (ratio)" in reasons["decode"] and state.stepping
    assert step(20.0)[0] == ("scale", "qwen3-8b-prefill", "1")
    if decode_with_prefill:
        assert api.calls[-1] == ("scale", "qwen3-8b-decode", "1")
    else:
        assert sizes["decode"] == 2 and step(25.0) == [("scale", "qwen3-8b-decode", "1")]
    assert sizes == {"prefill": 1, "decode": 1}


def test_a_marked_pod_the_planner_keeps_is_selected_again() -> None:
    plan = autoscaled()
    kept = pod("p1", leaving=True)
    kept["metadata"]["annotations"][retire.LEAVING] = plan.kv_revision
    api = Api([pod("p0"), kept], plan.name)
    busy = '{"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, "8"]}]}}'
    deployments = {"qwen3-8b-prefill": {"spec": {"replicas": 2}, "status": {"readyReplicas": 2}},
                   "qwen3-8b-decode": {"spec": {"replicas": 2}, "status": {"readyReplicas": 2}}}
    result = tick(plan, deployments, {}, api, ModelState(), fetch=lambda url: busy, now=0.0)
    assert result is not None and ("patch", "p1") in api.calls
    assert api.pods_["p1"]["metadata"]["labels"][names.KV_REVISION] == plan.kv_revision
    assert retire.LEAVING not in api.pods_["p1"]["metadata"]["annotations"]
    assert "PrefillReselected" in [r for r, _ in result.events]


def test_a_users_hpa_taking_the_pool_over_puts_marked_pods_back() -> None:
    plan = autoscaled()
    left = pod("p1", leaving=True)
    left["metadata"]["annotations"][retire.LEAVING] = plan.kv_revision
    api = Api([pod("p0"), left, pod("p2", leaving=True, deleting=True)], plan.name)
    idle = '{"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, "0"]}]}}'
    deployments = {"qwen3-8b-prefill": {"spec": {"replicas": 2}, "status": {"readyReplicas": 2}},
                   "qwen3-8b-decode": {"spec": {"replicas": 2}, "status": {"readyReplicas": 2}}}
    result = tick(plan, deployments, {"qwen3-8b-prefill": "mine"}, api, ModelState(), fetch=lambda url: idle, now=0.0)
    assert result is not None and result.status["pools"]["prefill"]["managedBy"] == "HorizontalPodAutoscaler/mine"
    assert api.calls == [("patch", "p1")], "only the living marked pod; nothing scaled"
    assert api.pods_["p1"]["metadata"]["labels"][names.KV_REVISION] == plan.kv_revision
    assert [r for r, _ in result.events] == ["PrefillReselected"]
