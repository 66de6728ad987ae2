"""examples/cluster-tiny.yaml on the real node, the way a user deploys it (tests/harness/cluster_tiny.py:
images imported with ctr, `helm install` of the chart, `kubectl apply -f` of the example). Every pool
then runs real containers behind their real probes, and the openai SDK talks to the model through
the decode Service's ClusterIP (kube-proxy on this host).

One operator release and one deployment serve every test here and in test_cluster_scaling.py
(engines take minutes to start on a busy 2-core machine: the harness starts them while the engine
tests run); the last two take the node down under it and delete the model."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
from openai import OpenAI

from disagg_operator.names import KV_REVISION
from tests.cluster.real_node import node_pids, running
from tests.harness.cluster import REAL_NODE, Cluster, ClusterError, RealNodeSession, host_state, node_script
# The example's fixtures, shared with tests/e2e/test_cluster_scaling.py (which runs first).
from tests.harness.cluster_tiny import MODEL, READY_TIMEOUT, Deployed, cluster_tiny, get, pods, ready, tiny  # noqa: F401
from tests.harness.agent_apis import messages_views, responses_views
from tests.harness.coupled import forced_views
from tests.harness.pod_watch import PodWatch, Seen
from tests.harness.request_stream import RequestStream

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

POOLS = ("prefill", "decode", "render")
CHAT_PATH = "/v1/chat/completions"


def test_operator_is_a_real_pod_under_its_service_account(cluster: Cluster, tiny: Deployed) -> None:
    [pod] = get(cluster, "pods", "-n", tiny.operator_ns, "-l", f"app.kubernetes.io/instance={tiny.release}")["items"]
    assert pod["spec"]["nodeName"] == REAL_NODE and pod["spec"]["serviceAccountName"] == tiny.release
    [status] = pod["status"]["containerStatuses"]
    assert status["containerID"].startswith("containerd://") and status["started"] and status["restartCount"] == 0
    # It reconciled through the in-cluster API (the `kubernetes` Service), as that account.
    dm = get(cluster, "dm", MODEL, "-n", tiny.ns)
    [cond] = [c for c in dm["status"]["conditions"] if c["type"] == "Ready"]
    assert cond["status"] == "True" and cond["observedGeneration"] == dm["metadata"]["generation"]
    # The chart's least-privilege RBAC covers everything it does (nothing refused, not even once). Writes into a
    # namespace being deleted (other tests' namespaces: the operator watches all) are refused as Forbidden too,
    # with the cause NamespaceTerminating; those are not RBAC refusals.
    log = cluster.kubectl("logs", pod["metadata"]["name"], "-n", tiny.operator_ns).stdout
    assert "Handler 'child-deployments' succeeded" in log
    refused = [line for line in log.splitlines() if "Forbidden" in line and "NamespaceTerminating" not in line]
    assert not refused, refused


def test_every_pool_runs_real_containers_ready_through_real_probes(cluster: Cluster, tiny: Deployed) -> None:
    table = cluster.kubectl("get", "dm", MODEL, "-n", tiny.ns).stdout.splitlines()
    assert table[1].split()[:4] == [MODEL, "True", "3/3", f"http://{MODEL}.{tiny.ns}.svc:8000"], table
    for pool in POOLS:
        [pod] = pods(cluster, tiny.ns, pool)
        assert pod["spec"]["nodeName"] == REAL_NODE and ready(pod)
        for status in pod["status"]["containerStatuses"]:
            assert status["containerID"].startswith("containerd://") and status["ready"], status
        vllm = next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(vllm)
        assert vllm["lifecycle"]["preStop"]  # accepted by the API server, run by kubelet (decode: httpGet)
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        [home] = [v for v in pod["spec"]["volumes"] if v["name"] == "cache"]
        assert home["persistentVolumeClaim"] == {"claimName": "engine-cache"}
    # engine.cacheClaim: vLLM keeps its model inspection there for the next start (uid 1000, the engines')
    cache = Path(get(cluster, "pv", "disagg-engine-cache")["spec"]["hostPath"]["path"])
    infos = list((cache / ".cache" / "vllm" / "modelinfos").glob("*.json"))
    assert infos and all(p.stat().st_uid == 1000 for p in infos), infos


@pytest.fixture(scope="module")
def client(tiny: Deployed) -> OpenAI:
    return OpenAI(base_url=tiny.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parity
@pytest.mark.parametrize("stream", [False, True])
def test_forced_answers_through_the_decode_service_equal_the_coupled_reference(
    engine_set, forcer, client: OpenAI, stream: bool
) -> None:
    got_view, want = forced_views(engine_set, forcer, client, "reasoning_tool_call", stream)
    assert got_view == want
    assert want["choices"][0]["tool_calls"] == [("get_weather", {"city": "東京"})]


def _long_prompt(forcer) -> dict[str, Any]:
    """A new prompt of several KV blocks: the sidecar sends it to prefill (short ones stay on decode)."""
    body = forcer.chat_body("plain")
    body["messages"][0]["content"] = f"{time.time_ns()} a prompt nobody sent before" + " and more words" * 150
    return body


def _counters(url: str) -> dict[str, float]:
    wanted = {"vllm:external_prefix_cache_hits_total": "hits", "vllm:request_success_total": "done"}
    totals = dict.fromkeys(wanted.values(), 0.0)
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def test_decode_metrics_show_the_prompt_kv_came_from_prefill(
    cluster: Cluster, tiny: Deployed, forcer, client: OpenAI
) -> None:
    [decode], [prefill] = pods(cluster, tiny.ns, "decode"), pods(cluster, tiny.ns, "prefill")
    decode_url, prefill_url = (f"http://{p['status']['podIP']}:8200" for p in (decode, prefill))
    before = {"decode": _counters(decode_url), "prefill": _counters(prefill_url)}
    body = _long_prompt(forcer)
    client.chat.completions.create(model="tiny-qwen3", messages=body["messages"], max_tokens=body["max_tokens"],
                                   extra_body={"vllm_xargs": body["vllm_xargs"],
                                               "chat_template_kwargs": body["chat_template_kwargs"]})
    deadline = time.monotonic() + 30
    while (after := {"decode": _counters(decode_url), "prefill": _counters(prefill_url)})["decode"]["done"] \
            < before["decode"]["done"] + 1:
        assert time.monotonic() < deadline, "decode never counted the request"
        time.sleep(0.2)
    assert after["prefill"]["done"] == before["prefill"]["done"] + 1
    assert after["decode"]["hits"] > before["decode"]["hits"]


@pytest.mark.parity
@pytest.mark.parametrize("api", ["responses", "messages"])
def test_responses_and_messages_through_their_sdks_equal_the_coupled_reference_with_kv_from_prefill(
    engine_set, cluster: Cluster, tiny: Deployed, forcer, api: str
) -> None:
    """The openai SDK's Responses and the anthropic SDK's Messages calls through the decode Service
    read what the coupled reference gives them; the new prompt's KV came from the prefill pod."""
    views = {"responses": responses_views, "messages": messages_views}[api]
    [decode] = pods(cluster, tiny.ns, "decode")
    decode_url = f"http://{decode['status']['podIP']}:8200"
    before = _counters(decode_url)
    assert views(tiny.url, forcer, note=f"{time.time_ns()} ") == views(engine_set.url("coupled"), forcer)
    deadline = time.monotonic() + 30
    while _counters(decode_url)["hits"] <= before["hits"]:
        assert time.monotonic() < deadline, f"the decode pod loaded no KV from prefill for {api}"
        time.sleep(0.2)


def _uids(cluster: Cluster, ns: str, pool: str) -> set[str]:
    return {p["metadata"]["uid"] for p in pods(cluster, ns, pool)}


def _replaced(cluster: Cluster, ns: str, pool: str, old: set[str]) -> bool:
    """The pool's pods are all new and Ready, and every old one is gone (not just terminating)."""
    now = pods(cluster, ns, pool)
    return bool(now) and all(p["metadata"]["uid"] not in old and ready(p) and "deletionTimestamp" not in p["metadata"]
                             for p in now)


def _model_ready(cluster: Cluster, ns: str) -> bool:
    dm = get(cluster, "dm", MODEL, "-n", ns)
    return any(c["type"] == "Ready" and c["status"] == "True" and c.get("observedGeneration") == dm["metadata"][
        "generation"] for c in dm.get("status", {}).get("conditions", []))


def _served(stream: RequestStream, count: int, what: str, since: float = 0.0, prefill: str | None = None) -> None:
    deadline = time.monotonic() + 180
    while stream.served(since, prefill) < count:
        assert time.monotonic() < deadline, f"{what}: {stream.summary()}"
        time.sleep(0.2)


def test_deleting_a_prefill_pod_under_a_request_stream_fails_no_request(
    cluster: Cluster, tiny: Deployed, forcer
) -> None:
    """The Deployment replaces the pod; the sidecar's EndpointSlice watch drops the terminating pod
    at once (its preStop sleep lets legs already on it finish) and finds the new pod's address.
    With one prefill replica, requests in between are prefilled by decode (prefillFailurePolicy:
    fallback, the default): served, and counted apart."""
    [old] = pods(cluster, tiny.ns, "prefill")
    with RequestStream(tiny.url, forcer) as stream:
        _served(stream, 4, "prefill in use before the deletion", prefill="remote")
        t0 = time.monotonic()
        cluster.kubectl("delete", "pod", old["metadata"]["name"], "-n", tiny.ns, "--wait=false")
        cluster.wait_for(lambda: _replaced(cluster, tiny.ns, "prefill", {old["metadata"]["uid"]}),
                         "a new prefill pod Ready, the old one gone", timeout=READY_TIMEOUT, interval=1)
        replaced = time.monotonic()
        _served(stream, 4, "the new prefill pod in use", since=replaced, prefill="remote")
    print(f"prefill pod replaced in {replaced - t0:.0f}s: {stream.summary()}")
    assert not stream.failed(), stream.summary()
    assert stream.served(t0, "fallback") >= 1, "no request was sent while no prefill pod was Ready"
    [decode] = pods(cluster, tiny.ns, "decode")
    assert all(c["restartCount"] == 0 for c in decode["status"]["containerStatuses"])


def _access_lines(seen: Seen) -> list[dict[str, Any]]:
    """The sidecar's access lines of the client's chats (JSON lines, tests/sidecar/test_access_log.py)."""
    lines = [json.loads(line) for line in seen.lines() if line.startswith("{")]
    return [line for line in lines if line.get("logger") == "disagg_sidecar.access" and line["path"] == CHAT_PATH]


def test_a_kv_relevant_change_rolls_every_pool_and_pairs_each_decode_pod_with_prefill_pods_of_its_revision(
    cluster: Cluster, tiny: Deployed, forcer, tmp_path: Path
) -> None:
    """One patch changes the tool-call parser (render and decode parse; checked in the new pods'
    args) and ``maxModelLen`` (KV-relevant: a new ``disagg.dev/kv-revision``), under a request
    stream: render, prefill and decode roll, a surge pod at a time. Every prefill leg a decode
    pod's sidecar logged (its access lines' ``prefill_endpoints``, read for the pod's whole life
    with ``kubectl logs -f``) went to a prefill pod of the decode pod's own KV revision, decode pods
    of both revisions served remotely prefilled requests, and no request failed. Rolling updates:
    the old decode pod's sidecar keeps serving for its deregister window with readiness off,
    drains, and vLLM beside it outlives that (its preStop hook waits for /health/drained); the old
    render and prefill pods serve until their Services dropped them. That a non-KV change (the
    parser alone) rolls no prefill pod is shown without pods: tests/operator/test_plan.py's
    ``ROLLS`` and tests/operator/test_pairing.py's table; the Services a rollout pairs through,
    against the control plane: tests/operator/test_cluster_pairing.py."""
    before = {pool: _uids(cluster, tiny.ns, pool) for pool in POOLS}
    [old_decode] = pods(cluster, tiny.ns, "decode")
    old_kv = old_decode["metadata"]["labels"][KV_REVISION]
    parser, max_len = "qwen3_xml", 4096  # parser from hermes; 4096 from 8192, far above the stream's prompts
    selector = f"app.kubernetes.io/instance={MODEL},app.kubernetes.io/component="
    with PodWatch(cluster, tiny.ns, selector + "prefill", tmp_path / "prefill") as prefills, \
            PodWatch(cluster, tiny.ns, selector + "decode", tmp_path / "decode", container="sidecar") as decodes:
        with RequestStream(tiny.url, forcer) as stream:
            _served(stream, 4, "the stream prefilled remotely before the change", prefill="remote")
            t0 = time.monotonic()
            cluster.kubectl("patch", "dm", MODEL, "-n", tiny.ns, "--type=merge", "-p", json.dumps(
                {"spec": {"model": {"toolCallParser": parser, "maxModelLen": max_len}}}))
            for pool in POOLS:
                cluster.wait_for(lambda: _replaced(cluster, tiny.ns, pool, before[pool]),
                                 f"every {pool} pod replaced", timeout=READY_TIMEOUT, interval=1)
            cluster.wait_for(lambda: _model_ready(cluster, tiny.ns), f"{MODEL} Ready again", timeout=120, interval=1)
            rolled = time.monotonic()
            _served(stream, 4, "the new pods prefilling remotely after the rollout", since=rolled, prefill="remote")
    print(f"rollout (render, prefill, decode) in {rolled - t0:.0f}s: {stream.summary()}")
    assert not stream.failed(), stream.summary()
    [new_decode] = pods(cluster, tiny.ns, "decode")
    new_kv = new_decode["metadata"]["labels"][KV_REVISION]
    assert new_kv != old_kv, "maxModelLen is KV-relevant: a new revision"

    # Every prefill pod there was during the stream, by IP: its revision.
    kv_of_ip: dict[str, set[str]] = {}
    for seen in prefills.snapshot().values():
        assert seen.ip, f"prefill pod {seen.name} never had an IP"
        kv_of_ip.setdefault(seen.ip, set()).add(seen.labels[KV_REVISION])
    assert {kv for kvs in kv_of_ip.values() for kv in kvs} == {old_kv, new_kv}
    decoded = decodes.snapshot()
    assert not [s.name for s in decoded.values() if not s.whole], (f"a decode pod's log not read to its end: "
                                                                   f"{decodes.errors}")
    assert {s.labels[KV_REVISION] for s in decoded.values()} == {old_kv, new_kv}
    remote = dict.fromkeys((old_kv, new_kv), 0)
    logged: dict[str, list[str]] = {}  # request id -> the decode pods whose sidecar answered it
    crossed = []
    for seen in decoded.values():
        kv = seen.labels[KV_REVISION]
        for line in _access_lines(seen):
            logged.setdefault(line.get("request_id", ""), []).append(seen.name)
            for endpoint in line.get("prefill_endpoints", ()):
                host = urlsplit(endpoint).hostname or ""
                if kv_of_ip.get(host) != {kv}:
                    crossed.append((seen.name, kv, endpoint, kv_of_ip.get(host)))
            remote[kv] += bool(line.get("prefill_endpoints"))
    assert not crossed, f"prefill legs to a prefill pod of another (or no known) revision: {crossed}"
    assert all(remote.values()), f"remotely prefilled requests per decode revision: {remote}"
    # The logs are the whole story: every answered request of the stream is in exactly one of them.
    answered = [a.request_id for a in stream.snapshot() if a.error is None]
    assert answered and all(len(logged.get(rid or "", [])) == 1 for rid in answered), \
        [rid for rid in answered if len(logged.get(rid or "", [])) != 1]
    print(f"remotely prefilled per revision {remote}; prefill pods {kv_of_ip}; decode pods "
          f"{ {s.name: s.labels[KV_REVISION] for s in decoded.values()} }")

    for pool in POOLS:
        [pod] = pods(cluster, tiny.ns, pool)
        args = next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")["args"]
        assert args[args.index("--max-model-len") + 1] == str(max_len)
        if pool != "prefill":
            assert args[args.index("--tool-call-parser") + 1] == parser


def test_node_down_with_every_disagg_pod_running_leaves_nothing(
    cluster: Cluster, tiny: Deployed, real_node_session: RealNodeSession
) -> None:
    """``make cluster-down`` runs ``scripts/node down`` first: with the operator and the model's
    pods running (vLLM engines, the sidecar, their volumes and network namespaces), the pods go
    through the API and the machine is left as it was before the node started: no process,
    container, mount, interface, iptables chain, sysctl or cgroup. Next to last: the model's
    Deployments now make Pending pods (no real node), which deleting the model removes."""
    pids = node_pids(cluster.state_dir / "node")
    containers = [pid for pid, what in pids.items() if what == "container"]
    assert len(containers) >= 5, pids  # operator, prefill, render, decode's vLLM and sidecar (and pause)
    names = {p["metadata"]["name"] for p in pods(cluster, tiny.ns)}
    down = node_script("down", cluster.state_dir, timeout=300)
    assert down.returncode == 0, down.stderr
    assert {pid: what for pid, what in pids.items() if running(pid)} == {}
    assert host_state() == real_node_session.before
    left = {p["metadata"]["name"] for p in pods(cluster, tiny.ns)}
    assert not names & left, "the node's pods are deleted, not left Terminating on a dead node"
    with pytest.raises(ClusterError, match="NotFound"):
        cluster.kubectl("get", "node", REAL_NODE)


def test_deleting_the_model_removes_every_pod(cluster: Cluster, tiny: Deployed) -> None:
    # Last: it takes the deployment down.
    cluster.kubectl("delete", "dm", MODEL, "-n", tiny.ns, "--wait=true", "--timeout=120s")
    cluster.wait_for(lambda: not pods(cluster, tiny.ns), "every pod of the model gone", timeout=300, interval=1)
    assert not get(cluster, "deployments", "-n", tiny.ns, "-l", f"app.kubernetes.io/instance={MODEL}")["items"]
