"""The ``DisaggregatedModel`` API's observability and scaling sections: ``spec.monitoring`` (PodMonitors)
and ``spec.autoscaling`` (the operator's planner: docs/autoscaling.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from disagg_operator.spec_base import WireModel


class MonitoringSpec(WireModel):
    """Prometheus Operator monitors for this model's pods."""

    pod_monitors: Literal["auto", "true", "false"] = Field(
        "auto", description="PodMonitors (monitoring.coreos.com/v1) for every pool's vLLM /metrics and the "
        "sidecars' /metrics, with the labels model, pool, role and revision. auto: when the cluster serves the "
        "PodMonitor CRD (checked at each reconcile); true: always (a PodMonitorsReady condition says when the "
        "CRD is missing); false: never.")
    interval: Annotated[str, StringConstraints(pattern=r"^[0-9]+(ms|s|m)$", max_length=16)] = Field(
        "15s", description="Scrape interval of the monitors (Prometheus duration).")


class PoolBounds(WireModel):
    """The replica range the planner keeps one pool in."""

    min_replicas: int = Field(1, description="Never fewer pods (at least 1).")
    max_replicas: int = Field(description="Never more pods.")


class RatioBounds(WireModel):
    """Prefill replicas per decode replica the planner keeps (prefill / decode)."""

    min: float = Field(0.0, description="At least this many prefill pods per decode pod (0: no lower bound).")
    max: float = Field(100.0, description="At most this many prefill pods per decode pod.")


class ScalingTargets(WireModel):
    """What the planner keeps each pool under (unset targets are not used). Prefill scales on the first two,
    decode on the last two; a pool scales up when any of its signals is above its target."""

    ttft_seconds: float | None = Field(
        None, description="Time to first token, 90th percentile over the last interval, from the prefill engines "
        "(vllm:time_to_first_token_seconds; the decode engines' when prefill is off).")
    waiting_per_prefill_pod: float | None = Field(
        None, description="Requests waiting in the prefill engines' queues (vllm:num_requests_waiting), per pod.")
    itl_seconds: float | None = Field(
        None, description="Inter-token latency, 90th percentile over the last interval, from the decode engines "
        "(vllm:inter_token_latency_seconds).")
    decode_kv_cache_usage: float | None = Field(
        None, description="Mean KV-cache usage of the decode engines, 0-1 (vllm:kv_cache_usage_perc).")


class Stabilization(WireModel):
    """How long a recommendation must hold before the planner acts on it (as an HPA's behavior)."""

    scale_up_seconds: int = Field(0, description="Scale up to the lowest recommendation of this window.")
    scale_down_seconds: int = Field(300, description="Scale down to the highest recommendation of this window.")


class PrometheusSource(WireModel):
    """Read the signals from a Prometheus that scrapes this model through its PodMonitors."""

    url: Annotated[str, StringConstraints(pattern=r"^https?://[^\s]+$", max_length=2048)] = Field(
        description="Base URL of the Prometheus HTTP API, e.g. http://prometheus-operated.monitoring.svc:9090.")


class AutoscalingSpec(WireModel):
    """The operator's planner: scales prefill and decode on inference signals within bounds and a ratio."""

    prefill: PoolBounds = Field(description="Bounds of the prefill pool.")
    decode: PoolBounds = Field(description="Bounds of the decode pool.")
    ratio: RatioBounds = Field(default_factory=RatioBounds)
    targets: ScalingTargets = Field(description="At least one target.")
    stabilization: Stabilization = Field(default_factory=Stabilization)
    interval_seconds: int = Field(15, description="How often the planner reads the signals and decides.")
    tolerance: float = Field(0.1, description="Signals within this fraction of their target change nothing.")
    prometheus: PrometheusSource | None = Field(
        None, description="Where the signals come from; unset: the operator scrapes the pods' /metrics itself.")
