"""The planner of ``spec.autoscaling``: read the signals, decide (``decide.py``), scale through the
Deployments' ``scale`` subresource, and explain (status, Events, metrics). One ``tick`` per model
per ``intervalSeconds`` (``planner_handlers.py`` runs them).

Signals come from the engines' ``/metrics`` (their pods' addresses from the EndpointSlices of
``<name>-prefill`` and ``<name>``, the engine port of the spec), or from Prometheus when
``autoscaling.prometheus`` is set (the PodMonitors' labels select the model's series). A pool an
HPA of the user's scales is left to it (status: ``managedBy``); the other pool is still planned.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg_operator import names, retire, signals as sig
from disagg_operator.decide import Decision, Recommendation, Replicas, Signals, decide, decode_beside, surge_step
from disagg_operator.names import Role
from disagg_operator.plan import Plan

MAX_BYTES = 8 << 20  # an engine's exposition is tens of KB
TIMEOUT = 3.0

Fetch = Callable[[str], str]  # URL → body (raises OSError/ValueError when there is none)


def http_get(url: str) -> str:
    request = urllib.request.Request(url, headers={"Accept": "text/plain; version=0.0.4, application/json"})
    # No redirects to follow (a scrape target or Prometheus that redirects is misconfigured), and no
    # proxy from the environment: pod addresses are reached directly.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)
    with opener.open(request, timeout=TIMEOUT) as response:
        body = response.read(MAX_BYTES + 1)
    if len(body) > MAX_BYTES:
        raise ValueError(f"{url}: more than {MAX_BYTES} bytes")
    return body.decode("utf-8")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


@dataclass
class ModelState:
    """What the planner remembers of one model between ticks (in memory: a restarted operator starts
    with the sizes it finds, which hold off scaling down for a window)."""

    history: tuple[Recommendation, ...] = ()
    readings: dict[str, sig.EngineReading] = field(default_factory=dict)  # by pod
    last_tick: float = 0.0
    # A pool is on its way (a surge step held for the other pool's pods, or prefill pods leaving the
    # sidecars' selection): the next tick comes at the timer's pace, not after a whole interval.
    stepping: bool = False


@dataclass(frozen=True)
class Move:
    pool: Role
    before: int
    after: int


@dataclass(frozen=True)
class TickResult:
    signals: Signals
    decision: Decision
    moves: tuple[Move, ...]
    status: dict[str, Any]
    events: tuple[tuple[str, str], ...]  # (reason, message)
    errors: tuple[str, ...]


def _engine_urls(api: Any, plan: Plan, service: str) -> dict[str, str]:
    port = plan.spec.engine.port
    return {pod: f"http://{_host(ip)}:{port}/metrics" for pod, ip in api.service_endpoints(plan.namespace, service)}


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def read_from_pods(api: Any, plan: Plan, state: ModelState, fetch: Fetch) -> tuple[Signals, list[str]]:
    errors: list[str] = []
    readings: dict[Role, dict[str, sig.EngineReading]] = {Role.PREFILL: {}, Role.DECODE: {}}
    services = {Role.DECODE: names.client_service(plan.name)}
    if plan.disaggregated:
        services[Role.PREFILL] = names.pool_service(plan.name, Role.PREFILL)
    for role, service in services.items():
        for pod, url in _engine_urls(api, plan, service).items():
            try:
                readings[role][pod] = sig.parse_engine(fetch(url))
            except (OSError, ValueError) as exc:
                errors.append(f"{pod}: {exc}"[:200])
    current = {**readings[Role.PREFILL], **readings[Role.DECODE]}
    result = sig.signals(readings[Role.PREFILL], readings[Role.DECODE], state.readings, plan.disaggregated)
    state.readings = current
    return result, errors


def read_from_prometheus(plan: Plan, url: str, fetch: Fetch) -> tuple[Signals, list[str]]:
    errors: list[str] = []
    results: dict[str, list[float]] = {}
    for name, query in sig.promql(plan.namespace, plan.name, plan.disaggregated).items():
        try:
            body = json.loads(fetch(f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': query})}"))
            if body.get("status") != "success":
                raise ValueError(body.get("error") or "query failed")
            data = body["data"]
            values = ([float(data["result"][1])] if data["resultType"] == "scalar"
                      else [float(item["value"][1]) for item in data["result"]])
            results[name] = values
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            errors.append(f"{name}: {exc}"[:200])
    return sig.from_query_results(results), errors


def _signals_status(s: Signals) -> dict[str, Any]:
    out = {"ttftP90Seconds": s.ttft_p90, "waitingRequests": s.waiting, "itlP90Seconds": s.itl_p90,
           "decodeKVCacheUsage": s.kv_usage}
    return {k: round(v, 4) for k, v in out.items() if v is not None}


def _current(plan: Plan, deployments: Mapping[str, Mapping[str, Any]], role: Role, ready: bool = False) -> int | None:
    """A pool's replica count (``ready``: its ready pods, as its Deployment's status says)."""
    pool = plan.pool(role)
    if pool is None:
        return None
    dep = deployments.get(pool.name)
    if dep is None:
        return None
    if ready:
        return int((dep.get("status") or {}).get("readyReplicas") or 0)
    return int((dep.get("spec") or {}).get("replicas", 1))


def release_prefill(api: Any, namespace: str, model: str) -> list[str]:
    """Every prefill pod the planner took out of the sidecars' selection is put back (the planner no
    longer sizes the pool: ``spec.autoscaling`` removed, or the user's HPA took it over)."""
    pods = api.pods(namespace, names.selector(model, Role.PREFILL))
    back = [p for p in retire.alive(pods) if retire.marked(p)]
    for pod in back:
        api.patch_pod(namespace, pod["metadata"]["name"], retire.unmark_patch(pod))
    return [p["metadata"]["name"] for p in back]


def _retire_prefill(api: Any, plan: Plan, before: int, after: int) -> tuple[bool, list[tuple[str, str]], str]:
    """Prefill pods leave the sidecars' selection before their pool shrinks (``retire.py``): (scale now,
    events, why not yet). Also puts back marked pods that are no longer to go."""
    if plan.kv_revision is None:  # no KV-revision Services: nothing selects on the label
        return True, [], ""
    pods = api.pods(plan.namespace, names.selector(plan.name, Role.PREFILL))
    listed = {pod for service in retire.revision_services(plan.name, retire.alive(pods))
              for pod, _ in api.service_endpoints(plan.namespace, service)}
    step = retire.plan(pods, before, after, listed)
    by_name = {p["metadata"]["name"]: p for p in pods}
    for name in step.mark:
        api.patch_pod(plan.namespace, name, retire.mark_patch(by_name[name]))
    for name in step.unmark:
        api.patch_pod(plan.namespace, name, retire.unmark_patch(by_name[name]))
    events = []
    if step.mark:
        events.append(("PrefillDeselected", f"prefill pods {', '.join(step.mark)} leave the sidecars' selection "
                                            f"before prefill {before} → {after}"))
    if step.unmark:
        events.append(("PrefillReselected", f"prefill pods {', '.join(step.unmark)} are selected again"))
    why = ""
    if step.mark or step.waiting_for:
        why = f"; waiting for {', '.join(step.mark or step.waiting_for)} to leave the sidecars' selection"
    return step.scale, events, why


def tick(plan: Plan, deployments: Mapping[str, Mapping[str, Any]], hpas: Mapping[str, str], api: Any,
         state: ModelState, *, fetch: Fetch = http_get, now: float | None = None,
         stamp: str = "") -> TickResult | None:
    """One planning step for ``plan`` (None: its Deployments are not there yet). ``hpas``: Deployment
    name → the user's HPA scaling it. Scales what the decision changes; returns what to report."""
    spec = plan.spec.autoscaling
    assert spec is not None
    now = time.monotonic() if now is None else now
    decode = _current(plan, deployments, Role.DECODE)
    prefill = _current(plan, deployments, Role.PREFILL)
    if decode is None or (plan.disaggregated and prefill is None):
        return None
    if spec.prometheus is not None:
        signals, errors = read_from_prometheus(plan, spec.prometheus.url, fetch)
    else:
        signals, errors = read_from_pods(api, plan, state, fetch)
    current = Replicas(prefill, decode)
    decision = decide(spec, signals, current, state.history, now)
    state.history, state.last_tick = decision.history, now
    # Both pools grow together, each only as far as the other's ready pods keep the ratio.
    ready = Replicas(_current(plan, deployments, Role.PREFILL, ready=True), _current(plan, deployments, Role.DECODE,
                                                                                     ready=True) or 0)
    step = surge_step(spec, decision.replicas, current, ready)

    moves, managed, notes, retire_events = [], {}, dict(decision.reasons), []
    state.stepping = prefill_held = False
    for role, before, target, after in ((Role.PREFILL, prefill, decision.replicas.prefill, step.prefill),
                                        (Role.DECODE, decode, decision.replicas.decode, step.decode)):
        if before is None or after is None or target is None:
            continue
        deployment = names.pool_name(plan.name, role)
        if deployment in hpas:
            managed[str(role)] = f"HorizontalPodAutoscaler/{hpas[deployment]}"
            if role == Role.PREFILL and (back := release_prefill(api, plan.namespace, plan.name)):
                retire_events.append(("PrefillReselected", f"prefill pods {', '.join(back)} are selected again"))
            continue
        managed[str(role)] = "planner"
        if role == Role.DECODE and prefill_held and prefill is not None:
            after = decode_beside(spec, prefill, before, after)
        if after != target:
            wait = "the other pool's new pods are ready" if after < target else "the other pool has shrunk"
            notes[str(role)] = f"{notes.get(str(role), '')}; {after} until {wait} (ratio)"
            state.stepping = True
        if role == Role.PREFILL:
            now_ok, found, why = _retire_prefill(api, plan, before, after)
            retire_events += found
            notes[str(role)] = notes.get(str(role), "") + why
            if not now_ok:
                state.stepping = prefill_held = True
                continue
        if after != before:
            api.scale(plan.namespace, deployment, after)
            moves.append(Move(role, before, after))

    events = [*retire_events, *(("ScaledUp" if m.after > m.before else "ScaledDown",
                                 f"{m.pool} {m.before} → {m.after}: {notes.get(str(m.pool), '')}") for m in moves)]
    if decision.ratio_held and moves:
        events.append(("RatioHeld", f"prefill:decode kept within {spec.ratio.min:g}-{spec.ratio.max:g} "
                                    f"prefill pods per decode pod"))
    pools: dict[str, Any] = {}
    for role, before, after, bounds in ((Role.PREFILL, prefill, decision.replicas.prefill, spec.prefill),
                                        (Role.DECODE, decode, decision.replicas.decode, spec.decode)):
        if before is None or after is None:
            continue
        pools[str(role)] = {"current": before, "desired": after if managed[str(role)] == "planner" else before,
                            "minReplicas": bounds.min_replicas, "maxReplicas": bounds.max_replicas,
                            "managedBy": managed[str(role)], "reason": notes.get(str(role), "")}
    status: dict[str, Any] = {
        "source": "prometheus" if spec.prometheus is not None else "pods",
        "lastDecisionTime": stamp,
        "signals": _signals_status(signals),
        "pools": pools,
        "ratioHeld": decision.ratio_held,
    }
    if errors:
        status["errors"] = errors[:5]
    return TickResult(signals, decision, tuple(moves), status, tuple(events), tuple(errors))
