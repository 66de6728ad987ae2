"""One function per pool kind: what runs in it (flags, env, ports, size) and its configuration hash.

Tier rules:
- render and derender: ``vllm launch render`` on the CPU image, template + parser flags,
  ``--renderer-num-workers``, ``VLLM_PLUGINS=disagg`` with ``engine.renderExtension``;
- decode: the *same* template + parser flags, ``--enable-scale-out``, parallelism, the KV config
  when a prefill pool exists, ``VLLM_PLUGINS=disagg`` with the engine extension;
- prefill: ``--tokens-only`` when the render tier feeds it (then no template/parser flags: it
  never sees text), ``--enable-scale-out``, the KV config, the connector's side-channel env.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg_operator import derender, engine_args, names
from disagg_operator.engine_args import Launcher
from disagg_operator.kv import KVPlan
from disagg_operator.names import Role
from disagg_operator.pool_plan import AutoscalingPlan, ChatTemplatePlan, EnvVar, ModelSource, PoolPlan, config_hash
from disagg_operator.spec import CPUPoolSpec, DisaggregatedModelSpec, GPUPoolSpec, PoolSpec, SpecError
from disagg_sidecar import wire

DEFAULT_CPU_TARGET = 80
# Startup budgets before Kubernetes gives up on a pod: weights download + load vs tokenizer only.
GPU_STARTUP_SECONDS = 1800
CPU_STARTUP_SECONDS = 600


@dataclass(frozen=True)
class PoolInputs:
    """What every pool of one model is built from."""

    spec: DisaggregatedModelSpec
    name: str  # the DisaggregatedModel's
    model: ModelSource
    template: ChatTemplatePlan | None
    kv: KVPlan
    render_tier: bool
    sidecar: Mapping[str, Any]  # the sidecar's configuration file: it lives in decode pods
    # Flag groups, spelled once and reused verbatim: what keeps render, derender and decode agreeing.
    shared: tuple[str, ...]
    tokenize: tuple[str, ...]
    parse: tuple[str, ...]


def _merge_env(*groups: Sequence[EnvVar]) -> tuple[EnvVar, ...]:
    """Later groups override earlier ones by name (a container's env is a map keyed by name)."""
    merged: dict[str, EnvVar] = {}
    for group in groups:
        for var in group:
            merged[var.name] = var
    return tuple(merged.values())


def _user_env(pool: PoolSpec, spec: DisaggregatedModelSpec) -> list[EnvVar]:
    return [EnvVar(e.name, e.value, e.value_from) for e in (*spec.model.env, *pool.env)]


def _with_plugin(env: tuple[EnvVar, ...], plugin: str, switch: str) -> tuple[EnvVar, ...]:
    """Add ``plugin`` to VLLM_PLUGINS, keeping plugins the user listed (it is also an allowlist);
    ``switch``: the spec field that turned it on."""
    current = next((e for e in env if e.name == engine_args.VLLM_PLUGINS), None)
    if current is not None and current.value_from is not None:
        raise SpecError([f"env {engine_args.VLLM_PLUGINS} must be a plain value when {switch} is on"])
    listed = [n for n in re.split(r"[,\s]+", current.value or "") if n] if current else []
    value = ",".join(listed if plugin in listed else [*listed, plugin])
    return _merge_env(env, [EnvVar(engine_args.VLLM_PLUGINS, value)])


def _with_api_key(env: tuple[EnvVar, ...], spec: DisaggregatedModelSpec, model: str) -> tuple[EnvVar, ...]:
    """The engine key from the model's Secret (security.engineAPIKey), over any value of the user's."""
    if not spec.security.engine_api_key.enabled:
        return env
    ref = {"secretKeyRef": {"name": names.engine_api_key_secret(model), "key": names.API_KEY_KEY}}
    return _merge_env(env, [EnvVar(engine_args.VLLM_API_KEY, None, ref)])


def _autoscaling(pool: PoolSpec) -> AutoscalingPlan | None:
    a = pool.autoscaling
    if a is None:
        return None
    if a.metrics is not None:
        metrics = tuple(a.metrics)
    else:
        target = a.target_cpu_utilization_percentage or DEFAULT_CPU_TARGET
        metrics = ({"type": "Resource", "resource": {"name": "cpu", "target": {
            "type": "Utilization", "averageUtilization": target}}},)
    return AutoscalingPlan(a.min_replicas, a.max_replicas, metrics)


def _pool_plan(i: PoolInputs, role: Role, pool: PoolSpec, launcher: Launcher, args: Sequence[str],
               env: tuple[EnvVar, ...], side_ports: tuple[int, ...] = (), uses_template: bool = False) -> PoolPlan:
    spec, template = i.spec, i.template
    gpu = isinstance(pool, GPUPoolSpec)
    env = _with_api_key(env, spec, i.name)
    vllm_args = (*args, *(engine_args.TLS_FLAGS if spec.security.tls else ()), *spec.model.engine_args,
                 *pool.extra_args)
    shared_claim = i.kv.shared_claim if gpu else None
    effective: dict[str, Any] = {
        "role": role, "image": spec.engine.gpu_image if gpu else spec.engine.cpu_image,
        "pullPolicy": spec.engine.image_pull_policy, "launcher": launcher,
        "model": [i.model.argument, i.model.revision, i.model.claim], "args": vllm_args,
        "env": [e.to_k8s() for e in env], "port": spec.engine.port, "sidePorts": side_ports,
        "resources": pool.resources, "nodeSelector": pool.node_selector, "tolerations": pool.tolerations,
        "affinity": pool.affinity, "template": template.digest if uses_template and template else None,
        "kvClaim": shared_claim,
    }
    if role == Role.DECODE:  # the sidecar lives in decode pods: its config rolls them too
        effective["sidecar"] = [spec.router.image, i.sidecar, spec.router.resources]
    pod_labels = (names.inference_pool_labels(i.name, role)
                  if spec.router.inference_pool.enabled and role in (Role.DECODE, Role.PREFILL) else {})
    if pod_labels:  # in the hash: labels dropped from a template are no drift, a changed hash is
        effective["podLabels"] = pod_labels
    if spec.engine.cache_claim:  # only when set: pools without one keep their hash
        effective["cacheClaim"] = spec.engine.cache_claim
    return PoolPlan(
        role=role, name=names.pool_name(i.name, role), replicas=pool.replicas, launcher=launcher,
        image=effective["image"], image_pull_policy=spec.engine.image_pull_policy, gpu=gpu,
        vllm_args=vllm_args, env=env, port=spec.engine.port, side_channel_ports=side_ports,
        uses_chat_template=uses_template and template is not None,
        kv_shared_path=i.kv.shared_path if gpu else None, kv_shared_claim=shared_claim, resources=pool.resources,
        cache_claim=spec.engine.cache_claim,
        node_selector=pool.node_selector, tolerations=tuple(pool.tolerations) if pool.tolerations else None,
        affinity=pool.affinity, autoscaling=_autoscaling(pool),
        startup_seconds=GPU_STARTUP_SECONDS if gpu else CPU_STARTUP_SECONDS, config_hash=config_hash(effective),
        pod_labels=tuple(pod_labels.items()),
        planned=spec.autoscaling is not None and role in (Role.PREFILL, Role.DECODE),
    )


def _parallel(pool: GPUPoolSpec) -> list[str]:
    p = pool.parallelism
    return engine_args.parallel_flags(p.tensor, p.data, p.expert)


def prefill_pool(i: PoolInputs, pool: GPUPoolSpec) -> PoolPlan:
    env, ports = i.kv.side_channel_env(pool)
    # Fed by the render tier, prefill only ever sees token ids: no tokenizer, template or parsers.
    # Without a render tier it renders prompts itself, so it needs the template (never parsers).
    role_args = [engine_args.TOKENS_ONLY] if i.render_tier else list(i.tokenize)
    args = [*i.shared, *role_args, engine_args.ENABLE_SCALE_OUT, *_parallel(pool), *i.kv.flags(Role.PREFILL)]
    return _pool_plan(i, Role.PREFILL, pool, Launcher.SERVE, args, _merge_env(env, _user_env(pool, i.spec)), ports,
                      uses_template=not i.render_tier)


def decode_pool(i: PoolInputs, pool: GPUPoolSpec) -> PoolPlan:
    env, ports = i.kv.side_channel_env(pool)
    decode_env = _merge_env(env, _user_env(pool, i.spec))
    if i.spec.engine.extension:
        decode_env = _with_plugin(decode_env, wire.ENGINE_EXTENSION, "engine.extension")
    args = [*i.shared, *i.tokenize, *i.parse, engine_args.ENABLE_SCALE_OUT, *_parallel(pool), *i.kv.flags(Role.DECODE)]
    return _pool_plan(i, Role.DECODE, pool, Launcher.SERVE, args, decode_env, ports, uses_template=True)


def cpu_pool(i: PoolInputs, role: Role, pool: CPUPoolSpec) -> PoolPlan:
    """Render or derender: `vllm launch render` with the decode engine's template and parsers."""
    args = [*i.shared, *i.tokenize, *i.parse, *engine_args.renderer_flags(pool.renderer_workers)]
    env = _merge_env(_user_env(pool, i.spec))
    if derender.render_extension(i.spec, i.render_tier):
        env = _with_plugin(env, wire.ENGINE_EXTENSION, "engine.renderExtension")
    return _pool_plan(i, role, pool, Launcher.LAUNCH_RENDER, args, env, uses_template=True)
