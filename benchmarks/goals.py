"""Issue #19's goals, checked against the results' keys (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NAN = float("nan")


@dataclass(frozen=True)
class Goal:
    name: str
    key: str
    op: str        # "<=" or ">="
    bound: float
    unit: str = ""

    def check(self, keys: dict[str, Any]) -> dict[str, Any]:
        value = keys.get(self.key)
        if value is None or value != value:
            return {"goal": self.name, "key": self.key, "value": None, "bound": self.bound, "op": self.op,
                    "unit": self.unit, "status": "not measured"}
        met = value <= self.bound if self.op == "<=" else value >= self.bound
        by = value - self.bound if self.op == "<=" else self.bound - value
        return {"goal": self.name, "key": self.key, "value": value, "bound": self.bound, "op": self.op,
                "unit": self.unit, "status": "met" if met else "missed",
                "missed_by": None if met else by, "missed_by_factor": None if met or not self.bound else
                (value / self.bound if self.op == "<=" else self.bound / value if value else None)}


GOALS = (
    Goal("sidecar CPU per relayed chunk, one stream at a time", "sidecar_cpu_us_per_chunk", "<=", 50.0, "µs"),
    Goal("sidecar CPU per relayed chunk, 16 streams at once (a decode pod's regime)", "sidecar_cpu_us_per_chunk_c16",
         "<=", 50.0, "µs"),
    Goal("sidecar CPU per short request", "sidecar_cpu_ms_per_request", "<=", 0.5, "ms"),
    Goal("sidecar: added p50 latency of a short chat at concurrency 1 beyond its render and prefill legs",
         "proxy_added_beyond_legs_p50_ms_c1", "<=", 2.0, "ms"),
    Goal("throughput through the sidecar vs direct, concurrency 64", "proxy_throughput_ratio_c64", ">=", 0.98, "×"),
    Goal("inline derender: non-engine CPU vs coupled API CPU, 4,096 tokens", "inline_cpu_ratio_4096", "<=", 1.1, "×"),
    Goal("inline derender: client chunks vs coupled, 4,096 tokens", "inline_chunks_ratio_4096", ">=", 0.95, "×"),
    Goal("stock-inline (vLLM 0.34 stock decode): client chunks vs coupled 0.34, 4,096 tokens",
         "stock_inline_chunks_ratio_4096", ">=", 0.95, "×"),
    Goal("stock-inline: non-engine CPU vs coupled 0.34 API CPU, 4,096 tokens", "stock_inline_cpu_ratio_4096",
         "<=", 1.2, "×"),
    Goal("chained: bytes to derender per token, largest n vs smallest n (linear: ≤ 1.25)",
         "chained_bytes_per_token_growth", "<=", 1.25, "×"),
    Goal("derender session (stock decode): client chunks vs coupled, 4,096 tokens", "session_client_chunks_ratio_4096",
         ">=", 0.95, "×"),
    Goal("derender session: non-engine CPU (render + sidecar + decode API) vs coupled API CPU, 4,096 tokens",
         "session_cpu_ratio_4096", "<=", 1.5, "×"),
    Goal("derender session: bytes sidecar → render vs the token ids' JSON plus the request, 4,096 tokens",
         "session_bytes_ratio_4096", "<=", 2.0, "×"),
    Goal("derender session: bytes to render per token, largest n vs smallest n (linear: ≤ 1.25)",
         "session_bytes_per_token_growth", "<=", 1.25, "×"),
    Goal("500 CRs applied vs kubectl apply --server-side of the same objects", "operator_500_crs_kubectl_ratio",
         "<=", 2.0, "×"),
    Goal("soak errors", "soak_errors", "<=", 0, ""),
    Goal("soak: sidecar RSS growth between 10 s and the end", "soak_rss_growth_ratio", "<=", 0.10, "×"),
    Goal("prefix-affinity: prefill prefix-cache hit rate minus least-requests'", "prefix_hit_rate_gain", ">=", 0.05, ""),
    Goal("prefix-affinity: prefill requests, busiest engine vs idlest (per round)", "prefix_imbalance_prefix_affinity",
         "<=", 2.0, "×"),
    Goal("prefix-affinity: busiest prefill engine's requests above the stated share bound (per round)",
         "prefix_over_share_cap", "<=", 0, ""),
)


def check_all(keys: dict[str, Any]) -> list[dict[str, Any]]:
    return [g.check(keys) for g in GOALS]
