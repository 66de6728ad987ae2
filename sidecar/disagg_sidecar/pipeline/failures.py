"""How a failed leg looks to the client: the status, the message and nothing of the upstream's
own body (tracebacks, addresses), which stays in the log."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from disagg_sidecar.errors import SidecarError
from disagg_sidecar.upstream.reading import Leg, LegError

log = logging.getLogger(__name__)


# Kinds of failure where the tier answered, but with something the sidecar does not use: a bad
# gateway (502), not an unavailable tier (503, Retry-After).
BAD_ANSWERS = {"redirect": "a redirect, which the sidecar does not follow", "invalid": "an invalid answer",
               "oversize": "an answer over its size limit", "credentials": "a refusal of the sidecar's engine key"}


def leg_failure(exc: LegError) -> SidecarError:
    """A leg that failed after its retries, as the client sees it (the details only in the log)."""
    err = _leg_failure(exc)
    err.leg, err.unavailable = exc.leg, exc.kind not in (*BAD_ANSWERS, "budget")
    return err


def _leg_failure(exc: LegError) -> SidecarError:
    log.warning("%s", exc)
    if exc.kind == "budget":  # no endpoint's fault: the sidecar holds too much for others now
        who = "decode engine" if exc.leg == "decode" else f"{exc.leg} tier"
        return SidecarError(503, f"The sidecar's memory budget cannot hold the {who}'s answer now "
                                 "(limits.memory_budget_bytes)", type_="ServiceUnavailableError",
                            headers={"Retry-After": "1"})
    if exc.kind in BAD_ANSWERS:
        who = "decode engine" if exc.leg == "decode" else f"{exc.leg} tier"
        why = f" (status {exc.status})" if exc.kind == "redirect" and exc.status else \
            f" ({exc.detail})" if exc.kind == "invalid" and exc.detail else ""
        return SidecarError(502, f"The {who} answered with {BAD_ANSWERS[exc.kind]}{why}", type_="BadGatewayError")
    if exc.leg == "decode":
        if exc.kind == "connect":
            return SidecarError(503, "The decode engine is not reachable; is it running?",
                                type_="ServiceUnavailableError", headers={"Retry-After": "1"})
        # Its body stays in the log (LegError's text): tracebacks and addresses are not the client's.
        detail = f"status {exc.status}" if exc.status else exc.kind
        return SidecarError(502, f"The decode engine failed: {detail}", type_="BadGatewayError")
    return SidecarError(503, f"The {exc.leg} tier is unavailable ({exc.kind})", type_="ServiceUnavailableError",
                        headers={"Retry-After": "1"})


def invalid_answer(leg: Leg, exc: ValueError, url: str | None = None) -> SidecarError:
    """An answer that failed its shape check (``answers``): a 502 that says what was wrong with it
    (in a stream: an error event without ``[DONE]``, the answer is not whole)."""
    err = leg_failure(LegError(leg, "invalid", url, detail=str(exc)[:200]))
    err.done = False
    return err


def streamed_error(error: Mapping[str, Any]) -> SidecarError:
    """An error event in the decode stream: a 4xx as the engine said it; anything else a 502
    whose detail stays in the log."""
    code = error.get("code")
    if isinstance(code, int) and 400 <= code < 500:
        return SidecarError(code, str(error.get("message")))
    log.warning("decode stream error event: %.500s", error)
    return SidecarError(502, "The decode engine failed during the stream", type_="BadGatewayError")
