"""Local mode's pure half: the example spec -> the processes ``disagg up`` starts (no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from disagg_cli.local.plan import KV_SPACE_ENV, LOOPBACK
from disagg_cli.local.runner import load_spec, plan_processes
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
