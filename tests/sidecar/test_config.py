"""The configuration file: what the operator and local mode write is what the sidecar reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from disagg_sidecar.plan import capabilities
from disagg_sidecar.commands import sidecar_main
from disagg_sidecar.config import (
    Decode, DNSDiscovery, EndpointSliceDiscovery, Prefill, SidecarConfig, StaticDiscovery, dump_config, load_config,
)

REPO = Path(__file__).resolve().parents[2]

MINIMAL = {"decode": {"url": "http://127.0.0.1:8200"}}
FULL = {
    "version": 1,
    "served_model_name": "qwen3-8b",
    "listen": {"host": "0.0.0.0", "port": 8000},
    "decode": {"url": "http://127.0.0.1:8200",
               "capabilities": {"output_modes": ["tokens", "text"], "streaming_output_modes": ["tokens"]}},
    "render": {"mode": "remote", "urls": ["http://r1:8200", "http://r2:8200"]},
    "derender": {"mode": "remote", "url": "http://d:8200"},
    "prefill": {"mode": "remote", "discovery": {"kind": "dns", "host": "p.ns.svc.cluster.local", "port": 8200},
                "selection": "least-requests", "trust_prefiller_header": True, "failure_policy": "fail",
                "min_prompt_tokens": 64},
    "kv_connector": "NixlConnector",
    "timeouts": {"connect_seconds": 2, "render_seconds": 10, "prefill_seconds": 60, "decode_seconds": 600,
                 "derender_seconds": 5},
    "retries": 2,
    "max_body_bytes": 1048576,
    "limits": {"max_concurrent_requests": 64, "drain_seconds": 20, "coalesce": True, "keepalive_seconds": 3},
    "engine": {"vllm_version": "0.33.0", "extension": True, "prefill_tokens_only": True},
}


def test_minimal_config_is_decode_only() -> None:
    c = SidecarConfig.model_validate(MINIMAL)
    assert c.render_urls == c.derender_urls == ("http://127.0.0.1:8200",)
    assert c.prefill.mode == "local" and capabilities.configured(c).output_modes == ("tokens", "text")
    assert c.limits.keepalive_seconds < 5


def test_full_config(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(FULL))
    c = load_config(path)
    assert c.render_urls == ("http://r1:8200", "http://r2:8200") and c.derender_urls == ("http://d:8200",)
    assert c.derender_timeout == 5 and c.prefill_tokens_only
    assert capabilities.configured(c).streaming_output_modes == ("tokens",)


@pytest.mark.parametrize("discovery", [
    StaticDiscovery(urls=("http://p:1",)), DNSDiscovery(host="p.ns.svc", port=8200),
    EndpointSliceDiscovery(namespace="ns", service="p", port_name="engine"),
])
def test_a_written_config_reads_back_equal_with_only_what_the_writer_set(discovery) -> None:
    """dump_config keeps defaults out of the file, but always writes a discovery's `kind` (it tells them apart)."""
    config = SidecarConfig(decode=Decode(url="http://127.0.0.1:8200"), kv_connector="NixlConnector",
                           prefill=Prefill(mode="remote", discovery=discovery))
    written = dump_config(config)
    assert written["prefill"]["discovery"]["kind"] == discovery.kind
    assert set(written) == {"decode", "kv_connector", "prefill"} and "limits" not in written
    assert SidecarConfig.model_validate(yaml.safe_load(yaml.safe_dump(written))) == config


@pytest.mark.parametrize("patch, match", [
    ({"decode": {"url": "127.0.0.1:8200"}}, "http"),
    ({"prefill": {"mode": "remote"}}, "discovery"),
    ({"prefill": {"mode": "remote", "discovery": {"kind": "static", "urls": ["http://p:1"]}}, "kv_connector": None},
     "kv_connector"),
    ({"prefill": {"mode": "remote", "discovery": {"kind": "static", "urls": ["http://p:1"]}}, "kv_connector": "X"},
     "unknown kv_connector"),
    ({"render": {"mode": "remote"}}, "url"),
    ({"limits": {"keepalive_seconds": 5}}, "less than 5"),
    ({"timeouts": {"decode_secs": 5}}, "decode_secs"),  # typos are errors, not defaults
    ({"version": 2}, "version"),
])
def test_invalid_configs(patch: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        SidecarConfig.model_validate({**MINIMAL, **patch})


@pytest.mark.parametrize("example", ["minimal", "qwen3-8b"])
def test_the_operators_config_is_accepted(example: str) -> None:
    """The sidecar ConfigMap content the operator derives from the examples validates unchanged,
    in the cluster (EndpointSlice discovery) and in local mode (static endpoints)."""
    from disagg_operator import sidecar_config
    from disagg_operator.plan import build_plan
    from disagg_operator.spec import DisaggregatedModelSpec

    doc = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    plan = build_plan(DisaggregatedModelSpec.model_validate(doc["spec"]), doc["metadata"]["name"], "ns")
    config = SidecarConfig.model_validate(yaml.safe_load(yaml.safe_dump(dump_config(plan.sidecar.config))))
    assert config == plan.sidecar.config  # the file the operator writes reads back as the same config
    assert config.decode.url.startswith("http://127.0.0.1:")
    if config.prefill.mode == "remote":
        assert config.kv_connector is not None
    local = plan.sidecar_config(sidecar_config.static_endpoints(
        decode_url="http://127.0.0.1:8200", render_url="http://127.0.0.1:8100", derender_url=None,
        prefill_urls=["http://127.0.0.1:8300"]), listen_port=9000)
    config = SidecarConfig.model_validate(dump_config(local))
    assert config.listen.port == 9000 and config.derender_urls == ("http://127.0.0.1:8200",)


def test_command_rejects_a_bad_config(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("decode: {url: nope}\n")
    assert sidecar_main(["--config", str(path)]) == 2
    assert "invalid configuration" in capsys.readouterr().err


def test_abuse_limits_have_safe_defaults_and_are_validated() -> None:
    limits = SidecarConfig.model_validate(MINIMAL).limits
    assert (limits.max_n, limits.max_prompts, limits.max_legs, limits.max_json_depth) == (128, 64, 256, 64)
    assert limits.header_read_seconds == 10 and limits.body_read_seconds == 30
    assert limits.memory_budget_bytes == 256 << 20 and limits.max_connections_per_ip == 0
    for bad in ({"max_n": 0}, {"max_json_depth": 1}, {"max_json_depth": 100_000}, {"body_read_seconds": 0},
                {"memory_budget_bytes": 1024}, {"max_connections_per_ip": -1}, {"max_legs": 2}):
        with pytest.raises(ValidationError):
            SidecarConfig.model_validate({**MINIMAL, "limits": bad})
