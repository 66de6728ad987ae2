"""What the sidecar writes into an OpenAI Responses answer, which the decode engine itself makes
(vLLM's Responses serving code: output items, events, sequence numbers; docs/protocol.md):

- ``usage.input_tokens_details.cached_tokens``: the prefill engine's cache hits where the KV
  connector reports them (``usage.cached_tokens``), as for chat: the decode engine counts every
  transferred token as cached, a coupled server only what its prefix cache held;
- the ``error`` event a stream ends with when the decode engine's stream breaks (OpenAI's
  ``ResponseErrorEvent``), numbered after the last event the client got.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The events that end a Responses stream (vLLM's, and OpenAI's).
END_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def with_cached_tokens(response: Mapping[str, Any], cached: int | None) -> dict[str, Any] | None:
    """``response`` (a ``ResponsesResponse``) with the prefill's cache hits as its cached tokens;
    None when there is nothing to change (no count, or no usage details to put it in)."""
    usage = response.get("usage")
    details = usage.get("input_tokens_details") if isinstance(usage, Mapping) else None
    if cached is None or not isinstance(details, Mapping) or details.get("cached_tokens") == cached:
        return None
    return {**response, "usage": {**usage, "input_tokens_details": {**details, "cached_tokens": cached}}}


def error_event(status: int, message: str, sequence_number: int) -> dict[str, Any]:
    return {"type": "error", "code": str(status), "message": message, "param": None,
            "sequence_number": sequence_number}
