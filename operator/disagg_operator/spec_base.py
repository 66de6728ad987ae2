"""The base of every ``DisaggregatedModel`` API object (``spec.py``) and the bounded types they share."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from disagg_operator import rules

# Bounds that keep CEL cost estimates finite (the API server rejects unbounded list/string rules).
MAX_ARGS = 64
MAX_ARG_LENGTH = 4096

# Kubernetes objects we pass through untouched (resources, affinity, tolerations, valueFrom, ...).
KubeObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
Arg = Annotated[str, StringConstraints(max_length=MAX_ARG_LENGTH)]
Args = Annotated[list[Arg], Field(max_length=MAX_ARGS)]
ShortString = Annotated[str, StringConstraints(max_length=256)]


class WireModel(BaseModel):
    """Base of every API object: camelCase on the wire, unknown fields rejected, rules enforced."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _apply_rules(self) -> WireModel:
        broken = rules.failures(type(self).__name__, self)
        if broken:
            messages = [r.message_for(self) for r in broken]
            raise PydanticCustomError(
                "disagg_rule", "{summary}",
                {"summary": "; ".join(messages), "rules": [r.id for r in broken], "messages": messages},
            )
        return self
