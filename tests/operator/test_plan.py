"""spec → Plan: which flags and environment each tier gets, and which pools a change rolls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from disagg_operator import sidecar_config
from disagg_operator.engine_args import Launcher
from disagg_operator.plan import Role, build_plan
from disagg_operator.pool_plan import POD_IP
from disagg_operator.manifest import parse_manifest, parse_spec
from disagg_operator.spec import SpecError
from disagg_sidecar.config import SidecarConfig, dump_config
from disagg_sidecar.connectors import NixlConnector
from tests.operator.builders import (
    PARSER_FLAGS, TEMPLATE, TOKENIZER_FLAGS, argv, env, example_doc, flags, full_spec, plan_of, sidecar_file,
)
from tests.operator.cases import merged

NIXL = NixlConnector.side_channel
REPO = Path(__file__).resolve().parents[2]

def test_render_derender_and_decode_share_model_template_and_parser_flags() -> None:
    plan = plan_of(full_spec())
    assert plan.roles == (Role.PREFILL, Role.DECODE, Role.RENDER, Role.DERENDER)
    views = {}
    for role in (Role.RENDER, Role.DERENDER, Role.DECODE):
        cmd = argv(plan, role)
        model_pos = 3 if role != Role.DECODE else 2  # after `vllm launch render` / `vllm serve`
        f = flags(cmd)
        views[role] = (cmd[model_pos], f["--revision"], {k: f.get(k) for k in TOKENIZER_FLAGS + PARSER_FLAGS})
    assert views[Role.RENDER] == views[Role.DERENDER] == views[Role.DECODE]
    model, revision, shared = views[Role.DECODE]
    assert (model, revision) == ("Qwen/Qwen3-8B", "a1b2c3")
    assert shared == {
        "--served-model-name": "qwen3-8b", "--max-model-len": "32768",
        "--chat-template": "/etc/disagg/chat-template/chat-template.jinja",
        "--default-chat-template-kwargs": '{"enable_thinking":false}', "--trust-remote-code": True,
        "--tokenizer-mode": "auto", "--reasoning-parser": "qwen3", "--tool-call-parser": "hermes",
        "--enable-auto-tool-choice": True,
    }


def test_tiers_get_their_launchers_images_and_role_flags() -> None:
    plan = plan_of(full_spec())
    render, derender, decode, prefill = (plan.pool(r) for r in (Role.RENDER, Role.DERENDER, Role.DECODE, Role.PREFILL))
    assert argv(plan, Role.RENDER)[:3] == ["vllm", "launch", "render"]
    assert argv(plan, Role.DECODE)[:2] == argv(plan, Role.PREFILL)[:2] == ["vllm", "serve"]
    assert render.image == derender.image == "ghcr.io/disagg/vllm-cpu:v0.34.0" and not render.gpu
    assert decode.image == prefill.image == "vllm/vllm-openai:v0.34.0" and decode.gpu
    assert flags(argv(plan, Role.RENDER))["--renderer-num-workers"] == "8"
    assert flags(argv(plan, Role.DERENDER))["--renderer-num-workers"] == "16"
    assert "--enable-scale-out" in decode.vllm_args and "--enable-scale-out" in prefill.vllm_args
    assert "--enable-scale-out" not in render.vllm_args  # `launch render` always serves its routes
    assert flags(argv(plan, Role.DECODE))["--port"] == "8200"


def test_prefill_fed_by_the_render_tier_is_tokens_only_without_template_or_parsers() -> None:
    plan = plan_of(full_spec())
    f = flags(argv(plan, Role.PREFILL))
    assert f["--tokens-only"] is True and f["--enable-scale-out"] is True
    for flag in PARSER_FLAGS + ("--chat-template", "--default-chat-template-kwargs"):
        assert flag not in f, flag
    # Shared engine args still apply: they are about loading the model, not rendering.
    assert f["--trust-remote-code"] is True and f["--max-model-len"] == "32768"
    assert not plan.pool(Role.PREFILL).uses_chat_template


def test_prefill_without_a_render_tier_renders_with_the_decode_template_but_never_parses() -> None:
    spec = merged(full_spec(), {"pools": {"render": {"replicas": 0}}})
    del spec["pools"]["derender"]
    plan = plan_of(spec)
    assert plan.roles == (Role.PREFILL, Role.DECODE)
    prefill, decode = flags(argv(plan, Role.PREFILL)), flags(argv(plan, Role.DECODE))
    assert "--tokens-only" not in prefill
    assert all(prefill.get(k) == decode.get(k) for k in TOKENIZER_FLAGS)
    assert not any(k in prefill for k in PARSER_FLAGS)
    assert sidecar_file(plan)["render"] == sidecar_file(plan)["derender"] == {"mode": "local"}
    assert sidecar_file(plan)["engine"]["prefill_tokens_only"] is False


def test_nixl_kv_config_is_identical_on_prefill_and_decode() -> None:
    plan = plan_of(full_spec())
    configs = [json.loads(flags(argv(plan, role))["--kv-transfer-config"]) for role in (Role.PREFILL, Role.DECODE)]
    assert configs[0] == configs[1] == {
        "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"backends": ["UCX"]}}
    assert "--kv-transfer-config" not in argv(plan, Role.RENDER)


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_nixl_side_channel_env_and_ports(data_parallel: int) -> None:
    spec = merged(full_spec(), {"pools": {"prefill": {"parallelism": {"data": data_parallel}}},
                                "kvTransfer": {"sideChannelPort": 5700}})
    plan = plan_of(spec)
    for role in (Role.PREFILL, Role.DECODE):
        pool = plan.pool(role)
        assert env(pool)[NIXL.host_env] == POD_IP
        assert env(pool)[NIXL.port_env] == "5700"
    assert plan.pool(Role.PREFILL).side_channel_ports == tuple(5700 + r for r in range(data_parallel))
    assert plan.pool(Role.DECODE).side_channel_ports == (5700,)
    assert NIXL.host_env not in env(plan.pool(Role.RENDER))


def test_example_connector_uses_shared_storage_and_no_nixl_env() -> None:
    spec = merged(full_spec(), {"kvTransfer": {"connector": "ExampleConnector", "extraConfig": {},
                                               "sharedStorageClaim": "kv-cache"}})
    plan = plan_of(spec)
    for role, kv_role in ((Role.PREFILL, "kv_producer"), (Role.DECODE, "kv_consumer")):
        config = json.loads(flags(argv(plan, role))["--kv-transfer-config"])
        assert config == {"kv_connector": "ExampleConnector", "kv_role": kv_role, "kv_connector_extra_config": {
            "shared_storage_path": "/var/lib/disagg/kv", "backends": ["UCX"]}}
    assert plan.pool(Role.PREFILL).kv_shared_claim == plan.pool(Role.DECODE).kv_shared_claim == "kv-cache"
    assert plan.pool(Role.RENDER).kv_shared_claim is None
    assert not plan.pool(Role.PREFILL).side_channel_ports
    assert NIXL.host_env not in env(plan.pool(Role.PREFILL))


def test_no_prefill_pool_means_decode_prefills_locally() -> None:
    spec = merged(full_spec(), {"pools": {"prefill": {"replicas": 0}}})
    plan = plan_of(spec)
    assert Role.PREFILL not in plan.roles and not plan.disaggregated and plan.kv_connector is None
    decode = plan.pool(Role.DECODE)
    assert "--kv-transfer-config" not in decode.vllm_args
    assert NIXL.host_env not in env(decode) and decode.side_channel_ports == ()
    assert sidecar_file(plan)["prefill"] == {"mode": "local"}
    assert sidecar_file(plan)["kv_connector"] is None


def test_sidecar_config_names_the_services() -> None:
    plan = plan_of(full_spec())
    config = sidecar_file(plan)
    assert config["listen"] == {"host": "0.0.0.0", "port": 8000}
    assert config["decode"] == {"url": "http://127.0.0.1:8200"}
    assert config["render"] == {"mode": "remote", "urls": ["http://qwen3-8b-render.prod.svc:8200"]}
    assert config["derender"] == {"mode": "remote", "urls": ["http://qwen3-8b-derender.prod.svc:8200"]}
    assert config["prefill"] == {
        "mode": "remote",
        # The prefill pods of decode's own KV revision (tests/operator/test_pairing.py).
        "discovery": {"kind": "endpointslices", "namespace": "prod", "service": f"qwen3-8b-kv{plan.kv_revision[:6]}",
                      "port": 8200, "port_name": "engine"},
        "selection": "least-requests", "affinity_block_tokens": 16, "trust_prefiller_header": False,
        "failure_policy": "fallback",
    }
    assert config["kv_connector"] == "NixlConnector"
    assert config["timeouts"]["prefill_seconds"] == 60
    assert config["served_model_name"] == "qwen3-8b"
    assert plan.endpoint == "http://qwen3-8b.prod.svc:8000"


def test_render_failure_policy_reaches_the_sidecar_config() -> None:
    """Unset: the sidecar's default (fail), nothing written; decodeRenders: decode answers itself."""
    assert "failure_policy" not in sidecar_file(plan_of(full_spec()))["render"]
    plan = plan_of(merged(full_spec(), {"router": {"renderFailurePolicy": "decodeRenders"}}))
    assert sidecar_file(plan)["render"] == {"mode": "remote", "urls": ["http://qwen3-8b-render.prod.svc:8200"],
                                            "failure_policy": "decode"}
    assert SidecarConfig.model_validate(sidecar_file(plan)).render.failure_policy == "decode"


def test_derender_shares_the_render_pool_by_default() -> None:
    plan = plan_of(example_doc()["spec"])
    assert plan.derender_shared and Role.DERENDER not in plan.roles
    assert sidecar_file(plan)["derender"]["urls"] == ["http://qwen3-8b-derender.prod.svc:8200"]


def test_engine_extension_enables_the_disagg_plugin_on_decode_of_the_gpu_pools() -> None:
    plan = plan_of(merged(full_spec(), {"engine": {"extension": True}}))
    assert env(plan.pool(Role.DECODE))["VLLM_PLUGINS"] == "disagg"
    assert "VLLM_PLUGINS" not in env(plan.pool(Role.PREFILL))
    spec = merged(full_spec(), {"engine": {"extension": True},
                                "model": {"env": [{"name": "VLLM_PLUGINS", "value": "lora_resolver"}]}})
    assert env(plan_of(spec).pool(Role.DECODE))["VLLM_PLUGINS"] == "lora_resolver,disagg"
    spec["model"]["env"][0]["value"] = "disagg, other"
    assert env(plan_of(spec).pool(Role.DECODE))["VLLM_PLUGINS"] == "disagg,other"


def test_pool_env_overrides_model_env_by_name() -> None:
    spec = merged(full_spec(), {"model": {"env": [{"name": "A", "value": "model"}, {"name": "B", "value": "b"}]},
                                "pools": {"render": {"env": [{"name": "A", "value": "render"}]}}})
    plan = plan_of(spec)
    assert {k: env(plan.pool(Role.RENDER))[k] for k in "AB"} == {"A": "render", "B": "b"}
    assert env(plan.pool(Role.DECODE))["A"] == "model"


def test_served_name_defaults_to_the_object_name_and_pvc_sources_are_mounted_paths() -> None:
    plan = plan_of({"model": {"source": "pvc://weights/qwen3/8b"}}, name="qwen")
    assert plan.served_name == "qwen"
    assert (plan.model.scheme, plan.model.claim, plan.model.argument) == ("pvc", "weights", "/models/weights/qwen3/8b")
    assert argv(plan, Role.DECODE)[2] == "/models/weights/qwen3/8b"
    assert "--revision" not in argv(plan, Role.DECODE)


def test_autoscaling_defaults_to_a_cpu_target() -> None:
    plan = plan_of(merged(full_spec(), {"pools": {"render": {"autoscaling": {"maxReplicas": 6}}}}))
    scaling = plan.pool(Role.RENDER).autoscaling
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 6)
    assert scaling.metrics[0]["resource"]["target"] == {"type": "Utilization", "averageUtilization": 80}


def test_a_plan_is_reusable_by_local_processes() -> None:
    """Local mode: its own model directory, ports and sidecar endpoints; the same tier flags."""
    plan = plan_of(full_spec())
    decode = plan.pool(Role.DECODE)
    assert decode.launcher == Launcher.SERVE and plan.pool(Role.RENDER).launcher == Launcher.LAUNCH_RENDER
    for pool in plan.pools:  # flags only: the realiser adds launcher, model and listen address
        assert not {"--port", "--host", "--model", "--revision"} & set(flags(list(pool.vllm_args)))
        assert "vllm" not in pool.vllm_args
    local = decode.argv(plan.model, model_arg="/tmp/qwen3", port=9101, host="127.0.0.1")
    assert local[:3] == ["vllm", "serve", "/tmp/qwen3"] and "--revision" not in local
    assert flags(local)["--port"] == "9101" and flags(local)["--host"] == "127.0.0.1"
    assert local[-len(decode.vllm_args):] == list(decode.vllm_args)
    config = dump_config(plan.sidecar_config(sidecar_config.static_endpoints(
        decode_url="http://127.0.0.1:9101", render_url="http://127.0.0.1:9100", derender_url="http://127.0.0.1:9100",
        prefill_urls=["http://127.0.0.1:9102"]), listen_port=9000))
    assert config["prefill"]["discovery"] == {"kind": "static", "urls": ["http://127.0.0.1:9102"]}
    assert config["listen"]["port"] == 9000 and config["decode"]["url"] == "http://127.0.0.1:9101"
    custom = build_plan(parse_spec(full_spec()), "m", "ns", chat_template_path="/tmp/t.jinja")
    assert flags(argv(custom, Role.RENDER))["--chat-template"] == "/tmp/t.jinja"


@pytest.mark.parametrize(("client_max", "engines"), [(None, "21"), (5, "6"), (0, "1"), (-1, "-1")])
def test_engines_allow_one_logprob_candidate_more_than_clients_and_the_sidecar_refuses_the_rest(
        client_max: int | None, engines: str) -> None:
    """Completions show the sampled token beside the top k: the engines need room for k + 1."""
    spec = full_spec() if client_max is None else merged(full_spec(), {"model": {"maxLogprobs": client_max}})
    plan = plan_of(spec)
    assert {str(p.role): flags(argv(plan, p.role))["--max-logprobs"] for p in plan.pools} == dict.fromkeys(
        ("prefill", "decode", "render", "derender"), engines)
    config = sidecar_file(plan)
    assert (config["limits"]["max_logprobs"], config["engine"]["max_logprobs"]) == (
        20 if client_max is None else client_max, int(engines))


def test_the_session_stream_interval_reaches_the_sidecar_only_when_set() -> None:
    assert "session_stream_interval" not in sidecar_file(plan_of(full_spec()))["limits"]  # the sidecar's own 4
    tuned = sidecar_file(plan_of(merged(full_spec(), {"router": {"sessionStreamInterval": 1}})))
    assert tuned["limits"]["session_stream_interval"] == 1


# --- which pools a change rolls ------------------------------------------------------------------

ROLLS = [
    ("reasoning parser", {"model": {"reasoningParser": "deepseek_r1"}}, {"decode", "render", "derender"}),
    ("tool parser", {"model": {"toolCallParser": "qwen3_xml"}}, {"decode", "render", "derender"}),
    ("chat template", {"model": {"chatTemplate": {"inline": TEMPLATE + " "}}}, {"decode", "render", "derender"}),
    ("template kwargs", {"model": {"defaultChatTemplateKwargs": {"enable_thinking": True}}},
     {"decode", "render", "derender"}),
    ("max model len", {"model": {"maxModelLen": 16384}}, {"prefill", "decode", "render", "derender"}),
    ("max logprobs", {"model": {"maxLogprobs": 5}}, {"prefill", "decode", "render", "derender"}),
    ("prefill replicas", {"pools": {"prefill": {"replicas": 3}}}, set()),
    ("decode replicas", {"pools": {"decode": {"replicas": 5}}}, set()),
    ("render autoscaling", {"pools": {"render": {"autoscaling": {"maxReplicas": 4}}}}, set()),
    ("prefill args", {"pools": {"prefill": {"extraArgs": ["--max-num-batched-tokens", "8192"]}}}, {"prefill"}),
    ("derender workers", {"pools": {"derender": {"rendererWorkers": 2}}}, {"derender"}),
    ("router timeouts", {"router": {"timeouts": {"decodeSeconds": 60}}}, {"decode"}),
    ("session stream interval", {"router": {"sessionStreamInterval": 8}}, {"decode"}),  # its sidecar's limits
    ("sidecar image", {"router": {"image": "ghcr.io/disagg/disagg:v0.2.0"}}, {"decode"}),
    ("cpu image", {"engine": {"cpuImage": "ghcr.io/disagg/vllm-cpu:v0.34.1"}}, {"render", "derender"}),
    # not decode: 0.34 has no derender sessions to come or go (where they do, decode rolls too: below)
    ("render extension", {"engine": {"renderExtension": False}}, {"render", "derender"}),
    ("vllm version", {"engine": {"vllmVersion": "0.32.0"}}, {"decode"}),  # its sidecar's features
    ("gpu image", {"engine": {"gpuImage": "vllm/vllm-openai:v0.34.1"}}, {"prefill", "decode"}),
    ("cache claim", {"engine": {"cacheClaim": "engine-cache"}}, {"prefill", "decode", "render", "derender"}),
    ("kv extra config", {"kvTransfer": {"extraConfig": {"backends": ["UCX", "GDS"]}}}, {"prefill", "decode"}),
    ("decode resources", {"pools": {"decode": {"resources": {"limits": {"nvidia.com/gpu": "2"}}}}}, {"decode"}),
    ("render node selector", {"pools": {"render": {"nodeSelector": {"pool": "cpu"}}}}, {"render"}),
]


@pytest.mark.parametrize(("change", "patch", "rolled"), ROLLS, ids=[r[0] for r in ROLLS])
def test_a_change_rolls_exactly_the_pools_it_affects(change: str, patch: dict, rolled: set[str]) -> None:
    before, after = plan_of(full_spec()), plan_of(merged(full_spec(), patch))
    changed = {str(p.role) for p in before.pools if p.config_hash != after.pool(p.role).config_hash}
    assert changed == rolled
    assert (before.config_hash != after.config_hash) == bool(rolled)


def test_hashes_are_stable_and_per_pool() -> None:
    a, b = plan_of(full_spec()), plan_of(full_spec())
    assert [p.config_hash for p in a.pools] == [p.config_hash for p in b.pools]
    assert len({p.config_hash for p in a.pools}) == len(a.pools)


def test_the_issue_example_is_what_the_issue_asks_for() -> None:
    manifest = parse_manifest(example_doc())
    plan = build_plan(manifest.spec, manifest.name, "default")
    assert {str(p.role): p.replicas for p in plan.pools} == {"prefill": 2, "decode": 2, "render": 2}
    assert plan.kv_connector == "NixlConnector" and plan.served_name == "qwen3-8b"
    assert flags(argv(plan, Role.RENDER))["--reasoning-parser"] == "qwen3"
    assert flags(argv(plan, Role.RENDER))["--tool-call-parser"] == "hermes"


# A version outside the release table (0.35, 1.0) assumes nothing of stock vLLM.
@pytest.mark.parametrize(("version", "derender_mode"), [("0.32.0", False), ("0.32.0+cpu", False), ("0.33.0rc1", True),
                                                        ("0.33.0", True), ("0.34.1", True), ("0.35.0", False),
                                                        ("1.0.0", False)])
def test_vllm_version_decides_the_features_the_sidecar_may_use(version: str, derender_mode: bool) -> None:
    plan = plan_of(merged(full_spec(), {"engine": {"vllmVersion": version}}))
    features = sidecar_file(plan)["engine"]["features"]
    assert features["generate_output_mode_derender"] is derender_mode
    assert "render_hoists_kv_transfer_params" not in features  # written and never read: gone


def test_extension_refuses_a_vllm_plugins_env_it_cannot_extend() -> None:
    spec = merged(full_spec(), {"engine": {"extension": True}, "model": {"env": [
        {"name": "VLLM_PLUGINS", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]}})
    with pytest.raises(SpecError, match="VLLM_PLUGINS must be a plain value when engine.extension is on"):
        plan_of(spec)


def test_render_extension_puts_the_plugin_on_the_render_and_derender_pools_by_default() -> None:
    plan = plan_of(full_spec())
    assert env(plan.pool(Role.RENDER))["VLLM_PLUGINS"] == env(plan.pool(Role.DERENDER))["VLLM_PLUGINS"] == "disagg"
    assert all("VLLM_PLUGINS" not in env(plan.pool(r)) for r in (Role.PREFILL, Role.DECODE))
    spec = merged(full_spec(), {"pools": {"render": {"env": [{"name": "VLLM_PLUGINS", "value": "lora_resolver"}]}}})
    assert env(plan_of(spec).pool(Role.RENDER))["VLLM_PLUGINS"] == "lora_resolver,disagg"
    stock = plan_of(merged(full_spec(), {"engine": {"renderExtension": False, "cpuImage": "vllm/vllm-openai-cpu:v0.33.0"}}))
    assert all("VLLM_PLUGINS" not in env(p) for p in stock.pools)


@pytest.mark.parametrize("image, loaded", [
    ("docker.io/vllm/vllm-openai-cpu@sha256:ab", False), ("vllm/vllm-openai", False), ("vllm/vllm-openai-cpu:v0.32.0", False),
    ("registry.example/vllm/vllm-openai-cpu:v0.32.0", True), ("ghcr.io/disagg/vllm-cpu:v0.32.0", True),
    ("vllm/vllm-openai-cpu-disagg:v1", True)])
def test_a_stock_cpu_image_runs_without_the_render_extension(image: str, loaded: bool) -> None:
    """vLLM's own images lack the package (vLLM would skip the plugin silently): no plugin asked for,
    and the status and the sidecar say stateless."""
    plan = plan_of(merged(full_spec(), {"engine": {"cpuImage": image, "vllmVersion": "0.32.0"}}))
    assert ("VLLM_PLUGINS" in env(plan.pool(Role.RENDER))) is loaded
    assert plan.derender_strategy == ("session" if loaded else "stateless")
    assert sidecar_file(plan)["engine"]["derender_sessions"] is loaded


def test_render_extension_refuses_a_vllm_plugins_env_it_cannot_extend() -> None:
    spec = merged(full_spec(), {"pools": {"derender": {"env": [
        {"name": "VLLM_PLUGINS", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]}}})
    with pytest.raises(SpecError, match="VLLM_PLUGINS must be a plain value when engine.renderExtension is on"):
        plan_of(spec)


STRATEGIES = [
    # (engine, render replicas) -> status.derender.strategy, the sidecar's engine.derender_sessions
    ({"vllmVersion": "0.32.0"}, 1, "session", True),
    ({"vllmVersion": "0.32.0+cpu", "extension": True}, 1, "inline", True),  # sessions stay a fallback
    ({"vllmVersion": "0.33.0"}, 1, "session", True),
    ({"vllmVersion": "0.33.0", "extension": True}, 1, "inline", True),
    ({"vllmVersion": "0.32.0", "renderExtension": False}, 1, "stateless", False),
    ({"vllmVersion": "0.32.0"}, 0, "stateless", False),  # decode renders and derenders on its own routes
    ({"vllmVersion": "0.32.0", "extension": True}, 0, "inline", False),
    ({"vllmVersion": "0.34.0"}, 1, "stock-inline", False),  # stock 0.34 streams derender itself
    ({"vllmVersion": "0.34.0", "renderExtension": False}, 1, "stock-inline", False),
    ({"vllmVersion": "0.34.0", "extension": True}, 1, "inline", False),
    ({"vllmVersion": "0.35.0"}, 1, "stateless", False),  # untested: nothing assumed
]


@pytest.mark.parametrize(("engine", "renders", "strategy", "sessions"), STRATEGIES)
def test_the_derender_strategy_and_what_the_sidecar_may_ask_the_render_tier(
        engine: dict, renders: int, strategy: str, sessions: bool) -> None:
    spec = merged(example_doc()["spec"], {"engine": engine, "pools": {"render": {"replicas": renders}}})
    plan = plan_of(spec)
    assert plan.derender_strategy == strategy
    assert sidecar_file(plan)["engine"]["derender_sessions"] is sessions
    assert (plan.render_tier and env(plan.pool(Role.RENDER)).get("VLLM_PLUGINS") == "disagg") \
        is (renders > 0 and engine.get("renderExtension", True))


def test_a_model_without_a_version_gets_the_current_releases_images_features_and_strategy() -> None:
    """The operator's default is vLLM 0.34.0 (the current release, its lane runs): a model that names no
    engine gets 0.34's images, a sidecar that may ask a stock decode for streamed derender output, no
    derender sessions, and stock-inline derender (examples/minimal.yaml)."""
    spec = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())["spec"]
    assert "engine" not in spec
    plan = plan_of(spec)
    assert plan.spec.engine.vllm_version == "0.34.0"
    assert plan.pool(Role.RENDER).image == "ghcr.io/disagg/vllm-cpu:v0.34.0"
    assert plan.pool(Role.DECODE).image == plan.pool(Role.PREFILL).image == "vllm/vllm-openai:v0.34.0"
    engine = sidecar_file(plan)["engine"]
    assert engine["vllm_version"] == "0.34.0" and engine["extension"] is False
    assert engine["features"] == {"generate_output_mode_derender": True, "generate_streaming_derender": True,
                                  "render_parse_context": True, "derender_finish_reason": True}
    assert engine["derender_sessions"] is False  # sessions are off on 0.34
    assert plan.derender_strategy == "stock-inline"
    assert "VLLM_PLUGINS" not in env(plan.pool(Role.DECODE))  # the stock GPU image: no extension asked for
    assert env(plan.pool(Role.RENDER))["VLLM_PLUGINS"] == "disagg"  # Disagg's CPU image carries it


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_sessions_coming_or_going_roll_decode_with_the_render_tier(version: str) -> None:
    on = plan_of(merged(full_spec(), {"engine": {"vllmVersion": version}}))
    off = plan_of(merged(full_spec(), {"engine": {"vllmVersion": version, "renderExtension": False}}))
    changed = {str(p.role) for p in on.pools if p.config_hash != off.pool(p.role).config_hash}
    assert changed == {"decode", "render", "derender"}  # decode: its sidecar's engine.derender_sessions
    assert (on.derender_strategy, off.derender_strategy) == ("session", "stateless")
