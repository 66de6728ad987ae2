"""The request context every leg carries: the request's id, the headers its legs get, where its
prefill goes, and which engines it is on (for aborts); and what its prefill legs did, for the
response's header and the access log."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

from disagg_sidecar.budget import Reservation
from disagg_sidecar.plan import legs
from disagg_sidecar import wire
from disagg_sidecar.upstream.client import InFlight


@dataclass
class Context:
    """Per request: the id every leg carries, the headers they get, where the prefill goes."""

    request_id: str  # the client's (or a new) id: logs, response ids and headers, render/derender legs
    headers: dict[str, str]
    prefill_target: str | None = None
    engine_id: str | None = None  # X-Request-Id of the engine legs, unique per request; None: request_id
    inflight: InFlight = field(init=False)
    prefill_outcomes: set[str] = field(default_factory=set)  # the prefill metric's labels, as counted
    prefilled_at: list[str] = field(default_factory=list)  # the endpoints (URLs) of the prefill legs that succeeded
    reservation: Reservation | None = None  # its memory budget: upstream answers are charged to it

    def __post_init__(self) -> None:
        engine_id = self.engine_id or self.request_id
        self.inflight = InFlight(legs.engine_request_id(engine_id), {**self.headers, wire.REQUEST_ID: engine_id})

    @property
    def prefill_header(self) -> str | None:
        for outcome in ("fallback", "skipped", "remote", "local"):
            if outcome in self.prefill_outcomes:
                return outcome
        return None

    def access_fields(self) -> dict[str, object]:
        """Where the prompt was prefilled, for the access log: ``prefill`` as the header says it (or
        ``failed``), and ``prefill_endpoints``, the endpoints the successful prefill legs used."""
        outcome = self.prefill_header or ("failed" if "failed" in self.prefill_outcomes else None)
        fields: dict[str, object] = {"prefill": outcome} if outcome else {}
        if self.prefilled_at:
            fields["prefill_endpoints"] = list(self.prefilled_at)
        return fields

    def response_headers(self) -> dict[str, str]:
        headers = {wire.REQUEST_ID: self.request_id}
        if self.prefill_header:
            headers[wire.PREFILL_OUTCOME] = self.prefill_header
        return headers


# The request being served (set where its Context is made, reset by the access log's middleware,
# which reads it: a context variable as ``logs.request_id_var``, seen by every await of the request).
request_context: ContextVar[Context | None] = ContextVar("disagg_request_context", default=None)
