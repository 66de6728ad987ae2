"""The request context every leg carries: the request's id, the headers its legs get, where its
prefill goes, and which engines it is on (for aborts)."""

from __future__ import annotations

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
    prefill_outcomes: set[str] = field(default_factory=set)
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

    def response_headers(self) -> dict[str, str]:
        headers = {wire.REQUEST_ID: self.request_id}
        if self.prefill_header:
            headers[wire.PREFILL_OUTCOME] = self.prefill_header
        return headers
