"""The generated CRD: equal to the checked-in file, structural, carrying every rule, defaulting like pydantic."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_operator import rules
from disagg_operator.crd import crd, crd_yaml
from disagg_operator.manifest import parse_spec
from disagg_operator.spec import DisaggregatedModelSpec

REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = REPO / "crds" / "disagg.dev_disaggregatedmodels.yaml"


def root_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from nodes(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from nodes(schema["additionalProperties"], f"{path}{{}}")


def test_checked_in_crd_is_the_generated_one() -> None:
    assert CHECKED_IN.read_text() == crd_yaml(), "crds/ is stale: run `make crds` (disagg crd > crds/...)"


def test_crd_yaml_round_trips() -> None:
    assert yaml.safe_load(crd_yaml()) == crd()


def test_schema_is_structural() -> None:
    for path, node in nodes(root_schema()):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs"):
            assert forbidden not in node, f"{path} has {forbidden}"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") is not False, path
        if node.get("type") == "object" and "properties" not in node and "additionalProperties" not in node:
            assert node.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata", f"{path} is an open object"
        if node.get("type") == "array":
            assert "items" in node, path


def test_unknown_fields_are_preserved_only_for_pass_through_kubernetes_objects() -> None:
    preserved = {p for p, n in nodes(root_schema()) if n.get("x-kubernetes-preserve-unknown-fields")}
    pool_objects = {f".spec.pools.{pool}.{f}" for pool in ("prefill", "decode", "render", "derender")
                    for f in ("resources", "affinity", "tolerations[]", "autoscaling.metrics[]")}
    env_sources = {".spec.model.env[].valueFrom"} | {f".spec.pools.{p}.env[].valueFrom"
                                                    for p in ("prefill", "decode", "render", "derender")}
    assert preserved == pool_objects | env_sources | {
        ".spec.model.defaultChatTemplateKwargs", ".spec.kvTransfer.extraConfig", ".spec.router.resources", ".status",
        ".spec.networkPolicy.extraEngineFrom[]"}


def test_every_rule_is_on_its_node_with_its_message() -> None:
    found: dict[str, list[dict[str, str]]] = {}
    for path, node in nodes(root_schema()):
        for validation in node.get("x-kubernetes-validations", []):
            found.setdefault(validation["message"], []).append({**validation, "path": path})
    for rule in rules.RULES:
        assert rule.message in found, rule.id
        for entry in found[rule.message]:
            assert entry["rule"] == rule.cel
            assert entry.get("fieldPath") == rule.field_path
            assert entry.get("messageExpression") == rule.message_cel
    # Pool rules apply to all four pools; every other rule to exactly one node.
    assert len(found[rules.rules_for("GPUPoolSpec")[0].message]) == 4


def test_crd_identity_subresource_and_columns() -> None:
    doc = crd()
    spec = doc["spec"]
    assert doc["metadata"]["name"] == "disaggregatedmodels.disagg.dev"
    assert spec["names"]["shortNames"] == ["dm"] and spec["scope"] == "Namespaced"
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Ready": '.status.conditions[?(@.type=="Ready")].status', "Pools": ".status.readyPools",
        "Mode": ".status.disaggregation", "Derender": ".status.derender.strategy", "Endpoint": ".status.endpoint",
        "Age": ".metadata.creationTimestamp",
    }


# --- the API server's defaulting, as documented: missing fields with a default are set, then
# defaulting recurses into them (so `default: {}` pulls in nested defaults); nulls are pruned.

def apiserver_defaults(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if v is not None}
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                value[name] = apiserver_defaults(value[name], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apiserver_defaults(v, schema["items"]) for v in value]
    return value


@pytest.mark.parametrize("spec", [
    {"model": {"source": "hf://Qwen/Qwen3-0.6B"}},
    {"model": {"source": "/m", "chatTemplate": {"configMapRef": {"name": "t"}}},
     "pools": {"derender": {}, "decode": {"autoscaling": {"maxReplicas": 3}}}},
])
def test_crd_defaults_equal_pydantic_defaults(spec: dict[str, Any]) -> None:
    defaulted = apiserver_defaults(spec, root_schema()["properties"]["spec"])
    assert parse_spec(defaulted) == parse_spec(spec)
    # The stored object already holds every default pydantic would add (except empty lists, which
    # have no schema default): CEL rules read the same values the Python checks read.
    full = without_empty_lists(DisaggregatedModelSpec.model_validate(spec).model_dump(by_alias=True, exclude_none=True))
    assert defaulted == full


def without_empty_lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_empty_lists(v) for k, v in value.items() if v != []}
    if isinstance(value, list):
        return [without_empty_lists(v) for v in value]
    return value
