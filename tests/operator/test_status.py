"""Observed Deployments → status: pool conditions, consistency, progress, degradation, timestamps."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from disagg_operator import names
from disagg_operator.objects import build_objects
from disagg_operator.plan import Plan, Role
from disagg_operator.reconcile import converge
from disagg_operator.status import compute_status, invalid_status, status_patch
from tests.operator.cases import merged
from tests.operator.builders import example_doc, plan_of

T0, T1 = "2026-11-29T08:00:00Z", "2026-11-29T09:00:00Z"


def plan() -> Plan:
    return plan_of(example_doc()["spec"])


def live_deployments(p: Plan, **overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The plan's Deployments as the API would show them after a finished rollout, then ``overrides``
    (by role: {"status": {...}} merged, "hash" replaces the template hash, None removes the Deployment)."""
    out = {}
    for obj in build_objects(p):
        if obj["kind"] != "Deployment":
            continue
        role = obj["metadata"]["labels"][names.POOL]
        live = copy.deepcopy(obj)
        n = live["spec"].get("replicas", 1)  # an autoscaled pool leaves the count to its HPA
        live["metadata"]["generation"] = 2
        live["status"] = {"observedGeneration": 2, "replicas": n, "readyReplicas": n, "updatedReplicas": n,
                          "availableReplicas": n}
        change = overrides.get(role, {})
        if change is None:
            continue
        if "hash" in change:
            live["spec"]["template"]["metadata"]["annotations"][names.CONFIG_HASH] = change["hash"]
        live = merged(live, {k: v for k, v in change.items() if k != "hash"})
        out[obj["metadata"]["name"]] = live
    return out


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_pools_ready() -> None:
    p = plan()
    status = compute_status(p, live_deployments(p), generation=4, previous=None, now=T0)
    assert conditions(status) == {
        "Ready": ("True", "Ready"), "PrefillReady": ("True", "Ready"), "DecodeReady": ("True", "Ready"),
        "RenderReady": ("True", "Ready"), "DerenderReady": ("True", "SharedWithRender"),
        "ConfigConsistent": ("True", "Consistent"), "Progressing": ("False", "Stable"),
        "Degraded": ("False", "AsExpected"), "VersionSupported": ("True", "Supported"),
    }
    assert [c["type"] for c in status["conditions"]][0] == "Ready"
    assert all(c["observedGeneration"] == 4 and c["lastTransitionTime"] == T0 for c in status["conditions"])
    assert status["observedGeneration"] == 4
    assert status["endpoint"] == "http://qwen3-8b.prod.svc:8000"
    assert status["readyPools"] == "3/3" and status["disaggregation"] == "prefill-decode"
    assert status["configHash"] == p.config_hash
    assert status["pools"]["decode"] == {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                                         "availableReplicas": 2, "configHash": p.pool(Role.DECODE).config_hash}
    assert "serving at http://qwen3-8b.prod.svc:8000" in next(c for c in status["conditions"] if c["type"] == "Ready")["message"]


@pytest.mark.parametrize(("change", "expected"), [
    ({"decode": None}, {"DecodeReady": ("False", "Missing"), "Degraded": ("False", "AsExpected"),
                        "Ready": ("False", "NotReady")}),
    ({"render": {"status": {"readyReplicas": 1}}},
     {"RenderReady": ("False", "NotReady"), "DerenderReady": ("False", "SharedWithRender"),
      "Progressing": ("True", "Scaling"), "ConfigConsistent": ("True", "Consistent"), "Ready": ("False", "NotReady")}),
    ({"decode": {"status": {"replicas": 3, "updatedReplicas": 1, "readyReplicas": 2}}},
     {"DecodeReady": ("False", "RollingOut"), "ConfigConsistent": ("False", "RollingOut"),
      "Progressing": ("True", "RollingOut"), "Degraded": ("False", "AsExpected")}),
    ({"prefill": {"hash": "edited-by-hand"}},
     {"PrefillReady": ("False", "Pending"), "ConfigConsistent": ("False", "Drifted")}),
    ({"decode": {"metadata": {"generation": 3}}},
     {"DecodeReady": ("False", "Pending"), "ConfigConsistent": ("False", "RollingOut"), "Progressing": ("True", "RollingOut")}),
    ({"prefill": {"spec": {"replicas": 4}, "status": {"replicas": 4, "updatedReplicas": 4, "readyReplicas": 2}}},
     {"PrefillReady": ("True", "Ready"), "Progressing": ("True", "Scaling")}),  # scaled by hand: restored soon
    ({"decode": {"status": {"conditions": [{"type": "Progressing", "status": "False",
                                            "reason": "ProgressDeadlineExceeded", "message": "timed out"}]}}},
     {"Degraded": ("True", "PoolFailing")}),
])
def test_conditions_follow_what_the_deployments_show(change: dict[str, Any], expected: dict[str, tuple[str, str]]) -> None:
    p = plan()
    status = compute_status(p, live_deployments(p, **change), generation=2, previous=None, now=T0)
    got = conditions(status)
    assert {k: got[k] for k in expected} == expected


def test_degraded_message_names_the_failure() -> None:
    p = plan()
    change = {"decode": {"status": {"conditions": [{"type": "ReplicaFailure", "status": "True", "message": "quota"}]}}}
    status = compute_status(p, live_deployments(p, **change), generation=2, previous=None, now=T0)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == "decode: cannot create pods: quota"


def test_transition_times_move_only_when_a_status_flips() -> None:
    p = plan()
    first = compute_status(p, live_deployments(p), generation=2, previous=None, now=T0)
    same = compute_status(p, live_deployments(p), generation=2, previous=first, now=T1)
    assert same == first
    flipped = compute_status(p, live_deployments(p, decode={"status": {"readyReplicas": 0}}), generation=2,
                             previous=first, now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert times["DecodeReady"] == times["Ready"] == times["Progressing"] == T1
    assert times["PrefillReady"] == times["RenderReady"] == times["ConfigConsistent"] == T0


def test_decode_only_has_no_prefill_condition_and_says_so() -> None:
    p = plan_of(merged(example_doc()["spec"], {"pools": {"prefill": {"replicas": 0}}}))
    status = compute_status(p, live_deployments(p), generation=1, previous=None, now=T0)
    assert "PrefillReady" not in conditions(status)
    assert status["disaggregation"] == "decode-only" and status["readyPools"] == "2/2"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and "decode prefills locally" in ready["message"]


def test_separate_derender_pool_has_its_own_condition() -> None:
    p = plan_of(merged(example_doc()["spec"], {"pools": {"derender": {"replicas": 1}}}))
    status = compute_status(p, live_deployments(p, derender={"status": {"readyReplicas": 0}}), generation=1,
                            previous=None, now=T0)
    assert conditions(status)["DerenderReady"] == ("False", "NotReady")
    assert conditions(status)["RenderReady"] == ("True", "Ready")


def test_invalid_spec_status_keeps_the_last_pool_conditions() -> None:
    p = plan()
    good = compute_status(p, live_deployments(p), generation=2, previous=None, now=T0)
    bad = invalid_status("spec.pools.decode.replicas: pools.decode.replicas must be at least 1", generation=3,
                         previous=good, now=T1)
    got = conditions(bad)
    assert got["Ready"] == ("False", "InvalidSpec") and got["Degraded"] == ("True", "InvalidSpec")
    assert got["DecodeReady"] == ("True", "Ready")  # the running pods are untouched
    assert bad["observedGeneration"] == 3


def test_status_patch_is_empty_when_nothing_changed_and_clears_removed_pools() -> None:
    p = plan()
    status = compute_status(p, live_deployments(p), generation=2, previous=None, now=T0)
    stored = {**status, "kopf": {"progress": {}}}
    assert status_patch(stored, status) == {}
    fewer = plan_of(merged(example_doc()["spec"], {"pools": {"prefill": {"replicas": 0}}}))
    new = compute_status(fewer, live_deployments(fewer), generation=3, previous=stored, now=T1)
    patch = status_patch(stored, new)
    assert patch["pools"]["prefill"] is None and "kopf" not in patch
    assert patch["disaggregation"] == "decode-only"


def test_a_deployment_that_has_not_taken_the_new_replica_count_is_not_ready() -> None:
    p = plan_of(merged(example_doc()["spec"], {"pools": {"prefill": {"replicas": 3}}}))
    status = compute_status(p, live_deployments(p, prefill={"spec": {"replicas": 2},
                                                            "status": {"replicas": 2, "readyReplicas": 2,
                                                                       "updatedReplicas": 2}}),
                            generation=3, previous=None, now=T0)
    assert conditions(status)["PrefillReady"] == ("False", "RollingOut")
    assert status["pools"]["prefill"]["replicas"] == 3


def test_an_autoscaled_pool_counts_what_the_hpa_asked_for() -> None:
    p = plan_of(merged(example_doc()["spec"], {"pools": {"render": {"autoscaling": {"maxReplicas": 8}}}}))
    status = compute_status(p, live_deployments(p, render={"spec": {"replicas": 5}, "status": {
        "replicas": 5, "readyReplicas": 5, "updatedReplicas": 5, "availableReplicas": 5}}),
        generation=1, previous=None, now=T0)
    assert conditions(status)["RenderReady"] == ("True", "Ready")
    assert status["pools"]["render"]["replicas"] == 5


# The example runs vLLM 0.34 with a stock decode image: stock-inline; sessions need 0.32 or 0.33.
@pytest.mark.parametrize(("engine", "strategy"), [
    ({}, "stock-inline"), ({"renderExtension": False}, "stock-inline"), ({"extension": True}, "inline"),
    ({"vllmVersion": "0.33.0"}, "session"), ({"vllmVersion": "0.33.0", "renderExtension": False}, "stateless")])
def test_status_records_the_derender_strategy_and_a_change_of_it_is_a_patch(engine: dict, strategy: str) -> None:
    p = plan_of(merged(example_doc()["spec"], {"engine": engine}))
    status = compute_status(p, live_deployments(p), generation=2, previous=None, now=T0)
    assert status["derender"] == {"strategy": strategy}
    before = compute_status(plan(), live_deployments(plan()), generation=2, previous=None, now=T0)
    assert status_patch(before, status).get("derender") == (
        None if strategy == "stock-inline" else {"strategy": strategy})


@pytest.mark.parametrize(("version", "supported"), [("0.32.0", True), ("0.33.0", True), ("0.33.2", True),
                                                   ("0.34.0", True), ("0.34.0rc1", True), ("0.35.0", False),
                                                   ("1.0.0", False)])
def test_a_version_outside_the_release_table_is_reported_not_refused(version: str, supported: bool) -> None:
    p = plan_of(merged(example_doc()["spec"], {"engine": {"vllmVersion": version}}))
    status = compute_status(p, live_deployments(p), generation=4, previous=None, now=T0)
    by_type = {c["type"]: c for c in status["conditions"]}
    version_cond = by_type["VersionSupported"]
    assert (version_cond["status"], version_cond["reason"]) == (("True", "Supported") if supported
                                                                 else ("False", "UntestedVersion"))
    if not supported:
        assert version in version_cond["message"] and "0.34" in version_cond["message"]
        assert status["derender"]["strategy"] == "stateless"  # no derender sessions assumed
    assert by_type["Ready"]["status"] == "True"  # served all the same


class _ApplyingApi:
    """Stands in for the API server: applies everything, serves every kind."""

    def __init__(self) -> None:
        self.applied: list[str] = []

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(obj["kind"])
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}

    def create_if_missing(self, obj: dict[str, Any]) -> bool:
        return True

    def delete(self, obj: dict[str, Any]) -> None:
        raise AssertionError("nothing to prune")

    def serves(self, kind: Any) -> bool:
        return True


@pytest.mark.parametrize(("version", "event"), [("0.35.0", True), ("0.34.0", False), ("0.33.0", False)])
def test_converging_an_untested_version_deploys_it_and_says_why(version: str, event: bool) -> None:
    spec = merged(example_doc()["spec"], {"engine": {"vllmVersion": version}})
    model = {**example_doc(), "spec": spec,
             "metadata": {"name": "m", "namespace": "ns", "uid": f"uid-{version}", "generation": 1}}
    api = _ApplyingApi()
    outcome = converge(model, {}, api, now=T0)
    assert outcome.invalid is None and "Deployment" in api.applied
    assert (outcome.untested_version is not None) is event  # handlers post it as an UntestedVersion Event
    if event:
        assert version in outcome.untested_version
