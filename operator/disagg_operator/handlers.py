"""kopf handlers: thin glue from watch events to ``reconcile``.

- DisaggregatedModel create/update/resume → converge, Events for what changed, refresh the status.
- An owned child changes or disappears → put back what we own in that child (a deleted one is
  recreated, an edited field restored); a Deployment change refreshes the owner's status.
  Children are found in an in-memory index, never by listing the API.
- Status writes go through one coalescing writer per model that recomputes from the live state
  when it writes, so a burst of events costs a few writes and a stale status never lands last.
- No finalizer: children carry controller ownerReferences, so deleting a model garbage-collects them.
- A namespace being deleted takes its models and children with it: once the API server refuses a
  creation there for that reason, the operator restores nothing and writes no status there (a
  namespace of many models would otherwise mean a refused request and a refused Event per child).
Status writes never trigger the update handler (kopf ignores status changes), and a pass with
nothing to change writes nothing, so there is no hot loop and an operator restart is silent.
"""

from __future__ import annotations

import copy
import datetime
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from disagg_operator import drift, metrics, names
from disagg_operator.apply import ApplyError, KubeApi
from disagg_operator.kinds import WATCHED_KINDS, Kind
from disagg_operator.reconcile import Outcome, converge, model_status, restore_child
from disagg_operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION
from disagg_operator.status import UNTESTED_VERSION, status_patch

CHILD_FILTER = {names.MANAGED_BY: names.OPERATOR, names.INSTANCE: kopf.PRESENT}
RETRY_SECONDS = 10
ROLLOUT_RETRY_SECONDS = 10  # how soon an older KV revision's prefill Service is looked at again
WORKERS = 32  # threads for sync handlers, and API connections to match


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(dict(body))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.loggers = False  # Events only for what we report explicitly, not every log line
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.execution.max_workers = WORKERS  # sync handlers; many models may converge at once
    memo.api = KubeApi.from_environment(connections=WORKERS, withheld=memo.withheld)
    # The status each model was last given by this process. The models index may lag behind our
    # own writes; diffing against it would repeat writes during bursts of child events.
    memo.statuses = {}
    memo.unavailable = {}  # (namespace, name) -> CRDs its spec needs that the cluster lacks (last converge)
    memo.terminating = set()  # namespaces being deleted (a creation there was refused for that reason)
    memo.terminating_lock = threading.Lock()  # handlers run in threads: the first refusal says so once
    memo.status_writer = StatusWriter()


# --- indices: what the handlers read instead of listing the API --------------------------------

@kopf.index(GROUP, VERSION, PLURAL)
def models(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, name): _plain(body)}


def _index_child(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, labels[names.INSTANCE]): _plain(body)}


def _live(children: kopf.Index, namespace: str, name: str) -> dict[drift.Key, dict[str, Any]]:
    return {drift.key_of(obj): obj for obj in children.get((namespace, name), [])}


def _reference(doc: Mapping[str, Any]) -> dict[str, Any]:
    meta = doc["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}}


def _report(doc: Mapping[str, Any], outcome: Outcome, reason: str) -> None:
    ref = _reference(doc)
    if outcome.invalid:
        kopf.warn(ref, reason="InvalidSpec", message=outcome.invalid)
    if outcome.untested_version:
        kopf.warn(ref, reason=UNTESTED_VERSION, message=outcome.untested_version)
    if outcome.applied:
        kopf.info(ref, reason=reason, message=", ".join(outcome.applied))
    if outcome.pruned:
        kopf.info(ref, reason="Pruned", message=", ".join(outcome.pruned))


def _stand_aside(memo: kopf.Memo, namespace: str, logger: kopf.Logger) -> None:
    with memo.terminating_lock:
        first = namespace not in memo.terminating
        memo.terminating.add(namespace)
    if first:
        logger.info(f"Namespace {namespace} is being deleted: nothing is restored there any more.")


def _converge(doc: Mapping[str, Any], children: kopf.Index, memo: kopf.Memo, logger: kopf.Logger) -> Outcome:
    meta = doc["metadata"]
    started = time.monotonic()
    try:
        outcome = converge(doc, _live(children, meta["namespace"], meta["name"]), memo.api, now=_now())
    except ApplyError as exc:
        metrics.RECONCILES.labels("failed").inc()
        if exc.namespace_terminating:  # the model goes with its namespace; an Event there would be refused too
            _stand_aside(memo, meta["namespace"], logger)
            raise kopf.PermanentError(str(exc)) from exc
        kopf.warn(_reference(doc), reason="ApplyFailed", message=str(exc))
        if exc.permanent:
            raise kopf.PermanentError(str(exc)) from exc
        raise kopf.TemporaryError(str(exc), delay=RETRY_SECONDS) from exc
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    memo.terminating.discard(meta["namespace"])  # a namespace of that name exists again
    metrics.RECONCILES.labels("invalid" if outcome.invalid else "applied" if outcome.applied or outcome.pruned
                              else "unchanged").inc()
    for label in outcome.applied:
        metrics.OBJECTS_APPLIED.labels(metrics.kind_of(label)).inc()
    for label in outcome.pruned:
        metrics.OBJECTS_PRUNED.labels(metrics.kind_of(label)).inc()
    _report(doc, outcome, reason="Applied")
    return outcome


# --- the model ---------------------------------------------------------------------------------

@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, models: kopf.Index, children: kopf.Index,
              logger: kopf.Logger, **_: Any) -> None:
    doc = _plain(body)
    meta = doc["metadata"]
    outcome = _converge(doc, children, memo, logger)
    if outcome.invalid:
        changes = status_patch(doc.get("status"), outcome.invalid_status or {})
        if changes:
            patch.status.update(changes)
        raise kopf.PermanentError(outcome.invalid)  # retrying cannot fix the spec; the next edit will
    # Status goes through the same per-model writer as child events, which recomputes it from the
    # live state when it writes: a status computed here could otherwise land after a fresher one.
    memo.unavailable[(meta["namespace"], meta["name"])] = tuple(outcome.unavailable)
    memo.status_writer.submit((meta["namespace"], meta["name"]),
                              lambda: _refresh_status(meta["namespace"], meta["name"], memo, models, children))
    if outcome.retained:  # an older KV revision's prefill Service goes once decode has rolled
        raise kopf.TemporaryError(f"kept while decode rolls out: {', '.join(outcome.retained)}",
                                  delay=ROLLOUT_RETRY_SECONDS)
    if outcome.awaited:  # reported in the status; try again in case the CRD gets installed
        raise kopf.TemporaryError(f"CRDs not installed: {', '.join(outcome.awaited)}",
                                  delay=memo.crd_retry_seconds)  # `disagg operator --crd-retry-seconds`


# --- the children ------------------------------------------------------------------------------

def child_changed(event: kopf.RawEvent, namespace: str, labels: kopf.Labels, body: kopf.Body, memo: kopf.Memo,
                  models: kopf.Index, children: kopf.Index, logger: kopf.Logger, **_: Any) -> None:
    owners = list(models.get((namespace, labels.get(names.INSTANCE, "")), []))
    if not owners or namespace in memo.terminating:
        return  # the model is gone (garbage collection removes its children) or going with its namespace
    doc = owners[0]
    meta = doc["metadata"]
    if meta.get("deletionTimestamp") or not drift.owned_by(body, meta["uid"]):
        return
    deleted = event.get("type") == "DELETED"
    # The model's own DELETED event may not have reached its index yet (separate watch streams):
    # do not bring back a child that garbage collection is removing.
    if deleted and not memo.api.model_exists(namespace, meta["name"], meta["uid"]):
        return
    try:
        restored = restore_child(doc, _plain(body), deleted, memo.api)
    except ApplyError as exc:
        if exc.namespace_terminating:
            _stand_aside(memo, namespace, logger)
            return
        kopf.warn(_reference(doc), reason="RestoreFailed", message=str(exc))
        return  # the next event for this child, or the model's own handler, tries again
    for label in restored:
        metrics.RESTORES.labels(metrics.kind_of(label)).inc()
    if restored:
        kopf.info(_reference(doc), reason="Restored", message=", ".join(restored))
    # Only Deployments carry what the status reports; other children matter only when restored.
    if body.get("kind") == "Deployment" or restored:
        memo.status_writer.submit((namespace, meta["name"]), lambda: _refresh_status(namespace, meta["name"], memo,
                                                                                     models, children))


def _refresh_status(namespace: str, name: str, memo: kopf.Memo, models: kopf.Index, children: kopf.Index) -> None:
    """Write the model's status as the live Deployments show it now, if that differs."""
    owners = list(models.get((namespace, name), []))
    if not owners or namespace in memo.terminating:
        return
    doc = owners[0]
    key = (namespace, name)
    if key not in memo.unavailable:
        # Not converged by this process yet (an operator start replays the children first): which
        # optional objects exist (PodMonitors, an InferencePool) is unknown until then, and the
        # model's own handler refreshes the status right after it converges.
        return
    known = memo.statuses.get(key)  # what we last wrote; the index may not show it yet
    if known is not None and known.get("observedGeneration") == doc["metadata"].get("generation"):
        doc = {**doc, "status": {**(doc.get("status") or {}), **known}}
    status = model_status(doc, _live(children, namespace, name), now=_now(),
                          unavailable=memo.unavailable.get(key, ()))
    if status is None:
        return
    changes = status_patch(doc.get("status"), status)
    if changes:
        memo.api.patch_status(namespace, name, changes)
        metrics.STATUS_WRITES.inc()
        memo.statuses[key] = status


class StatusWriter:
    """Coalesces status writes per model: while one write is in flight, later requests collapse into
    a single follow-up that recomputes from the then-current state (bursts of Deployment events
    during a rollout become a few writes, and the last one always reflects the latest state)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[tuple[str, str]] = set()
        self._again: dict[tuple[str, str], Callable[[], None]] = {}

    def submit(self, key: tuple[str, str], write: Callable[[], None]) -> None:
        with self._lock:
            if key in self._busy:
                self._again[key] = write
                return
            self._busy.add(key)
        current: Callable[[], None] | None = write
        try:
            while current is not None:
                current()
                with self._lock:
                    current = self._again.pop(key, None)
                    if current is None:
                        self._busy.discard(key)
        except BaseException:
            with self._lock:
                self._busy.discard(key)
                self._again.pop(key, None)
            raise


def register(kinds: tuple[Kind, ...] = WATCHED_KINDS) -> None:
    """Index and watch the child kinds the operator may own (``disagg operator`` leaves out those it
    is told not to write, e.g. PodMonitors with --no-pod-monitors: their list/watch would be refused)."""
    for kind in kinds:
        kopf.index(*kind.resource, id="children", labels=CHILD_FILTER)(_index_child)
        kopf.on.event(*kind.resource, id=f"child-{kind.plural}", labels=CHILD_FILTER)(child_changed)
