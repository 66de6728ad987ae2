"""Revision-aware pairing: a decode pod's sidecar discovers only the prefill pods of its own KV
revision (a per-revision headless Service), and an older revision's Service stays while decode pods
of that revision may still run (reconcile.converge)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from disagg_operator import names
from disagg_operator.drift import key_of
from disagg_operator.kinds import Kind
from disagg_operator.objects import build_objects
from disagg_operator.plan import Plan
from disagg_operator.reconcile import converge
from tests.operator.builders import full_spec, plan_of
from tests.operator.cases import merged

UID = "uid-pairing"


def discovered_service(plan: Plan) -> str:
    discovery = plan.sidecar.config.prefill.discovery
    assert discovery is not None
    return discovery.service


def objects(plan: Plan, owner: dict[str, Any] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in build_objects(plan, owner)}


def pod_labels(plan: Plan, pool: str) -> dict[str, str]:
    return objects(plan)[("Deployment", f"qwen3-8b-{pool}")]["spec"]["template"]["metadata"]["labels"]


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_sidecar_discovers_only_prefill_pods_of_its_own_kv_revision() -> None:
    old, new = plan_of(full_spec()), plan_of(merged(full_spec(), {"model": {"maxModelLen": 8192}}))
    assert old.kv_revision and new.kv_revision and old.kv_revision != new.kv_revision
    for decode_plan in (old, new):
        service = objects(decode_plan)[("Service", discovered_service(decode_plan))]
        assert service["spec"]["clusterIP"] == "None"  # headless: EndpointSlices list every pod
        selector = service["spec"]["selector"]
        # The decode pod's own revision is the one its sidecar's Service selects ...
        assert pod_labels(decode_plan, "decode")[names.KV_REVISION] == selector[names.KV_REVISION]
        # ... so of the prefill pods of both revisions (mid-rollout), only the matching ones are endpoints.
        matching = [p for p in (old, new) if selects(selector, pod_labels(p, "prefill"))]
        assert matching == [decode_plan]
        assert not selects(selector, pod_labels(decode_plan, "decode"))  # never decode pods


@pytest.mark.parametrize("change,pairs_anew", [
    ({"model": {"maxModelLen": 8192}}, True),
    ({"model": {"engineArgs": ["--dtype", "bfloat16"]}}, True),
    ({"kvTransfer": {"extraConfig": {"backends": ["UCX", "GDS"]}}}, True),
    ({"engine": {"gpuImage": "vllm/vllm-openai:v0.34.1"}}, True),
    ({"pools": {"prefill": {"resources": {"requests": {"cpu": "2"}}}}}, False),  # size and placement: same KV
    ({"pools": {"prefill": {"replicas": 3}}}, False),
    ({"model": {"toolCallParser": "hermes"}}, False),  # decode-side parsing: prefill's KV unchanged
])
def test_what_changes_the_kv_revision(change: dict[str, Any], pairs_anew: bool) -> None:
    before, after = plan_of(full_spec()), plan_of(merged(full_spec(), change))
    assert (before.kv_revision != after.kv_revision) is pairs_anew


def test_a_vllm_release_upgrade_pairs_anew() -> None:
    """0.33 -> 0.34 (tests/sidecar/test_rollout.py): a decode pod of either release prefills only
    with prefill pods of its own (their KV layout and connector code are the release's)."""
    old, new = (plan_of(merged(full_spec(), {"engine": {"vllmVersion": v}})) for v in ("0.33.0", "0.34.0"))
    assert old.kv_revision != new.kv_revision


def test_without_a_prefill_pool_there_is_no_revision_service() -> None:
    plan = plan_of(merged(full_spec(), {"pools": {"prefill": {"replicas": 0}}}))
    assert plan.kv_revision is None
    assert not any(names.KV_REVISION in o["metadata"]["labels"] for o in build_objects(plan))


# --- an older revision's Service during decode's rollout -----------------------------------------

class Api:
    def __init__(self) -> None:
        self.deleted: list[str] = []

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}

    def create_if_missing(self, obj: Mapping[str, Any]) -> bool:
        return False

    def delete(self, obj: Mapping[str, Any]) -> None:
        self.deleted.append(f"{obj['kind']}/{obj['metadata']['name']}")

    def serves(self, kind: Kind) -> bool:
        return True


def doc(spec: dict[str, Any], generation: int) -> dict[str, Any]:
    return {"apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedModel",
            "metadata": {"name": "qwen3-8b", "namespace": "prod", "uid": UID, "generation": generation}, "spec": spec}


def live_of(plan: Plan, decode_status: dict[str, int], decode_hash: str) -> dict[Any, dict[str, Any]]:
    owner = names.owner_reference("disagg.dev/v1alpha1", "DisaggregatedModel", "qwen3-8b", UID)
    live = {key_of(o): o for o in build_objects(plan, owner)}
    for key, obj in live.items():
        if key[1] == "Deployment" and key[3] == "qwen3-8b-decode":
            obj["metadata"]["generation"] = 2
            obj["spec"]["template"]["metadata"]["annotations"][names.CONFIG_HASH] = decode_hash
            obj["status"] = {"observedGeneration": 2, **decode_status}
    return live


@pytest.mark.parametrize("decode_status,rolled", [
    ({"replicas": 3, "updatedReplicas": 2}, False),  # an old decode pod remains
    ({"replicas": 2, "updatedReplicas": 2}, True),
])
def test_the_old_revisions_service_goes_only_once_decode_has_rolled(decode_status: dict[str, int], rolled: bool) -> None:
    old_spec, new_spec = full_spec(), merged(full_spec(), {"model": {"maxModelLen": 8192}})
    old, new = plan_of(old_spec, namespace="prod"), plan_of(new_spec, namespace="prod")
    new_decode = new.pool(names.Role.DECODE)
    assert new_decode is not None
    live = live_of(old, decode_status, new_decode.config_hash)  # decode already runs the new template
    api = Api()
    outcome = converge(doc(new_spec, 2), live, api, now="2026-01-01T00:00:00Z")
    old_service = f"Service/{discovered_service(old)}"
    if rolled:
        assert old_service in api.deleted and outcome.retained == []
    else:
        assert old_service not in api.deleted and outcome.retained == [old_service]
    # The decode template not yet the plan's (the apply just happened): kept as well.
    api = Api()
    outcome = converge(doc(new_spec, 2), live_of(old, {"replicas": 2, "updatedReplicas": 2}, "stale"), api,
                       now="2026-01-01T00:00:00Z")
    assert outcome.retained == [old_service]
