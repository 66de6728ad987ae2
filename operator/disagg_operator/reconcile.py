"""Convergence for one DisaggregatedModel: desired objects vs live ones, and its status.

Level-based and idempotent: ``converge`` applies only what is missing or differs and prunes only
what the model controls and no longer wants (spec changes, operator start); ``restore_child``
repairs the one child an event is about; ``model_status`` is the status the live children call
for. The Kubernetes API is reached only through ``api`` (``apply.KubeApi`` in the operator).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from disagg_operator import drift, names
from disagg_operator.kinds import BY_TYPE, POD_MONITOR, Kind
from disagg_operator.objects import build_objects
from disagg_operator.objects.secrets import with_new_key
from disagg_operator.plan import Plan, build_plan
from disagg_operator.manifest import parse_manifest
from disagg_operator.spec import API_VERSION, KIND, SpecError
from disagg_operator.status import compute_status, invalid_status, version_condition


class Api(Protocol):
    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...

    def create_if_missing(self, obj: Mapping[str, Any]) -> bool: ...

    def delete(self, obj: Mapping[str, Any]) -> None: ...

    def serves(self, kind: Kind) -> bool: ...


@dataclass
class Outcome:
    applied: list[str] = field(default_factory=list)  # "Kind/name" of objects created or changed
    pruned: list[str] = field(default_factory=list)
    invalid: str | None = None  # the spec cannot be served (nothing was applied) ...
    invalid_status: dict[str, Any] | None = None  # ... and the status that says so
    unavailable: list[str] = field(default_factory=list)  # CRDs of desired kinds that the cluster lacks
    awaited: list[str] = field(default_factory=list)  # ... of which the spec requires (retried until installed)
    # Not pruned yet: the prefill Service of an older KV revision while decode rolls (retried until it is done).
    retained: list[str] = field(default_factory=list)
    untested_version: str | None = None  # why the spec's vLLM version is outside the release table (an Event)


def _label(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


class _DesiredCache:
    """Plans by (uid, generation): a generation's spec never changes, and child events are many."""

    def __init__(self, size: int = 512):
        self._size = size
        self._items: OrderedDict[tuple[str, int], tuple[Plan, list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, doc: Mapping[str, Any]) -> tuple[Plan, list[dict[str, Any]]]:
        meta = doc["metadata"]
        key = (meta["uid"], int(meta.get("generation") or 0))
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        manifest = parse_manifest(doc)  # SpecError propagates; invalid specs are not cached
        plan = build_plan(manifest.spec, manifest.name, meta["namespace"])
        value = plan, build_objects(plan, names.owner_reference(API_VERSION, KIND, meta["name"], meta["uid"]))
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


_desired = _DesiredCache().get


def _apply(api: Api, obj: Mapping[str, Any], live: Mapping[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """Apply ``obj``; whether that wrote anything (our view of ``live`` may lag behind the watch)."""
    fresh = api.apply(obj)
    before = (live or {}).get("metadata", {}).get("resourceVersion")
    return fresh, fresh.get("metadata", {}).get("resourceVersion") != before


def converge(doc: Mapping[str, Any], live: Mapping[drift.Key, Mapping[str, Any]], api: Api, *, now: str) -> Outcome:
    # ``now`` stamps the conditions of an invalid spec; a valid one's status is model_status's job.
    """Make all children of ``doc`` (a DisaggregatedModel as stored) match its spec."""
    meta = doc["metadata"]
    try:
        plan, desired = _desired(doc)
    except SpecError as exc:
        message = "; ".join(exc.problems)
        generation = int(meta.get("generation") or 0)
        return Outcome(invalid=message, invalid_status=invalid_status(
            message, generation=generation, previous=doc.get("status"), now=now))

    current = {k: v for k, v in live.items() if drift.owned_by(v, meta["uid"])}
    version = version_condition(plan.spec.engine.vllm_version)
    outcome = Outcome(untested_version=None if version.status else version.message)
    optional = {BY_TYPE[(o["apiVersion"], o["kind"])] for o in desired} - {k for k in BY_TYPE.values() if not k.optional}
    missing = {kind for kind in optional if not api.serves(kind)}
    outcome.unavailable = sorted(kind.crd for kind in missing)
    # PodMonitors on "auto" are written where the CRD is served and quietly left out elsewhere.
    outcome.awaited = sorted(kind.crd for kind in missing
                             if kind is not POD_MONITOR or plan.spec.monitoring.pod_monitors == "true")
    desired = [o for o in desired if BY_TYPE[(o["apiVersion"], o["kind"])] not in missing]
    for obj in [o for o in desired if BY_TYPE[(o["apiVersion"], o["kind"])].create_only]:
        if api.create_if_missing(with_new_key(obj)):  # a key is drawn each time, kept only on creation
            outcome.applied.append(_label(obj))
    desired = [o for o in desired if not BY_TYPE[(o["apiVersion"], o["kind"])].create_only]
    for obj in drift.to_apply(desired, current):
        _, wrote = _apply(api, obj, current.get(drift.key_of(obj)))
        if wrote:
            outcome.applied.append(_label(obj))
    rolling = decode_rolling(plan, current)
    for obj in drift.to_prune(desired, current, meta["uid"]):
        if rolling and names.KV_REVISION in (obj["metadata"].get("labels") or {}):
            outcome.retained.append(_label(obj))  # decode pods of that KV revision may still send to it
            continue
        api.delete(obj)
        outcome.pruned.append(_label(obj))
    return outcome


def decode_rolling(plan: Plan, live: Mapping[drift.Key, Mapping[str, Any]]) -> bool:
    """Whether decode pods of an older configuration may still run: the live decode Deployment does not
    yet run the plan's template, its controller has not seen it, or old pods remain."""
    pool = plan.pool(names.Role.DECODE)
    deployment = next((obj for key, obj in live.items() if key[1] == "Deployment" and pool is not None
                       and key[3] == pool.name), None)
    if pool is None or deployment is None:
        return False
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    template = ((spec.get("template") or {}).get("metadata") or {}).get("annotations") or {}
    return (template.get(names.CONFIG_HASH) != pool.config_hash
            or int(status.get("observedGeneration") or 0) < int(deployment["metadata"].get("generation") or 0)
            or int(status.get("replicas") or 0) > int(status.get("updatedReplicas") or 0))


def model_status(doc: Mapping[str, Any], live: Mapping[drift.Key, Mapping[str, Any]], *, now: str,
                 unavailable: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The status ``doc`` should have given its live children (None when its spec is invalid);
    ``unavailable``: the CRDs its last ``converge`` found missing."""
    try:
        plan, _ = _desired(doc)
    except SpecError:
        return None
    deployments = {key[3]: obj for key, obj in live.items()
                   if key[1] == "Deployment" and drift.owned_by(obj, doc["metadata"]["uid"])}
    return compute_status(plan, deployments, generation=int(doc["metadata"].get("generation") or 0),
                          previous=doc.get("status") or {}, now=now, unavailable=unavailable)


def restore_child(doc: Mapping[str, Any], child: Mapping[str, Any], deleted: bool, api: Api) -> list[str]:
    """One child of ``doc`` changed or vanished: put back what we own in it; what was written.

    Only that child is touched (a change to one object cannot drift another); creating and
    pruning children is ``converge``'s job. Nothing happens when ``doc``'s spec is invalid (its
    own handler reports that).
    """
    try:
        _, desired = _desired(doc)
    except SpecError:
        return []
    key = drift.key_of(child)
    want = next((obj for obj in desired if drift.key_of(obj) == key), None)
    if want is None or not (deleted or not drift.covers(child, want)):
        return []
    _, wrote = _apply(api, want, None if deleted else child)
    return [_label(want)] if wrote else []
