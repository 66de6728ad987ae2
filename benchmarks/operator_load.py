"""Part 4, operator: N ``DisaggregatedModel``s created at once (one ``kubectl apply``) on the local
control plane, timed until every child object exists and every model's status is written for its
generation; then the operator's CPU and memory at rest. The baseline is ``kubectl apply
--server-side`` of the very same child objects in another namespace, in the same run."""

from __future__ import annotations

import json
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.procs import cpu_seconds, rss_mb
from disagg_operator import names
from tests.harness.cluster import Cluster, ClusterError, _release, _session_lock, _start_or_reuse, default_state_dir
from tests.harness.operator import OperatorProcess
from tests.operator.cases import base
from tests.operator.conftest import CRD
from tests.operator.test_cluster import COLLECTIONS, METADATA_ONLY, expected_objects, expected_plan

COUNTS = (50, 500)
IDLE_SECONDS = 10.0


def docs_for(count: int) -> list[dict[str, Any]]:
    return [base(f"m{i:03d}") for i in range(count)]


def children_count(cluster: Cluster, ns: str) -> int:
    selector = urllib.parse.quote(f"{names.MANAGED_BY}={names.OPERATOR}")
    return sum(len(cluster.api("GET", f"/{group}/namespaces/{ns}/{kind}?labelSelector={selector}",
                               accept=METADATA_ONLY, timeout=120)["items"] or []) for kind, group in COLLECTIONS.items())


def statuses_written(cluster: Cluster, ns: str) -> int:
    items = cluster.api("GET", f"/apis/disagg.dev/v1alpha1/namespaces/{ns}/disaggregatedmodels", timeout=120)["items"]
    return sum(1 for o in items if (o.get("status") or {}).get("observedGeneration") == o["metadata"]["generation"])


def create_at_once(cluster: Cluster, op: OperatorProcess, ns: str, count: int, timeout: float = 1800) -> dict[str, Any]:
    """Apply ``count`` models in one request; seconds until all children exist and all statuses are written."""
    docs = docs_for(count)
    want = sum(len(expected_objects(expected_plan(d, ns))) for d in docs)
    cpu0 = cpu_seconds(op.proc.pid)
    start = time.monotonic()
    # One request stream for all: `kubectl create` (apply would GET each object first).
    cluster.kubectl("create", "-n", ns, "-f", "-", timeout=timeout,
                    input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    applied_at = status_at = None
    while applied_at is None or status_at is None:
        now = time.monotonic()
        if now - start > timeout:
            raise TimeoutError(f"{count} models: children/status not complete after {timeout}s\n{op.log_tail()}")
        try:
            if applied_at is None and children_count(cluster, ns) >= want:
                applied_at = time.monotonic()
            if status_at is None and statuses_written(cluster, ns) >= count:
                status_at = time.monotonic()
        except ClusterError:  # a busy API server times a list out (504): poll again
            pass
        time.sleep(0.5)
    done = max(applied_at, status_at)
    busy_cpu = cpu_seconds(op.proc.pid) - cpu0
    return {"models": count, "objects": want, "children_seconds": applied_at - start,
            "status_seconds": status_at - start, "seconds": done - start, "operator_cpu_s": busy_cpu}


def kubectl_baseline(cluster: Cluster, ns: str, count: int) -> float:
    """``kubectl apply --server-side`` of the children of ``count`` models, until all exist."""
    objects = [o for d in docs_for(count) for o in expected_objects(expected_plan(d, ns))]
    start = time.monotonic()
    cluster.kubectl("apply", "--server-side", "-n", ns, "-f", "-", timeout=1800,
                    input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    cluster.wait_for(lambda: children_count(cluster, ns) >= len(objects), "the baseline objects", timeout=600)
    return time.monotonic() - start


def at_rest(pid: int, seconds: float = IDLE_SECONDS) -> dict[str, float]:
    """CPU share and RSS of the operator over ``seconds`` with nothing to do."""
    c0 = cpu_seconds(pid)
    time.sleep(seconds)  # a measurement window, not a synchronisation
    return {"idle_cpu_percent": 100 * (cpu_seconds(pid) - c0) / seconds, "rss_mb": rss_mb(pid)}


@contextmanager
def control_plane() -> Iterator[Cluster]:
    """The local control plane as the tests use it: reused if up, else started and stopped again."""
    state = default_state_dir()
    with _session_lock(state):
        _start_or_reuse(state)
    try:
        cluster = Cluster.from_state_dir(state)
        cluster.kubectl("apply", "-f", str(CRD))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/disaggregatedmodels.disagg.dev")
        yield cluster
    finally:
        with _session_lock(state):
            _release(state)


def run(ctx) -> dict[str, Any]:
    results: dict[str, Any] = {"runs": []}
    t0 = time.monotonic()
    with control_plane() as cluster, tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        ctx.log(f"control plane ready in {time.monotonic() - t0:.0f}s")
        op = OperatorProcess(cluster.kubeconfig, Path(tmp)).start()
        namespaces = []
        try:
            cluster.wait_for(op.alive, "the operator's liveness endpoint", timeout=120)
            results["operator_at_start"] = at_rest(op.proc.pid)
            for count in ctx.sizes("counts", COUNTS):
                namespaces.append(ns := cluster.create_namespace(f"bench-{count}"))
                run = create_at_once(cluster, op, ns, count)
                run.update(at_rest(op.proc.pid))
                namespaces.append(bns := cluster.create_namespace(f"bench-{count}-kubectl"))
                run["kubectl_server_side_seconds"] = kubectl_baseline(cluster, bns, count)
                run["ratio_to_kubectl"] = run["seconds"] / run["kubectl_server_side_seconds"]
                results["runs"].append(run)
                ctx.log(f"operator: {count} models ({run['objects']} objects) in {run['seconds']:.1f}s "
                        f"(children {run['children_seconds']:.1f}s, status {run['status_seconds']:.1f}s); kubectl "
                        f"--server-side {run['kubectl_server_side_seconds']:.1f}s; idle CPU {run['idle_cpu_percent']:.1f}%, "
                        f"RSS {run['rss_mb']:.0f} MB")
        finally:
            op.stop()
            for ns in namespaces:
                cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    last = results["runs"][-1]
    results["keys"] = {f"operator_{r['models']}_crs_seconds": r["seconds"] for r in results["runs"]}
    results["keys"].update({f"operator_{r['models']}_crs_kubectl_ratio": r["ratio_to_kubectl"] for r in results["runs"]})
    results["keys"].update({"operator_idle_cpu_percent": last["idle_cpu_percent"], "operator_rss_mb": last["rss_mb"]})
    return results
