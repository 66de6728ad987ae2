"""Local mode's pure half: the example spec -> the processes ``disagg up`` starts (no server)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
import yaml

from disagg_cli.local.plan import ENGINE_KEY_FILE, KV_SPACE_ENV, LOOPBACK
from disagg_cli.local.runner import load_spec, plan_processes
from disagg_operator.spec import SpecError
from disagg_sidecar.config import Limits, SidecarConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-tiny.yaml"


def _processes(tmp_path: Path, doc: dict | None = None) -> dict:
    path = EXAMPLE
    if doc is not None:
        path = tmp_path / "spec.yaml"
        path.write_text(yaml.safe_dump(doc))
    return {p.name: p for p in plan_processes(load_spec(path), tmp_path, port=None)}


def test_example_runs_vllm_modules_on_loopback(tmp_path):
    procs = _processes(tmp_path)
    assert set(procs) == {"prefill-0", "decode-0", "render-0", "sidecar-0"}
    for name in ("prefill-0", "decode-0", "render-0"):
        argv = procs[name].argv
        assert argv[:2] == [sys.executable, "-m"] and argv[2].startswith("vllm.entrypoints.launchers.")
        assert argv[argv.index("--host") + 1] == LOOPBACK
        assert argv[argv.index("--port") + 1] == str(procs[name].port)
        assert argv[argv.index("--model") + 1] == str(Path("~/.cache/disagg/models/tiny-qwen3").expanduser())
    assert procs["decode-0"].env["VLLM_PLUGINS"] == "disagg"


def test_local_sidecars_drain_at_once_on_sigterm(tmp_path):
    """No Service routes to a local sidecar: no deregister window before the drain (``disagg down``
    would wait for nothing); everything else is the operator's configuration."""
    config = _processes(tmp_path)["sidecar-0"].config
    assert config is not None and config.limits.deregister_seconds == 0
    assert SidecarConfig.model_validate({"decode": {"url": "http://127.0.0.1:1"}}).limits.deregister_seconds > 0
    assert config.limits.drain_seconds == Limits().drain_seconds


def test_a_spec_sized_kv_cache_is_not_overridden_by_the_cpu_default(tmp_path):
    procs = _processes(tmp_path)
    for name in ("prefill-0", "decode-0"):
        argv = procs[name].argv
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "134217728"
        assert KV_SPACE_ENV not in procs[name].env  # vLLM would let the env win over the flag
    assert procs["render-0"].env[KV_SPACE_ENV] == "1"


def test_without_a_kv_size_engines_get_the_cpu_default_and_user_env_wins(tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    for pool in ("prefill", "decode"):
        doc["spec"]["pools"][pool].pop("extraArgs")
    doc["spec"]["pools"]["decode"]["env"] = [{"name": KV_SPACE_ENV, "value": "3"}]
    procs = _processes(tmp_path, doc)
    assert "--kv-cache-memory-bytes" not in procs["prefill-0"].argv
    assert procs["prefill-0"].env[KV_SPACE_ENV] == "1"
    assert procs["decode-0"].env[KV_SPACE_ENV] == "3"


def test_engines_and_sidecar_share_a_key_from_the_state_directory(tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    del doc["spec"]["security"]  # the default: on
    procs = _processes(tmp_path, doc)
    key_file = tmp_path / ENGINE_KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text().strip()
    assert len(key) >= 43
    for name in ("prefill-0", "decode-0", "render-0"):
        assert procs[name].env["VLLM_API_KEY"] == key
        assert not any(key in arg or "--api-key" in arg for arg in procs[name].argv)
    assert procs["sidecar-0"].config.auth.engine_api_key_file == str(key_file)
    assert "VLLM_API_KEY" not in procs["sidecar-0"].env


def test_switched_off_local_engines_take_no_key(tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert doc["spec"]["security"] == {"engineAPIKey": {"enabled": False}}  # the example's own setting
    procs = _processes(tmp_path)
    assert not (tmp_path / ENGINE_KEY_FILE).exists()
    assert all("VLLM_API_KEY" not in p.env for p in procs.values())
    assert procs["sidecar-0"].config.auth.engine_api_key_file is None


@pytest.mark.parametrize("field, value", [("clientAPIKey", {"name": "keys"}), ("tls", {"secretName": "certs"})])
def test_secrets_of_a_cluster_are_refused_locally(tmp_path, field, value):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["security"] = {"engineAPIKey": {"enabled": False}, field: value}
    with pytest.raises(SpecError, match=f"security.{field}"):
        _processes(tmp_path, doc)


def test_the_example_render_runs_the_extension_and_can_do_without(tmp_path):
    """examples/local-tiny.yaml follows the operator's default: its render runs the extension (derender
    sessions, a fallback behind decode's inline derender); engine.renderExtension false drops it."""
    procs = _processes(tmp_path)
    assert procs["render-0"].env["VLLM_PLUGINS"] == "disagg"
    assert procs["sidecar-0"].config.engine.derender_sessions is True  # 0.32: the render runs sessions
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["engine"]["renderExtension"] = False
    procs = _processes(tmp_path, doc)
    assert "VLLM_PLUGINS" not in procs["render-0"].env
    assert procs["sidecar-0"].config.engine.derender_sessions is False
