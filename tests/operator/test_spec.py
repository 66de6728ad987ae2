"""The DisaggregatedModel API: defaults, wire names, and every validation rule's message."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from disagg_operator import rules
from disagg_operator.manifest import parse_manifest, parse_spec
from disagg_operator.spec import DisaggregatedModelSpec, SpecError
from tests.operator.cases import EDGES, INVALID, Invalid, base, merged

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_each_rule_rejects_with_its_message_at_its_field(case: Invalid) -> None:
    with pytest.raises(SpecError) as err:
        parse_manifest(case.document())
    assert err.value.problems == [f"{case.where}: {case.message}"]


def test_every_rule_has_an_invalid_case() -> None:
    assert {c.rule for c in INVALID} == {r.id for r in rules.RULES}
    assert len(rules.RULES) >= 10


def test_rule_ids_and_messages_are_unique_per_target() -> None:
    ids = [r.id for r in rules.RULES]
    assert len(ids) == len(set(ids))
    for target in {r.target for r in rules.RULES}:
        messages = [r.message for r in rules.rules_for(target)]
        assert len(messages) == len(set(messages)), target


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    if path.name.startswith("local-"):  # local-mode files may name weights under ~ (expanded locally)
        from disagg_cli.local.runner import load_spec

        load_spec(path)
        return
    docs = list(yaml.safe_load_all(path.read_text()))
    models = [d for d in docs if d.get("kind") == "DisaggregatedModel"]  # cluster-tiny.yaml has its claims too
    assert models
    for doc in models:
        parse_manifest(doc)


def test_defaults_of_a_minimal_spec() -> None:
    spec = parse_manifest(base()).spec
    assert (spec.pools.prefill.replicas, spec.pools.decode.replicas, spec.pools.render.replicas) == (1, 1, 1)
    assert spec.pools.derender is None  # shared with render
    assert spec.kv_transfer.connector == "NixlConnector"
    assert spec.router.prefill_failure_policy == "fallback"
    assert spec.router.trust_prefiller_header is False
    assert spec.engine.extension is False


def test_the_sidecar_and_the_crd_default_to_ignoring_the_prefiller_header() -> None:
    """A sidecar config without the key (hand-written, or an older operator's) must not trust clients more
    than the CRD's default does."""
    from disagg_sidecar.config import Prefill

    crd_default = parse_manifest(base()).spec.router.trust_prefiller_header
    assert Prefill(mode="local").trust_prefiller_header is crd_default is False


def test_camel_case_on_the_wire_snake_case_in_python() -> None:
    wire = {"model": {"source": "/models/q", "maxModelLen": 4096, "toolCallParser": "hermes",
                      "enableAutoToolChoice": True}, "kvTransfer": {"sideChannelPort": 5700}}
    spec = parse_spec(wire)
    assert spec.model.max_model_len == 4096 and spec.kv_transfer.side_channel_port == 5700
    assert DisaggregatedModelSpec.model_validate({"model": {"source": "/m", "max_model_len": 7}}).model.max_model_len == 7
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["model"]["maxModelLen"] == 4096 and dumped["kvTransfer"]["sideChannelPort"] == 5700
    assert parse_spec(dumped) == spec


@pytest.mark.parametrize(("spec", "problem"), [
    ({"model": {"source": "/m"}, "pools": {"prefil": {}}}, "spec.pools.prefil: unknown field"),
    ({"model": {}}, "spec.model.source: required field is missing"),
    ({"model": {"source": "/m"}, "pools": {"decode": {"replicas": "two"}}}, "spec.pools.decode.replicas: "
     "Input should be a valid integer, unable to parse string as an integer"),
    ({"model": {"source": "/m"}, "router": {"prefillFailurePolicy": "retry"}},
     "spec.router.prefillFailurePolicy: Input should be 'fallback' or 'fail'"),
    ({"model": {"source": "/m"}, "router": {"renderFailurePolicy": "decode"}},
     "spec.router.renderFailurePolicy: Input should be 'fail' or 'decodeRenders'"),
])
def test_schema_errors_are_located_and_readable(spec: dict, problem: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert err.value.problems == [problem]


def test_all_problems_are_reported_at_once() -> None:
    doc = base("Bad_Name")
    doc["spec"]["kvTransfer"] = {"connector": "Mooncake"}
    doc["spec"]["pools"] = {"decode": {"replicas": 0}}
    with pytest.raises(SpecError) as err:
        parse_manifest(doc)
    assert [p.split(":")[0] for p in err.value.problems] == [
        "metadata.name", "spec.kvTransfer.connector", "spec.pools.decode.replicas"]
    assert "invalid DisaggregatedModel Bad_Name:" in str(err.value)


def test_manifest_kind_and_namespace() -> None:
    doc = base()
    assert parse_manifest(doc, "team-a").namespace == "team-a"
    doc["metadata"]["namespace"] = "team-b"
    assert parse_manifest(doc).namespace == "team-b"
    with pytest.raises(SpecError, match="apiVersion/kind must be disagg.dev/v1alpha1/DisaggregatedModel"):
        parse_manifest({**doc, "kind": "Deployment"})


@pytest.mark.parametrize(("name", "patch", "valid"), EDGES, ids=[e[0] for e in EDGES])
def test_borderline_values(name: str, patch: dict, valid: bool) -> None:
    doc = base()
    doc["spec"] = merged(doc["spec"], patch)
    if valid:
        parse_manifest(doc)
    else:
        with pytest.raises(SpecError):
            parse_manifest(doc)


def test_the_default_vllm_version_is_the_release_the_table_calls_the_default() -> None:
    from disagg_operator.spec import DEFAULT_VLLM_VERSION
    from disagg_sidecar import vllm_releases

    defaults = [r.name for r in vllm_releases.RELEASES if "default" in r.label]
    assert defaults == [vllm_releases.release_name(DEFAULT_VLLM_VERSION)]
