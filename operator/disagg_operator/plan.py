"""spec → Plan: what runs in each tier, decided once, independent of Kubernetes objects.

A Plan says, per active pool, which launcher and flags vLLM gets, its environment, ports and
size, and a hash of the pool's effective configuration (``pools.py``); plus the sidecar's
configuration. ``objects/`` turns a Plan into Kubernetes objects; local mode turns the same Plan
into local processes, so a PoolPlan keeps apart what differs between the two:

- ``launcher`` + ``vllm_args``: the flags after `vllm serve MODEL` / `vllm launch render MODEL`,
  without the model and without ``--host/--port`` (``PoolPlan.argv`` adds those);
- ``Plan.model``: where the weights are (local mode may pass its own directory to ``argv``);
- ``env``: values, or Kubernetes ``valueFrom`` sources (``POD_IP`` is the only one the plan
  itself emits; a local realisation substitutes 127.0.0.1);
- inputs of ``build_plan``: the chat template path, the KV connector's shared directory, and
  whether the engines can import the disagg package (pods: with the engine extension).

Prefill replicas 0: no prefill pool and no KV config; the sidecar prefills on decode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_operator import derender, engine_args, names, sidecar_config
from disagg_operator.kv import KV_SHARED_PATH, KVPlan, kv_plan
from disagg_operator.names import Role
from disagg_operator.pool_plan import HEALTH_PATH, ChatTemplatePlan, ModelSource, PoolPlan, config_hash
from disagg_operator.pools import PoolInputs, cpu_pool, decode_pool, prefill_pool
from disagg_operator.spec import DisaggregatedModelSpec, PoolSpec
from disagg_sidecar.config import Listen, SidecarConfig, dump_config

CHAT_TEMPLATE_PATH = "/etc/disagg/chat-template/chat-template.jinja"
LISTEN_HOST = "0.0.0.0"


@dataclass(frozen=True)
class SidecarPlan:
    image: str
    port: int
    resources: Mapping[str, Any] | None
    config: SidecarConfig  # the cluster configuration (sidecar_config.cluster_endpoints)
    health_path: str = HEALTH_PATH


@dataclass(frozen=True)
class Plan:
    name: str
    namespace: str
    spec: DisaggregatedModelSpec
    served_name: str
    model: ModelSource
    chat_template: ChatTemplatePlan | None
    pools: tuple[PoolPlan, ...]  # active pools only, in names.ROLES order
    sidecar: SidecarPlan
    kv: KVPlan
    derender_shared: bool  # the render pool also derenders (Service <name>-derender → render pods)
    derender_strategy: derender.Strategy  # how streams are derendered (status.derender.strategy)
    config_hash: str
    service_type: str
    service_port: int
    kv_revision: str | None = None  # with a prefill pool: what prefill and decode must agree on (kv_revision)

    def pool(self, role: Role) -> PoolPlan | None:
        return next((p for p in self.pools if p.role == role), None)

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(p.role for p in self.pools)

    @property
    def kv_connector(self) -> str | None:
        """None when no KV transfer happens (no prefill pool)."""
        return self.kv.name

    @property
    def min_prompt_tokens(self) -> int:
        """Shorter prompts skip the prefill pool (what the connector can carry)."""
        return self.kv.min_prompt_tokens

    def side_channel_ports(self, pool: PoolPlan) -> list[tuple[str, int]]:
        """(name, number) of the KV connector's side-channel ports of ``pool``."""
        channel = self.kv.side_channel
        if channel is None:
            return []
        return [(names.side_channel_port_name(channel.port_name, rank), port)
                for rank, port in enumerate(pool.side_channel_ports)]

    @property
    def disaggregated(self) -> bool:
        return self.pool(Role.PREFILL) is not None

    @property
    def render_tier(self) -> bool:
        return self.pool(Role.RENDER) is not None

    @property
    def endpoint(self) -> str:
        return names.service_url(names.client_service(self.name), self.namespace, self.service_port)

    def sidecar_config(self, endpoints: sidecar_config.Endpoints, listen_port: int | None = None,
                       listen_host: str = LISTEN_HOST) -> SidecarConfig:
        """The sidecar configuration for other endpoints (local mode: ``sidecar_config.static_endpoints``)."""
        return _sidecar_config(self.spec, self.served_name, self.kv, self.render_tier, endpoints,
                               Listen(host=listen_host, port=listen_port or self.spec.router.port),
                               _trace_attributes(self.name, self.namespace, self.kv_revision))


def _trace_attributes(name: str, namespace: str, kv_revision: str | None) -> dict[str, str]:
    """What the sidecars' spans say of where they come from (``monitoring.tracing``)."""
    return {"disagg.model": name, "k8s.namespace.name": namespace,
            **({"disagg.kv_revision": kv_revision} if kv_revision else {})}


def _sidecar_config(spec: DisaggregatedModelSpec, served_name: str, kv: KVPlan, render_tier: bool,
                    endpoints: sidecar_config.Endpoints, listen: Listen,
                    trace_attributes: dict[str, str]) -> SidecarConfig:
    return sidecar_config.build(spec, served_name=served_name, endpoints=endpoints, kv_connector=kv.name,
                                prefill_tokens_only=render_tier, listen=listen,
                                derender_sessions=derender.derender_sessions(spec, render_tier),
                                min_prompt_tokens=kv.min_prompt_tokens, block_tokens=kv.block_tokens,
                                side_channel_ports=kv.side_channel_env(spec.pools.prefill)[1],
                                trace_attributes=trace_attributes)


def _active(pool: PoolSpec | None) -> bool:
    return pool is not None and pool.replicas > 0


def build_plan(
    spec: DisaggregatedModelSpec, name: str, namespace: str, *, chat_template_path: str = CHAT_TEMPLATE_PATH,
    kv_shared_path: str = KV_SHARED_PATH, engine_package: bool | None = None,
) -> Plan:
    """The whole deployment of one DisaggregatedModel, derived from its spec (pure).

    ``engine_package``: the engines can import the disagg package (None: they can when the engine
    extension is on, which needs it in the image)."""
    m, pools = spec.model, spec.pools
    disaggregated = _active(pools.prefill)
    render_tier = _active(pools.render)
    derender_separate = render_tier and _active(pools.derender)

    template: ChatTemplatePlan | None = None
    if m.chat_template is not None:
        ref = m.chat_template.config_map_ref
        template = ChatTemplatePlan(chat_template_path, inline=m.chat_template.inline,
                                    config_map=ref.name if ref else None, key=ref.key if ref else None)
    kv = kv_plan(spec, disaggregated=disaggregated, shared_path=kv_shared_path,
                 engine_package=spec.engine.extension if engine_package is None else engine_package,
                 engines=[pools.decode, *([pools.prefill] if disaggregated else [])])

    def service(role: Role, active: bool) -> str | None:
        return names.pool_service(name, role) if active else None

    source = ModelSource.parse(m.source, m.revision)
    revision = kv_revision(spec, source, kv) if disaggregated else None

    sidecar_cfg = _sidecar_config(spec, m.served_name or name, kv, render_tier, sidecar_config.cluster_endpoints(
        namespace=namespace, engine_port=spec.engine.port, render_service=service(Role.RENDER, render_tier),
        # <name>-derender always selects whichever pool derenders, so switching between a shared
        # and a separate derender pool re-points a Service instead of rolling decode.
        derender_service=service(Role.DERENDER, render_tier),
        # Only the prefill pods of this decode pod's KV revision (a rollout never pairs mismatched pods).
        prefill_service=names.prefill_revision_service(name, revision) if revision else None,
        tls_name=names.engine_tls_name(name, namespace) if spec.security.tls else None,
    ), Listen(host=LISTEN_HOST, port=spec.router.port), _trace_attributes(name, namespace, revision))

    inputs = PoolInputs(
        spec=spec, name=name, model=source, template=template, kv=kv,
        render_tier=render_tier, sidecar=dump_config(sidecar_cfg),
        shared=tuple(engine_args.model_flags(m.served_name or name, m.max_model_len, m.max_logprobs)),
        tokenize=tuple(engine_args.chat_template_flags(template.path if template else None,
                                                       m.default_chat_template_kwargs)),
        parse=tuple(engine_args.parser_flags(m.tool_call_parser, m.reasoning_parser, m.enable_auto_tool_choice)),
    )
    plans = [
        *([prefill_pool(inputs, pools.prefill)] if disaggregated else []),
        decode_pool(inputs, pools.decode),
        *([cpu_pool(inputs, Role.RENDER, pools.render)] if render_tier else []),
        *([cpu_pool(inputs, Role.DERENDER, pools.derender)] if derender_separate and pools.derender else []),
    ]
    return Plan(
        name=name, namespace=namespace, spec=spec, served_name=m.served_name or name, model=inputs.model,
        chat_template=template, pools=tuple(plans),
        sidecar=SidecarPlan(spec.router.image, spec.router.port, spec.router.resources, sidecar_cfg), kv=kv,
        derender_shared=render_tier and not derender_separate, derender_strategy=derender.strategy(spec, render_tier),
        config_hash=config_hash({p.role: p.config_hash for p in plans}), service_type=spec.router.service.type,
        service_port=spec.router.service.port, kv_revision=revision,
    )


def kv_revision(spec: DisaggregatedModelSpec, model: ModelSource, kv: KVPlan) -> str:
    """The hash of what decides whether prefill's KV cache is usable by decode: the weights, the engine
    image and version, the model-wide engine flags (dtype, context length, ...) and the KV connector's
    configuration. Sizes, placement and pool-only flags are not in it: changing those pairs as before."""
    return config_hash({
        "model": [model.argument, model.revision], "image": spec.engine.gpu_image,
        "vllm": spec.engine.vllm_version, "args": list(spec.model.engine_args),
        "maxModelLen": spec.model.max_model_len, "kv": [kv.name, dict(kv.extra_config), kv.engine_module],
        "blockTokens": kv.block_tokens,
    })
