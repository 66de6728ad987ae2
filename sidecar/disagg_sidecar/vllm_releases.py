"""The vLLM releases Disagg supports and what each offers: the one table (pure, standard library only).

The operator (features, derender strategy, the CRD's text, the ``VersionSupported`` condition), the
sidecar (shapes and context per engine) and the engine extension (which of vLLM's own paths it
leaves alone, its capabilities answer) all read it; README's "Supported:" line is ``supported_line()``
(tests/sidecar/test_vllm_releases.py keeps it true). A release is a MAJOR.MINOR: every patch of it is alike.

A version outside the table is not refused (below the oldest one the plan's flags do not exist, so
the spec's rule refuses that): it gets ``UNTESTED``, the conservative row: nothing stock vLLM may or
may not do is assumed, no derender sessions; the sidecar then uses only what the engines report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

StreamStateKey = str  # the key of a stateless derender's decode window in DerenderStreamState


@dataclass(frozen=True)
class Release:
    """What one vLLM release offers Disagg (every field False/None: nothing assumed)."""

    name: str  # MAJOR.MINOR
    label: str  # why it is in the table, as README says it
    # Stock /inference/v1/generate answers output_mode="derender" with render's parse_context ...
    stock_batch_derender: bool = False  # ... batch (0.33+)
    stock_streaming_derender: bool = False  # ... and stream=true (0.34+: one ChatStreamProcessor per choice)
    render_parse_context: bool = False  # /render answers carry parse_context (0.33+)
    derender_finish_reason: bool = False  # batch /derender reports coupled's finish_reason (0.33+)
    # The engine extension on the render tier runs derender sessions (built from vLLM's chat serving and
    # output-processing internals; off where those were not checked).
    derender_sessions: bool = False
    # parse_context.return_tokens_as_token_ids is a field (0.34); an older generate server refuses it.
    parse_context_token_ids: bool = False
    # ChatMessage.annotations and UsageInfo.prompt_tokens_details are left out when None (0.34), not null.
    omits_none_shapes: bool = False
    # DerenderStreamState's decode window: "prev_tokens" (strings, 0.32/0.33), "prev_token_ids" (0.34).
    # Unknown keys are ignored, so a state read by the other kind silently loses its window.
    stream_state_key: StreamStateKey | None = None


RELEASES: tuple[Release, ...] = (
    Release("0.32", "kept: the test suite's main lane",
            derender_sessions=True, stream_state_key="prev_tokens"),
    Release("0.33", "previous",
            stock_batch_derender=True, render_parse_context=True, derender_finish_reason=True,
            derender_sessions=True, stream_state_key="prev_tokens"),
    # Read from 0.34.0's sources; its test lane runs 0.34's frontend over 0.32's CPU kernels (docs/development.md).
    Release("0.34", "current, the operator's default",
            stock_batch_derender=True, stock_streaming_derender=True, render_parse_context=True,
            derender_finish_reason=True, parse_context_token_ids=True, omits_none_shapes=True,
            stream_state_key="prev_token_ids"),
)
BY_NAME = {r.name: r for r in RELEASES}
OLDEST = RELEASES[0]
NEWEST = RELEASES[-1]
# A version outside the table: what the sidecar may count on without asking the engines.
UNTESTED = Release("untested", "not in the table: nothing assumed, the engines' own reports decide")

_VERSION = re.compile(r"^v?(\d+)[.](\d+)(?:[.]|$)")


def release_name(version: str | None) -> str | None:
    """MAJOR.MINOR of ``0.33.0``, ``0.33.1rc1``, ``0.32.0+cpu``, ``v0.34.0``; None if not a version."""
    match = _VERSION.match(version or "")
    return f"{int(match[1])}.{int(match[2])}" if match else None


def minor_tuple(version: str | None) -> tuple[int, int] | None:
    name = release_name(version)
    return None if name is None else tuple(int(p) for p in name.split("."))  # type: ignore[return-value]


def known(version: str | None) -> Release | None:
    """The table's row for ``version``; None outside the table."""
    return BY_NAME.get(release_name(version) or "")


def release(version: str | None) -> Release:
    """The table's row, or ``UNTESTED`` (unknown or unparsable versions assume nothing)."""
    return known(version) or UNTESTED


def supported(version: str | None) -> bool:
    return known(version) is not None


def features(version: str | None) -> dict[str, bool]:
    """The boolean offers of ``version`` by name (what the sidecar's ``engine.features`` carries)."""
    row = release(version)
    return {f.name: getattr(row, f.name) for f in fields(Release) if f.type in ("bool", bool)}


def names() -> str:
    """``0.32, 0.33 and 0.34``."""
    items = [r.name for r in RELEASES]
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else items[0]


def with_feature(feature: str) -> str:
    """The releases that offer ``feature``, e.g. ``vLLM 0.32, 0.33``, for descriptions."""
    return "vLLM " + ", ".join(r.name for r in RELEASES if getattr(r, feature))


def supported_line() -> str:
    """README's words (tests/sidecar/test_vllm_releases.py keeps the README's copy equal)."""
    parts = [f"{r.name} ({r.label})" for r in reversed(RELEASES)]
    return f"Supported: vLLM {', '.join(parts[:-1])} and {parts[-1]}"


def untested_message(version: str) -> str:
    return (f"vLLM {version} is not one Disagg was tested with (supported: {names()}): it is deployed without "
            "derender sessions and without assuming what stock vLLM does; the sidecar uses only what the "
            "engines report")


# --- the stateless derender's stream_state across releases --------------------------------------
# A chained stream carries DerenderStreamState between derender calls; behind a Service, successive
# calls may reach render pods of different releases during a rolling upgrade. The window cannot be
# translated (0.33 keeps token strings, 0.34 token ids; only a tokenizer maps one to the other), so a
# state must be read by a release that keeps its window under the same key.
WINDOW_KEYS: tuple[StreamStateKey, ...] = tuple(sorted({r.stream_state_key for r in RELEASES if r.stream_state_key}))


def _states(state: object) -> list[dict]:
    if isinstance(state, dict):
        return [state]
    if isinstance(state, list):
        return [s for s in state if isinstance(s, dict)]
    return []


def window_lost(sent: object, answered: object) -> bool:
    """Whether the derender call that got ``sent`` (a stream_state, or a list of them) answered from a
    release that keeps the window under another key: it ignored ours and decoded without it."""
    ours = {k for s in _states(sent) for k in WINDOW_KEYS if s.get(k)}
    theirs = {k for s in _states(answered) for k in WINDOW_KEYS if k in s}
    return bool(ours) and bool(theirs) and not ours & theirs


def strip_parse_context(parse_context: dict, row: Release) -> dict | None:
    """Render's ``parse_context`` as ``row``'s generate server accepts it, or None when it cannot
    honour it: ``return_tokens_as_token_ids`` (0.34) is unknown to older servers, which refuse it;
    unset, it is dropped; set, the inline derender would answer other logprob tokens, so None."""
    if row.parse_context_token_ids or "return_tokens_as_token_ids" not in parse_context:
        return parse_context
    if parse_context["return_tokens_as_token_ids"] is not None:
        return None
    return {k: v for k, v in parse_context.items() if k != "return_tokens_as_token_ids"}
