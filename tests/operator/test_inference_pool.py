"""router.inferencePool, router.minPrefillTokens and prefix-affinity: plan, objects, status (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from disagg_operator import names
from disagg_operator.kinds import INFERENCE_POOL, POD_MONITOR, Kind
from disagg_operator.objects import build_objects
from disagg_operator.plan import Plan, Role
from disagg_operator.reconcile import converge, model_status
from disagg_operator.status import compute_status, status_patch
from disagg_sidecar.config import SidecarConfig
from tests.operator.builders import example_doc, full_spec, plan_of, sidecar_file
from tests.operator.cases import merged

T0 = "2026-12-01T08:00:00Z"
PICKER = {"name": "qwen-epp", "port": 9002, "failureMode": "FailOpen"}


def enabled(spec: dict[str, Any] | None = None, **pool: Any) -> dict[str, Any]:
    return merged(spec or full_spec(), {"router": {"inferencePool": {"enabled": True, **pool}}})


def of_kind(plan: Plan, kind: str) -> list[dict[str, Any]]:
    return [o for o in build_objects(plan) if o["kind"] == kind]


def templates(plan: Plan) -> dict[str, dict[str, str]]:
    """Pod template labels by pool role."""
    return {d["metadata"]["labels"][names.POOL]: d["spec"]["template"]["metadata"]["labels"]
            for d in of_kind(plan, "Deployment")}


def test_off_by_default_no_pool_no_labels_no_header_trust() -> None:
    plan = plan_of(full_spec())
    assert of_kind(plan, "InferencePool") == []
    assert all(names.LLM_D_ROLE not in labels and names.INFERENCE_POOL not in labels
               for labels in templates(plan).values())
    prefill = sidecar_file(plan)["prefill"]
    assert prefill["trust_prefiller_header"] is False and "pool_port" not in prefill
    assert "metrics" not in sidecar_file(plan)  # the sidecar's default: its own metrics only


def test_enabled_pool_selects_exactly_decode_and_prefill_pods_at_the_sidecar_port() -> None:
    plan = plan_of(enabled(endpointPicker=PICKER))
    [pool] = of_kind(plan, "InferencePool")
    assert (pool["apiVersion"], pool["kind"]) == (INFERENCE_POOL.api_version, INFERENCE_POOL.kind)
    assert pool["metadata"]["name"] == plan.name
    assert pool["spec"]["targetPorts"] == [{"number": plan.sidecar.port}]
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "qwen-epp", "port": {"number": 9002},
                                                 "failureMode": "FailOpen"}
    selector = pool["spec"]["selector"]["matchLabels"]
    members = {role for role, labels in templates(plan).items() if selector.items() <= labels.items()}
    assert members == {"decode", "prefill"}  # render and derender pods are not members
    for role in members:
        assert templates(plan)[role][names.LLM_D_ROLE] == role


def test_without_a_picker_the_pool_names_none() -> None:
    [pool] = of_kind(plan_of(enabled()), "InferencePool")
    assert "endpointPickerRef" not in pool["spec"]


def test_enabling_never_changes_a_deployment_selector() -> None:
    def selectors(plan: Plan) -> dict[str, Any]:
        return {d["metadata"]["name"]: d["spec"]["selector"] for d in of_kind(plan, "Deployment")}
    assert selectors(plan_of(enabled())) == selectors(plan_of(full_spec()))


def test_enabled_pool_trusts_the_header_and_maps_the_pool_port() -> None:
    spec = merged(enabled(), {"router": {"port": 8100, "service": {"port": 80}}})
    plan = plan_of(spec)
    prefill = sidecar_file(plan)["prefill"]
    assert prefill["trust_prefiller_header"] is True and prefill["pool_port"] == 8100
    assert of_kind(plan, "InferencePool")[0]["spec"]["targetPorts"] == [{"number": 8100}]


def test_decode_only_model_gets_a_pool_of_decode_pods() -> None:
    plan = plan_of(enabled(merged(full_spec(), {"pools": {"prefill": {"replicas": 0}}})))
    [pool] = of_kind(plan, "InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    assert {r for r, labels in templates(plan).items() if selector.items() <= labels.items()} == {"decode"}
    assert sidecar_file(plan)["prefill"] == {"mode": "local"}
    assert sidecar_file(plan)["metrics"] == {"include_engine": True}


def test_enabled_pool_serves_the_engines_metrics_at_the_target_port() -> None:
    file = sidecar_file(plan_of(enabled()))
    assert file["metrics"] == {"include_engine": True}
    assert SidecarConfig.model_validate(file).metrics.include_engine is True  # what the sidecar reads


def test_prefix_affinity_is_the_default_with_the_engines_block_size() -> None:
    spec = example_doc()["spec"]
    spec["router"].pop("prefillSelection", None)
    prefill = sidecar_file(plan_of(spec))["prefill"]
    assert prefill["selection"] == "prefix-affinity" and prefill["affinity_block_tokens"] == 16  # GPU default
    assert prefill["affinity_load_bound_percent"] == 125
    bound = sidecar_file(plan_of(merged(spec, {"router": {"prefillLoadBoundPercent": 150}})))["prefill"]
    assert bound["affinity_load_bound_percent"] == 150
    big = merged(spec, {"model": {"engineArgs": ["--block-size", "64"]}})
    assert sidecar_file(plan_of(big))["prefill"]["affinity_block_tokens"] == 64


@pytest.mark.parametrize("connector, asked", [("NixlConnector", 0), ("NixlConnector", 500), ("ExampleConnector", 1),
                                              ("ExampleConnector", 10_000)])
def test_min_prefill_tokens_is_the_larger_of_the_spec_and_the_connector(connector: str, asked: int) -> None:
    spec = merged(full_spec(), {"kvTransfer": {"connector": connector}, "router": {"minPrefillTokens": asked}})
    plan = plan_of(spec)
    assert sidecar_file(plan)["prefill"].get("min_prompt_tokens", 0) == max(asked, plan.min_prompt_tokens)


# --- status ------------------------------------------------------------------------------------

def ready_deployments(plan: Plan) -> dict[str, dict[str, Any]]:
    out = {}
    for obj in of_kind(plan, "Deployment"):
        n = obj["spec"].get("replicas", 1)
        out[obj["metadata"]["name"]] = {**obj, "metadata": {**obj["metadata"], "generation": 1}, "status": {
            "observedGeneration": 1, "replicas": n, "readyReplicas": n, "updatedReplicas": n, "availableReplicas": n}}
    return out


def conditions(status: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_status_reports_the_pool_and_a_missing_crd() -> None:
    plan = plan_of(enabled())
    ok = compute_status(plan, ready_deployments(plan), generation=1, previous=None, now=T0)
    assert ok["inferencePool"] == {"name": plan.name, "targetPort": plan.sidecar.port,
                                   "selector": names.inference_pool_selector(plan.name)}
    assert conditions(ok)["InferencePoolReady"]["status"] == "True" and conditions(ok)["Ready"]["status"] == "True"

    missing = compute_status(plan, ready_deployments(plan), generation=1, previous=ok, now=T0,
                             unavailable=(INFERENCE_POOL.crd,))
    cond = conditions(missing)["InferencePoolReady"]
    assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled") and INFERENCE_POOL.crd in cond["message"]
    assert conditions(missing)["Ready"]["status"] == "False" and missing["inferencePool"] is None
    assert status_patch(ok, missing)["inferencePool"] is None  # the merge patch removes it


def test_disabling_removes_the_pool_from_the_status() -> None:
    on, off = plan_of(enabled()), plan_of(full_spec())
    before = compute_status(on, ready_deployments(on), generation=1, previous=None, now=T0)
    after = compute_status(off, ready_deployments(off), generation=2, previous=before, now=T0)
    assert "InferencePoolReady" not in conditions(after)
    assert status_patch(before, after)["inferencePool"] is None
    assert "inferencePool" not in status_patch({}, after)  # never written: nothing to remove


# --- convergence without the CRD -----------------------------------------------------------------

class RecordingApi:
    """Stands in for the API server: serves the InferencePool kind only when ``crd`` is True."""

    def __init__(self, crd: bool):
        self.crd = crd
        self.applied: list[str] = []

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        self.applied.append(obj["kind"])
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}

    def create_if_missing(self, obj: Mapping[str, Any]) -> bool:
        self.applied.append(obj["kind"])
        return True

    def delete(self, obj: Mapping[str, Any]) -> None:
        raise AssertionError("nothing to prune")

    def serves(self, kind: Kind) -> bool:
        return self.crd or not kind.optional


def doc(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedModel",
            "metadata": {"name": "qwen3-8b", "namespace": "prod", "uid": f"uid-{id(spec)}", "generation": 1},
            "spec": spec}


def test_converge_without_the_crd_applies_the_rest_and_says_which_crd_is_missing() -> None:
    model = doc(enabled())
    api = RecordingApi(crd=False)
    outcome = converge(model, {}, api, now=T0)
    # PodMonitors on "auto" (the default) are left out quietly: missing, but not awaited.
    assert outcome.unavailable == [INFERENCE_POOL.crd, POD_MONITOR.crd] and "InferencePool" not in api.applied
    assert outcome.awaited == [INFERENCE_POOL.crd]
    assert "Deployment" in api.applied
    status = model_status(model, {}, now=T0, unavailable=tuple(outcome.unavailable))
    assert status is not None and conditions(status)["InferencePoolReady"]["reason"] == "CRDNotInstalled"

    with_crd = RecordingApi(crd=True)
    assert converge(model, {}, with_crd, now=T0).unavailable == [] and "InferencePool" in with_crd.applied
    assert "PodMonitor" in with_crd.applied


def test_models_without_the_pool_never_ask_for_the_crd() -> None:
    class NoDiscovery(RecordingApi):
        def serves(self, kind: Kind) -> bool:
            assert kind is not INFERENCE_POOL, "asked about " + kind.kind
            return True
    assert converge(doc(full_spec()), {}, NoDiscovery(crd=False), now=T0).unavailable == []


def test_toggling_changes_the_member_pools_hash_only() -> None:
    """Labels dropped from a template look like no drift to a comparison of our fields; the config
    hash is what makes the operator re-apply decode and prefill when the pool is turned off."""
    def hashes(plan: Plan) -> dict[Role, str]:
        return {p.role: p.config_hash for p in plan.pools}
    on, off = hashes(plan_of(enabled())), hashes(plan_of(full_spec()))
    assert {r for r in on if on[r] != off[r]} == {Role.DECODE, Role.PREFILL}
