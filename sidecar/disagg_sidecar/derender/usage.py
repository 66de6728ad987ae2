"""``usage`` as the coupled endpoint reports it, from what the legs know.

``prompt_tokens`` is the rendered prompt's length (the decode engine only sees the prompt, the
derender tier only what it is told). ``cached_tokens`` comes from the prefill leg: with a KV
connector that reports ``remote_prefill_cached_tokens`` (NIXL), that is what the prefill engine
found in its cache, which is what a coupled server would report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from disagg_sidecar import wire


def cached_tokens(prefill_kv_params: Mapping[str, Any] | None) -> int | None:
    value = (prefill_kv_params or {}).get(wire.REMOTE_PREFILL_CACHED_TOKENS)
    return value if isinstance(value, int) else None


def fix_usage(usage: Mapping[str, Any] | None, *, prompt_tokens: int,
              cached: int | None = None) -> dict[str, Any] | None:
    """``usage`` with ``prompt_tokens`` (and ``total_tokens``) from render and the prefill's cache hits.

    ``prompt_tokens_details`` is only filled where the engine reports it (vLLM's
    ``--enable-prompt-tokens-details``), as the coupled server does.
    """
    if usage is None:
        return None
    out = dict(usage)
    completion = int(out.get("completion_tokens") or 0)
    out["prompt_tokens"] = prompt_tokens
    out["total_tokens"] = prompt_tokens + completion
    details = out.get("prompt_tokens_details")
    if cached is not None and isinstance(details, Mapping):
        out["prompt_tokens_details"] = {**details, "cached_tokens": cached}
    return out


def add_usage(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Sum of two usages (completions with several prompts: one decode leg per prompt)."""
    if a is None or b is None:
        return dict(a or b) if (a or b) else None
    out = dict(a)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        out[key] = int(a.get(key) or 0) + int(b.get(key) or 0)
    da, db = a.get("prompt_tokens_details"), b.get("prompt_tokens_details")
    if isinstance(da, Mapping) and isinstance(db, Mapping):
        out["prompt_tokens_details"] = {**da, "cached_tokens": int(da.get("cached_tokens") or 0)
                                        + int(db.get("cached_tokens") or 0)}
    return out


def total_usage(usages: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The sum of the usages of a request's prompts (None where none reported one)."""
    total = None
    for usage in usages:
        total = add_usage(total, usage)
    return total
