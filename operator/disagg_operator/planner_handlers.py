"""kopf glue of the planner (``planner.py``): a timer on every model with ``spec.autoscaling``.

The timer fires every few seconds; a model is planned every ``autoscaling.intervalSeconds``, or at
the timer's pace while a pool is on its way (``ModelState.stepping``). It reads
the model's Deployments from the operator's children index (as the status does), writes
``status.autoscaling`` (merge patch, only when it changed), posts an Event per scaling step and
updates the planner's metrics. Registered by ``disagg operator`` unless ``--no-planner``.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import kopf

from disagg_operator import drift, metrics
from disagg_operator.apply import ApplyError
from disagg_operator.handlers import _live, _reference
from disagg_operator.manifest import parse_manifest
from disagg_operator.plan import build_plan
from disagg_operator.planner import ModelState, release_prefill, tick
from disagg_operator.spec import GROUP, PLURAL, VERSION, SpecError

TIMER_SECONDS = 5.0  # the shortest intervalSeconds the rules allow

_states: dict[str, ModelState] = {}  # by model uid
_lock = threading.Lock()


def _stamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _autoscaled(spec: dict[str, Any], **_: Any) -> bool:
    return bool(spec.get("autoscaling"))


@kopf.timer(GROUP, VERSION, PLURAL, id="planner", interval=TIMER_SECONDS, sharp=True, when=_autoscaled)
def plan_model(body: kopf.Body, memo: kopf.Memo, children: kopf.Index, logger: kopf.Logger, **_: Any) -> None:
    doc = dict(body)
    meta = doc["metadata"]
    try:
        manifest = parse_manifest(doc)
    except SpecError:
        return  # the reconcile handler reports an invalid spec
    plan = build_plan(manifest.spec, manifest.name, meta["namespace"])
    spec = plan.spec.autoscaling
    if spec is None:
        return
    with _lock:
        state = _states.setdefault(meta["uid"], ModelState())
    now = time.monotonic()
    if state.last_tick and now - state.last_tick < spec.interval_seconds - 0.5 and not state.stepping:
        return
    live = _live(children, meta["namespace"], meta["name"])
    deployments = {key[3]: obj for key, obj in live.items()
                   if key[1] == "Deployment" and drift.owned_by(obj, meta["uid"])}
    try:
        hpas = memo.api.hpa_targets(meta["namespace"])
        result = tick(plan, deployments, hpas, memo.api, state, now=now, stamp=_stamp())
    except ApplyError as exc:
        metrics.PLANNER_DECISIONS.labels("failed").inc()
        kopf.warn(_reference(doc), reason="ScalingFailed", message=str(exc))
        return
    if result is None:
        return
    outcome = "held"
    if result.moves:
        outcome = "scaled_up" if any(m.after > m.before for m in result.moves) else "scaled_down"
    metrics.PLANNER_DECISIONS.labels(outcome).inc()
    metrics.PLANNER_READ_ERRORS.inc(len(result.errors))
    for pool, entry in result.status["pools"].items():
        metrics.PLANNER_DESIRED.labels(meta["namespace"], meta["name"], pool).set(entry["desired"])
    for name in ("ttft_p90", "waiting", "itl_p90", "kv_usage"):
        value = getattr(result.signals, name)
        if value is not None:
            metrics.PLANNER_SIGNAL.labels(meta["namespace"], meta["name"], name).set(value)
    for reason, message in result.events:
        kopf.info(_reference(doc), reason=reason, message=message)
    if result.errors:
        logger.info(f"planner: signals not read: {'; '.join(result.errors[:3])}")
    previous = (doc.get("status") or {}).get("autoscaling") or {}
    status = result.status
    if not result.moves and previous.get("lastScaleTime"):
        status = {**status, "lastScaleTime": previous["lastScaleTime"]}
    if result.moves:
        status = {**status, "lastScaleTime": status["lastDecisionTime"]}
    if _without_time(previous) != _without_time(status):
        memo.api.patch_status(meta["namespace"], meta["name"], {"autoscaling": {**status, "pools": {
            **{k: None for k in previous.get("pools") or {} if k not in status["pools"]}, **status["pools"]}}})
        metrics.STATUS_WRITES.inc()


def _without_time(status: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in status.items() if k != "lastDecisionTime"}


@kopf.on.update(GROUP, VERSION, PLURAL, id="planner-release", field="spec.autoscaling")
def release(new: Any, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """``spec.autoscaling`` removed: prefill pods the planner had taken out of the sidecars'
    selection for a scale-down it will not make are put back, and ``status.autoscaling`` goes (it
    would still say ``managedBy: planner``); a planner turned on again starts from the sizes it finds."""
    if new:
        return
    meta = body["metadata"]
    with _lock:
        _states.pop(meta.get("uid", ""), None)
    if (body.get("status") or {}).get("autoscaling") is not None:
        memo.api.patch_status(meta["namespace"], meta["name"], {"autoscaling": None})
    back = release_prefill(memo.api, meta["namespace"], meta["name"])
    if back:
        kopf.info(_reference(dict(body)), reason="PrefillReselected",
                  message=f"prefill pods {', '.join(back)} are selected again (spec.autoscaling removed)")


@kopf.on.delete(GROUP, VERSION, PLURAL, id="planner-forget", optional=True)
def forget(meta: kopf.Meta, **_: Any) -> None:
    with _lock:
        _states.pop(meta.get("uid", ""), None)
