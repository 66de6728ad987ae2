"""Two Prometheus text expositions as one: the sidecar's own, then the decode engine's.

An endpoint picker scrapes one port per endpoint (the pool's target port, the sidecar's), and its
scorers read vLLM's families there (docs/llm-d.md). A family may appear once in an exposition, and
both processes export ``process_*`` and ``python_*``: the sidecar's are kept (they describe the
process serving the port), the engine's families with a name the sidecar exports are dropped.
Parsing and writing are prometheus_client's own, so the result is what its parser accepts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    """A collector of already-parsed families (what ``generate_latest`` writes)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = tuple(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


# The name ``generate_latest`` writes in HELP/TYPE lines, by type (a counter ``foo``: ``foo_total``).
_WRITTEN_SUFFIX = {"counter": "_total", "info": "_info"}


def _names(family: Metric) -> set[str]:
    """A family's name, the one it is written under and its samples' (a histogram's ``_bucket``...)."""
    return {family.name, family.name + _WRITTEN_SUFFIX.get(family.type, ""), *(s.name for s in family.samples)}


def merge(own: str, engine: str) -> str:
    """``own``, then each family of ``engine`` that shares no name with ``own`` or with an engine
    family before it (a name twice would make the whole exposition invalid).

    Raises ValueError when ``engine`` is not a Prometheus text exposition (``own`` is trusted).
    """
    return own + engine_part(own, engine)


def engine_part(own: str, engine: str) -> str:
    """What ``merge`` appends to ``own`` (its names only decide what is kept: the part can follow a
    later exposition of the same registry)."""
    taken = set().union(*(_names(f) for f in text_string_to_metric_families(own)))
    families = []
    try:
        for family in text_string_to_metric_families(engine):
            if not (names := _names(family)) & taken:
                families.append(family)
                taken |= names
    except (ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"not a Prometheus text exposition: {exc}") from exc
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]  # a collector is anything with collect()
    return generate_latest(registry).decode()
