"""No request can kill an engine: the KV connector profiles, the plan's roles and prompt guard,
and the sidecar's readiness for a dead decode engine (pure parts, no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg_cli.local.runner import load_spec, plan_processes
from disagg_operator import engine_args
from disagg_operator.plan import Role, build_plan
from disagg_sidecar.config import SidecarConfig, dump_config
from disagg_sidecar.connectors import REGISTRY, get_connector
from disagg_sidecar.plan.decisions import prefill_route
from disagg_sidecar.state import DecodeAnswers, SidecarState
from tests.operator.builders import full_spec, merged, plan_of

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-tiny.yaml"


def _align(n: int, block: int) -> int:
    """vLLM's example_connector.align_to_block_size, spelled out for the arithmetic below."""
    return (n - 1) // block * block


@pytest.mark.parametrize("block", [16, 128])
def test_example_connector_minimum_is_the_shortest_prompt_decode_finds_again(block):
    """Prefill writes the folder of align(len) tokens, decode looks up align(len - 1): the
    minimum is the shortest prompt whose lookup is a non-empty prefix that prefill wrote."""
    minimum = get_connector("ExampleConnector").min_prompt_tokens(block)
    shortest = next(n for n in range(1, 4 * block) if _align(n - 1, block) > 0 and _align(n - 1, block) == _align(n, block))
    assert minimum == shortest == block + 2
    for n in range(1, minimum):  # every shorter prompt looks up the empty (or a negative) prefix
        assert _align(n - 1, block) <= 0
    assert get_connector("NixlConnector").min_prompt_tokens(block) == 0


def test_connector_roles_and_local_support():
    assert get_connector("ExampleConnector").kv_roles == {"prefill": "kv_producer", "decode": "kv_consumer"}
    assert get_connector("NixlConnector").kv_roles == {"prefill": "kv_both", "decode": "kv_both"}
    assert [name for name, c in REGISTRY.items() if c.runs_locally] == ["ExampleConnector"]


@pytest.mark.parametrize("args, gpu, expected", [
    ([], True, 16), ([], False, 128), (["--block-size", "32"], True, 32), (["--block-size=64"], False, 64),
    (["--block_size", "48", "--block-size", "256"], True, 256), (["--block-size"], False, 128),
])
def test_block_size_from_flags_or_the_platform_default(args, gpu, expected):
    assert engine_args.block_size(args, gpu) == expected


def test_gpu_resources():
    assert engine_args.requests_gpu({"limits": {"nvidia.com/gpu": 1}})
    assert engine_args.requests_gpu({"requests": {"amd.com/gpu": "1"}})
    assert not engine_args.requests_gpu({"limits": {"cpu": "4"}}) and not engine_args.requests_gpu(None)


def _kv(plan, role: Role) -> dict:
    args = list(plan.pool(role).vllm_args)
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def _example_spec(**pools) -> dict:
    return merged(full_spec(), {"kvTransfer": {"connector": "ExampleConnector", "extraConfig": {}},
                                "engine": {"extension": True}, "pools": pools})


def test_example_plan_roles_engine_class_and_guard():
    gpu = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
    plan = plan_of(_example_spec(prefill=gpu, decode=gpu))
    assert _kv(plan, Role.PREFILL)["kv_role"] == "kv_producer" and _kv(plan, Role.DECODE)["kv_role"] == "kv_consumer"
    assert _kv(plan, Role.DECODE)["kv_connector_module_path"] == "disagg_engine.kv_example"
    assert plan.sidecar.config.prefill.min_prompt_tokens == 16 + 2
    # --block-size on either engine pool decides (the larger one); CPU engines default to 128.
    bigger = plan_of(_example_spec(prefill={**gpu, "extraArgs": ["--block-size", "64"]}, decode=gpu))
    assert bigger.sidecar.config.prefill.min_prompt_tokens == 66
    cpu = _example_spec()
    cpu["pools"]["decode"].pop("resources")  # no GPU requested: a CPU engine, whatever prefill runs on
    assert plan_of(cpu).sidecar.config.prefill.min_prompt_tokens == 130
    # Without the extension the image may lack the disagg package: vLLM's own class.
    stock = plan_of(merged(_example_spec(), {"engine": {"extension": False}}))
    assert "kv_connector_module_path" not in _kv(stock, Role.DECODE)


def test_nixl_plan_keeps_kv_both_and_no_guard():
    plan = plan_of(full_spec())
    assert _kv(plan, Role.PREFILL)["kv_role"] == _kv(plan, Role.DECODE)["kv_role"] == "kv_both"
    assert "kv_connector_module_path" not in _kv(plan, Role.DECODE)
    assert "min_prompt_tokens" not in dump_config(plan.sidecar.config)["prefill"]


def test_local_mode_runs_the_operators_roles_and_guard(tmp_path):
    procs = {p.name: p for p in plan_processes(load_spec(EXAMPLE), tmp_path, port=None)}
    for name, role in (("prefill-0", "kv_producer"), ("decode-0", "kv_consumer")):
        argv = procs[name].argv
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert config["kv_role"] == role and config["kv_connector_module_path"] == "disagg_engine.kv_example"
        assert config["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "kv")
    sidecar = SidecarConfig.model_validate(procs["sidecar-0"].config)
    assert sidecar.prefill.min_prompt_tokens == 130  # CPU engines: block size 128
    assert prefill_route(True, 129, sidecar.prefill.min_prompt_tokens) == "skipped"
    assert prefill_route(True, 130, sidecar.prefill.min_prompt_tokens) == "remote"


def test_local_mode_refuses_connectors_that_need_gpus(tmp_path):
    doc = json.loads(json.dumps(__import__("yaml").safe_load(EXAMPLE.read_text())))
    doc["spec"]["kvTransfer"]["connector"] = "NixlConnector"
    path = tmp_path / "nixl.yaml"
    path.write_text(json.dumps(doc))
    from disagg_operator.spec import SpecError
    with pytest.raises(SpecError, match="'NixlConnector' cannot run locally; use ExampleConnector"):
        plan_processes(load_spec(path), tmp_path, port=None)


# -- readiness -------------------------------------------------------------------------------------

def _state() -> SidecarState:
    return SidecarState(SidecarConfig.model_validate({"decode": {"url": "http://127.0.0.1:1"}}))


def test_a_refused_decode_is_unready_at_the_first_probe_a_slow_one_at_the_second():
    state = _state()
    state.record_probe("decode", True)
    assert state.not_ready() == []
    state.record_probe("decode", False)  # a slow answer: no outage yet
    assert state.not_ready() == []
    state.record_probe("decode", False)
    assert state.not_ready() == ["decode unreachable"]
    state.record_probe("decode", True)
    state.record_probe("decode", False, refused=True)  # nothing listens: the process is gone
    assert state.not_ready() == ["decode unreachable"]


def test_decode_5xx_without_success_triggers_the_serving_check_until_it_passes():
    state = _state()
    state.record_probe("decode", True)
    assert not state.needs_serving_check(DecodeAnswers(0, 5))  # successes only
    assert not state.needs_serving_check(DecodeAnswers(1, 6))  # an error, but also a success
    assert state.needs_serving_check(DecodeAnswers(3, 6))  # errors and no success since
    state.decode_serving = False
    assert state.not_ready() == ["decode failing (5xx)"]
    assert state.needs_serving_check(DecodeAnswers(3, 6))  # checked every probe while failing
    state.decode_serving = True
    assert state.not_ready() == [] and not state.needs_serving_check(DecodeAnswers(3, 6))
