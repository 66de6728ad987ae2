"""spec → Plan: what runs in each tier, decided once, independent of Kubernetes objects.

A Plan says, per active pool, which launcher and flags vLLM gets, its environment, ports and
size, and a hash of the pool's effective configuration; plus the sidecar's configuration.
``objects/`` turns a Plan into Kubernetes objects; local mode turns the same Plan into local
processes, so a PoolPlan keeps apart what differs between the two:

- ``launcher`` + ``vllm_args``: the flags after `vllm serve MODEL` / `vllm launch render MODEL`,
  without the model and without ``--host/--port`` (``PoolPlan.argv`` adds those);
- ``Plan.model``: where the weights are (local mode may pass its own directory to ``argv``);
- ``env``: values, or Kubernetes ``valueFrom`` sources (``POD_IP`` is the only one the plan
  itself emits; a local realisation substitutes 127.0.0.1);
- the chat template path is a parameter of ``build_plan``.

Tier rules (vllm-scale-out-protocol.md §1, §5; anchors.md "Suggestions"):
- render and derender: ``vllm launch render`` on the CPU image, template + parser flags,
  ``--renderer-num-workers``;
- decode: the *same* template + parser flags, ``--enable-scale-out``, parallelism, the KV config
  when a prefill pool exists, ``VLLM_PLUGINS=disagg`` with the engine extension;
- prefill: ``--tokens-only`` when the render tier feeds it (then no template/parser flags: it
  never sees text), ``--enable-scale-out``, the KV config, NIXL side-channel env;
- prefill replicas 0: no prefill pool and no KV config; the sidecar prefills on decode.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from disagg_operator import engine_args, sidecar_config
from disagg_operator.engine_args import Launcher
from disagg_operator.spec import CPUPoolSpec, DisaggregatedModelSpec, GPUPoolSpec, PoolSpec, SpecError
from disagg_sidecar.connectors import REGISTRY as KV_CONNECTORS

CHAT_TEMPLATE_PATH = "/etc/disagg/chat-template/chat-template.jinja"
MODEL_MOUNT_ROOT = "/models"  # pvc://CLAIM/PATH is mounted at /models/CLAIM
KV_SHARED_PATH = "/var/lib/disagg/kv"  # ExampleConnector's shared_storage_path in pods
DEFAULT_CPU_TARGET = 80
HEALTH_PATH = "/health"
# Startup budgets before Kubernetes gives up on a pod: weights download + load vs tokenizer only.
GPU_STARTUP_SECONDS = 1800
CPU_STARTUP_SECONDS = 600

POD_IP: Mapping[str, Any] = {"fieldRef": {"fieldPath": "status.podIP"}}


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    RENDER = "render"
    DERENDER = "derender"


ROLES: tuple[Role, ...] = (Role.PREFILL, Role.DECODE, Role.RENDER, Role.DERENDER)


@dataclass(frozen=True)
class ModelSource:
    """Where the weights are and what vLLM gets as MODEL."""

    source: str
    scheme: Literal["hf", "pvc", "path"]
    argument: str  # repo id, mounted path, or the path itself
    revision: str | None = None
    claim: str | None = None  # pvc:// only

    @classmethod
    def parse(cls, source: str, revision: str | None = None) -> ModelSource:
        if source.startswith("hf://"):
            return cls(source, "hf", source.removeprefix("hf://"), revision)
        if source.startswith("pvc://"):
            claim, _, path = source.removeprefix("pvc://").partition("/")
            mounted = f"{MODEL_MOUNT_ROOT}/{claim}" + (f"/{path.strip('/')}" if path.strip("/") else "")
            return cls(source, "pvc", mounted, None, claim)
        return cls(source, "path", source)


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str | None = None
    value_from: Mapping[str, Any] | None = None  # a Kubernetes EnvVarSource

    def to_k8s(self) -> dict[str, Any]:
        if self.value_from is not None:
            return {"name": self.name, "valueFrom": dict(self.value_from)}
        return {"name": self.name, "value": self.value or ""}


@dataclass(frozen=True)
class ChatTemplatePlan:
    """The template file every tokenizing tier reads (mounted at ``path`` in pods)."""

    path: str
    inline: str | None = None
    config_map: str | None = None  # a user ConfigMap (else the model's own ConfigMap holds ``inline``)
    key: str | None = None

    @property
    def digest(self) -> str:
        content = self.inline if self.inline is not None else f"configmap:{self.config_map}/{self.key}"
        return hashlib.sha256(content.encode()).hexdigest()


@dataclass(frozen=True)
class AutoscalingPlan:
    min_replicas: int
    max_replicas: int
    metrics: tuple[Mapping[str, Any], ...]  # autoscaling/v2 MetricSpec


@dataclass(frozen=True)
class PoolPlan:
    role: Role
    name: str  # Deployment name, `<model>-<role>`
    replicas: int
    launcher: Launcher
    image: str
    image_pull_policy: str | None
    gpu: bool
    vllm_args: tuple[str, ...]
    env: tuple[EnvVar, ...]
    port: int
    side_channel_ports: tuple[int, ...]  # NIXL, one per data-parallel rank; empty without NIXL
    uses_chat_template: bool
    kv_shared_claim: str | None
    resources: Mapping[str, Any] | None
    node_selector: Mapping[str, str] | None
    tolerations: tuple[Mapping[str, Any], ...] | None
    affinity: Mapping[str, Any] | None
    autoscaling: AutoscalingPlan | None
    startup_seconds: int
    config_hash: str
    health_path: str = HEALTH_PATH

    def argv(self, model: ModelSource, *, model_arg: str | None = None, port: int | None = None,
             host: str = "0.0.0.0") -> list[str]:
        """The full command line; ``model_arg`` replaces the model location (and drops --revision)."""
        return engine_args.vllm_argv(
            self.launcher, model_arg or model.argument, self.vllm_args, port=self.port if port is None else port,
            revision=model.revision if model_arg is None else None, host=host,
        )


@dataclass(frozen=True)
class SidecarPlan:
    image: str
    port: int
    resources: Mapping[str, Any] | None
    config: Mapping[str, Any]  # the cluster configuration (sidecar_config.cluster_endpoints)
    health_path: str = HEALTH_PATH


@dataclass(frozen=True)
class Plan:
    name: str
    namespace: str
    spec: DisaggregatedModelSpec
    served_name: str
    model: ModelSource
    chat_template: ChatTemplatePlan | None
    pools: tuple[PoolPlan, ...]  # active pools only, in ROLES order
    sidecar: SidecarPlan
    kv_connector: str | None  # None when no KV transfer happens (no prefill pool)
    min_prompt_tokens: int  # shorter prompts skip the prefill pool (what the connector can carry)
    derender_shared: bool  # the render pool also derenders (Service <name>-derender → render pods)
    config_hash: str
    service_type: str
    service_port: int

    def pool(self, role: Role) -> PoolPlan | None:
        return next((p for p in self.pools if p.role == role), None)

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(p.role for p in self.pools)

    @property
    def disaggregated(self) -> bool:
        return self.pool(Role.PREFILL) is not None

    @property
    def render_tier(self) -> bool:
        return self.pool(Role.RENDER) is not None

    @property
    def endpoint(self) -> str:
        return sidecar_config.service_url(self.name, self.namespace, self.service_port)

    def sidecar_config(self, endpoints: sidecar_config.Endpoints, listen_port: int | None = None) -> dict[str, Any]:
        """The sidecar configuration for other endpoints (local mode: ``sidecar_config.static_endpoints``)."""
        return sidecar_config.build(
            self.spec, served_name=self.served_name, endpoints=endpoints, kv_connector=self.kv_connector,
            prefill_tokens_only=self.render_tier, listen_port=listen_port, min_prompt_tokens=self.min_prompt_tokens,
        )


# --- helpers ---------------------------------------------------------------------------------

def config_hash(value: Any) -> str:
    return hashlib.sha256(engine_args.canonical_json(value).encode()).hexdigest()[:16]


def _active(pool: PoolSpec | None) -> bool:
    return pool is not None and pool.replicas > 0


def _merge_env(*groups: Sequence[EnvVar]) -> tuple[EnvVar, ...]:
    """Later groups override earlier ones by name (a container's env is a map keyed by name)."""
    merged: dict[str, EnvVar] = {}
    for group in groups:
        for var in group:
            merged[var.name] = var
    return tuple(merged.values())


def _user_env(pool: PoolSpec, spec: DisaggregatedModelSpec) -> list[EnvVar]:
    return [EnvVar(e.name, e.value, e.value_from) for e in (*spec.model.env, *pool.env)]


def _with_plugin(env: tuple[EnvVar, ...], plugin: str) -> tuple[EnvVar, ...]:
    """Add ``plugin`` to VLLM_PLUGINS, keeping plugins the user listed (it is also an allowlist)."""
    current = next((e for e in env if e.name == engine_args.VLLM_PLUGINS), None)
    if current is not None and current.value_from is not None:
        raise SpecError([f"env {engine_args.VLLM_PLUGINS} must be a plain value when engine.extension is on"])
    names = [n for n in re.split(r"[,\s]+", current.value or "") if n] if current else []
    value = ",".join(names if plugin in names else [*names, plugin])
    return _merge_env(env, [EnvVar(engine_args.VLLM_PLUGINS, value)])


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


# --- the plan --------------------------------------------------------------------------------

def build_plan(
    spec: DisaggregatedModelSpec, name: str, namespace: str, *, chat_template_path: str = CHAT_TEMPLATE_PATH,
) -> Plan:
    """The whole deployment of one DisaggregatedModel, derived from its spec (pure)."""
    m, pools, kv = spec.model, spec.pools, spec.kv_transfer
    served_name = m.served_name or name
    model = ModelSource.parse(m.source, m.revision)

    disaggregated = _active(pools.prefill)
    render_tier = _active(pools.render)
    derender_separate = render_tier and _active(pools.derender)
    connector = kv.connector if disaggregated and kv.connector != engine_args.NO_CONNECTOR else None
    nixl = connector == engine_args.NIXL

    template: ChatTemplatePlan | None = None
    if m.chat_template is not None:
        ref = m.chat_template.config_map_ref
        template = ChatTemplatePlan(
            chat_template_path, inline=m.chat_template.inline,
            config_map=ref.name if ref else None, key=ref.key if ref else None,
        )

    # Flag groups. `shared` and `tokenize` + `parse` are spelled once and reused verbatim, which
    # is what keeps render, derender and decode from disagreeing.
    shared = engine_args.model_flags(served_name, m.max_model_len)
    tokenize = engine_args.chat_template_flags(template.path if template else None, m.default_chat_template_kwargs)
    parse = engine_args.parser_flags(m.tool_call_parser, m.reasoning_parser, m.enable_auto_tool_choice)
    kv_shared_claim = None
    kv_extra = dict(kv.extra_config or {})
    if connector == engine_args.EXAMPLE:
        kv_extra.setdefault("shared_storage_path", KV_SHARED_PATH)
        kv_shared_claim = kv.shared_storage_claim
    kv_profile = KV_CONNECTORS[connector]() if connector in KV_CONNECTORS else None

    def kv_flags(role: Role) -> list[str]:
        if connector is None:
            return []
        kv_role = kv_profile.kv_roles[role] if kv_profile else "kv_both"
        # The connector's own engine class needs the disagg package, which extension images have.
        module = kv_profile.engine_module if kv_profile and spec.engine.extension else None
        return engine_args.kv_transfer_flags(engine_args.kv_transfer_config(connector, kv_extra, kv_role, module))

    # The shortest prompt the connector carries depends on the engines' KV block size.
    engines = [pools.decode, *([pools.prefill] if disaggregated else [])]
    block = max(engine_args.block_size([*m.engine_args, *p.extra_args], engine_args.requests_gpu(p.resources))
                for p in engines)
    min_prompt_tokens = kv_profile.min_prompt_tokens(block) if kv_profile else 0

    def nixl_env(pool: GPUPoolSpec) -> tuple[list[EnvVar], tuple[int, ...]]:
        if not nixl:
            return [], ()
        ports = tuple(kv.side_channel_port + rank for rank in range(pool.parallelism.data))
        return [
            EnvVar(engine_args.NIXL_SIDE_CHANNEL_HOST, value_from=POD_IP),
            EnvVar(engine_args.NIXL_SIDE_CHANNEL_PORT, str(kv.side_channel_port)),
        ], ports

    def pool_plan(role: Role, pool: PoolSpec, launcher: Launcher, args: list[str], env: Sequence[EnvVar],
                  side_ports: tuple[int, ...] = (), uses_template: bool = False) -> PoolPlan:
        gpu = isinstance(pool, GPUPoolSpec)
        vllm_args = (*args, *m.engine_args, *pool.extra_args)
        effective: dict[str, Any] = {
            "role": role, "image": spec.engine.gpu_image if gpu else spec.engine.cpu_image,
            "pullPolicy": spec.engine.image_pull_policy, "launcher": launcher,
            "model": [model.argument, model.revision, model.claim], "args": vllm_args,
            "env": [e.to_k8s() for e in env], "port": spec.engine.port, "sidePorts": side_ports,
            "resources": pool.resources, "nodeSelector": pool.node_selector, "tolerations": pool.tolerations,
            "affinity": pool.affinity, "template": template.digest if uses_template and template else None,
            "kvClaim": kv_shared_claim if gpu else None,
        }
        if role == Role.DECODE:  # the sidecar lives in decode pods: its config rolls them too
            effective["sidecar"] = [spec.router.image, sidecar_cfg, spec.router.resources]
        return PoolPlan(
            role=role, name=f"{name}-{role}", replicas=pool.replicas, launcher=launcher,
            image=effective["image"], image_pull_policy=spec.engine.image_pull_policy, gpu=gpu,
            vllm_args=vllm_args, env=tuple(env), port=spec.engine.port, side_channel_ports=side_ports,
            uses_chat_template=uses_template and template is not None,
            kv_shared_claim=kv_shared_claim if gpu else None, resources=pool.resources,
            node_selector=pool.node_selector, tolerations=tuple(pool.tolerations) if pool.tolerations else None,
            affinity=pool.affinity, autoscaling=_autoscaling(pool),
            startup_seconds=GPU_STARTUP_SECONDS if gpu else CPU_STARTUP_SECONDS,
            config_hash=config_hash(effective),
        )

    sidecar_cfg = sidecar_config.build(
        spec, served_name=served_name, kv_connector=connector, prefill_tokens_only=render_tier,
        min_prompt_tokens=min_prompt_tokens, endpoints=sidecar_config.cluster_endpoints(
            namespace=namespace, engine_port=spec.engine.port,
            render_service=f"{name}-render" if render_tier else None,
            # <name>-derender always selects whichever pool derenders, so switching between a shared
            # and a separate derender pool re-points a Service instead of rolling decode.
            derender_service=f"{name}-derender" if render_tier else None,
            prefill_service=f"{name}-prefill" if disaggregated else None,
        ),
    )

    plans: list[PoolPlan] = []
    if disaggregated:
        p = pools.prefill
        env, ports = nixl_env(p)
        # Fed by the render tier, prefill only ever sees token ids: no tokenizer, template or parsers.
        # Without a render tier it renders prompts itself, so it needs the template (never parsers).
        role_args = [engine_args.TOKENS_ONLY] if render_tier else tokenize
        args = [*shared, *role_args, engine_args.ENABLE_SCALE_OUT,
                *engine_args.parallel_flags(p.parallelism.tensor, p.parallelism.data, p.parallelism.expert),
                *kv_flags(Role.PREFILL)]
        plans.append(pool_plan(Role.PREFILL, p, Launcher.SERVE, args, _merge_env(env, _user_env(p, spec)), ports,
                               uses_template=not render_tier))

    d = pools.decode
    env, ports = nixl_env(d)
    decode_env = _merge_env(env, _user_env(d, spec))
    if spec.engine.extension:
        decode_env = _with_plugin(decode_env, engine_args.ENGINE_PLUGIN_NAME)
    args = [*shared, *tokenize, *parse, engine_args.ENABLE_SCALE_OUT,
            *engine_args.parallel_flags(d.parallelism.tensor, d.parallelism.data, d.parallelism.expert),
            *kv_flags(Role.DECODE)]
    plans.append(pool_plan(Role.DECODE, d, Launcher.SERVE, args, decode_env, ports, uses_template=True))

    def cpu_pool(role: Role, pool: CPUPoolSpec) -> PoolPlan:
        args = [*shared, *tokenize, *parse, *engine_args.renderer_flags(pool.renderer_workers)]
        return pool_plan(role, pool, Launcher.LAUNCH_RENDER, args, _merge_env(_user_env(pool, spec)),
                         uses_template=True)

    if render_tier:
        plans.append(cpu_pool(Role.RENDER, pools.render))
    if derender_separate:
        assert pools.derender is not None
        plans.append(cpu_pool(Role.DERENDER, pools.derender))

    sidecar = SidecarPlan(spec.router.image, spec.router.port, spec.router.resources, sidecar_cfg)
    return Plan(
        name=name, namespace=namespace, spec=spec, served_name=served_name, model=model, chat_template=template,
        pools=tuple(plans), sidecar=sidecar, kv_connector=connector, min_prompt_tokens=min_prompt_tokens,
        derender_shared=render_tier and not derender_separate,
        config_hash=config_hash({p.role: p.config_hash for p in plans}), service_type=spec.router.service.type,
        service_port=spec.router.service.port,
    )
