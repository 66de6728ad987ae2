"""Desired vs live: an unchanged object is left alone, an edited or missing one re-applied, a stale one pruned."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from disagg_operator.drift import covers, key_of, to_apply, to_prune
from disagg_operator import names
from disagg_operator.objects import build_objects
from tests.operator.cases import merged
from tests.operator.builders import full_spec, plan_of

OWNER = names.owner_reference("disagg.dev/v1alpha1", "DisaggregatedModel", "qwen3-8b", "uid-1")


def as_stored(obj: dict[str, Any]) -> dict[str, Any]:
    """What the API server returns: our fields plus its own (defaults, metadata, status)."""
    live = merged(obj, {"metadata": {"uid": f"uid-{obj['metadata']['name']}", "resourceVersion": "7",
                                     "managedFields": [{"manager": "disagg-operator"}]}})
    if obj["kind"] == "Deployment":
        live["spec"]["progressDeadlineSeconds"] = 600
        live["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
        for c in live["spec"]["template"]["spec"]["containers"]:
            c["terminationMessagePath"] = "/dev/termination-log"
            for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
                if probe in c:
                    c[probe]["successThreshold"] = 1
        live["status"] = {"replicas": 1}
    if obj["kind"] == "Service":
        live["spec"]["sessionAffinity"] = "None"
    return live


def objects() -> list[dict[str, Any]]:
    return build_objects(plan_of(full_spec()), OWNER)


def live_of(objs: list[dict[str, Any]]) -> dict:
    return {key_of(o): as_stored(o) for o in objs}


def test_nothing_to_apply_when_live_objects_carry_our_fields() -> None:
    assert to_apply(objects(), live_of(objects())) == []


def test_missing_and_edited_objects_are_reapplied() -> None:
    desired = objects()
    live = live_of(desired)
    decode_key = next(k for k in live if k[1] == "Deployment" and k[3] == "qwen3-8b-decode")
    live[decode_key]["spec"]["template"]["spec"]["containers"][0]["args"].append("--enforce-eager")
    del live[next(k for k in live if k[1] == "Service" and k[3] == "qwen3-8b-render")]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in to_apply(desired, live)) == [
        ("Deployment", "qwen3-8b-decode"), ("Service", "qwen3-8b-render")]


def test_scaled_by_hand_is_drift_but_not_when_an_hpa_owns_replicas() -> None:
    desired = objects()
    live = live_of(desired)
    for obj in live.values():
        if obj["kind"] == "Deployment":
            obj["spec"]["replicas"] = 9
    assert {o["kind"] for o in to_apply(desired, live)} == {"Deployment"}
    scaled = build_objects(plan_of(merged(full_spec(), {"pools": {"render": {"autoscaling": {"maxReplicas": 9}}}})), OWNER)
    live = live_of(scaled)
    render = next(k for k in live if k[1] == "Deployment" and k[3] == "qwen3-8b-render")
    live[render]["spec"]["replicas"] = 7
    assert to_apply(scaled, live) == []


def test_only_owned_objects_the_plan_dropped_are_pruned() -> None:
    before = objects()
    after = build_objects(plan_of(merged(full_spec(), {"pools": {"prefill": {"replicas": 0}}})), OWNER)
    live = live_of(before)
    foreign = copy.deepcopy(next(o for o in live.values() if o["metadata"]["name"] == "qwen3-8b-prefill"
                                 and o["kind"] == "Service"))
    foreign["metadata"]["name"] = "someone-elses"
    foreign["metadata"]["ownerReferences"] = [{**OWNER, "uid": "uid-other"}]
    live[key_of(foreign)] = foreign
    pruned = sorted((o["kind"], o["metadata"]["name"]) for o in to_prune(after, live, "uid-1"))
    revision = plan_of(full_spec()).kv_revision
    assert revision is not None
    assert pruned == sorted([("Deployment", "qwen3-8b-prefill"), ("NetworkPolicy", "qwen3-8b-prefill"),
                             ("PodDisruptionBudget", "qwen3-8b-prefill"),
                             ("Role", "qwen3-8b-sidecar"), ("RoleBinding", "qwen3-8b-sidecar"),
                             ("Service", "qwen3-8b-prefill"), ("Service", f"qwen3-8b-kv{revision[:6]}"),
                             ("ServiceAccount", "qwen3-8b-sidecar")])


@pytest.mark.parametrize(("live", "desired", "expected"), [
    ({"a": 1, "b": 2}, {"a": 1}, True),
    ({"a": 1}, {"a": 1, "b": 2}, False),
    ({"cpu": "8"}, {"cpu": 8}, True),  # the API server turns quantities into strings
    ({"x": [1, 2]}, {"x": [1]}, False),
    ({"x": [{"a": 1, "z": 0}]}, {"x": [{"a": 1}]}, True),
    ({"flag": 1}, {"flag": True}, False),
    ({"s": "None"}, {"s": None}, False),
])
def test_covers(live: Any, desired: Any, expected: bool) -> None:
    assert covers(live, desired) is expected
