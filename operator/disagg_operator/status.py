"""Observed children → DisaggregatedModel status (pure).

Conditions (each with reason and message; ``lastTransitionTime`` changes only when ``status`` does):

=================  ===========================================================================
PrefillReady,      One per active pool: True when its Deployment runs the desired configuration
DecodeReady,       (config-hash annotation), the controller has seen the latest Deployment spec,
RenderReady        and every desired replica is updated and ready. Reasons: Ready, Missing,
                   Pending, RollingOut, NotReady. A pool that is off has no condition.
DerenderReady      Its own pool's readiness, or — when the render pool derenders — RenderReady's
                   status with reason SharedWithRender.
ConfigConsistent   True when every active pool's pods all run the current configuration, so
                   render/derender and decode cannot disagree. Reasons: Consistent, RollingOut, Drifted.
Progressing        True while a pool rolls out or scales (RollingOut / Scaling); else Stable.
Degraded           True when a pool's rollout failed (ProgressDeadlineExceeded, ReplicaFailure) or the
                   spec cannot be served (InvalidSpec). Else AsExpected.
InferencePoolReady Only with spec.router.inferencePool.enabled: True when the InferencePool is applied;
                   False with reason CRDNotInstalled when the cluster lacks its CRD.
VersionSupported   True (Supported) when engine.vllmVersion is a release in ``disagg_sidecar.vllm_releases``;
                   False (UntestedVersion) otherwise: the model is served the conservative way. Not part of Ready.
PodMonitorsReady   Only with spec.monitoring.podMonitors "true": the same for the PodMonitors.
Ready              True when every pool condition (and InferencePoolReady) is True and nothing is Degraded.
=================  ===========================================================================

Beside them: the endpoint, pool counts, and ``derender.strategy`` (``derender.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg_operator import names
from disagg_operator.kinds import INFERENCE_POOL, POD_MONITOR
from disagg_operator.names import Role
from disagg_operator.plan import Plan
from disagg_operator.pool_plan import PoolPlan
from disagg_sidecar import vllm_releases

POOL_CONDITIONS: Mapping[Role, str] = {
    Role.PREFILL: "PrefillReady", Role.DECODE: "DecodeReady", Role.RENDER: "RenderReady",
    Role.DERENDER: "DerenderReady",
}
CONDITION_ORDER = ("Ready", "PrefillReady", "DecodeReady", "RenderReady", "DerenderReady", "InferencePoolReady",
                   "PodMonitorsReady", "ConfigConsistent", "Progressing", "Degraded", "VersionSupported")
UNTESTED_VERSION = "UntestedVersion"  # the condition's reason, and the Event's
INFERENCE_POOL_CRD = INFERENCE_POOL.crd
POD_MONITOR_CRD = POD_MONITOR.crd


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


@dataclass(frozen=True)
class PoolState:
    role: Role
    desired: int
    replicas: int
    ready: int
    updated: int
    available: int
    current_config: bool  # the Deployment's template carries the desired hash
    observed: bool  # the Deployment controller has seen the latest spec
    failure: str | None  # why the rollout failed, if it did
    missing: bool = False

    @property
    def current(self) -> bool:  # the Deployment asks for the desired configuration, and it was seen
        return not self.missing and self.current_config and self.observed

    @property
    def old_pods(self) -> bool:  # pods of an older ReplicaSet (configuration) still exist
        return self.replicas > self.updated

    @property
    def is_ready(self) -> bool:
        return self.current and self.updated >= self.desired and self.ready >= self.desired


def observe_pool(pool: PoolPlan, deployment: Mapping[str, Any] | None) -> PoolState:
    """What one pool's Deployment says about it."""
    if deployment is None:
        return PoolState(pool.role, pool.replicas, 0, 0, 0, 0, False, False, None, missing=True)
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    template_hash = (((spec.get("template") or {}).get("metadata") or {}).get("annotations") or {}).get(names.CONFIG_HASH)
    failure = None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            failure = f"rollout exceeded its progress deadline: {cond.get('message', '')}".strip()
        elif cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            failure = f"cannot create pods: {cond.get('message', '')}".strip()
    meta = deployment.get("metadata") or {}
    return PoolState(
        role=pool.role,
        # The spec's count, so a status for this generation never counts an older one as ready;
        # with autoscaling the HPA or the planner owns the count and the Deployment's own spec says it.
        desired=int(spec.get("replicas", pool.replicas)) if pool.external_replicas else pool.replicas,
        replicas=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        available=int(status.get("availableReplicas") or 0),
        current_config=template_hash == pool.config_hash,
        observed=int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0),
        failure=failure,
    )


def _pool_condition(state: PoolState) -> Condition:
    kind = POOL_CONDITIONS[state.role]
    counts = f"{state.ready}/{state.desired} ready, {state.updated}/{state.desired} updated"
    if state.missing:
        return Condition(kind, False, "Missing", f"Deployment for the {state.role} pool does not exist")
    if state.is_ready:
        return Condition(kind, True, "Ready", counts)
    if not state.observed or not state.current_config:
        return Condition(kind, False, "Pending", f"waiting for the {state.role} Deployment to take the new configuration")
    if state.updated < state.desired:
        return Condition(kind, False, "RollingOut", counts)
    return Condition(kind, False, "NotReady", counts)


def _summary(roles: Sequence[Role]) -> str:
    return ", ".join(str(r) for r in roles)


def _optional_kind_condition(name: str, crd: str, unavailable: Sequence[str], setting: str, install: str,
                             applied: str) -> Condition:
    """A condition for children of an optional kind that ``setting`` asks for: False while the
    cluster lacks its CRD."""
    if crd in unavailable:
        return Condition(name, False, "CRDNotInstalled",
                         f"{setting} but the cluster has no {crd} CRD: {install}; the operator retries")
    return Condition(name, True, "Applied", applied)


def _pod_monitor_names(plan: Plan) -> list[str]:
    return [names.engine_monitor(plan.name), names.sidecar_monitor(plan.name)]


def conditions_for(plan: Plan, states: Sequence[PoolState], unavailable: Sequence[str] = ()) -> list[Condition]:
    conds = [_pool_condition(s) for s in states]
    if plan.spec.router.inference_pool.enabled:
        conds.append(_optional_kind_condition(
            "InferencePoolReady", INFERENCE_POOL_CRD, unavailable, "router.inferencePool is enabled",
            "install it (docs/llm-d.md)",
            f"InferencePool {plan.name} selects the decode and prefill pods at port {plan.sidecar.port}"))
    if plan.spec.monitoring.pod_monitors == "true":
        conds.append(_optional_kind_condition(
            "PodMonitorsReady", POD_MONITOR_CRD, unavailable, "monitoring.podMonitors is true",
            "install the Prometheus Operator's CRDs (or set podMonitors to auto)",
            f"PodMonitors {', '.join(_pod_monitor_names(plan))} select this model's pods"))
    if plan.derender_shared:
        render = next(c for c in conds if c.type == POOL_CONDITIONS[Role.RENDER])
        conds.append(Condition(POOL_CONDITIONS[Role.DERENDER], render.status, "SharedWithRender",
                               f"the render pool derenders: {render.message}"))

    drifted = [s.role for s in states if not s.missing and s.observed and not s.current_config]
    stale = [s.role for s in states if not s.missing and (not s.current or s.old_pods)]
    if drifted:
        consistent = Condition("ConfigConsistent", False, "Drifted",
                               f"pools not running the current configuration: {_summary(drifted)}")
    elif stale:
        consistent = Condition("ConfigConsistent", False, "RollingOut",
                               f"pods with an older configuration remain in: {_summary(stale)}")
    else:
        consistent = Condition("ConfigConsistent", True, "Consistent", "every pool runs the current configuration")

    scaling = [s.role for s in states if s.role not in stale and not s.missing
               and (s.replicas != s.desired or s.updated < s.desired or s.ready < s.desired)]
    if stale:
        progressing = Condition("Progressing", True, "RollingOut", f"rolling out: {_summary(stale)}")
    elif scaling:
        progressing = Condition("Progressing", True, "Scaling", f"scaling: {_summary(scaling)}")
    else:
        progressing = Condition("Progressing", False, "Stable", "no rollout in progress")

    # A missing Deployment is not "degraded": it is being created or restored right now.
    problems = [f"{s.role}: {s.failure}" for s in states if s.failure]
    degraded = (Condition("Degraded", True, "PoolFailing", "; ".join(problems)) if problems
                else Condition("Degraded", False, "AsExpected", "no failures observed"))

    not_ready = [c.type for c in conds if not c.status]
    if not_ready or degraded.status:
        mode = "prefill-decode" if plan.disaggregated else "decode-only"
        ready = Condition("Ready", False, "NotReady",
                          f"not ready: {', '.join(not_ready) or 'Degraded'} ({mode})")
    else:
        how = ("prefill and decode disaggregated" if plan.disaggregated
               else "decode prefills locally (pools.prefill.replicas is 0)")
        ready = Condition("Ready", True, "Ready", f"serving at {plan.endpoint}; {how}")
    return [ready, *conds, consistent, progressing, degraded, version_condition(plan.spec.engine.vllm_version)]


def version_condition(version: str) -> Condition:
    """Whether the model's vLLM is a release in the table; outside it the plan assumes nothing."""
    row = vllm_releases.known(version)
    if row is None:
        return Condition("VersionSupported", False, UNTESTED_VERSION, vllm_releases.untested_message(version))
    return Condition("VersionSupported", True, "Supported", f"vLLM {row.name}: {row.label}")


def invalid_conditions(message: str) -> list[Condition]:
    """Conditions for a spec that cannot be served (the children are left as they are)."""
    return [Condition("Ready", False, "InvalidSpec", message), Condition("Degraded", True, "InvalidSpec", message)]


def render_conditions(conditions: Sequence[Condition], previous: Sequence[Mapping[str, Any]], *,
                      generation: int, now: str) -> list[dict[str, Any]]:
    """Kubernetes condition dicts, keeping ``lastTransitionTime`` when a condition's status is unchanged."""
    before = {c.get("type"): c for c in previous}
    out = []
    for cond in sorted(conditions, key=lambda c: CONDITION_ORDER.index(c.type)):
        status = "True" if cond.status else "False"
        old = before.get(cond.type)
        since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
        out.append({"type": cond.type, "status": status, "reason": cond.reason, "message": cond.message,
                    "lastTransitionTime": since, "observedGeneration": generation})
    return out


def compute_status(
    plan: Plan, deployments: Mapping[str, Mapping[str, Any]], *, generation: int,
    previous: Mapping[str, Any] | None, now: str, unavailable: Sequence[str] = (),
) -> dict[str, Any]:
    """The status subresource for ``plan`` given the live Deployments (by name); ``unavailable``: the
    CRDs the last convergence found missing."""
    states = [observe_pool(pool, deployments.get(pool.name)) for pool in plan.pools]
    conditions = conditions_for(plan, states, unavailable)
    previous = previous or {}
    ready_pools = sum(1 for s in states if s.is_ready)
    return {
        "observedGeneration": generation,
        "endpoint": plan.endpoint,
        "configHash": plan.config_hash,
        "disaggregation": "prefill-decode" if plan.disaggregated else "decode-only",
        "readyPools": f"{ready_pools}/{len(states)}",
        "derender": {"strategy": plan.derender_strategy},
        "pools": {
            str(s.role): {"replicas": s.desired, "readyReplicas": s.ready, "updatedReplicas": s.updated,
                          "availableReplicas": s.available, "configHash": pool.config_hash}
            for s, pool in zip(states, plan.pools)
        },
        "inferencePool": _inference_pool(plan, unavailable),
        "monitoring": _monitoring(plan, unavailable),
        "conditions": render_conditions(conditions, previous.get("conditions") or [], generation=generation, now=now),
    }


def _monitoring(plan: Plan, unavailable: Sequence[str]) -> dict[str, Any] | None:
    """The PodMonitors as written (None: none are)."""
    if plan.spec.monitoring.pod_monitors == "false" or POD_MONITOR_CRD in unavailable:
        return None
    return {"podMonitors": _pod_monitor_names(plan)}


def _inference_pool(plan: Plan, unavailable: Sequence[str]) -> dict[str, Any] | None:
    """The InferencePool as written (None: none is, and a merge patch with None removes it)."""
    if not plan.spec.router.inference_pool.enabled or INFERENCE_POOL_CRD in unavailable:
        return None
    return {"name": plan.name, "targetPort": plan.sidecar.port,
            "selector": names.inference_pool_selector(plan.name)}


def invalid_status(message: str, *, generation: int, previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    previous = previous or {}
    kept = [c for c in previous.get("conditions") or [] if c.get("type") not in ("Ready", "Degraded")]
    return {
        "observedGeneration": generation,
        "conditions": [*render_conditions(invalid_conditions(message), previous.get("conditions") or [],
                                          generation=generation, now=now), *kept],
    }


def status_patch(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch taking ``current`` status to ``desired`` for the keys status.py owns
    (empty when nothing changes: no write). Keys kopf keeps in status are left alone."""
    current = current or {}
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        if current.get(key) != value and not (value is None and key not in current):
            patch[key] = value
    if "pools" in desired and isinstance(current.get("pools"), Mapping):
        gone = {k: None for k in current["pools"] if k not in desired["pools"]}
        if gone:
            patch["pools"] = {**desired["pools"], **gone}
    return patch
