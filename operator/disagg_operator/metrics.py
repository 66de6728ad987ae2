"""The operator's Prometheus metrics (``disagg operator --metrics-port``).

One registry per process (the operator is one process); served by prometheus_client's own HTTP
server on its own port, beside kopf's liveness endpoint.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()
_NS = "disagg_operator"

RECONCILES = Counter(f"{_NS}_reconciles", "Model reconciliations by outcome (applied, unchanged, invalid, failed).",
                     ["outcome"], registry=REGISTRY)
RECONCILE_SECONDS = Histogram(f"{_NS}_reconcile_seconds", "Time to converge one model (plan, diff, apply).",
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY)
OBJECTS_APPLIED = Counter(f"{_NS}_objects_applied", "Child objects created or changed, by kind.", ["kind"],
                          registry=REGISTRY)
OBJECTS_PRUNED = Counter(f"{_NS}_objects_pruned", "Child objects deleted because the spec no longer wants them.",
                         ["kind"], registry=REGISTRY)
RESTORES = Counter(f"{_NS}_drift_restores", "Child objects put back after someone edited or deleted them.",
                   ["kind"], registry=REGISTRY)
STATUS_WRITES = Counter(f"{_NS}_status_writes", "Status patches written to models.", registry=REGISTRY)

# The planner (spec.autoscaling): what it read, wanted and did, per model and pool.
PLANNER_DECISIONS = Counter(f"{_NS}_planner_decisions", "Planner decisions by outcome (scaled_up, scaled_down, held, "
                            "failed).", ["outcome"], registry=REGISTRY)
PLANNER_DESIRED = Gauge(f"{_NS}_planner_desired_replicas", "Replicas the planner wants for a pool.",
                        ["namespace", "model", "pool"], registry=REGISTRY)
PLANNER_SIGNAL = Gauge(f"{_NS}_planner_signal", "The signals of the planner's last decision (ttft_p90, waiting, "
                       "itl_p90, kv_usage).", ["namespace", "model", "signal"], registry=REGISTRY)
PLANNER_READ_ERRORS = Counter(f"{_NS}_planner_read_errors", "Signals the planner could not read (a pod or a query).",
                              registry=REGISTRY)


def kind_of(label: str) -> str:
    """``"Deployment/x-decode"`` -> ``"Deployment"`` (the labels Outcome and restore_child report)."""
    return label.split("/", 1)[0]


def serve(port: int, address: str) -> None:
    start_http_server(port, addr=address, registry=REGISTRY)
