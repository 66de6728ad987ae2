"""The CRD and the operator against the real control plane (kwok nodes make pods Ready).

Every wait is a poll for an observable condition with a stated bound (``cluster.wait_for``).
"""

from __future__ import annotations

import base64
import copy
import json
import re
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_operator import names
from disagg_operator.manifest import parse_manifest
from disagg_operator.objects import build_objects
from disagg_operator.plan import Plan, Role, build_plan
from disagg_operator.spec import API_VERSION, PLURAL
from disagg_sidecar.config import dump_config
from tests.harness.cluster import Cluster, ClusterError
from tests.operator.cases import EDGES, INVALID, Invalid, base, merged
from tests.harness.operator import OperatorProcess
from tests.operator.builders import PARSER_FLAGS, TOKENIZER_FLAGS, flags

pytestmark = pytest.mark.cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-8b.yaml"
# The kinds the operator creates and their API collections. What the tests poll is read in-process
# (a kubectl process per poll costs ~0.1 CPU-s beside the operator and API server being waited for);
# what a user would do, applying and patching, goes through kubectl.
COLLECTIONS = {"secrets": "api/v1", "serviceaccounts": "api/v1", "configmaps": "api/v1", "services": "api/v1",
               "roles": "apis/rbac.authorization.k8s.io/v1", "rolebindings": "apis/rbac.authorization.k8s.io/v1",
               "deployments": "apis/apps/v1", "horizontalpodautoscalers": "apis/autoscaling/v2",
               "poddisruptionbudgets": "apis/policy/v1", "networkpolicies": "apis/networking.k8s.io/v1"}
KINDS = ",".join(COLLECTIONS)
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
READY_TIMEOUT = 240  # generous: kwok heartbeats lag on a loaded 2-core machine


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def apply(cluster: Cluster, ns: str, *docs: dict[str, Any], check: bool = True):  # type: ignore[no-untyped-def]
    items = {"apiVersion": "v1", "kind": "List", "items": list(docs)}
    return cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(items), check=check)


def get(cluster: Cluster, ns: str, *what: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "-n", ns, *what, "-o", "json").stdout)


def listed(cluster: Cluster, ns: str, plural: str, label: str, accept: str = "application/json"
           ) -> tuple[str, list[dict[str, Any]]]:
    """The kind and the items labelled ``label`` (``key=value``) in one collection (in-process)."""
    selector = urllib.parse.quote(label)
    found = cluster.api("GET", f"/{COLLECTIONS[plural]}/namespaces/{ns}/{plural}?labelSelector={selector}",
                        accept=accept)
    return found["kind"].removesuffix("List"), found["items"] or []


def of(instance: str) -> str:
    """The label selector of model ``instance``'s children."""
    return f"{names.INSTANCE}={instance}"


def children(cluster: Cluster, ns: str, instance: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(kind, o["metadata"]["name"]): {"kind": kind, **o}
            for kind, items in (listed(cluster, ns, plural, of(instance)) for plural in COLLECTIONS) for o in items}


def model(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    """The DisaggregatedModel as stored (in-process)."""
    return cluster.api("GET", f"/apis/{API_VERSION}/namespaces/{ns}/{PLURAL}/{name}")


def expected_plan(doc: dict[str, Any], ns: str) -> Plan:
    manifest = parse_manifest(doc, ns)
    return build_plan(manifest.spec, manifest.name, ns)


def expected_objects(plan: Plan) -> list[dict[str, Any]]:
    """What the operator writes here: PodMonitors (monitoring.podMonitors auto) only where their CRD is
    installed, which only tests/operator/test_cluster_monitors.py does, for its own module."""
    return [o for o in build_objects(plan) if o["kind"] != "PodMonitor"]


def expected_keys(plan: Plan) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in expected_objects(plan)}


def condition(obj: dict[str, Any], kind: str) -> str | None:
    return next((c["status"] for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


def wait_ready(cluster: Cluster, op: OperatorProcess, ns: str, name: str, generation: int | None = None) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        dm = model(cluster, ns, name)
        status = dm.get("status", {})
        current = status.get("observedGeneration") == (generation or dm["metadata"]["generation"])
        return dm if current and condition(dm, "Ready") == "True" else None

    try:
        return cluster.wait_for(ready, f"{ns}/{name} Ready", timeout=READY_TIMEOUT)
    except AssertionError as exc:
        dm = get(cluster, ns, "dm", name)
        conditions = [(c["type"], c["status"], c.get("message")) for c in dm.get("status", {}).get("conditions", [])]
        raise AssertionError(f"{exc}\n--- conditions: {conditions}\n--- operator log ---\n{op.log_tail()}") from None


def container_args(deployment: dict[str, Any], container: str = names.VLLM_CONTAINER) -> list[str]:
    c = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == container)
    return c["command"] + c["args"]


def template_hash(deployment: dict[str, Any]) -> str:
    return deployment["spec"]["template"]["metadata"]["annotations"][names.CONFIG_HASH]


def deployments(cluster: Cluster, ns: str, instance: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["labels"][names.POOL]: o for o in listed(cluster, ns, "deployments", of(instance))[1]}


# --- the example -------------------------------------------------------------------------------

def test_example_gets_every_child_with_consistent_flags(cluster: Cluster, operator: OperatorProcess, ns: str) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    plan = expected_plan(example(), ns)
    want = expected_keys(plan)
    cluster.wait_for(lambda: want <= set(children(cluster, ns, "qwen3-8b")), "every child of qwen3-8b", timeout=180)
    live = children(cluster, ns, "qwen3-8b")
    assert set(live) == want
    for obj in live.values():
        ref = obj["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["controller"]) == ("DisaggregatedModel", "qwen3-8b", True)
        # Applied, except the engine key Secret: created once (an Update entry), never applied.
        operation = "Update" if obj["kind"] == "Secret" else "Apply"
        assert any(m["manager"] == "disagg-operator" and m["operation"] == operation
                   for m in obj["metadata"]["managedFields"])

    pods = deployments(cluster, ns, "qwen3-8b")
    views = {role: flags(container_args(pods[role])) for role in ("render", "decode", "prefill")}
    shared = TOKENIZER_FLAGS + PARSER_FLAGS
    assert {k: views["render"].get(k) for k in shared} == {k: views["decode"].get(k) for k in shared}
    assert views["decode"]["--reasoning-parser"] == "qwen3" and views["decode"]["--tool-call-parser"] == "hermes"
    assert container_args(pods["render"])[3] == container_args(pods["decode"])[2] == "Qwen/Qwen3-8B"
    assert views["prefill"]["--tokens-only"] is True
    assert not any(k in views["prefill"] for k in PARSER_FLAGS + ("--chat-template",))
    assert json.loads(views["prefill"]["--kv-transfer-config"]) == json.loads(views["decode"]["--kv-transfer-config"]) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"backends": ["UCX"]}}
    vllm = next(c for c in pods["prefill"]["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    assert {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}} in vllm["env"]

    config = yaml.safe_load(live[("ConfigMap", "qwen3-8b-config")]["data"]["sidecar.yaml"])
    assert config == dump_config(plan.sidecar.config)
    services = {name for kind, name in live if kind == "Service"}
    assert config["prefill"]["discovery"]["service"] in services
    for tier in ("render", "derender"):
        (url,) = config[tier]["urls"]
        host = url.removeprefix("http://").split(".")[0]
        assert host in services and url.startswith(f"http://{host}.{ns}.svc:")

    dm = wait_ready(cluster, operator, ns, "qwen3-8b")
    status = dm["status"]
    assert status["readyPools"] == "3/3" and status["endpoint"] == f"http://qwen3-8b.{ns}.svc:8000"
    assert {role: p["readyReplicas"] for role, p in status["pools"].items()} == {"prefill": 2, "decode": 2, "render": 2}
    assert {c["type"] for c in status["conditions"]} == {
        "Ready", "PrefillReady", "DecodeReady", "RenderReady", "DerenderReady", "ConfigConsistent", "Progressing",
        "Degraded", "VersionSupported"}
    assert next(c for c in status["conditions"] if c["type"] == "VersionSupported")["status"] == "True"
    assert status["derender"] == {"strategy": plan.derender_strategy} == {"strategy": "stock-inline"}  # vLLM 0.34
    table = cluster.kubectl("get", "dm", "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "POOLS", "ENDPOINT", "AGE"]
    assert table[1].split()[:4] == ["qwen3-8b", "True", "3/3", f"http://qwen3-8b.{ns}.svc:8000"]


def test_a_change_rolls_exactly_the_affected_pools(cluster: Cluster, operator: OperatorProcess, ns: str) -> None:
    doc = merged(example(), {"spec": {"pools": {"derender": {"replicas": 1}}}})
    apply(cluster, ns, doc)
    wait_ready(cluster, operator, ns, "qwen3-8b")
    before = deployments(cluster, ns, "qwen3-8b")
    assert set(before) == {"prefill", "decode", "render", "derender"}

    cluster.kubectl("patch", "dm", "qwen3-8b", "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"model": {"reasoningParser": "deepseek_r1"}}}))
    dm = wait_ready(cluster, operator, ns, "qwen3-8b")
    after = deployments(cluster, ns, "qwen3-8b")
    rolled = {role for role in before if template_hash(before[role]) != template_hash(after[role])}
    assert rolled == {"decode", "render", "derender"}
    assert after["prefill"]["metadata"]["generation"] == before["prefill"]["metadata"]["generation"]
    assert flags(container_args(after["derender"]))["--reasoning-parser"] == "deepseek_r1"
    assert dm["status"]["observedGeneration"] == dm["metadata"]["generation"]

    cluster.kubectl("patch", "dm", "qwen3-8b", "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"pools": {"prefill": {"replicas": 3}}}}))
    dm = wait_ready(cluster, operator, ns, "qwen3-8b")
    final = deployments(cluster, ns, "qwen3-8b")
    touched = {role for role in after if final[role]["metadata"]["generation"] != after[role]["metadata"]["generation"]}
    assert touched == {"prefill"} and final["prefill"]["spec"]["replicas"] == 3
    assert dm["status"]["pools"]["prefill"]["readyReplicas"] == 3


# --- validation --------------------------------------------------------------------------------

def k8s_path(where: str) -> str:
    """spec.model.env.0 (pydantic) → spec.model.env[0] (API server)."""
    return re.sub(r"\.(\d+)", r"[\1]", where)


@pytest.fixture(scope="module")
def cases_ns(cluster: Cluster, crd_installed: Path) -> Iterator[str]:
    """One namespace for the ~100 validation cases: each is rejected or only dry-run, so none leaves an
    object for the next, and the API server is spared ~100 namespace creations and deletions."""
    name = cluster.create_namespace("validation-cases")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def stored_models(cluster: Cluster, ns: str) -> list[str]:
    items = cluster.api("GET", f"/apis/{API_VERSION}/namespaces/{ns}/{PLURAL}", accept=METADATA_ONLY)["items"]
    return [o["metadata"]["name"] for o in items or []]


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_the_api_server_rejects_each_invalid_object_with_the_rule_message(cluster: Cluster, cases_ns: str,
                                                                          case: Invalid) -> None:
    result = apply(cluster, cases_ns, case.document(), check=False)
    stored = stored_models(cluster, cases_ns)
    for name in stored:  # wrongly accepted: gone before the next case shares the namespace
        cluster.api("DELETE", f"/apis/{API_VERSION}/namespaces/{cases_ns}/{PLURAL}/{name}")
    assert result.returncode != 0, f"{case.rule} was accepted"
    assert case.message in result.stderr, result.stderr
    if case.rule != "name":
        assert f"{k8s_path(case.where)}: Invalid value" in result.stderr, result.stderr
    assert stored == []


@pytest.mark.parametrize(("name", "patch", "valid"), EDGES, ids=[e[0] for e in EDGES])
def test_the_api_server_judges_borderline_values_like_pydantic(cluster: Cluster, cases_ns: str,
                                                               name: str, patch: dict, valid: bool) -> None:
    doc = base()
    doc["spec"] = merged(doc["spec"], patch)
    try:  # a server-side dry run, in-process: 53 kubectl processes would cost more than the checks
        cluster.api("POST", f"/apis/{API_VERSION}/namespaces/{cases_ns}/{PLURAL}?dryRun=All", doc)
    except ClusterError as exc:
        assert not valid, str(exc)
        assert "-> 422:" in str(exc), str(exc)  # refused by the schema or a rule, not failed otherwise
    else:
        assert valid, "accepted"


def test_the_api_server_accepts_and_defaults_a_minimal_object(cluster: Cluster, crd_installed: Path, ns: str) -> None:
    apply(cluster, ns, base("tiny"))
    stored = get(cluster, ns, "dm", "tiny")
    assert parse_manifest(stored).spec == parse_manifest(base("tiny")).spec
    assert stored["spec"]["pools"]["decode"]["replicas"] == 1
    assert stored["spec"]["kvTransfer"]["connector"] == "NixlConnector"


# --- self-healing, garbage collection, restarts --------------------------------------------------

def test_deleted_and_edited_children_are_restored_and_gc_removes_all(cluster: Cluster, operator: OperatorProcess,
                                                                    ns: str) -> None:
    before = operator.metrics()
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    wait_ready(cluster, operator, ns, "qwen3-8b")
    old = deployments(cluster, ns, "qwen3-8b")["decode"]["metadata"]["uid"]
    cluster.kubectl("delete", "deployment", "qwen3-8b-decode", "-n", ns, "--wait=false")
    cluster.wait_for(lambda: deployments(cluster, ns, "qwen3-8b").get("decode", {}).get("metadata", {}).get("uid") not in (None, old),
                     "the decode Deployment recreated", timeout=90)

    want_selector = get(cluster, ns, "service", "qwen3-8b-render")["spec"]["selector"]
    cluster.kubectl("patch", "service", "qwen3-8b-render", "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"selector": {names.POOL: "decode"}}}))
    cluster.wait_for(lambda: get(cluster, ns, "service", "qwen3-8b-render")["spec"]["selector"] == want_selector,
                     "the render Service selector restored", timeout=90)
    want_args = container_args(deployments(cluster, ns, "qwen3-8b")["render"])
    cluster.kubectl("patch", "deployment", "qwen3-8b-render", "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--enforce-eager"}]))
    cluster.wait_for(lambda: container_args(deployments(cluster, ns, "qwen3-8b")["render"]) == want_args,
                     "the render args restored", timeout=90)

    # What happened is visible on the operator's /metrics (counters are per process: compare deltas).
    after = operator.metrics()
    grew = {k for k in after if after[k] > before.get(k, 0.0)}
    assert {'disagg_operator_reconciles_total{outcome="applied"}', "disagg_operator_status_writes_total",
            'disagg_operator_objects_applied_total{kind="Deployment"}',
            'disagg_operator_drift_restores_total{kind="Deployment"}',
            'disagg_operator_drift_restores_total{kind="Service"}'} <= grew, sorted(grew)

    cluster.kubectl("delete", "dm", "qwen3-8b", "-n", ns, "--wait=false")
    cluster.wait_for(lambda: not children(cluster, ns, "qwen3-8b"), "garbage collection of every child", timeout=180)


# --- the engine API key Secret (its garbage collection is awaited: before the scale test's) -----

def engine_key_secret(cluster: Cluster, ns: str, instance: str) -> dict[str, Any] | None:
    name = names.engine_api_key_secret(instance)
    return next((o for o in listed(cluster, ns, "secrets", of(instance))[1] if o["metadata"]["name"] == name), None)


def test_the_engine_key_secret_is_created_once_used_by_every_engine_and_collected(
        cluster: Cluster, operator: OperatorProcess, ns: str) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    cluster.wait_for(lambda: engine_key_secret(cluster, ns, "qwen3-8b"), "the engine key Secret", timeout=90)
    first = engine_key_secret(cluster, ns, "qwen3-8b")
    assert first is not None
    assert first["metadata"]["ownerReferences"][0]["name"] == "qwen3-8b" and first["type"] == "Opaque"
    assert len(base64.b64decode(first["data"][names.API_KEY_KEY])) >= 43
    wait_ready(cluster, operator, ns, "qwen3-8b")

    pods = deployments(cluster, ns, "qwen3-8b")
    assert set(pods) == {"prefill", "decode", "render"}
    ref = {"secretKeyRef": {"name": "qwen3-8b-engine-api-key", "key": names.API_KEY_KEY}}
    for role, dep in pods.items():
        spec = dep["spec"]["template"]["spec"]
        vllm = next(c for c in spec["containers"] if c["name"] == names.VLLM_CONTAINER)
        assert {"name": "VLLM_API_KEY", "valueFrom": ref} in vllm["env"], role
        assert not any("api-key" in a for a in vllm["args"]), role
    decode = pods["decode"]["spec"]["template"]["spec"]
    volume = next(v for v in decode["volumes"] if v["name"] == "engine-api-key")
    assert volume["secret"]["secretName"] == "qwen3-8b-engine-api-key"
    sidecar = next(c for c in decode["containers"] if c["name"] == names.SIDECAR_CONTAINER)
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "engine-api-key")
    config = yaml.safe_load(get(cluster, ns, "configmap", "qwen3-8b-config")["data"]["sidecar.yaml"])
    assert config["auth"]["engine_api_key_file"] == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"

    # Reconciles (a spec change; an operator-visible child event) leave the Secret as it is.
    cluster.kubectl("patch", "dm", "qwen3-8b", "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"router": {"retries": 2}}}))
    generation = get(cluster, ns, "dm", "qwen3-8b")["metadata"]["generation"]
    wait_ready(cluster, operator, ns, "qwen3-8b", generation)
    cluster.kubectl("delete", "deployment", "qwen3-8b-render", "-n", ns, "--wait=false")
    cluster.wait_for(lambda: "render" in deployments(cluster, ns, "qwen3-8b"), "the render Deployment back", timeout=90)
    again = engine_key_secret(cluster, ns, "qwen3-8b")
    assert again is not None and again["data"] == first["data"]
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]

    cluster.kubectl("delete", "dm", "qwen3-8b", "-n", ns, "--wait=false")
    cluster.wait_for(lambda: engine_key_secret(cluster, ns, "qwen3-8b") is None,
                     "garbage collection of the Secret", timeout=180)


# --- scale -------------------------------------------------------------------------------------

FIFTY_GOAL_SECONDS = 30.0


def test_fifty_models_at_once_are_fully_applied_within_the_bound(cluster: Cluster, operator: OperatorProcess, ns: str,
                                                                 record_property: Any) -> None:
    """Bound: 30 s, or — on a machine where the API server itself is slower than that — no more than
    twice what `kubectl apply --server-side` needs to create the very same objects directly (measured
    only when the 30 s are exceeded). Measured once earlier tests' namespaces are gone: their
    deletion (hundreds of objects, garbage-collected by the controller manager) would otherwise
    compete for the same API server during one measurement and not the other."""
    docs = [base(f"m{i:02d}") for i in range(50)]
    want = sum(len(expected_objects(expected_plan(d, ns))) for d in docs)
    quiet = time.monotonic()
    cluster.wait_for(lambda: not [n for n in cluster.api("GET", "/api/v1/namespaces")["items"]
                                  if n["status"].get("phase") == "Terminating"],
                     "earlier tests' namespaces deleted", timeout=300, interval=0.5)
    record_property("fifty_models_waited_for_deletions_seconds", round(time.monotonic() - quiet, 1))

    def applied(namespace: str) -> bool:
        managed = f"{names.MANAGED_BY}={names.OPERATOR}"
        return want <= sum(len(listed(cluster, namespace, plural, managed, accept=METADATA_ONLY)[1])
                           for plural in COLLECTIONS)

    start = time.monotonic()
    apply(cluster, ns, *docs)
    cluster.wait_for(lambda: applied(ns), f"{want} children of 50 models", timeout=600, interval=0.5)
    elapsed = time.monotonic() - start

    record_property("fifty_models_seconds", round(elapsed, 1))
    if elapsed <= FIFTY_GOAL_SECONDS:
        print(f"50 DisaggregatedModels ({want} objects) fully applied in {elapsed:.1f}s (goal {FIFTY_GOAL_SECONDS:.0f}s)")
        return
    # Over the goal: measured against what this API server needs for the same objects from kubectl.
    baseline_ns = cluster.create_namespace("fifty-baseline")
    try:
        objects = [o for d in docs for o in expected_objects(expected_plan(d, baseline_ns))]
        start = time.monotonic()
        cluster.kubectl("apply", "--server-side", "-n", baseline_ns, "-f", "-", timeout=600,
                        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        cluster.wait_for(lambda: applied(baseline_ns), "the baseline objects", timeout=120)
        baseline = time.monotonic() - start
    finally:
        cluster.kubectl("delete", "namespace", baseline_ns, "--wait=false", check=False)

    bound = 2 * baseline
    record_property("fifty_models_kubectl_baseline_seconds", round(baseline, 1))
    print(f"50 DisaggregatedModels ({want} objects) fully applied in {elapsed:.1f}s, over the {FIFTY_GOAL_SECONDS:.0f}s "
          f"goal (kubectl --server-side, same objects: {baseline:.1f}s; bound {bound:.1f}s)")
    assert elapsed <= bound


def test_separate_derender_service_switches_pools_without_rolling_decode(cluster: Cluster, operator: OperatorProcess,
                                                                        ns: str) -> None:
    doc = merged(example(), {"spec": {"pools": {"derender": {"replicas": 1}}}})
    apply(cluster, ns, doc)
    wait_ready(cluster, operator, ns, "qwen3-8b")
    decode_generation = deployments(cluster, ns, "qwen3-8b")["decode"]["metadata"]["generation"]
    shared = copy.deepcopy(example())
    cluster.kubectl("replace", "-n", ns, "-f", "-", input=json.dumps(
        {**shared, "metadata": {**shared["metadata"], "namespace": ns}}))
    wait_ready(cluster, operator, ns, "qwen3-8b")
    cluster.wait_for(lambda: "derender" not in deployments(cluster, ns, "qwen3-8b"), "the derender pool pruned", timeout=90)
    assert get(cluster, ns, "service", "qwen3-8b-derender")["spec"]["selector"][names.POOL] == str(Role.RENDER)
    assert deployments(cluster, ns, "qwen3-8b")["decode"]["metadata"]["generation"] == decode_generation


def test_status_records_the_derender_strategy_the_spec_makes(cluster: Cluster, operator: OperatorProcess,
                                                              ns: str) -> None:
    """status.derender.strategy in a real API server (the CRD's status schema keeps it), shown by
    `kubectl get dm -o wide`, following engine.extension, engine.renderExtension and the vLLM version;
    without a version the CRD's default, 0.34.0, makes a stock decode derender its streams."""
    apply(cluster, ns, merged(base("strategy"), {"spec": {"engine": {"vllmVersion": "0.32.0"}}}))

    def shows(strategy: str) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            dm = model(cluster, ns, "strategy")
            current = dm.get("status", {}).get("observedGeneration") == dm["metadata"]["generation"]
            return dm if current and dm["status"].get("derender") == {"strategy": strategy} else None
        return cluster.wait_for(probe, f"status.derender.strategy {strategy}", timeout=READY_TIMEOUT)

    def render_plugins() -> str | None:
        vllm = next(c for c in deployments(cluster, ns, "strategy")["render"]["spec"]["template"]["spec"]["containers"]
                    if c["name"] == names.VLLM_CONTAINER)
        return next((e.get("value") for e in vllm.get("env", []) if e["name"] == "VLLM_PLUGINS"), None)

    shows("session")
    assert render_plugins() == "disagg"
    wide = [line.split() for line in cluster.kubectl("get", "dm", "strategy", "-n", ns, "-o", "wide").stdout.splitlines()]
    assert wide[1][wide[0].index("DERENDER")] == "session"
    for patch, strategy in [({"extension": True}, "inline"),
                            ({"extension": False, "renderExtension": False}, "stateless")]:
        cluster.kubectl("patch", "dm", "strategy", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"engine": patch}}))
        shows(strategy)
    cluster.wait_for(lambda: render_plugins() is None, "the render pool without the extension", timeout=READY_TIMEOUT)
    cluster.kubectl("patch", "dm", "strategy", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"engine": {"vllmVersion": None, "renderExtension": None}}}))
    engine = shows("stock-inline")["spec"]["engine"]
    assert (engine["vllmVersion"], engine["gpuImage"], engine["renderExtension"]) == (
        "0.34.0", "vllm/vllm-openai:v0.34.0", True)
    cluster.wait_for(lambda: render_plugins() == "disagg", "the render pool with the extension again",
                     timeout=READY_TIMEOUT)


# --- NetworkPolicies (the local control plane enforces none: the objects are what is checked) -----

def network_policies(cluster: Cluster, ns: str, instance: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in listed(cluster, ns, "networkpolicies", of(instance))[1]}


def test_network_policies_are_on_by_default_restored_and_pruned_when_disabled(
        cluster: Cluster, operator: OperatorProcess, ns: str) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    doc = example()
    pools = {"qwen3-8b-prefill", "qwen3-8b-decode", "qwen3-8b-render"}
    cluster.wait_for(lambda: set(network_policies(cluster, ns, "qwen3-8b")) == pools, "a policy per pool", timeout=90)
    # the policies may be applied before the Deployments: wait for every pool's
    cluster.wait_for(lambda: {"prefill", "decode", "render"} <= set(deployments(cluster, ns, "qwen3-8b")),
                     "a deployment per pool", timeout=90)
    live = network_policies(cluster, ns, "qwen3-8b")
    pods = deployments(cluster, ns, "qwen3-8b")
    for role, dep in pods.items():  # each policy selects its own pool's pods and no other pool's
        labels = dep["spec"]["template"]["metadata"]["labels"]
        selecting = [n for n, p in live.items()
                     if all(labels.get(k) == v for k, v in p["spec"]["podSelector"]["matchLabels"].items())]
        assert selecting == [f"qwen3-8b-{role}"]
        assert live[f"qwen3-8b-{role}"]["spec"]["policyTypes"] == ["Ingress"]
    sidecar_port, engine_port = doc["spec"]["router"].get("port", 8000), 8200
    decode_rules = live["qwen3-8b-decode"]["spec"]["ingress"]
    open_to_all = [r for r in decode_rules if "from" not in r]
    assert open_to_all == [{"ports": [{"protocol": "TCP", "port": sidecar_port}]}]
    decode_selector = pods["decode"]["spec"]["selector"]["matchLabels"]
    assert live["qwen3-8b-render"]["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": decode_selector}}], "ports": [{"protocol": "TCP", "port": engine_port}]}]
    assert all(r["from"] == [{"podSelector": {"matchLabels": decode_selector}}]
               for r in live["qwen3-8b-prefill"]["spec"]["ingress"])

    # Deleted or loosened: put back.
    old = live["qwen3-8b-render"]["metadata"]["uid"]
    cluster.kubectl("delete", "networkpolicy", "qwen3-8b-render", "-n", ns, "--wait=false")
    cluster.wait_for(lambda: network_policies(cluster, ns, "qwen3-8b").get("qwen3-8b-render", {})
                     .get("metadata", {}).get("uid") not in (None, old), "the render policy recreated", timeout=90)
    cluster.kubectl("patch", "networkpolicy", "qwen3-8b-decode", "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/ingress", "value": [{}]}]))  # {}: every source, every port
    cluster.wait_for(lambda: network_policies(cluster, ns, "qwen3-8b")["qwen3-8b-decode"]["spec"]["ingress"]
                     == decode_rules, "the decode policy restored", timeout=90)

    # Switched off: pruned, and no pod rolls; switched on again: back.
    generations = {r: d["metadata"]["generation"] for r, d in deployments(cluster, ns, "qwen3-8b").items()}
    cluster.kubectl("patch", "dm", "qwen3-8b", "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"networkPolicy": {"enabled": False}}}))
    cluster.wait_for(lambda: not network_policies(cluster, ns, "qwen3-8b"), "the policies pruned", timeout=90)
    wait_ready(cluster, operator, ns, "qwen3-8b")
    assert {r: d["metadata"]["generation"] for r, d in deployments(cluster, ns, "qwen3-8b").items()} == generations
    cluster.kubectl("patch", "dm", "qwen3-8b", "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"networkPolicy": {"enabled": True}}}))
    cluster.wait_for(lambda: set(network_policies(cluster, ns, "qwen3-8b")) == pools, "the policies back", timeout=90)


def test_a_namespace_being_deleted_is_left_to_its_deletion(cluster: Cluster, operator: OperatorProcess, ns: str) -> None:
    """Deleting a namespace deletes its models and their children in no fixed order. A policy here
    refuses the model's deletion while its children go, so the operator sees children of a live
    model vanish in a namespace being deleted: it tries once, is refused for that reason, and from
    then on restores nothing there and posts no Event (each would be refused and retried)."""
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    want = expected_keys(expected_plan(example(), ns))
    cluster.wait_for(lambda: set(children(cluster, ns, "qwen3-8b")) == want, "every child", timeout=90)
    hold = f"hold-{ns}"
    rule = {"apiGroups": ["disagg.dev"], "apiVersions": ["*"], "operations": ["DELETE"], "resources": [PLURAL]}
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": hold},
              "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [rule]},
                       "validations": [{"expression": "false", "message": "held by the test"}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": hold},
               "spec": {"policyName": hold, "validationActions": ["Deny"], "matchResources": {
                   "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}}}
    apply(cluster, "default", policy, binding)
    try:
        cluster.wait_for(lambda: cluster.kubectl("delete", "dm", "qwen3-8b", "-n", ns, "--dry-run=server",
                                                 check=False).returncode != 0, "the hold in force", timeout=60)
        logged = len(operator.log())
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
        cluster.wait_for(lambda: not children(cluster, ns, "qwen3-8b"), "the children deleted", timeout=120)
        stand_aside = f"Namespace {ns} is being deleted"
        cluster.wait_for(lambda: stand_aside in operator.log()[logged:], "the operator standing aside", timeout=60)
        assert get(cluster, ns, "dm", "qwen3-8b")["metadata"]["name"] == "qwen3-8b"  # held: the model was live
    finally:  # the namespace then goes in the background
        cluster.kubectl("delete", "validatingadmissionpolicybinding", hold, check=False)
        cluster.kubectl("delete", "validatingadmissionpolicy", hold, check=False)
    log = operator.log()[logged:]
    assert log.count(stand_aside) == 1, log
    refused = [line for line in log.splitlines() if "RestoreFailed" in line or "Failed to post an event" in line
               or "Request attempt" in line]
    assert not refused, refused
