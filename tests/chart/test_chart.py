"""charts/disagg against the real control plane: lint, server-side validation, install / upgrade /
uninstall, the values schema, least-privilege RBAC (a can-i matrix of SelfSubjectAccessReviews), the operator
itself running with the chart's ServiceAccount token until examples/qwen3-8b.yaml is Ready, and
leader election for replicas > 1 (two such operators: one reconciles, the other takes over on SIGTERM).

kwok marks the operator pod Running/Ready (no container runs), so the operator process is run
locally with the chart's identity. Every wait polls an observable condition with a bound.
"""
from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.cluster import Cluster
from tests.harness.operator import OperatorProcess

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "disagg"
VALUES = Path(__file__).parent / "values-namespaced.yaml"
EXAMPLE = REPO / "examples" / "qwen3-8b.yaml"
CRD_NAME = "disaggregatedmodels.disagg.dev"
INSTANCE = "app.kubernetes.io/instance"

NAMESPACED_KINDS = ("deployments,replicasets,pods,services,serviceaccounts,configmaps,roles,rolebindings,"
                    "horizontalpodautoscalers,poddisruptionbudgets,networkpolicies")
CLUSTER_KINDS = "clusterroles,clusterrolebindings"

# (verb, resource, subresource) the operator must be able to do in every namespace it serves.
CHILDREN = ("deployments.apps", "services", "configmaps", "serviceaccounts", "roles.rbac.authorization.k8s.io",
            "rolebindings.rbac.authorization.k8s.io", "horizontalpodautoscalers.autoscaling",
            "poddisruptionbudgets.policy", "networkpolicies.networking.k8s.io",
            "inferencepools.inference.networking.k8s.io", "podmonitors.monitoring.coreos.com")
ALLOWED = [
    *((verb, kind, None) for kind in CHILDREN for verb in ("get", "list", "watch", "create", "patch", "delete")),
    *((verb, CRD_NAME, None) for verb in ("get", "list", "watch", "patch")),
    ("get", CRD_NAME, "status"), ("patch", CRD_NAME, "status"),
    *((verb, "endpointslices.discovery.k8s.io", None) for verb in ("get", "list", "watch")),
    ("create", "events", None), ("patch", "events", None),
    ("create", "secrets", None),  # the engine API key Secret, created once and never read
    ("patch", "deployments.apps", "scale"),  # the planner (spec.autoscaling)
    ("list", "pods", None), ("patch", "pods", None),  # the planner: prefill pods leave the sidecars' selection first
]
# ... and must not be able to do even there.
DENIED_IN_WATCHED = [
    ("get", "secrets", None), ("list", "secrets", None), ("watch", "secrets", None), ("patch", "secrets", None),
    ("update", "secrets", None), ("delete", "secrets", None),
    ("create", "pods", None), ("create", "pods", "exec"), ("delete", "pods", None), ("update", "pods", None),
    ("get", "pods", "log"),
    ("create", CRD_NAME, None), ("delete", CRD_NAME, None), ("update", CRD_NAME, None),
    ("update", "deployments.apps", None), ("create", "endpointslices.discovery.k8s.io", None),
    ("escalate", "roles.rbac.authorization.k8s.io", None), ("bind", "roles.rbac.authorization.k8s.io", None),
    ("delete", "events", None), ("update", "inferencepools.inference.networking.k8s.io", None),
    ("patch", "inferencepools.inference.networking.k8s.io", "status"),
    ("update", "deployments.apps", "scale"), ("patch", "podmonitors.monitoring.coreos.com", "status"),
]
# Cluster-scoped: nothing at all.
DENIED_CLUSTER = [
    ("create", "clusterroles.rbac.authorization.k8s.io"), ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("create", "namespaces"), ("delete", "namespaces"), ("list", "namespaces"),
    ("get", "nodes"), ("create", "nodes"), ("patch", "nodes"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "persistentvolumes"),
]


# --- helpers -----------------------------------------------------------------------------------

def unique(prefix: str) -> str:
    return f"{prefix}-{os.urandom(3).hex()}"


def fullname(release: str) -> str:
    return release if "disagg" in release else f"{release}-disagg"


def sa_user(ns: str, sa: str) -> str:
    return f"system:serviceaccount:{ns}:{sa}"


def can_i(cluster: Cluster, user: str, verb: str, resource: str, ns: str | None = None,
          subresource: str | None = None, all_namespaces: bool = False) -> bool:
    """``kubectl auth can-i <verb> <resource>[.group][/name] --as=<user>``: the same
    SelfSubjectAccessReview, impersonated, sent in-process. Without ``ns`` the question is
    cluster-scoped (namespace "")."""
    resource, _, name = resource.partition("/")
    plural, _, group = resource.partition(".")
    attributes = {"verb": verb, "group": group, "resource": plural, "namespace": "" if all_namespaces else ns or "",
                  **({"subresource": subresource} if subresource else {}), **({"name": name} if name else {})}
    review = cluster.api("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attributes}}, as_user=user)
    return bool(review["status"]["allowed"])


def mismatches(cluster: Cluster, user: str, ns: str | None, cases: list[tuple[str, str, str | None]],
               want: bool) -> list[str]:
    """The cases whose can-i answer is not ``want`` (asked in parallel: many calls)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda case: can_i(cluster, user, case[0], case[1], ns, case[2]), cases))
    return [f"{verb} {res}{'/' + sub if sub else ''} in {ns or '<cluster>'}: want {'yes' if want else 'no'}"
            for (verb, res, sub), answer in zip(cases, answers) if answer != want]


def get_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def labelled(cluster: Cluster, release: str) -> list[str]:
    """Every object (namespaced in any namespace, and cluster-scoped) labelled with the release."""
    sel = f"{INSTANCE}={release}"
    items = get_json(cluster, NAMESPACED_KINDS, "-A", "-l", sel)["items"]
    items += get_json(cluster, CLUSTER_KINDS, "-l", sel)["items"]
    return sorted(f"{o['kind']}/{o['metadata'].get('namespace', '')}/{o['metadata']['name']}" for o in items)


PEERING_CRDS = sorted((REPO / "crds").glob("kopf.dev_*.yaml"))


def ensure_peering_crds(cluster: Cluster) -> None:
    """kopf's peering CRDs, established (shared by every test; helm install skips existing CRDs)."""
    assert [p.name for p in PEERING_CRDS] == ["kopf.dev_clusterkopfpeerings.yaml", "kopf.dev_kopfpeerings.yaml"]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", *(a for p in PEERING_CRDS for a in ("-f", str(p))))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/clusterkopfpeerings.kopf.dev", "crd/kopfpeerings.kopf.dev")


def namespaced_values(tmp_path: Path, watch: list[str], service_monitor: bool = False) -> Path:
    values = yaml.safe_load(VALUES.read_text())
    values["watchNamespaces"] = watch
    values["metrics"]["serviceMonitor"]["enabled"] = service_monitor  # no prometheus-operator CRDs here
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def render(cluster: Cluster, release: str, ns: str, *args: str) -> list[dict[str, Any]]:
    out = cluster.helm("template", release, str(CHART), "-n", ns, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def deployment(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return get_json(cluster, "-n", ns, "deployment", name)


def available(dep: dict[str, Any]) -> bool:
    conds = {c["type"]: c["status"] for c in dep.get("status", {}).get("conditions", [])}
    st = dep.get("status", {})
    return (conds.get("Available") == "True" and st.get("observedGeneration") == dep["metadata"]["generation"]
            and st.get("updatedReplicas") == st.get("availableReplicas") == dep["spec"]["replicas"]
            and not st.get("unavailableReplicas"))


def wait_available(cluster: Cluster, ns: str, name: str, after_generation: int = 0) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        dep = deployment(cluster, ns, name)
        return dep if available(dep) and dep["metadata"]["generation"] > after_generation else None

    return cluster.wait_for(probe, f"{ns}/{name} Available (generation > {after_generation})", timeout=120)


# --- fixtures ----------------------------------------------------------------------------------

@pytest.fixture
def namespaces(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Callable[[str], str]]:
    """A factory of fresh namespaces, all deleted after the test."""
    made: list[str] = []

    def make(prefix: str) -> str:
        made.append(cluster.create_namespace(f"chart-{prefix}"))
        return made[-1]

    yield make
    for name in made:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def releases(cluster: Cluster) -> Iterator[list[tuple[str, str]]]:
    """(release, namespace) pairs to uninstall after the test (cluster-scoped RBAC included)."""
    installed: list[tuple[str, str]] = []
    yield installed
    for release, ns in installed:
        cluster.helm("uninstall", release, "-n", ns, "--wait", "--ignore-not-found", check=False)


# --- static ------------------------------------------------------------------------------------

def test_chart_crds_are_the_top_level_crds() -> None:
    top = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert top, "no CRDs in crds/"
    assert sorted(chart) == sorted(top), "charts/disagg/crds/ must hold exactly the files of crds/"
    stale = [name for name in top if chart[name] != top[name]]
    assert not stale, f"charts/disagg/crds/ differs from crds/ for {stale}: cp crds/*.yaml charts/disagg/crds/"


def test_default_engine_and_sidecar_images_come_from_the_operator_image_registry() -> None:
    """The spec's default CPU engine image (images/vllm-cpu.Dockerfile, tagged by vLLM version) and
    sidecar image sit beside the operator image the chart installs; the sidecar's is that very image
    (the chart's appVersion, the package's version)."""
    from disagg_operator.spec import DEFAULT_CPU_IMAGE, DEFAULT_SIDECAR_IMAGE, DEFAULT_VLLM_VERSION

    registry = yaml.safe_load((CHART / "values.yaml").read_text())["image"]["repository"].rsplit("/", 1)[0]
    assert DEFAULT_CPU_IMAGE == f"{registry}/vllm-cpu:v{DEFAULT_VLLM_VERSION}"
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert DEFAULT_SIDECAR_IMAGE == f"{registry}/disagg:{app_version}"
    assert app_version == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    dockerfile = (REPO / "images" / "vllm-cpu.Dockerfile").read_text()
    assert f"ARG VLLM_VERSION={DEFAULT_VLLM_VERSION}" in dockerfile
    assert "FROM vllm/vllm-openai-cpu:v${VLLM_VERSION}" in dockerfile


@pytest.mark.parametrize("values", ["default", "namespaced", "leader-election"])
def test_helm_lint_passes(cluster: Cluster, values: str) -> None:
    args = {"default": [], "namespaced": ["-f", str(VALUES)],
            "leader-election": ["-f", str(VALUES), "--set", "replicas=3"]}[values]
    out = cluster.helm("lint", "--strict", str(CHART), *args)
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout, out.stdout


def test_non_default_values_render_as_configured(cluster: Cluster) -> None:
    docs = render(cluster, "ops", "platform", "-f", str(VALUES))
    kinds = sorted((d["kind"], d["metadata"].get("namespace", "")) for d in docs)
    assert kinds == [("Deployment", "platform"), ("Role", "team-a"), ("Role", "team-b"), ("RoleBinding", "team-a"),
                     ("RoleBinding", "team-b"), ("Service", "platform"), ("ServiceAccount", "platform"),
                     ("ServiceMonitor", "platform")]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example.com/platform/disagg:0.1.0-rc1"
    assert container["args"] == ["operator", "--liveness=http://0.0.0.0:9090/healthz", "--metrics-port=9091",
                                 "--namespace=team-a", "--namespace=team-b", "--verbose"]
    assert pod["serviceAccountName"] == "disagg-ops-operator"
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "disagg-ops-operator", "namespace": "platform"}]
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"

    default = render(cluster, "ops", "platform")
    dep = next(d for d in default if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "operator", "--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9090"]
    assert {d["kind"] for d in default} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service",
                                           "Deployment"}
    sc = dep["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def peering_rules(resource: str, name: str) -> list[dict[str, Any]]:
    return [{"apiGroups": ["kopf.dev"], "resources": [resource], "verbs": ["list", "watch"]},
            {"apiGroups": ["kopf.dev"], "resources": [resource], "resourceNames": [name], "verbs": ["get", "patch"]}]


def test_replicas_above_one_render_leader_election(cluster: Cluster) -> None:
    """replicas > 1: --peering, a RollingUpdate, the peering object(s) and RBAC on them; 1: none of it."""
    def docs_by_kind(*args: str) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for d in render(cluster, "ops", "platform", *args):
            out.setdefault(d["kind"], []).append(d)
        return out

    def peering_mentions(docs: dict[str, list[dict[str, Any]]]) -> list[str]:
        return [f"{kind}/{d['metadata']['name']}" for kind, items in docs.items() for d in items
                if "peering" in json.dumps(d).lower() or "POD_ID" in json.dumps(d)]

    # cluster-wide: one ClusterKopfPeering, the ClusterRole may use it
    docs = docs_by_kind("--set", "replicas=2")
    (dep,) = docs["Deployment"]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["operator", "--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9090",
                                 "--peering=ops-disagg"]
    assert "--priority" not in " ".join(container["args"]), "each replica must draw its own random priority"
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    (peering,) = docs["ClusterKopfPeering"]
    assert peering["apiVersion"] == "kopf.dev/v1" and peering["metadata"]["name"] == "ops-disagg"
    assert peering["metadata"]["labels"][INSTANCE] == "ops"
    (role,) = docs["ClusterRole"]
    assert role["rules"][-2:] == peering_rules("clusterkopfpeerings", "ops-disagg")
    assert [r for r in role["rules"] if "kopf.dev" in r["apiGroups"]] == role["rules"][-2:]
    assert "KopfPeering" not in docs and "Role" not in docs

    # namespace-scoped: a KopfPeering and the rules for it in every watched namespace, nothing cluster-wide
    docs = docs_by_kind("-f", str(VALUES), "--set", "replicas=3")
    (dep,) = docs["Deployment"]
    assert dep["spec"]["replicas"] == 3 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "operator", "--liveness=http://0.0.0.0:9090/healthz", "--metrics-port=9091",
        "--namespace=team-a", "--namespace=team-b", "--peering=disagg-ops", "--verbose"]
    assert sorted((d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs["KopfPeering"]) == [
        ("team-a", "disagg-ops"), ("team-b", "disagg-ops")]
    assert sorted(d["metadata"]["namespace"] for d in docs["Role"]) == ["team-a", "team-b"]
    for role in docs["Role"]:
        assert role["rules"][-2:] == peering_rules("kopfpeerings", "disagg-ops")
    assert not any(kind.startswith("Cluster") for kind in docs), sorted(docs)

    # one replica (and zero): standalone, Recreate, no peering anywhere
    for replicas in ("1", "0"):
        for args in ([], ["-f", str(VALUES)]):
            docs = docs_by_kind(*args, "--set", f"replicas={replicas}")
            (dep,) = docs["Deployment"]
            assert dep["spec"]["strategy"] == {"type": "Recreate"}
            assert not peering_mentions(docs), peering_mentions(docs)
            assert not {"ClusterKopfPeering", "KopfPeering"} & set(docs)


BAD_VALUES = [
    (["--set", "replicas=6"], ["/replicas", "maximum: got 6, want 5"]),
    (["--set", "replicas=-1"], ["/replicas", "minimum: got -1, want 0"]),
    (["--set", "logLevel=trace"], ["/logLevel", "'info', 'debug'"]),
    (["--set", "watchNamespaces={Team_A}"], ["/watchNamespaces/0", "does not match pattern"]),
    (["--set", "watchNamespaces={a,a}"], ["/watchNamespaces", "items at", "equal"]),
    (["--set", "image.pullPolicy=Sometimes"], ["/image/pullPolicy", "'Always', 'IfNotPresent', 'Never'"]),
    (["--set", "http.port=70000"], ["/http/port", "maximum: got 70,000, want 65,535"]),
    (["--set", "replicass=1"], ["additional properties 'replicass' not allowed"]),
    (["--set", "metrics.serviceMonitor.enable=true"], ["/metrics/serviceMonitor", "'enable' not allowed"]),
    (["--set", "securityContext.readOnlyRootFilesystem=false"], ["/securityContext/readOnlyRootFilesystem"]),
    (["--set", "resources.requests.cpu=lots"], ["/resources/requests/cpu"]),
]


@pytest.mark.parametrize(("args", "expected"), BAD_VALUES, ids=[" ".join(a[1:]) for a, _ in BAD_VALUES])
def test_values_breaking_the_schema_are_rejected_readably(cluster: Cluster, args: list[str],
                                                          expected: list[str]) -> None:
    proc = cluster.helm("template", "bad", str(CHART), *args, check=False)
    assert proc.returncode != 0, proc.stdout
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr


def test_template_guards_what_the_schema_cannot(cluster: Cluster) -> None:
    proc = cluster.helm("template", "bad", str(CHART), "--set", "metrics.service.enabled=false",
                        "--set", "metrics.serviceMonitor.enabled=true", check=False)
    assert proc.returncode != 0 and "metrics.serviceMonitor.enabled needs metrics.service.enabled" in proc.stderr
    proc = cluster.helm("template", "bad", str(CHART), "--set", "replicas=6", "--skip-schema-validation", check=False)
    assert proc.returncode != 0 and "replicas must be between 0 and 5" in proc.stderr, proc.stderr


def test_bad_values_install_nothing(cluster: Cluster, namespaces: Callable[[str], str]) -> None:
    ns = namespaces("bad")
    release = unique("bad")
    proc = cluster.helm("install", release, str(CHART), "-n", ns, "--set", "replicas=9", check=False)
    assert proc.returncode != 0 and "/replicas" in proc.stderr, proc.stderr
    assert labelled(cluster, release) == []
    assert cluster.helm("list", "-n", ns, "-q").stdout.strip() == ""


# --- against the cluster -----------------------------------------------------------------------

@pytest.mark.parametrize("values", ["default", "namespaced", "leader-election", "leader-election-namespaced"])
def test_template_applies_with_server_dry_run(cluster: Cluster, namespaces: Callable[[str], str],
                                              tmp_path: Path, values: str) -> None:
    ns = namespaces("dry")
    args = ["--include-crds"]
    if values.endswith("namespaced"):
        args += ["-f", str(namespaced_values(tmp_path, [namespaces("dry-w1"), namespaces("dry-w2")]))]
    if values.startswith("leader-election"):
        # A dry run creates no CRD, so the peering objects need kopf's CRDs in place (as helm install
        # does from crds/ first). Applying them is idempotent; they are never removed.
        ensure_peering_crds(cluster)
        args += ["--set", "replicas=2"]
    manifest = cluster.helm("template", unique("dry"), str(CHART), "-n", ns, *args).stdout
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=manifest).stdout
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines and all("(server dry run)" in line for line in lines), out
    assert len(lines) == len([d for d in yaml.safe_load_all(manifest) if d])


def test_install_upgrade_uninstall_cluster_wide(cluster: Cluster, namespaces: Callable[[str], str],
                                                releases: list[tuple[str, str]]) -> None:
    ns = namespaces("cw")
    release = unique("cw")
    name = fullname(release)
    releases.append((release, ns))
    cluster.helm("install", release, str(CHART), "-n", ns, "--wait", "--timeout", "3m")
    dep = wait_available(cluster, ns, name)
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == name
    created = labelled(cluster, release)
    for expected in (f"ClusterRole//{name}", f"ClusterRoleBinding//{name}", f"ServiceAccount/{ns}/{name}",
                     f"Service/{ns}/{name}-metrics", f"Deployment/{ns}/{name}"):
        assert expected in created, created
    assert not any(o.startswith(("Role/", "RoleBinding/")) for o in created), created
    endpoints = get_json(cluster, "-n", ns, "endpointslices", "-l", f"kubernetes.io/service-name={name}-metrics")
    assert endpoints["items"], "the metrics Service selects no pod"
    assert endpoints["items"][0]["ports"] == [{"name": "metrics", "port": 9090, "protocol": "TCP"}]

    # upgrade with changed values: a new pod template → a new ReplicaSet; the old one is scaled to 0
    def replica_sets() -> dict[str, dict[str, Any]]:
        items = get_json(cluster, "-n", ns, "replicasets", "-l", f"{INSTANCE}={release}")["items"]
        return {o["metadata"]["name"]: o for o in items}

    before = replica_sets()
    assert len(before) == 1
    generation = dep["metadata"]["generation"]
    cluster.helm("upgrade", release, str(CHART), "-n", ns, "--reuse-values", "--set", "logLevel=debug",
                 "--wait", "--timeout", "3m")
    dep = wait_available(cluster, ns, name, after_generation=generation)
    assert "--verbose" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    cluster.kubectl("rollout", "status", "-n", ns, f"deployment/{name}", "--timeout=120s")
    after = replica_sets()
    (new,) = set(after) - set(before)
    assert after[new]["status"].get("readyReplicas") == 1
    assert all(after[old]["spec"]["replicas"] == 0 for old in before)
    history = json.loads(cluster.helm("history", release, "-n", ns, "-o", "json").stdout)
    assert [h["revision"] for h in history] == [1, 2] and history[-1]["status"] == "deployed"

    cluster.helm("uninstall", release, "-n", ns, "--wait", "--timeout", "2m")
    cluster.wait_for(lambda: labelled(cluster, release) == [], f"every object of {release} gone", timeout=120)
    assert get_json(cluster, "-n", ns, "secrets", "-l", f"owner=helm,name={release}")["items"] == []
    assert cluster.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0, "uninstall keeps the CRD"


def test_rbac_cluster_wide_least_privilege(cluster: Cluster, namespaces: Callable[[str], str],
                                           releases: list[tuple[str, str]]) -> None:
    ns, anywhere = namespaces("cwrbac"), namespaces("cwrbac-any")
    release = unique("cwrbac")
    releases.append((release, ns))
    cluster.helm("install", release, str(CHART), "-n", ns, "--wait", "--timeout", "3m")
    user = sa_user(ns, fullname(release))
    problems = mismatches(cluster, user, anywhere, ALLOWED, True)
    problems += mismatches(cluster, user, anywhere, DENIED_IN_WATCHED, False)
    problems += [f"{v} {r} cluster-scoped: want no" for v, r in DENIED_CLUSTER if can_i(cluster, user, v, r)]
    assert can_i(cluster, user, "list", CRD_NAME, all_namespaces=True), "cluster-wide list of models"
    assert not can_i(cluster, user, "list", "secrets", all_namespaces=True)
    assert not problems, "\n".join(problems)


def test_rbac_namespaced_least_privilege(cluster: Cluster, namespaces: Callable[[str], str], tmp_path: Path,
                                         releases: list[tuple[str, str]]) -> None:
    ns, watched, other = namespaces("nsrbac"), [namespaces("nsrbac-w1"), namespaces("nsrbac-w2")], namespaces("nsrbac-o")
    release = unique("nsrbac")
    releases.append((release, ns))
    cluster.helm("install", release, str(CHART), "-n", ns, "-f", str(namespaced_values(tmp_path, watched)),
                 "--wait", "--timeout", "3m")
    dep = deployment(cluster, ns, "disagg-ops")
    assert available(dep)
    created = labelled(cluster, release)
    assert not any(o.startswith("Cluster") for o in created), created
    assert sorted(o for o in created if o.startswith("Role")) == sorted(
        [f"Role/{w}/disagg-ops" for w in watched] + [f"RoleBinding/{w}/disagg-ops" for w in watched])

    user = sa_user(ns, "disagg-ops-operator")
    problems: list[str] = []
    for w in watched:
        problems += mismatches(cluster, user, w, ALLOWED, True)
        problems += mismatches(cluster, user, w, DENIED_IN_WATCHED, False)
    for elsewhere in (other, ns, "default", "kube-system"):  # not even its own namespace
        problems += mismatches(cluster, user, elsewhere, ALLOWED, False)
    problems += [f"{v} {r} cluster-scoped: want no" for v, r in DENIED_CLUSTER if can_i(cluster, user, v, r)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        anywhere = list(pool.map(lambda c: can_i(cluster, user, c[0], c[1], all_namespaces=True), ALLOWED))
    problems += [f"{verb} {res} in all namespaces: want no" for (verb, res, _), yes in zip(ALLOWED, anywhere) if yes]
    assert not problems, "\n".join(problems)


# --- the operator with the chart's identity ------------------------------------------------------

def sa_kubeconfig(cluster: Cluster, ns: str, sa: str, path: Path) -> Path:
    admin = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    token = cluster.kubectl("create", "token", sa, "-n", ns, "--duration=1h").stdout.strip()
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "disagg", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": "disagg", "user": sa, "namespace": ns}}],
        "current-context": sa,
    }
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


def test_operator_with_chart_identity_reconciles_example_to_ready(
        cluster: Cluster, namespaces: Callable[[str], str], tmp_path: Path, releases: list[tuple[str, str]]) -> None:
    ns, watched = namespaces("op"), namespaces("op-w")
    release = unique("op")
    releases.append((release, ns))
    cluster.helm("install", release, str(CHART), "-n", ns, "-f", str(namespaced_values(tmp_path, [watched])),
                 "--wait", "--timeout", "3m")
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD_NAME}")
    kubeconfig = sa_kubeconfig(cluster, ns, "disagg-ops-operator", tmp_path / "sa.kubeconfig")
    whoami = json.loads(cluster.run("kubectl", [f"--kubeconfig={kubeconfig}", "auth", "whoami", "-o", "json"]).stdout)
    assert whoami["status"]["userInfo"]["username"] == sa_user(ns, "disagg-ops-operator")

    # The same arguments as the chart's Deployment (but local liveness and metrics ports).
    args = render(cluster, release, ns, "-f", str(namespaced_values(tmp_path, [watched])))
    container = next(d for d in args if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    op_args = [a for a in container["args"][1:] if not a.startswith(("--liveness", "--metrics-port"))]
    assert op_args == [f"--namespace={watched}", "--verbose"]
    operator = OperatorProcess(kubeconfig, tmp_path, op_args, metrics_endpoint=False).start()
    try:
        cluster.wait_for(operator.alive, "the operator's liveness endpoint", timeout=60)
        # Namespaced: no cluster-wide scanning (the Role could not list namespaces), straight to `watched`.
        serving = f"Starting the watch-stream for disaggregatedmodels.v1alpha1.disagg.dev in '{watched}'"
        cluster.wait_for(lambda: operator.alive() and serving in operator.log(),
                         "the operator watching its namespace", timeout=60, interval=1)
        cluster.kubectl("apply", "-n", watched, "-f", str(EXAMPLE))

        def ready() -> dict[str, Any] | None:
            dm = get_json(cluster, "-n", watched, "disaggregatedmodel", "qwen3-8b")
            conds = {c["type"]: c["status"] for c in dm.get("status", {}).get("conditions", [])}
            current = dm.get("status", {}).get("observedGeneration") == dm["metadata"]["generation"]
            return dm if current and conds.get("Ready") == "True" else None

        try:
            cluster.wait_for(ready, f"{watched}/qwen3-8b Ready", timeout=180)
        except AssertionError as exc:
            status = get_json(cluster, "-n", watched, "disaggregatedmodel", "qwen3-8b").get("status")
            pods = cluster.kubectl("get", "pods", "-n", watched, "-o", "wide", check=False).stdout
            raise AssertionError(f"{exc}\n--- status ---\n{json.dumps(status, indent=1)}\n--- pods ---\n{pods}"
                                 f"\n--- operator log ---\n{operator.log_tail()}") from None
        log = operator.log()
        assert "Handler 'reconcile' succeeded" in log, operator.log_tail()
        # The writes were this operator's own (its debug log has every request and its answer). A
        # cluster-wide disagg operator running concurrently (another session) could race it here.
        written = set(re.findall(rf'"PATCH /apis?(?:/[a-z0-9.]+)?/v[0-9a-z]+/namespaces/{watched}/([a-z]+)/'
                                 r'[^ "]+ HTTP/1.1" 20[01]', log))
        want = {"serviceaccounts", "roles", "rolebindings", "configmaps", "services", "deployments",
                "networkpolicies", "disaggregatedmodels"}
        assert want <= written, f"writes by the chart-identity operator: {sorted(written)}; want {sorted(want)}"
        failures = get_json(cluster, "-n", watched, "events", "--field-selector",
                            "involvedObject.name=qwen3-8b")["items"]
        assert not [e for e in failures if e["reason"] in ("ApplyFailed", "RestoreFailed", "InvalidSpec")], failures
        kinds = get_json(cluster, "-n", watched, "serviceaccounts,roles,rolebindings,deployments,networkpolicies",
                         "-l", f"{INSTANCE}=qwen3-8b")["items"]
        assert {o["kind"] for o in kinds} == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "NetworkPolicy"}
        assert operator.alive()
    finally:
        operator.stop()
        cluster.kubectl("delete", "-n", watched, "-f", str(EXAMPLE), "--ignore-not-found", "--wait=false",
                        check=False)
    # kopf's namespace and CRD scanning is refused on purpose (no cluster-wide reads): it warns and
    # falls back to the given namespaces. Nothing else may be refused.
    expected = ('resource "namespaces" in API group "" at the cluster scope',
                'resource "customresourcedefinitions" in API group "apiextensions.k8s.io" at the cluster scope')
    refused = [line for line in operator.log().splitlines()
               if ("Forbidden" in line or " 403" in line) and not any(e in line for e in expected)]
    assert not refused, "\n".join(refused)


# --- leader election (replicas > 1) --------------------------------------------------------------

MINIMAL = REPO / "examples" / "minimal.yaml"
PAUSED = "Pausing operations in favour of"
RESUMED = "Resuming operations after the pause"


def writes(log: str, ns: str) -> set[tuple[str, str]]:
    """(resource, name) of every successful write the operator's debug log shows in ``ns``."""
    return set(re.findall(rf'"(?:PATCH|POST|PUT|DELETE) /apis?(?:/[a-z0-9.]+)?/v[0-9a-z]+/namespaces/{ns}/'
                          r'([a-z]+)/([^ "/?]+)[^ "]* HTTP/1.1" 20[012]', log))


def model_doc(name: str) -> str:
    doc = yaml.safe_load(MINIMAL.read_text())
    doc["metadata"]["name"] = name
    return yaml.safe_dump(doc)


def test_replicas_elect_one_leader_that_hands_over_on_sigterm(
        cluster: Cluster, namespaces: Callable[[str], str], tmp_path: Path, releases: list[tuple[str, str]]) -> None:
    """Two operator processes with the chart's ServiceAccount and the chart's replicas=2 arguments:
    one reconciles, the other stands by; SIGTERM on the leader hands over to the standby at once."""
    ns, watched, other = namespaces("le"), namespaces("le-w"), namespaces("le-o")
    release = unique("le")
    releases.append((release, ns))
    values = namespaced_values(tmp_path, [watched])
    install = cluster.helm("install", release, str(CHART), "-n", ns, "-f", str(values), "--set", "replicas=2",
                           "--wait", "--timeout", "3m")
    assert "2 replicas elect a leader through kopf peering (KopfPeering disagg-ops)" in install.stdout  # NOTES
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD_NAME}",
                    "crd/kopfpeerings.kopf.dev")
    peering = "disagg-ops"
    peering_obj = get_json(cluster, "-n", watched, "kopfpeerings.kopf.dev", peering)
    assert peering_obj["metadata"]["labels"][INSTANCE] == release and not peering_obj.get("status")

    # RBAC on the peering: only its kind in the watched namespace, get/patch only on its own object.
    user = sa_user(ns, "disagg-ops-operator")
    kind = "kopfpeerings.kopf.dev"
    problems = mismatches(cluster, user, watched, [("list", kind, None), ("watch", kind, None),
                                                   ("get", f"{kind}/{peering}", None),
                                                   ("patch", f"{kind}/{peering}", None)], True)
    problems += mismatches(cluster, user, watched, [("patch", f"{kind}/someone-else", None), ("create", kind, None),
                                                    ("delete", f"{kind}/{peering}", None),
                                                    ("update", f"{kind}/{peering}", None)], False)
    for elsewhere in (other, ns):
        problems += mismatches(cluster, user, elsewhere, [("list", kind, None),
                                                          ("patch", f"{kind}/{peering}", None)], False)
    problems += [f"{v} {r} cluster-scoped: want no" for v, r in [
        ("list", "clusterkopfpeerings.kopf.dev"), ("patch", f"clusterkopfpeerings.kopf.dev/{peering}")]
        if can_i(cluster, user, v, r)]
    assert not problems, "\n".join(problems)

    # The chart's arguments for replicas=2 (local liveness port, no metrics port) ...
    docs = render(cluster, release, ns, "-f", str(values), "--set", "replicas=2")
    container = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    op_args = [a for a in container["args"][1:] if not a.startswith(("--liveness", "--metrics-port"))]
    assert op_args == [f"--namespace={watched}", f"--peering={peering}", "--verbose"]
    kubeconfig = sa_kubeconfig(cluster, ns, "disagg-ops-operator", tmp_path / "sa.kubeconfig")

    def status() -> dict[str, Any]:
        return get_json(cluster, "-n", watched, kind, peering).get("status") or {}

    # ... run by "replica-a" (a random priority, as in the chart) which starts alone and works, then by
    # "replica-b" with a priority above any random one: a pauses in its favour (a replica that joins
    # below the leader is paused from its start and says nothing; this order makes the pause visible).
    for replica in ("replica-a", "replica-b"):
        (tmp_path / replica).mkdir()  # each replica's log
    a = OperatorProcess(kubeconfig, tmp_path / "replica-a", op_args, env={"POD_ID": "replica-a"},
                        metrics_endpoint=False).start()
    b: OperatorProcess | None = None
    models = ("first", "second")
    try:
        cluster.wait_for(lambda: a.alive() and RESUMED in a.log(), "replica-a working (alone)", timeout=90,
                         interval=0.5)
        priority_a = status()["replica-a"]["priority"]
        assert 0 <= priority_a < 2**31, priority_a
        b = OperatorProcess(kubeconfig, tmp_path / "replica-b", [*op_args, f"--priority={2**31}"],
                            env={"POD_ID": "replica-b"}, metrics_endpoint=False).start()
        cluster.wait_for(lambda: b.alive() and RESUMED in b.log(), "replica-b working", timeout=90, interval=0.5)
        cluster.wait_for(lambda: PAUSED in a.log(), "replica-a pausing in favour of replica-b", timeout=60,
                         interval=0.5)
        paused = next(line for line in a.log().splitlines() if PAUSED in line)
        assert "replica-b" in paused, paused
        peers = status()
        assert peers["replica-b"]["priority"] == 2**31 and peers["replica-a"]["priority"] == priority_a

        def reconciled(op: OperatorProcess, model: str) -> bool:
            dm = get_json(cluster, "-n", watched, "disaggregatedmodel", model)
            current = dm.get("status", {}).get("observedGeneration") == dm["metadata"]["generation"]
            return op.alive() and current and ("deployments", f"{model}-decode") in writes(op.log(), watched)

        # The leader (b) reconciles the first model; the standby (a) writes nothing but its keep-alive.
        cluster.kubectl("apply", "-n", watched, "-f", "-", input=model_doc(models[0]))
        cluster.wait_for(lambda: reconciled(b, models[0]), f"replica-b reconciling {models[0]}", timeout=90)
        assert a.alive()
        assert "Handler 'reconcile'" not in a.log(), a.log_tail()
        assert writes(a.log(), watched) <= {("kopfpeerings", peering)}, writes(a.log(), watched)

        # SIGTERM: b removes itself from the peering as it exits, a resumes at once (no 60 s expiry).
        b.stop()
        assert b.proc.returncode == 0, b.log_tail()
        assert "replica-b" not in status()
        cluster.wait_for(lambda: a.log().count(RESUMED) >= 2, "replica-a resuming", timeout=30, interval=0.5)
        cluster.kubectl("apply", "-n", watched, "-f", "-", input=model_doc(models[1]))
        cluster.wait_for(lambda: reconciled(a, models[1]), f"replica-a reconciling {models[1]}", timeout=90)
        assert models[1] not in "".join(f"{r}/{n}" for r, n in writes(b.log(), watched))
    finally:
        a.stop()
        if b is not None:
            b.stop()
        for model in models:
            cluster.kubectl("delete", "-n", watched, "disaggregatedmodel", model, "--ignore-not-found",
                            "--wait=false", check=False)
    assert status() == {}, "both replicas left the peering on SIGTERM"
    # As in the single-operator test, only kopf's cluster-wide scanning may be refused.
    expected = ('resource "namespaces" in API group "" at the cluster scope',
                'resource "customresourcedefinitions" in API group "apiextensions.k8s.io" at the cluster scope')
    for op in (a, b):
        refused = [line for line in op.log().splitlines()
                   if ("Forbidden" in line or " 403" in line) and not any(e in line for e in expected)]
        assert not refused, "\n".join(refused)

    # helm uninstall removes the peering object with the rest.
    cluster.helm("uninstall", release, "-n", ns, "--wait", "--timeout", "2m")
    assert cluster.kubectl("get", "-n", watched, kind, peering, check=False).returncode != 0
