"""The operator's Prometheus metrics (``disagg operator --metrics-port``).

One registry per process (the operator is one process); served by prometheus_client's own HTTP
server on its own port, beside kopf's liveness endpoint.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

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


def kind_of(label: str) -> str:
    """``"Deployment/x-decode"`` -> ``"Deployment"`` (the labels Outcome and restore_child report)."""
    return label.split("/", 1)[0]


def serve(port: int, address: str) -> None:
    start_http_server(port, addr=address, registry=REGISTRY)
