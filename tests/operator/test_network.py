"""Per-model NetworkPolicies (ingress.py → objects/network.py): who can reach which port of which pool.

The objects are judged by a small evaluator of NetworkPolicy semantics (a pod selected by any
policy accepts only what some rule of a selecting policy allows; a rule without `from` admits every
source, without `ports` every port), over the pods the Deployments would create.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from disagg_operator import names
from disagg_operator.objects import build_objects
from disagg_operator.plan import Plan
from tests.operator.builders import full_spec, plan_of
from tests.operator.cases import merged

NS = "prod"


@dataclass(frozen=True)
class Pod:
    labels: dict[str, str]
    namespace: str = NS


OUTSIDER = Pod({"app": "curious"})  # any other pod of the namespace
OTHER_NAMESPACE = Pod({"app": "curious"}, namespace="elsewhere")


def policies(plan: Plan) -> list[dict[str, Any]]:
    return [o for o in build_objects(plan) if o["kind"] == "NetworkPolicy"]


def pods(plan: Plan) -> dict[str, Pod]:
    """The pod of each pool, by role (labels from the Deployment's template)."""
    return {o["metadata"]["labels"][names.POOL]: Pod(o["spec"]["template"]["metadata"]["labels"])
            for o in build_objects(plan) if o["kind"] == "Deployment"}


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # all the operator writes
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def peer_admits(peer: dict[str, Any], source: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # the sources here are pods of the cluster network, not in any test block
    if "namespaceSelector" in peer:
        return source.namespace != NS and matches(peer.get("podSelector", {}), source.labels)
    return source.namespace == NS and matches(peer["podSelector"], source.labels)


def reachable(objs: list[dict[str, Any]], source: Pod, target: Pod, port: int) -> bool:
    selecting = [p for p in objs if matches(p["spec"]["podSelector"], target.labels)]
    if not selecting:
        return True  # not isolated
    for policy in selecting:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            from_ok = "from" not in rule or any(peer_admits(p, source) for p in rule["from"])
            port_ok = "ports" not in rule or any(p["protocol"] == "TCP" and p["port"] == port for p in rule["ports"])
            if from_ok and port_ok:
                return True
    return False


ENGINE, SIDECAR, NIXL = 8200, 8000, 5600


def test_one_policy_per_pool_selecting_exactly_its_pods() -> None:
    plan = plan_of(full_spec())
    objs, by_role = policies(plan), pods(plan)
    assert sorted(p["metadata"]["name"] for p in objs) == sorted(pool.name for pool in plan.pools)
    for policy in objs:
        selected = [role for role, pod in by_role.items() if matches(policy["spec"]["podSelector"], pod.labels)]
        assert [f"qwen3-8b-{r}" for r in selected] == [policy["metadata"]["name"]]
        for rule in policy["spec"]["ingress"]:
            assert "from" in rule or "ports" in rule, "a rule admitting every source on every port"


def test_clients_reach_only_the_sidecar_port() -> None:
    plan = plan_of(full_spec())
    objs, by_role = policies(plan), pods(plan)
    for stranger in (OUTSIDER, OTHER_NAMESPACE):
        assert reachable(objs, stranger, by_role["decode"], SIDECAR)
        assert not reachable(objs, stranger, by_role["decode"], ENGINE), "decode's engine port from outside the pod"
        for role in ("prefill", "render", "derender"):
            assert not reachable(objs, stranger, by_role[role], ENGINE), role
        assert not reachable(objs, stranger, by_role["prefill"], NIXL)
        assert not reachable(objs, stranger, by_role["decode"], NIXL)


def test_engines_accept_only_this_models_decode_pods() -> None:
    plan = plan_of(full_spec())
    objs, by_role = policies(plan), pods(plan)
    decode = by_role["decode"]
    for role in ("prefill", "render", "derender"):
        assert reachable(objs, decode, by_role[role], ENGINE), role
    assert reachable(objs, decode, by_role["prefill"], NIXL)  # the NIXL side channel
    # Not from each other, nor from another model's decode pods.
    other_model = Pod({**decode.labels, names.INSTANCE: "other"})
    for role in ("prefill", "render", "derender"):
        assert not reachable(objs, other_model, by_role[role], ENGINE), role
    assert not reachable(objs, by_role["render"], by_role["prefill"], ENGINE)
    assert not reachable(objs, by_role["derender"], by_role["render"], ENGINE)
    assert not reachable(objs, by_role["render"], by_role["decode"], ENGINE)


def test_with_nixl_prefill_and_decode_accept_each_other_on_any_port() -> None:
    """UCX over TCP connects both ways on ports it picks; nothing else gets those ports."""
    plan = plan_of(full_spec())
    objs, by_role = policies(plan), pods(plan)
    assert plan.kv_connector == "NixlConnector"
    assert reachable(objs, by_role["decode"], by_role["prefill"], 41234)
    assert reachable(objs, by_role["prefill"], by_role["decode"], 41234)
    assert not reachable(objs, by_role["render"], by_role["decode"], 41234)
    assert not reachable(objs, OUTSIDER, by_role["prefill"], 41234)


def test_without_nixl_prefill_gets_only_the_engine_port() -> None:
    plan = plan_of(merged(full_spec(), {"kvTransfer": {"connector": "ExampleConnector"}}))
    objs, by_role = policies(plan), pods(plan)
    assert reachable(objs, by_role["decode"], by_role["prefill"], ENGINE)
    assert not reachable(objs, by_role["decode"], by_role["prefill"], 41234)
    assert not reachable(objs, by_role["prefill"], by_role["decode"], ENGINE)


def test_shared_derender_and_decode_only_models() -> None:
    spec = full_spec()
    del spec["pools"]["derender"]
    plan = plan_of(spec)
    objs, by_role = policies(plan), pods(plan)
    assert sorted(p["metadata"]["name"] for p in objs) == ["qwen3-8b-decode", "qwen3-8b-prefill", "qwen3-8b-render"]
    assert reachable(objs, by_role["decode"], by_role["render"], ENGINE)  # it also derenders
    alone = plan_of(merged(full_spec(), {"pools": {"prefill": {"replicas": 0}, "render": {"replicas": 0},
                                                   "derender": None}, "kvTransfer": {"connector": "None"}}))
    (policy,) = policies(alone)
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": SIDECAR}]}]


def test_extra_engine_sources_reach_every_engine_port_and_nothing_else() -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app": "prometheus"}}}
    plan = plan_of(merged(full_spec(), {"networkPolicy": {"extraEngineFrom": [prometheus]}}))
    objs, by_role = policies(plan), pods(plan)
    scraper = Pod({"app": "prometheus"}, namespace="monitoring")
    for role, pod in by_role.items():
        assert reachable(objs, scraper, pod, ENGINE), role
    assert not reachable(objs, scraper, by_role["prefill"], NIXL)
    assert not reachable(objs, OTHER_NAMESPACE, by_role["render"], ENGINE)


def test_disabled_writes_none_and_toggling_touches_only_the_policies() -> None:
    on = build_objects(plan_of(full_spec()))
    off = build_objects(plan_of(merged(full_spec(), {"networkPolicy": {"enabled": False}})))
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]
    assert [o for o in on if o["kind"] != "NetworkPolicy"] == off  # pods do not roll


@pytest.mark.parametrize("patch", [{"router": {"port": 9000}}, {"engine": {"port": 9200}},
                                   {"kvTransfer": {"sideChannelPort": 6600}}])
def test_ports_follow_the_spec(patch: dict[str, Any]) -> None:
    plan = plan_of(merged(full_spec(), patch))
    objs, by_role = policies(plan), pods(plan)
    sidecar, engine = plan.sidecar.port, plan.spec.engine.port
    assert reachable(objs, OUTSIDER, by_role["decode"], sidecar)
    assert not reachable(objs, OUTSIDER, by_role["decode"], engine)
    assert reachable(objs, by_role["decode"], by_role["render"], engine)
    assert not reachable(objs, by_role["decode"], by_role["render"], sidecar if sidecar != engine else 1)
