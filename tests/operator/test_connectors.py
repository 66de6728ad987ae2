"""A KV connector is one module plus its registration: a test-only one flows into the spec's
rules, the plan, the Kubernetes objects, the sidecar's configuration and local mode."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_cli.local.runner import load_spec, plan_processes
from disagg_operator import names
from disagg_operator.kv import KV_SHARED_PATH
from disagg_operator.manifest import parse_spec
from disagg_operator.objects import build_objects
from disagg_operator.plan import Role
from disagg_operator.spec import SpecError
from disagg_sidecar import connectors
from disagg_sidecar.config import SidecarConfig, dump_config
from disagg_sidecar.connectors import SideChannel
from tests.operator.builders import env, flags, full_spec, plan_of
from tests.operator.cases import merged

LOCAL_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-tiny.yaml"


class TestOnlyConnector:
    """Both kinds of profile at once: a side channel between engines and a shared directory."""

    name = "TestOnlyConnector"
    summary: str | None = "test only"
    kv_roles: Mapping[str, str] = {"prefill": "kv_producer", "decode": "kv_both"}
    runs_locally = True
    engine_module: str | None = "tests.operator.fake_kv"
    shared_path_key: str | None = "spool_dir"
    side_channel: SideChannel | None = SideChannel("TEST_KV_HOST", "TEST_KV_PORT", "testkv")

    def prefill_params(self) -> dict[str, Any]:
        return {"test": "prefill"}

    def decode_params(self, prefill_response_params: Any, prefilled: object) -> dict[str, Any] | None:
        return prefill_response_params

    def min_prompt_tokens(self, block_size: int) -> int:
        return 3 * block_size


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connectors.REGISTRY, TestOnlyConnector.name, TestOnlyConnector)


def _spec(**kv: Any) -> dict[str, Any]:
    return merged(full_spec(), {"engine": {"extension": True}, "kvTransfer": {
        "connector": TestOnlyConnector.name, "sideChannelPort": 5700, **kv},
        "pools": {"prefill": {"parallelism": {"data": 2}}}})


def _kv_config(argv: list[str]) -> dict[str, Any]:
    return json.loads(str(flags(argv)["--kv-transfer-config"]))


def test_an_unregistered_connector_is_refused_by_the_spec() -> None:
    with pytest.raises(SpecError, match="kvTransfer.connector must be one of NixlConnector, ExampleConnector, None"):
        parse_spec(_spec())


def test_the_plan_reads_roles_engine_class_shared_directory_side_channel_and_guard(registered: None) -> None:
    plan = plan_of(_spec())
    assert plan.kv_connector == TestOnlyConnector.name
    for role in (Role.PREFILL, Role.DECODE):
        pool = plan.pool(role)
        assert _kv_config(list(pool.vllm_args)) == {
            "kv_connector": "TestOnlyConnector", "kv_role": TestOnlyConnector.kv_roles[role],
            "kv_connector_module_path": "tests.operator.fake_kv",
            "kv_connector_extra_config": {"spool_dir": KV_SHARED_PATH, "backends": ["UCX"]}}
        assert env(pool)["TEST_KV_PORT"] == "5700" and env(pool)["TEST_KV_HOST"] == {
            "fieldRef": {"fieldPath": "status.podIP"}}
        assert pool.kv_shared_path == KV_SHARED_PATH
    assert plan.pool(Role.PREFILL).side_channel_ports == (5700, 5701)
    # The sidecar accepts kv_transfer_params naming exactly those ports (connectors.PrefilledAt).
    assert plan.sidecar.config.prefill.side_channel_ports == (5700, 5701)
    assert "TEST_KV_HOST" not in env(plan.pool(Role.RENDER)) and plan.pool(Role.RENDER).kv_shared_path is None
    # full_spec's engines request GPUs: block size 16.
    assert plan.min_prompt_tokens == 48


def test_the_objects_name_its_ports_mount_its_directory_and_open_engines_to_each_other(registered: None) -> None:
    objs = {(o["kind"], o["metadata"]["name"]): o for o in build_objects(plan_of(_spec(sharedStorageClaim="kv")))}
    prefill = objs[("Deployment", "qwen3-8b-prefill")]["spec"]["template"]["spec"]
    vllm = next(c for c in prefill["containers"] if c["name"] == names.VLLM_CONTAINER)
    assert [(p["name"], p["containerPort"]) for p in vllm["ports"]][1:] == [("testkv", 5700), ("testkv-1", 5701)]
    assert {"name": "kv-shared", "mountPath": KV_SHARED_PATH} in vllm["volumeMounts"]
    assert {"name": "kv-shared", "persistentVolumeClaim": {"claimName": "kv"}} in prefill["volumes"]
    service_ports = {p["name"] for p in objs[("Service", "qwen3-8b-prefill")]["spec"]["ports"]}
    assert service_ports == {names.ENGINE_PORT, "testkv", "testkv-1"}
    decode_policy = objs[("NetworkPolicy", "qwen3-8b-decode")]["spec"]["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": names.selector("qwen3-8b", Role.PREFILL)}}]} in decode_policy


def test_the_sidecar_config_names_it_and_its_guard(registered: None) -> None:
    plan = plan_of(_spec())
    written = dump_config(plan.sidecar.config)
    assert written["kv_connector"] == TestOnlyConnector.name and written["prefill"]["min_prompt_tokens"] == 48
    assert SidecarConfig.model_validate(written) == plan.sidecar.config


def test_local_mode_runs_it_on_the_state_directory(registered: None, tmp_path: Path) -> None:
    doc = yaml.safe_load(LOCAL_EXAMPLE.read_text())
    doc["spec"]["kvTransfer"] = {"connector": TestOnlyConnector.name}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    procs = {p.name: p for p in plan_processes(load_spec(path), tmp_path, port=None)}
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        config = _kv_config(procs[name].argv)
        assert config["kv_connector_extra_config"] == {"spool_dir": str(tmp_path / "kv")}
        assert config["kv_role"] == TestOnlyConnector.kv_roles[role]
        assert config["kv_connector_module_path"] == "tests.operator.fake_kv"  # local engines have the package
        assert procs[name].env["TEST_KV_HOST"] == "127.0.0.1"
    sidecar = procs["sidecar-0"].config
    assert sidecar is not None and sidecar.kv_connector == TestOnlyConnector.name
    assert sidecar.prefill.min_prompt_tokens == 3 * 128  # CPU engines: block size 128
