"""One validation rule: where it applies, its CEL expression, its message, its Python check (``rules.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    id: str
    target: str
    cel: str
    message: str
    check: Callable[[Any], bool]  # True when valid; gets the target model instance (ROOT: the name)
    field_path: str | None = None  # where the API server reports the error, relative to the target
    # A message naming what broke the rule: CEL messageExpression and the same words in Python.
    # ``message`` stays the fallback (the API server uses it if the expression cannot be evaluated).
    message_cel: str | None = None
    explain: Callable[[Any], str] | None = None

    def message_for(self, value: Any) -> str:
        return self.explain(value) if self.explain is not None else self.message
