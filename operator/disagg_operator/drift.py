"""Desired vs live objects (pure): what to apply, what to prune.

A live object "covers" a desired one when every field we set has our value; fields the API server
or other managers added are ignored, as server-side apply ignores them. Comparing before applying
keeps the operator from writing when nothing changed (a restart writes nothing), and a false
"drift" only costs one no-op apply, never a loop: a no-op apply changes no resourceVersion.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Key = tuple[str, str, str, str]  # apiVersion, kind, namespace, name


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"]


def covers(live: Any, desired: Any) -> bool:
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(k in live and covers(live[k], v) for k, v in desired.items())
    if isinstance(desired, Sequence) and not isinstance(desired, str):
        return (isinstance(live, Sequence) and not isinstance(live, str) and len(live) == len(desired)
                and all(covers(a, b) for a, b in zip(live, desired)))
    if isinstance(desired, bool) or isinstance(live, bool):
        return live is desired
    if isinstance(desired, (int, float)) and isinstance(live, str) or isinstance(live, (int, float)) and isinstance(desired, str):
        return str(live) == str(desired)  # quantities: we may send 8, the API server returns "8"
    return bool(live == desired)


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


def to_apply(desired: Iterable[Mapping[str, Any]], live: Mapping[Key, Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Desired objects that are missing or differ from their live version."""
    return [obj for obj in desired if key_of(obj) not in live or not covers(live[key_of(obj)], obj)]


def to_prune(desired: Iterable[Mapping[str, Any]], live: Mapping[Key, Mapping[str, Any]],
             owner_uid: str) -> list[Mapping[str, Any]]:
    """Live objects this owner controls that the plan no longer wants (e.g. a pool turned off)."""
    wanted = {key_of(obj) for obj in desired}
    return [obj for key, obj in live.items() if key not in wanted and owned_by(obj, owner_uid)]
