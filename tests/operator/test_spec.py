"""The DisaggregatedModel API: defaults, wire names, and every validation rule's message."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from disagg_operator import rules
from disagg_operator.spec import DisaggregatedModelSpec, SpecError, parse_manifest, parse_spec
from tests.operator.cases import INVALID, Invalid, base

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.rule)
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
    for doc in yaml.safe_load_all(path.read_text()):
        parse_manifest(doc)


def test_defaults_of_a_minimal_spec() -> None:
    spec = parse_manifest(base()).spec
    assert (spec.pools.prefill.replicas, spec.pools.decode.replicas, spec.pools.render.replicas) == (1, 1, 1)
    assert spec.pools.derender is None  # shared with render
    assert spec.kv_transfer.connector == "NixlConnector"
    assert spec.router.prefill_failure_policy == "fallback"
    assert spec.router.trust_prefiller_header is False
    assert spec.engine.extension is False


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


@pytest.mark.parametrize("source", ["hf://Qwen/Qwen3-8B", "hf://gpt2", "pvc://models/qwen3/8b", "pvc://models",
                                    "/srv/models/qwen3", "~/.cache/disagg/models/tiny-qwen3"])
def test_accepted_model_sources(source: str) -> None:
    assert parse_spec({"model": {"source": source}}).model.source == source


@pytest.mark.parametrize("source", ["Qwen/Qwen3-8B", "hf://", "hf://a/b/c", "pvc://Models", "relative/path", "/has space", "~user/x"])
def test_rejected_model_sources(source: str) -> None:
    with pytest.raises(SpecError, match="model.source must be"):
        parse_spec({"model": {"source": source}})


@pytest.mark.parametrize(("version", "ok"), [("0.32.0", True), ("0.33.0", True), ("0.33.0rc1", True),
                                             ("0.32.0+cpu", True), ("1.0.0", True), ("0.31.9", False),
                                             ("0.4.0", False), ("latest", False), ("0.33", False)])
def test_vllm_version_floor(version: str, ok: bool) -> None:
    spec = {"model": {"source": "/m"}, "engine": {"vllmVersion": version}}
    if ok:
        parse_spec(spec)
    else:
        with pytest.raises(SpecError, match="engine.vllmVersion must be"):
            parse_spec(spec)


@pytest.mark.parametrize(("args", "ok"), [
    (["--max-num-seqs", "64"], True),
    (["--gpu-memory-utilization=0.85"], True),
    (["--tokenizer-mode", "slow"], False),  # must match across tiers: model.engineArgs only
    (["--kv-transfer-config.kv_role", "kv_producer"], False),  # dotted form of an owned flag
    (["--tensor_parallel_size", "2"], False),  # underscore form
    (["-tp", "2"], False),
])
def test_pool_extra_args_cannot_touch_owned_or_shared_flags(args: list[str], ok: bool) -> None:
    spec = {"model": {"source": "/m"}, "pools": {"decode": {"extraArgs": args}}}
    if ok:
        parse_spec(spec)
    else:
        with pytest.raises(SpecError, match="extraArgs must not set flags"):
            parse_spec(spec)


def test_shared_flags_are_allowed_in_model_engine_args() -> None:
    parse_spec({"model": {"source": "/m", "engineArgs": ["--trust-remote-code", "--tokenizer-mode", "auto"]}})


def test_prefill_off_needs_no_connector() -> None:
    spec = parse_spec({"model": {"source": "/m"}, "kvTransfer": {"connector": "None"}, "pools": {"prefill": {"replicas": 0}}})
    assert spec.kv_transfer.connector == "None"
