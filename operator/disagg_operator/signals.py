"""The planner's signals (pure): engines' Prometheus expositions → ``decide.Signals``, and the
PromQL that reads the same signals from a Prometheus scraping the model's PodMonitors.

vLLM's families (vllm/v1/metrics/loggers.py): ``vllm:num_requests_waiting`` (gauge),
``vllm:kv_cache_usage_perc`` (gauge, 0-1; ``vllm:gpu_cache_usage_perc`` in older releases),
``vllm:time_to_first_token_seconds`` and ``vllm:inter_token_latency_seconds`` (histograms).
Latency percentiles are over the interval between two readings, from the histograms' bucket
increases, interpolated within a bucket as Prometheus' ``histogram_quantile`` does; a reading
without new requests has latency 0 (nothing waited).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from disagg_operator.decide import Signals

WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
QUANTILE = 0.9

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending; +Inf last


@dataclass(frozen=True)
class EngineReading:
    """One engine's exposition, summed over its label sets (data-parallel ranks, model names)."""

    waiting: float | None
    kv_usage: float | None
    ttft: Buckets
    itl: Buckets


def parse_engine(text: str) -> EngineReading:
    """One engine's ``/metrics`` (ValueError when it is not an exposition)."""
    gauges: dict[str, list[float]] = {}
    buckets: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (WAITING, *KV_USAGE):
                gauges.setdefault(sample.name, []).append(sample.value)
            for name in (TTFT, ITL):
                if sample.name == f"{name}_bucket":
                    le = float(sample.labels["le"])
                    buckets[name][le] = buckets[name].get(le, 0.0) + sample.value
    kv = next((gauges[n] for n in KV_USAGE if n in gauges), None)
    return EngineReading(
        waiting=sum(gauges[WAITING]) if WAITING in gauges else None,
        kv_usage=sum(kv) / len(kv) if kv else None,
        ttft=tuple(sorted(buckets[TTFT].items())), itl=tuple(sorted(buckets[ITL].items())),
    )


def increase(now: Buckets, before: Buckets | None) -> Buckets:
    """Bucket increases since ``before`` (all of ``now`` after a restart reset the counters)."""
    if before is None:
        return ()
    old = dict(before)
    if any(count < old.get(le, 0.0) for le, count in now):
        return now  # the engine restarted: its counters began again
    return tuple((le, count - old.get(le, 0.0)) for le, count in now)


def add(parts: Iterable[Buckets]) -> Buckets:
    total: dict[float, float] = {}
    for part in parts:
        for le, count in part:
            total[le] = total.get(le, 0.0) + count
    return tuple(sorted(total.items()))


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets; 0.0 without observations, None without buckets."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return 0.0
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower  # in the +Inf bucket: the highest finite bound, as Prometheus answers
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, count
    return lower


def signals(prefill: Mapping[str, EngineReading], decode: Mapping[str, EngineReading],
            before: Mapping[str, EngineReading], disaggregated: bool) -> Signals:
    """The model's signals from its engines' readings (by pod) and their previous readings."""
    def latency(readings: Mapping[str, EngineReading], attr: str) -> float | None:
        parts = [increase(getattr(r, attr), getattr(before[pod], attr) if pod in before else None)
                 for pod, r in readings.items()]
        parts = [p for p in parts if p]
        return quantile(QUANTILE, add(parts)) if parts else None

    waiting = [r.waiting for r in prefill.values() if r.waiting is not None]
    kv = [r.kv_usage for r in decode.values() if r.kv_usage is not None]
    return Signals(
        ttft_p90=latency(prefill if disaggregated else decode, "ttft"),
        waiting=sum(waiting) if waiting else None,
        itl_p90=latency(decode, "itl"),
        kv_usage=sum(kv) / len(kv) if kv else None,
    )


# --- the same signals from Prometheus ---------------------------------------------------------------

def _selector(namespace: str, model: str, pool: str) -> str:
    # The labels the model's PodMonitors give every series (objects/monitors.py), and Prometheus' namespace.
    return f'{{namespace="{namespace}",model="{model}",pool="{pool}",role="engine"}}'


def promql(namespace: str, model: str, disaggregated: bool, window: str = "2m") -> dict[str, str]:
    """Signal name → PromQL answering it with one number."""
    pre, dec = _selector(namespace, model, "prefill"), _selector(namespace, model, "decode")

    def p90(name: str, sel: str) -> str:
        return f"histogram_quantile({QUANTILE}, sum by (le) (rate({name}_bucket{sel}[{window}])))"
    return {
        "ttft_p90": p90(TTFT, pre if disaggregated else dec),
        "waiting": f"sum({WAITING}{pre})",
        "itl_p90": p90(ITL, dec),
        "kv_usage": f"avg({KV_USAGE[0]}{dec}) or avg({KV_USAGE[1]}{dec})",
    }


def from_query_results(results: Mapping[str, Sequence[float]]) -> Signals:
    """``Signals`` from the values each query returned (empty: no series). A latency quantile over a
    window without requests is NaN in Prometheus: no request waited, so 0."""
    def value(name: str, nan: float | None = None) -> float | None:
        values = results.get(name) or []
        if not values:
            return None
        return nan if math.isnan(values[0]) else values[0]
    return Signals(ttft_p90=value("ttft_p90", 0.0), waiting=value("waiting"), itl_p90=value("itl_p90", 0.0),
                   kv_usage=value("kv_usage"))
