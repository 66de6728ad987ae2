"""Plan → Kubernetes objects: names, selectors, ports, mounts, RBAC, autoscaling, rollout hashes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from disagg_operator import names
from disagg_operator.drift import key_of
from disagg_operator.kinds import MANAGED_KINDS
from disagg_operator.kv import KV_SHARED_PATH
from disagg_operator.objects import build_objects
from disagg_operator.objects.deployments import SIDECAR_COMMAND
from disagg_operator.plan import Plan, Role
from disagg_sidecar.config import SidecarConfig
from tests.operator.cases import merged
from tests.operator.builders import TEMPLATE, full_spec, plan_of

OWNER = names.owner_reference("disagg.dev/v1alpha1", "DisaggregatedModel", "qwen3-8b", "uid-1")


def objects_of(plan: Plan, owner: dict[str, Any] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in build_objects(plan, owner)}


def pod_templates(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: o["spec"]["template"] for (kind, name), o in objs.items() if kind == "Deployment"}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container(template: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in template["spec"]["containers"] if c["name"] == name)


@pytest.fixture
def plan() -> Plan:
    return plan_of(full_spec())


def test_object_names(plan: Plan) -> None:
    assert sorted(objects_of(plan)) == sorted([
        ("ServiceAccount", "qwen3-8b-sidecar"), ("Role", "qwen3-8b-sidecar"), ("RoleBinding", "qwen3-8b-sidecar"),
        ("ConfigMap", "qwen3-8b-config"),
        ("Service", "qwen3-8b"), ("Service", "qwen3-8b-prefill"), ("Service", "qwen3-8b-render"),
        ("Service", "qwen3-8b-derender"),
        ("Deployment", "qwen3-8b-prefill"), ("Deployment", "qwen3-8b-decode"), ("Deployment", "qwen3-8b-render"),
        ("Deployment", "qwen3-8b-derender"),
        ("PodDisruptionBudget", "qwen3-8b-prefill"), ("PodDisruptionBudget", "qwen3-8b-decode"),
        ("PodDisruptionBudget", "qwen3-8b-render"), ("PodDisruptionBudget", "qwen3-8b-derender"),
        ("NetworkPolicy", "qwen3-8b-prefill"), ("NetworkPolicy", "qwen3-8b-decode"),
        ("NetworkPolicy", "qwen3-8b-render"), ("NetworkPolicy", "qwen3-8b-derender"),
        ("Secret", "qwen3-8b-engine-api-key"),
        ("PodMonitor", "qwen3-8b-engines"), ("PodMonitor", "qwen3-8b-sidecars"),
        ("Service", f"qwen3-8b-kv{(plan.kv_revision or '')[:6]}"),
    ])
    kinds = [o["kind"] for o in build_objects(plan)]
    assert kinds == sorted(kinds, key=[k.kind for k in MANAGED_KINDS].index)  # apply order


def test_every_object_is_labelled_namespaced_and_plain_json(plan: Plan) -> None:
    for obj in build_objects(plan):
        meta = obj["metadata"]
        assert meta["namespace"] == "prod"
        assert meta["labels"][names.INSTANCE] == "qwen3-8b"
        assert meta["labels"][names.MANAGED_BY] == "disagg-operator"
        assert {names.NAME, names.COMPONENT, names.PART_OF} <= set(meta["labels"])
        assert json.loads(json.dumps(obj)) == obj  # no enums or tuples: safe for any client
        assert yaml.safe_load(yaml.safe_dump(obj)) == obj


def test_owner_references_only_when_an_owner_is_given(plan: Plan) -> None:
    assert all("ownerReferences" not in o["metadata"] for o in build_objects(plan))
    for obj in build_objects(plan, OWNER):
        assert obj["metadata"]["ownerReferences"] == [OWNER]
    assert OWNER["controller"] is True and OWNER["blockOwnerDeletion"] is True


def test_deployment_selectors_match_their_pod_labels_and_only_theirs(plan: Plan) -> None:
    objs = objects_of(plan)
    templates = pod_templates(objs)
    for name, template in templates.items():
        selector = objs[("Deployment", name)]["spec"]["selector"]["matchLabels"]
        assert [n for n, t in templates.items() if selects(selector, t["metadata"]["labels"])] == [name]
        assert template["metadata"]["labels"][names.POOL] == name.removeprefix("qwen3-8b-")


@pytest.mark.parametrize(("service", "pool"), [("qwen3-8b", "decode"), ("qwen3-8b-prefill", "prefill"),
                                               ("qwen3-8b-render", "render"), ("qwen3-8b-derender", "derender")])
def test_services_select_one_pool_and_target_ports_it_has(plan: Plan, service: str, pool: str) -> None:
    objs = objects_of(plan)
    svc = objs[("Service", service)]
    templates = pod_templates(objs)
    selected = [n for n, t in templates.items() if selects(svc["spec"]["selector"], t["metadata"]["labels"])]
    assert selected == [f"qwen3-8b-{pool}"]
    port_names = {p["name"] for c in templates[selected[0]]["spec"]["containers"] for p in c.get("ports", [])}
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in port_names
        assert len(port["name"]) <= 15


def test_service_shapes(plan: Plan) -> None:
    objs = objects_of(plan)
    client = objs[("Service", "qwen3-8b")]["spec"]
    assert client["type"] == "ClusterIP" and client["ports"][0]["port"] == 8000
    assert client["ports"][0]["targetPort"] == names.HTTP_PORT  # the sidecar, not vLLM
    prefill = objs[("Service", "qwen3-8b-prefill")]["spec"]
    assert prefill["clusterIP"] == "None"
    assert [p["name"] for p in prefill["ports"]] == ["engine", "nixl"]


def test_shared_derender_service_selects_render_pods() -> None:
    spec = full_spec()
    del spec["pools"]["derender"]
    objs = objects_of(plan_of(spec))
    assert ("Deployment", "qwen3-8b-derender") not in objs
    selector = objs[("Service", "qwen3-8b-derender")]["spec"]["selector"]
    assert selects(selector, pod_templates(objs)["qwen3-8b-render"]["metadata"]["labels"])


def test_containers_run_arg_lists_from_the_plan(plan: Plan) -> None:
    templates = pod_templates(objects_of(plan))
    for pool in plan.pools:
        vllm = container(templates[pool.name], names.VLLM_CONTAINER)
        assert vllm["command"] + vllm["args"] == pool.argv(plan.model)
        assert all(isinstance(a, str) for a in vllm["command"] + vllm["args"])
        assert vllm["image"] == pool.image
        assert not {"sh", "bash", "-c"} & set(vllm["command"])
    sidecar = container(templates["qwen3-8b-decode"], names.SIDECAR_CONTAINER)
    assert sidecar["command"] == SIDECAR_COMMAND == ["disagg", "sidecar", "--config", "/etc/disagg/sidecar.yaml"]
    assert sidecar["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert [c["name"] for c in templates["qwen3-8b-decode"]["spec"]["containers"]] == ["vllm", "sidecar"]
    assert all(len(t["spec"]["containers"]) == 1 for n, t in templates.items() if n != "qwen3-8b-decode")


def test_probes_target_named_ports(plan: Plan) -> None:
    for template in pod_templates(objects_of(plan)).values():
        for c in template["spec"]["containers"]:
            port_names = {p["name"] for p in c["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in port_names
            assert "readinessProbe" in c


def test_engines_get_their_whole_start_up_budget_probed_every_two_seconds(plan: Plan) -> None:
    """A short startup period (Ready soon after the engine is) without cutting the pool's budget."""
    templates = pod_templates(objects_of(plan))
    for pool in plan.pools:
        startup = container(templates[pool.name], names.VLLM_CONTAINER)["startupProbe"]
        assert startup["periodSeconds"] == 2
        assert startup["periodSeconds"] * startup["failureThreshold"] == pool.startup_seconds


def test_engines_outlive_what_still_sends_to_them_when_a_pod_terminates(plan: Plan) -> None:
    """kubelet signals every container of a terminating pod at once: decode's vLLM waits in its
    preStop hook for the sidecar beside it to drain (its ``/health/drained``, on the sidecar's port
    number); the other pools' vLLM sleeps until Services and the sidecars' EndpointSlice watches
    dropped the pod; the grace period covers it."""
    limits = plan.sidecar.config.limits
    assert limits.deregister_seconds >= 5 and limits.drain_seconds >= 30  # the sidecar's defaults
    templates = pod_templates(objects_of(plan))
    for pool in plan.pools:
        spec = templates[pool.name]["spec"]
        hook = container(templates[pool.name], names.VLLM_CONTAINER)["lifecycle"]["preStop"]
        grace = spec.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
        if pool.role == Role.DECODE:
            sidecar = container(templates[pool.name], names.SIDECAR_CONTAINER)
            assert hook == {"httpGet": {"path": "/health/drained", "port": sidecar["ports"][0]["containerPort"]}}
            assert "lifecycle" not in sidecar
            assert grace >= limits.stop_seconds + 30, "vLLM's own shutdown after the drain fits in the grace period"
        else:
            assert limits.deregister_seconds <= hook["sleep"]["seconds"] < grace


def test_config_hash_annotations_come_from_the_plan(plan: Plan) -> None:
    objs = objects_of(plan)
    for pool in plan.pools:
        deployment = objs[("Deployment", pool.name)]
        assert deployment["spec"]["template"]["metadata"]["annotations"][names.CONFIG_HASH] == pool.config_hash
        assert deployment["metadata"]["annotations"][names.CONFIG_HASH] == pool.config_hash


def test_config_map_holds_sidecar_config_and_inline_template(plan: Plan) -> None:
    objs = objects_of(plan)
    data = objs[("ConfigMap", "qwen3-8b-config")]["data"]
    assert SidecarConfig.model_validate(yaml.safe_load(data["sidecar.yaml"])) == plan.sidecar.config
    assert data["chat-template.jinja"] == TEMPLATE
    for template in pod_templates(objs).values():  # every ConfigMap volume points at an existing key
        for volume in template["spec"]["volumes"]:
            if "configMap" in volume and volume["configMap"]["name"] == "qwen3-8b-config":
                assert {i["key"] for i in volume["configMap"]["items"]} <= set(data)


def test_chat_template_is_mounted_where_the_flag_points() -> None:
    spec = full_spec()
    spec["model"]["chatTemplate"] = {"configMapRef": {"name": "tpl", "key": "t.j2"}}
    plan = plan_of(spec)
    objs = objects_of(plan)
    assert "chat-template.jinja" not in objs[("ConfigMap", "qwen3-8b-config")]["data"]
    for pool in plan.pools:
        template = pod_templates(objs)[pool.name]
        vllm = container(template, names.VLLM_CONTAINER)
        mounts = {m["name"]: m["mountPath"] for m in vllm["volumeMounts"]}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        if pool.role == Role.PREFILL:  # tokens-only: no template
            assert "chat-template" not in mounts
            continue
        assert mounts["chat-template"] + "/chat-template.jinja" == plan.chat_template.path
        assert volumes["chat-template"]["configMap"] == {"name": "tpl", "items": [{"key": "t.j2", "path": "chat-template.jinja"}]}


def test_sidecar_rbac_is_read_only_endpointslices_in_its_namespace(plan: Plan) -> None:
    objs = objects_of(plan)
    role = objs[("Role", "qwen3-8b-sidecar")]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = objs[("RoleBinding", "qwen3-8b-sidecar")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "qwen3-8b-sidecar"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qwen3-8b-sidecar", "namespace": "prod"}]
    templates = pod_templates(objs)
    decode = templates["qwen3-8b-decode"]["spec"]
    assert decode["serviceAccountName"] == "qwen3-8b-sidecar"
    # Only the sidecar container gets the API token; the pod does not automount it.
    for pod in templates.values():
        assert pod["spec"]["automountServiceAccountToken"] is False
    token_mounts = [c["name"] for c in decode["containers"]
                    if any(m["name"] == "api-token" for m in c["volumeMounts"])]
    assert token_mounts == ["sidecar"]
    assert all("serviceAccountName" not in t["spec"] for n, t in templates.items() if n != "qwen3-8b-decode")


def test_without_prefill_there_is_no_prefill_service_and_no_api_access() -> None:
    plan = plan_of(merged(full_spec(), {"pools": {"prefill": {"replicas": 0}}}))
    objs = objects_of(plan)
    assert not [k for k in objs if k[1].endswith("-prefill")]
    assert not [k for k in objs if k[0] in ("ServiceAccount", "Role", "RoleBinding")]
    decode = pod_templates(objs)["qwen3-8b-decode"]["spec"]
    assert "serviceAccountName" not in decode
    assert "api-token" not in {v["name"] for v in decode["volumes"]}


SPECS_FOR_EVERY_POOL_SHAPE = {
    "full": full_spec(),
    "decode-only": merged(full_spec(), {"pools": {"prefill": {"replicas": 0}, "render": {"replicas": 0},
                                                  "derender": None}, "kvTransfer": {"connector": "None"}}),
    "example-connector": merged(full_spec(), {"kvTransfer": {"connector": "ExampleConnector"}}),
    "example-connector-pvc": merged(full_spec(), {"kvTransfer": {"connector": "ExampleConnector",
                                                                 "sharedStorageClaim": "kv"},
                                                  "model": {"source": "pvc://weights/q", "revision": None},
                                                  "engine": {"cacheClaim": "engine-cache"}}),
}


@pytest.mark.parametrize("spec", SPECS_FOR_EVERY_POOL_SHAPE.values(), ids=SPECS_FOR_EVERY_POOL_SHAPE.keys())
def test_every_container_of_every_pool_is_locked_down(spec: dict[str, Any]) -> None:
    plan = plan_of(spec)
    templates = pod_templates(objects_of(plan))
    assert set(templates) == {p.name for p in plan.pools}
    for pool in plan.pools:
        pod = templates[pool.name]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"]:
            ctx = c["securityContext"]
            assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0 and ctx["runAsGroup"] != 0, (pool.name, c["name"])
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}
            assert ctx["readOnlyRootFilesystem"] is True
            assert "privileged" not in ctx and "add" not in ctx["capabilities"]


@pytest.mark.parametrize("spec", SPECS_FOR_EVERY_POOL_SHAPE.values(), ids=SPECS_FOR_EVERY_POOL_SHAPE.keys())
def test_what_vllm_writes_is_on_writable_volumes(spec: dict[str, Any]) -> None:
    """With a read-only root, every directory vLLM writes to must be a writable mount: HOME (HF, vLLM,
    Triton, CUDA caches under ~; engine.cacheClaim when set), /tmp (torch compile, vLLM's IPC sockets),
    /dev/shm on GPU pools (NCCL) and the ExampleConnector's storage."""
    plan = plan_of(spec)
    templates = pod_templates(objects_of(plan))
    for pool in plan.pools:
        template = templates[pool.name]
        vllm = container(template, names.VLLM_CONTAINER)
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        writable = {m["mountPath"]: volumes[m["name"]] for m in vllm["volumeMounts"] if not m.get("readOnly")}
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        needed = ["/tmp"] + (["/dev/shm"] if pool.gpu else [])

        def volume_for(path: str) -> dict[str, Any]:
            mount = max((m for m in writable if path == m or path.startswith(m.rstrip("/") + "/")), key=len)
            return writable[mount]

        for path in needed:
            assert "emptyDir" in volume_for(path), (pool.name, path)
        assert pool.cache_claim == spec.get("engine", {}).get("cacheClaim")
        home = {"persistentVolumeClaim": {"claimName": pool.cache_claim}} if pool.cache_claim else {"emptyDir": {}}
        for path in (env["HOME"], env["HF_HOME"]):
            assert {k: v for k, v in volume_for(path).items() if k != "name"} == home, (pool.name, path)
        if pool.gpu:
            assert volume_for("/dev/shm")["emptyDir"] == {"medium": "Memory"}
        if pool.gpu and plan.kv_connector == "ExampleConnector":  # writes KV files to its storage path
            assert ("persistentVolumeClaim" if pool.kv_shared_claim else "emptyDir") in volume_for(KV_SHARED_PATH)
        assert env["HOME"] != "/" and not env["HOME"].startswith("/root")


def test_a_users_home_wins_without_duplicating_env_names() -> None:
    spec = merged(full_spec(), {"pools": {"decode": {"env": [{"name": "HOME", "value": "/models/home"}]}}})
    templates = pod_templates(objects_of(plan_of(spec)))
    for name, template in templates.items():
        env = container(template, names.VLLM_CONTAINER)["env"]
        names_ = [e["name"] for e in env]
        assert len(names_) == len(set(names_)), name
    decode_env = {e["name"]: e.get("value") for e in container(templates["qwen3-8b-decode"], "vllm")["env"]}
    assert decode_env["HOME"] == "/models/home"


def test_gpu_pools_get_shared_memory_and_nixl_ports(plan: Plan) -> None:
    templates = pod_templates(objects_of(plan))
    for name in ("qwen3-8b-prefill", "qwen3-8b-decode"):
        vllm = container(templates[name], names.VLLM_CONTAINER)
        assert {"name": "dshm", "mountPath": "/dev/shm"} in vllm["volumeMounts"]
        assert {"name": "nixl", "containerPort": 5600, "protocol": "TCP"} in vllm["ports"]
        assert {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in vllm["env"]


def test_autoscaled_pools_get_an_hpa_and_leave_replicas_to_it() -> None:
    plan = plan_of(merged(full_spec(), {"pools": {"render": {"autoscaling": {"minReplicas": 2, "maxReplicas": 6}}}}))
    objs = objects_of(plan)
    hpa = objs[("HorizontalPodAutoscaler", "qwen3-8b-render")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen3-8b-render"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert "replicas" not in objs[("Deployment", "qwen3-8b-render")]["spec"]
    assert objs[("Deployment", "qwen3-8b-decode")]["spec"]["replicas"] == 2
    assert [k for k in objs if k[0] == "HorizontalPodAutoscaler"] == [("HorizontalPodAutoscaler", "qwen3-8b-render")]


def test_disruption_budgets_select_their_pool(plan: Plan) -> None:
    objs = objects_of(plan)
    templates = pod_templates(objs)
    for pool in plan.pools:
        pdb = objs[("PodDisruptionBudget", pool.name)]
        assert pdb["spec"]["maxUnavailable"] == 1
        matched = [n for n, t in templates.items() if selects(pdb["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])]
        assert matched == [pool.name]


def changed_objects(before: Plan, after: Plan) -> set[tuple[str, str]]:
    a = {key_of(o): o for o in build_objects(before)}
    b = {key_of(o): o for o in build_objects(after)}
    return {(k[1], k[3]) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_changing_prefill_replicas_touches_only_the_prefill_deployment() -> None:
    after = plan_of(merged(full_spec(), {"pools": {"prefill": {"replicas": 5}}}))
    assert changed_objects(plan_of(full_spec()), after) == {("Deployment", "qwen3-8b-prefill")}


def test_changing_a_parser_touches_the_tokenizing_deployments_only() -> None:
    after = plan_of(merged(full_spec(), {"model": {"reasoningParser": "deepseek_r1"}}))
    assert changed_objects(plan_of(full_spec()), after) == {
        ("Deployment", "qwen3-8b-decode"), ("Deployment", "qwen3-8b-render"), ("Deployment", "qwen3-8b-derender")}


def test_switching_derender_to_shared_repoints_the_service_without_rolling_decode() -> None:
    shared = full_spec()
    del shared["pools"]["derender"]
    assert changed_objects(plan_of(full_spec()), plan_of(shared)) == {
        ("Deployment", "qwen3-8b-derender"), ("PodDisruptionBudget", "qwen3-8b-derender"),
        ("Service", "qwen3-8b-derender"), ("NetworkPolicy", "qwen3-8b-derender")}


def test_pvc_models_are_mounted_read_only_in_every_pool() -> None:
    plan = plan_of(merged(full_spec(), {"model": {"source": "pvc://weights/qwen3", "revision": None}}))
    for template in pod_templates(objects_of(plan)).values():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
        mounts = {m["name"]: m for m in container(template, "vllm")["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models/weights", "readOnly": True}


def test_every_managed_kind_can_be_applied_and_the_chart_grants_it() -> None:
    """A kind in MANAGED_KINDS names a client API that has the verbs apply.py calls, and the chart's
    RBAC grants them (tests/chart checks the granted rules against the real API server)."""
    import re
    from pathlib import Path

    from kubernetes import client

    helpers = (Path(__file__).resolve().parents[2] / "charts/disagg/templates/_helpers.tpl").read_text()
    def rules(name: str) -> list[dict[str, Any]]:
        block = re.search(f'define "disagg.{name}" -}}}}\n(.*?)\n{{{{- end -}}}}', helpers, re.S)
        assert block is not None, name
        return yaml.safe_load(block.group(1))
    # rbacRules: coreRules, plus monitorRules and plannerRules when their values are on (the defaults).
    granted = {(g, r): set(rule["verbs"]) for rule in [*rules("coreRules"), *rules("monitorRules")]
               for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules("plannerRules") == [{"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["patch"]},
                                     {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]}]
    for kind in MANAGED_KINDS:
        group = kind.api_version.rpartition("/")[0]
        if kind.create_only:  # created once and never read back: create and nothing else
            assert callable(getattr(getattr(client, kind.client), f"create_{kind.method_suffix}", None)), kind
            assert granted.get((group, kind.plural)) == {"create"}, kind
            continue
        for verb in ("patch", "delete"):
            assert callable(getattr(getattr(client, kind.client), f"{verb}_{kind.method_suffix}", None)), kind
        assert granted.get((group, kind.plural), set()) >= {"get", "list", "watch", "create", "patch", "delete"}, kind
