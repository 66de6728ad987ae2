"""A set of real vLLM CPU servers on the tiny test model: the four roles the tests drive.

- ``render``:  ``launch render`` (chat template, tokenization, derender) with the parsers and the
  engine extension (derender sessions)
- ``prefill``: ``serve --tokens-only`` with the engine extension, writing KV through ``ExampleConnector``
- ``decode``:  ``serve --enable-scale-out`` with tokenizer and parsers and Disagg's engine
  extension (``VLLM_PLUGINS=disagg``), reading that KV
- ``coupled``: ``serve`` with the same model and parsers, the parity reference; it also has
  ``--enable-scale-out`` without the extension, i.e. a stock vLLM decode engine

Every engine loads the forced-output logits processor. ``python -m disagg_engine.testing.server_set``
starts the set outside pytest and prints the URLs (Ctrl-C stops it); benchmarks start it too. The
pytest harness starts only ``coupled`` here and takes render, prefill and decode from the local
deployment ``make demo`` brings up (tests/harness/engine.py), which has the same flags.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from disagg_engine.commands import PLUGIN_NAME, RENDER_MODULE, SERVE_MODULE
from disagg_engine.servers import CPU_ENGINE_ENV, ManagedServer, ServerSpec, free_port, start_all, stop_all
from disagg_engine.testing.lanes import ALL_LANES, MAIN, lane_env
from disagg_engine.testing.tiny_model import CHAT_TEMPLATE, SERVED_NAME, ensure_model

SERVE = [sys.executable, "-m", SERVE_MODULE]
RENDER = [sys.executable, "-m", RENDER_MODULE]
PARSER_FLAGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
# The template the tiny model carries, named explicitly: without it, every server with a tokenizer
# loads the tokenizer a second time (~5 CPU-s) looking for a processor's own template.
TEMPLATE_FLAGS = ["--chat-template", str(CHAT_TEMPLATE)]
FORCING = "disagg_engine.testing.forcing:ForcedOutput"
MAX_MODEL_LEN = 8192
# The tiny model needs 1 KiB of KV per token: 128 MiB hold 131k tokens (16 full-length requests).
# vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE, whole GiB) costs each engine ~0.5 GB more RSS
# (examples/local-tiny.yaml sizes its engines the same way).
KV_CACHE_BYTES = 128 * 1024 * 1024
# The Disagg tiers' --max-logprobs, as the operator sets it for vLLM's default of 20
# (disagg_operator.engine_args.engine_max_logprobs): one candidate more than clients may ask for,
# the room for the sampled token beside a completions client's top 20. Coupled keeps the default.
MAX_LOGPROBS_FLAGS = ["--max-logprobs", "21"]
ROLES = ("render", "prefill", "decode", "coupled")
# The render tier runs the extension too: its derender sessions (disagg_engine.sessions).
ROLE_ENV = {role: {"VLLM_PLUGINS": PLUGIN_NAME} for role in ("render", "prefill", "decode")}

# Offline: nothing is fetched.
ENGINE_ENV = {**CPU_ENGINE_ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def kv_config(shared_dir: Path, role: str) -> str:
    # Producer/consumer rather than kv_both: a decode engine that never writes KV can only report
    # an external cache hit for a prompt the prefill engine wrote, which is what tests check. The
    # connector class is Disagg's (disagg_engine.kv_example): vLLM's ignores the role.
    return json.dumps({
        "kv_connector": "ExampleConnector",
        "kv_connector_module_path": "disagg_engine.kv_example",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(shared_dir)},
    })


def role_argv(role: str, model: Path, port: int, kv_dir: Path, extra: list[str] | None = None) -> list[str]:
    common = ["--model", str(model), "--served-model-name", SERVED_NAME, "--port", str(port),
              "--host", "127.0.0.1", "--max-model-len", str(MAX_MODEL_LEN)]
    engine = ["--enforce-eager", "--dtype", "float32", "--logits-processors", FORCING,
              "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(role, "kv_both")
    kv = ["--kv-transfer-config", kv_config(kv_dir, kv_role)]
    argv = {
        "render": RENDER + common + MAX_LOGPROBS_FLAGS + TEMPLATE_FLAGS + PARSER_FLAGS,
        "prefill": SERVE + common + MAX_LOGPROBS_FLAGS + engine + ["--tokens-only"] + kv,
        "decode": SERVE + common + MAX_LOGPROBS_FLAGS + engine + TEMPLATE_FLAGS + PARSER_FLAGS + ["--enable-scale-out"] + kv,
        "coupled": SERVE + common + engine + TEMPLATE_FLAGS + PARSER_FLAGS + ["--enable-scale-out"],
    }[role]
    return argv + list(extra or [])


@dataclass
class ServerSet:
    servers: dict[str, ManagedServer]
    model_dir: Path
    kv_dir: Path
    log_dir: Path
    vllm_lane: str = MAIN

    def url(self, role: str) -> str:
        return self.servers[role].url

    def stop(self) -> None:
        stop_all(self.servers.values())

    def describe(self) -> dict:
        return {"model_dir": str(self.model_dir), "kv_dir": str(self.kv_dir), "log_dir": str(self.log_dir),
                "vllm_lane": self.vllm_lane,
                "servers": {name: {"url": s.url, "pid": s.pid, "log": str(s.log_path)} for name, s in self.servers.items()}}


def role_specs(roles: tuple[str, ...], model: Path, kv_dir: Path, name_prefix: str = "",
               env: dict[str, str] | None = None) -> list[ServerSpec]:
    """One server per role on a free port, named ``<name_prefix><role>``."""
    return [
        ServerSpec(name=name_prefix + role, argv=role_argv(role, model, port, kv_dir), port=port,
                   env={**ENGINE_ENV, **ROLE_ENV.get(role, {}), **(env or {})})
        for role in roles
        for port in [free_port()]
    ]


def start_server_set(log_dir: Path, roles: tuple[str, ...] = ROLES, timeout: float = 900.0,
                     lane: str = MAIN) -> ServerSet:
    model = ensure_model()
    kv_dir = Path(tempfile.mkdtemp(prefix="disagg-kv-"))
    servers = start_all(role_specs(roles, model, kv_dir, env=lane_env(lane)), log_dir, timeout=timeout)
    return ServerSet({s.spec.name: s for s in servers}, model, kv_dir, log_dir, lane)


if __name__ == "__main__":
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Start the four servers on one vLLM lane.")
    parser.add_argument("--lane", choices=ALL_LANES, default=MAIN)
    lane = parser.parse_args().lane
    logs = Path(os.environ.get("DISAGG_LOG_DIR", tempfile.mkdtemp(prefix="disagg-logs-")))
    t0 = time.monotonic()
    sset = start_server_set(logs, lane=lane)
    (logs / "servers.json").write_text(json.dumps(sset.describe(), indent=1))
    print(f"healthy after {time.monotonic() - t0:.1f}s; logs in {logs} (servers.json)", flush=True)
    for name, server in sset.servers.items():
        print(f"{name:8s} {server.url} pid={server.pid}", flush=True)
    try:
        while all(s.alive() for s in sset.servers.values()):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        sset.stop()
