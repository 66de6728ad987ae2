"""The rules of ``spec.monitoring`` and ``spec.autoscaling`` (spec.py), in ``rules.RULES``."""

from __future__ import annotations

from disagg_operator.rule import Rule

SCALING_RULES: tuple[Rule, ...] = (
    Rule(
        "tracing.sample-ratio", "TracingSpec", "self.sampleRatio >= 0.0 && self.sampleRatio <= 1.0",
        "monitoring.tracing.sampleRatio must be between 0 and 1", lambda t: 0 <= t.sample_ratio <= 1, ".sampleRatio",
    ),
    Rule(
        "autoscaling.one-scaler", "DisaggregatedModelSpec",
        "!has(self.autoscaling) || (!has(self.pools.prefill.autoscaling) && !has(self.pools.decode.autoscaling))",
        "autoscaling (the planner) and pools.prefill/decode.autoscaling (an HPA) cannot both scale a pool: "
        "use one of them",
        lambda s: s.autoscaling is None or (s.pools.prefill.autoscaling is None and s.pools.decode.autoscaling is None),
        ".autoscaling",
    ),
    Rule(
        "pool-bounds.min", "PoolBounds", "self.minReplicas >= 1 && self.minReplicas <= self.maxReplicas",
        "minReplicas must be at least 1 and not greater than maxReplicas",
        lambda b: 1 <= b.min_replicas <= b.max_replicas, ".minReplicas",
    ),
    Rule(
        "ratio.range", "RatioBounds", "self.min >= 0.0 && self.max > 0.0 && self.min <= self.max",
        "autoscaling.ratio needs 0 <= min <= max and max > 0 (prefill pods per decode pod)",
        lambda r: 0 <= r.min <= r.max and r.max > 0,
    ),
    Rule(
        "targets.some", "ScalingTargets",
        "has(self.ttftSeconds) || has(self.waitingPerPrefillPod) || has(self.itlSeconds) "
        "|| has(self.decodeKvCacheUsage)",
        "autoscaling.targets needs at least one target (ttftSeconds, waitingPerPrefillPod, itlSeconds, "
        "decodeKvCacheUsage)",
        lambda t: any(v is not None for v in (t.ttft_seconds, t.waiting_per_prefill_pod, t.itl_seconds,
                                              t.decode_kv_cache_usage)),
    ),
    Rule(
        "targets.positive", "ScalingTargets",
        "(!has(self.ttftSeconds) || self.ttftSeconds > 0.0) && (!has(self.itlSeconds) || self.itlSeconds > 0.0) "
        "&& (!has(self.waitingPerPrefillPod) || self.waitingPerPrefillPod > 0.0) "
        "&& (!has(self.decodeKvCacheUsage) || (self.decodeKvCacheUsage > 0.0 && self.decodeKvCacheUsage <= 1.0))",
        "autoscaling.targets must be greater than 0, and decodeKvCacheUsage at most 1",
        lambda t: all(v is None or v > 0 for v in (t.ttft_seconds, t.itl_seconds, t.waiting_per_prefill_pod))
        and (t.decode_kv_cache_usage is None or 0 < t.decode_kv_cache_usage <= 1),
    ),
    Rule(
        "stabilization.range", "Stabilization",
        "self.scaleUpSeconds >= 0 && self.scaleUpSeconds <= 3600 && self.scaleDownSeconds >= 0 "
        "&& self.scaleDownSeconds <= 3600",
        "autoscaling.stabilization windows must be between 0 and 3600 seconds",
        lambda s: 0 <= s.scale_up_seconds <= 3600 and 0 <= s.scale_down_seconds <= 3600,
    ),
    Rule(
        "autoscaling.interval", "AutoscalingSpec", "self.intervalSeconds >= 5 && self.intervalSeconds <= 600",
        "autoscaling.intervalSeconds must be between 5 and 600", lambda a: 5 <= a.interval_seconds <= 600,
        ".intervalSeconds",
    ),
    Rule(
        "autoscaling.tolerance", "AutoscalingSpec", "self.tolerance >= 0.0 && self.tolerance < 1.0",
        "autoscaling.tolerance must be at least 0 and less than 1", lambda a: 0 <= a.tolerance < 1, ".tolerance",
    ),
    Rule(
        "autoscaling.ratio-feasible", "AutoscalingSpec",
        "double(self.prefill.maxReplicas) >= double(self.decode.minReplicas) * self.ratio.min "
        "&& double(self.prefill.minReplicas) <= double(self.decode.maxReplicas) * self.ratio.max",
        "autoscaling.ratio cannot be held within the pools' bounds: prefill.maxReplicas must be at least "
        "decode.minReplicas * ratio.min, and prefill.minReplicas at most decode.maxReplicas * ratio.max",
        lambda a: a.prefill.max_replicas >= a.decode.min_replicas * a.ratio.min
        and a.prefill.min_replicas <= a.decode.max_replicas * a.ratio.max, ".ratio",
    ),
)
