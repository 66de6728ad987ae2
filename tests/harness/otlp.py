"""An OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with OpenTelemetry's protobuf
``ExportTraceServiceRequest`` (gzip or not), decoded with the ``opentelemetry-proto`` package and
kept as plain ``Span`` records; answers what a collector answers (an empty export response)."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)

from tests.sidecar.support import serving

PROTOBUF = "application/x-protobuf"


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@dataclass(frozen=True)
class Span:
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind (2 server, 3 client)
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: dict[str, Any]
    start_ns: int
    end_ns: int


@dataclass
class Receiver:
    url: str = ""
    spans: list[Span] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # requests it could not decode (a test fails on any)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def add(self, body: bytes) -> None:
        export = ExportTraceServiceRequest.FromString(body)
        spans = []
        for rs in export.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.kind,
                                      {kv.key: _value(kv.value) for kv in s.attributes}, s.status.code, resource,
                                      s.start_time_unix_nano, s.end_time_unix_nano))
        with self._lock:
            self.spans += spans


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()

    async def traces(request: web.Request) -> web.Response:
        if (request.method, request.path) != ("POST", "/v1/traces"):
            return web.Response(status=404)
        body = await request.read()
        try:
            if request.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if request.content_type != PROTOBUF:
                raise ValueError(f"content type {request.content_type}")
            receiver.add(body)
        except Exception as exc:  # noqa: BLE001 - recorded for the test to fail on
            receiver.refused.append(repr(exc))
            return web.Response(status=400, text=repr(exc))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF)

    with serving(traces) as receiver.url:
        yield receiver
