"""Prometheus metrics of one sidecar app (its own registry: no process-wide singletons)."""

from __future__ import annotations

from contextvars import ContextVar

from prometheus_client import (
    GCCollector, PlatformCollector, ProcessCollector, CollectorRegistry, Counter, Gauge, Histogram, generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The client API a request came in on (``disagg_sidecar_leg_seconds{api}``): set by the handler, read
# where its legs are timed, in the tasks the request's legs run in (they copy the context).
api_var: ContextVar[str] = ContextVar("disagg_api", default="none")
_LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ns = "disagg_sidecar"
        self.requests = Counter(f"{ns}_requests", "Client requests by API and status code.", ["api", "code"], registry=r)
        self.in_flight = Gauge(f"{ns}_requests_in_flight", "Client requests being served.", registry=r)
        self.rejected = Counter(f"{ns}_rejected_requests", "Requests refused before any leg, by reason.",
                                ["reason"], registry=r)
        self.leg_seconds = Histogram(f"{ns}_leg_seconds", "Leg latency (decode: to the last byte), by leg and client API.",
                                     ["leg", "api"], buckets=_LEG_BUCKETS, registry=r)
        self.leg_errors = Counter(f"{ns}_leg_errors", "Failed leg attempts by leg and kind.", ["leg", "kind"], registry=r)
        self.retries = Counter(f"{ns}_leg_retries", "Leg attempts repeated on another endpoint.", ["leg"], registry=r)
        self.prefill = Counter(f"{ns}_prefill", "How the prompt was prefilled (remote, fallback, skipped, local).",
                               ["outcome"], registry=r)
        self.output_modes = Counter(f"{ns}_decode_output_mode", "Decode legs by requested output_mode.",
                                    ["mode"], registry=r)
        self.mode_fallbacks = Counter(f"{ns}_output_mode_fallbacks",
                                      "Decode engines that did not produce the requested output_mode (chained instead).",
                                      ["requested"], registry=r)
        self.decode_answered = Counter(f"{ns}_decode_answered", "Requests the decode engine answered itself, by "
                                       "reason: its render or derender tier down (render.failure_policy decode), or "
                                       "a Responses request reading vLLM's response store.",
                                       ["reason"], registry=r)
        self.derender_calls = Counter(f"{ns}_derender_calls", "Calls to the derender tier.", ["kind"], registry=r)
        self.coalesced_chunks = Counter(f"{ns}_coalesced_chunks",
                                        "Generate chunks merged into a later derender call.", registry=r)
        self.aborts = Counter(f"{ns}_aborts", "Upstream requests aborted after a client disconnect.", registry=r)
        self.engine_metrics_missing = Counter(
            f"{ns}_engine_metrics_missing", "Scrapes of /metrics served without the decode engine's families "
            "(metrics.include_engine), by reason.", ["reason"], registry=r)
        # The sidecar's own process, as in prometheus_client's default registry: with include_engine these
        # names are the sidecar's, not the engine's (disagg_sidecar.upstream.exposition).
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
