"""Trace spans of a request and its legs, exported over OTLP/HTTP when ``tracing`` is configured.

One span per client request (kind server), its parent the client's ``traceparent`` when the edge
found it valid (``edge.handlers.trace_headers``), and one child span per leg attempt (kind client:
render, prefill, decode, derender), whose own context goes to the engine as the leg's
``traceparent``: the same trace id, so an engine that traces continues the client's trace. Without
``tracing`` nothing is recorded and the legs carry the client's headers unchanged.

The exporter is OpenTelemetry's own (a batch processor in a thread of its own, which sends
protobuf to ``<otlp_endpoint>/v1/traces``); no global provider is set, so several apps in one
process (tests) keep their spans apart.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from disagg_sidecar.config import TracingConfig

PATH = "/v1/traces"  # OTLP/HTTP's path for spans under the receiver's base URL
SCOPE = "disagg_sidecar"


class LegSpan:
    """What a leg reports on its span; a no-op without tracing."""

    def __init__(self, span: Any = None):
        self._span = span

    def answered(self, status: int) -> None:
        if self._span is not None:
            self._span.set_attribute("http.response.status_code", status)
            if status >= 500:
                self.failed(str(status))

    def failed(self, kind: str) -> None:
        """A failed attempt: ``kind`` is the leg error's kind (timeout, connect, status, ...)."""
        if self._span is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_attribute("error.type", kind)
            self._span.set_status(Status(StatusCode.ERROR, kind))


class Tracing:
    """The sidecar's tracer: ``enabled`` only with an OTLP endpoint configured."""

    def __init__(self, config: TracingConfig | None, served_model_name: str | None = None):
        self.config = config
        self._provider: Any = None
        self._tracer: Any = None
        if config is None:
            return
        # Imported only when tracing is on: nothing of OpenTelemetry is loaded otherwise.
        import requests
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        attributes = {"service.name": config.service_name,
                      **({"gen_ai.request.model": served_model_name} if served_model_name else {}),
                      **config.resource_attributes}
        self._provider = TracerProvider(resource=Resource.create(attributes),
                                        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        session = requests.Session()
        session.trust_env = False  # the receiver is the configured address, not one an environment proxy picks
        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint.rstrip("/") + PATH,
                                    timeout=config.export_timeout_seconds, session=session)
        self._provider.add_span_processor(BatchSpanProcessor(
            exporter, schedule_delay_millis=int(config.export_delay_seconds * 1000),
            max_queue_size=config.max_queued_spans))
        self._tracer = self._provider.get_tracer(SCOPE)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @contextmanager
    def request(self, name: str, trace_headers: Mapping[str, str],
                attributes: Mapping[str, Any]) -> Iterator[Any]:
        """The request's span, current for the block (legs started in it are its children);
        ``trace_headers``: the client's checked ``traceparent``/``tracestate`` (may be empty)."""
        if self._tracer is None:
            yield None
            return
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(dict(trace_headers))
        with self._tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER,
                                                attributes=dict(attributes), record_exception=False,
                                                set_status_on_exception=False) as span:
            yield span

    @contextmanager
    def leg(self, leg: str, url: str, path: str, headers: Mapping[str, str]) -> Iterator[tuple[LegSpan, Mapping[str, str]]]:
        """A leg attempt's span (a child of the current request's) and the headers its request
        gets: ``headers`` with the span's own ``traceparent``/``tracestate``."""
        if self._tracer is None:
            yield LegSpan(), headers
            return
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parts = urlsplit(url)
        span = self._tracer.start_span(leg, kind=SpanKind.CLIENT, attributes={
            "disagg.pool": leg, "http.request.method": "POST", "url.full": url + path,
            "server.address": parts.hostname or "", "server.port": parts.port or (443 if parts.scheme == "https" else 80)})
        carrier = {k: v for k, v in headers.items() if k.lower() not in ("traceparent", "tracestate")}
        TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
        try:
            yield LegSpan(span), carrier
        finally:
            span.end()

    def shutdown(self) -> None:
        """Export what is queued (blocking: run it off the event loop)."""
        if self._provider is not None:
            self._provider.shutdown()


def set_request_outcome(span: Any, status: int, fields: Mapping[str, Any]) -> None:
    """The request span's answer: its status code (a 5xx marks the span failed) and ``fields``."""
    if span is None:
        return
    span.set_attribute("http.response.status_code", status)
    for key, value in fields.items():
        if value is not None:
            span.set_attribute(key, value)
    if status >= 500:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, str(status)))
