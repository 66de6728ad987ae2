"""Prefill pods leave the sidecars' selection before the planner scales their pool down (pure).

The sidecars find prefill pods through the Service of their KV revision (``<name>-kv<revision>``),
which selects on the pods' ``disagg.dev/kv-revision`` label; the ReplicaSet selects on the pool's
labels only. So a pod chosen to go is first *marked*: that label is removed (the revision kept in
the ``disagg.dev/leaving`` annotation) and its ``controller.kubernetes.io/pod-deletion-cost`` set
lowest. The EndpointSlice controller drops it from the Service, the sidecars' watches drop it from
their selection, and only at a later planner tick, once no marked pod is listed by its Service any
more, is the Deployment scaled down: the ReplicaSet then deletes the marked pods (lowest deletion
cost) and no prefill leg is sent to a pod being removed. A marked pod that is no longer to go (the
load came back, or the ReplicaSet kept it) gets its label back.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg_operator import names

LEAVING = "disagg.dev/leaving"  # annotation: the KV revision a marked pod had
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_COST = str(-(2**31))  # the annotation is an int32; lower goes first


@dataclass(frozen=True)
class Retirement:
    mark: tuple[str, ...] = ()  # pods to take out of the sidecars' selection now
    unmark: tuple[str, ...] = ()  # marked pods to put back
    scale: bool = True  # the Deployment may be set to its new size now
    waiting_for: tuple[str, ...] = ()  # marked pods a Service still lists


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def deletion_order(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods in the order a ReplicaSet deletes them when their deletion costs are equal (unscheduled,
    then pending, then not ready, then the newest): the marked ones are then the ones it deletes."""
    def key(pod: Mapping[str, Any]) -> tuple[Any, ...]:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        phase = {"Pending": 0, "Unknown": 1, "Running": 2}.get(status.get("phase", ""), 0)
        return (bool(spec.get("nodeName")), phase, _ready(pod), _negated(meta.get("creationTimestamp") or ""),
                meta["name"])
    return sorted(pods, key=key)


def _negated(stamp: str) -> tuple[int, ...]:
    """Newest first: RFC 3339 stamps of one format sort as text, so each character's code is negated."""
    return tuple(-ord(c) for c in stamp)


def alive(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def marked(pod: Mapping[str, Any]) -> bool:
    return LEAVING in (pod["metadata"].get("annotations") or {})


def plan(pods: Sequence[Mapping[str, Any]], current: int, desired: int, listed: Collection[str]) -> Retirement:
    """What to do for a prefill pool at ``current`` replicas that the planner wants at ``desired``:
    ``pods`` are the pool's pods, ``listed`` the pods its KV-revision Services list now."""
    living = alive(pods)
    leaving = [p["metadata"]["name"] for p in deletion_order([p for p in living if marked(p)])]
    going = max(0, current - desired)
    if going == 0:
        if len(living) > current:  # the ReplicaSet has yet to delete the pods a scale-down marked
            return Retirement()
        return Retirement(unmark=tuple(leaving))
    if len(leaving) > going:  # fewer are to go than are marked: the last in deletion order stay
        return Retirement(unmark=tuple(leaving[going:]), scale=False)
    if len(leaving) < going:
        more = [p["metadata"]["name"] for p in deletion_order([p for p in living if not marked(p)])]
        return Retirement(mark=tuple(more[:going - len(leaving)]), scale=False)
    still = tuple(sorted(set(leaving) & set(listed)))
    return Retirement(scale=not still, waiting_for=still)


def mark_patch(pod: Mapping[str, Any]) -> dict[str, Any]:
    revision = (pod["metadata"].get("labels") or {}).get(names.KV_REVISION, "")
    return {"metadata": {"labels": {names.KV_REVISION: None},
                         "annotations": {LEAVING: revision, DELETION_COST: LOWEST_COST}}}


def unmark_patch(pod: Mapping[str, Any]) -> dict[str, Any]:
    revision = (pod["metadata"].get("annotations") or {}).get(LEAVING, "")
    return {"metadata": {"labels": {names.KV_REVISION: revision or None},
                         "annotations": {LEAVING: None, DELETION_COST: None}}}


def revision_services(model: str, pods: Sequence[Mapping[str, Any]]) -> set[str]:
    """The KV-revision Services that may list these pods (their label's, or a marked pod's kept one)."""
    revisions = {(p["metadata"].get("labels") or {}).get(names.KV_REVISION)
                 or (p["metadata"].get("annotations") or {}).get(LEAVING) for p in pods}
    return {names.prefill_revision_service(model, r) for r in revisions if r}
