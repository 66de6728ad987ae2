"""Parsing a DisaggregatedModel (a ``spec`` mapping or a whole object) with one line per problem.

Rule violations are reported with the rule's own message and field, as the API server reports
the CRD's CEL rules, so ``kubectl apply``, ``disagg manifests`` and local mode say the same words.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from disagg_operator import rules
from disagg_operator.spec import API_VERSION, KIND, DisaggregatedModelSpec, SpecError

_RULES_BY_ID = {r.id: r for r in rules.RULES}
_FRIENDLY = {"extra_forbidden": "unknown field", "missing": "required field is missing"}


def _problems(error: ValidationError, prefix: str) -> list[str]:
    out = []
    for item in error.errors():
        where = ".".join([prefix, *(str(p) for p in item["loc"])])
        if item["type"] == "disagg_rule":
            for rule_id, message in zip(item["ctx"]["rules"], item["ctx"]["messages"]):
                out.append(f"{where}{_RULES_BY_ID[rule_id].field_path or ''}: {message}")
        else:
            out.append(f"{where}: {_FRIENDLY.get(item['type'], item['msg'])}")
    return out


def parse_spec(data: Mapping[str, Any]) -> DisaggregatedModelSpec:
    """Validate a ``spec`` mapping (camelCase) or raise SpecError with one line per problem."""
    try:
        return DisaggregatedModelSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_problems(exc, "spec")) from None


@dataclass(frozen=True)
class Manifest:
    name: str
    namespace: str
    spec: DisaggregatedModelSpec


def parse_manifest(doc: Mapping[str, Any], default_namespace: str = "default") -> Manifest:
    """Validate a whole DisaggregatedModel object (as read from YAML or the API)."""
    problems = []
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        problems.append(f"apiVersion/kind must be {API_VERSION}/{KIND}, got {doc.get('apiVersion')}/{doc.get('kind')}")
    meta = doc.get("metadata") or {}
    name = meta.get("name") or ""
    for rule in rules.rules_for(rules.ROOT):
        if not rule.check(name):
            problems.append(f"metadata.name: {rule.message}")
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        problems.append("spec: required field is missing")
    else:
        try:
            parsed = parse_spec(spec)
        except SpecError as exc:
            problems += exc.problems
    if problems:
        raise SpecError(problems, f"{KIND} {name or '<unnamed>'}")
    return Manifest(name=name, namespace=meta.get("namespace") or default_namespace, spec=parsed)
