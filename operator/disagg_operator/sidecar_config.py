"""spec → the sidecar's configuration (``disagg_sidecar.config.SidecarConfig``, its one definition).

The operator's ConfigMap and local mode differ only in ``Endpoints``: Services and EndpointSlice
discovery in a cluster (``cluster_endpoints``), fixed loopback URLs locally (``static_endpoints``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from disagg_operator import engine_args, names
from disagg_operator.spec import DisaggregatedModelSpec
from disagg_sidecar.config import (
    Decode, Engine, EngineFeatures, EndpointSliceDiscovery, Listen, Prefill, SidecarConfig, StaticDiscovery, Tier,
    Timeouts,
)
from disagg_sidecar.discovery_config import Discovery


@dataclass(frozen=True)
class Endpoints:
    """Where the sidecar finds each tier; None: the tier is absent and decode does the step."""

    decode_url: str
    render_url: str | None
    derender_url: str | None
    prefill_discovery: Discovery | None


def cluster_endpoints(
    *, namespace: str, engine_port: int, render_service: str | None, derender_service: str | None,
    prefill_service: str | None,
) -> Endpoints:
    """In Kubernetes: render/derender through their Services, prefill pods from EndpointSlices."""
    def url(service: str | None) -> str | None:
        return names.service_url(service, namespace, engine_port) if service else None

    return Endpoints(
        decode_url=f"http://127.0.0.1:{engine_port}", render_url=url(render_service), derender_url=url(derender_service),
        prefill_discovery=None if prefill_service is None else EndpointSliceDiscovery(
            namespace=namespace, service=prefill_service, port_name=names.ENGINE_PORT, port=engine_port),
    )


def static_endpoints(
    *, decode_url: str, render_url: str | None, derender_url: str | None, prefill_urls: Sequence[str],
) -> Endpoints:
    """For local processes: fixed URLs (an empty prefill list means decode prefills)."""
    return Endpoints(decode_url=decode_url, render_url=render_url, derender_url=derender_url,
                     prefill_discovery=StaticDiscovery(urls=tuple(prefill_urls)) if prefill_urls else None)


def _tier(url: str | None) -> Tier:
    return Tier(mode="remote", url=url) if url else Tier(mode="local")


def build(
    spec: DisaggregatedModelSpec, *, served_name: str, endpoints: Endpoints, kv_connector: str | None,
    prefill_tokens_only: bool, listen: Listen, min_prompt_tokens: int = 0, block_tokens: int = 16,
) -> SidecarConfig:
    """``min_prompt_tokens``: the shortest prompt the KV connector carries; ``block_tokens``: the
    engines' KV block size."""
    router = spec.router
    pool = router.inference_pool.enabled  # an endpoint picker names prefill pods at the sidecar's port
    if endpoints.prefill_discovery is None:
        prefill = Prefill(mode="local")
    else:
        prefill = Prefill(
            mode="remote", discovery=endpoints.prefill_discovery, selection=router.prefill_selection,
            affinity_block_tokens=block_tokens, trust_prefiller_header=router.trust_prefiller_header or pool,
            failure_policy=router.prefill_failure_policy, **({"pool_port": router.port} if pool else {}),
            **({"affinity_load_bound_percent": router.prefill_load_bound_percent}
               if router.prefill_selection == "prefix-affinity" else {}),
            # Shorter prompts: the KV connector cannot carry them, or the user finds decode cheaper.
            **({"min_prompt_tokens": shortest} if (shortest := max(min_prompt_tokens, router.min_prefill_tokens)) else {}),
        )
    t = router.timeouts
    return SidecarConfig(
        version=1, served_model_name=served_name, listen=listen, decode=Decode(url=endpoints.decode_url),
        render=_tier(endpoints.render_url), derender=_tier(endpoints.derender_url), prefill=prefill,
        kv_connector=kv_connector,
        timeouts=Timeouts(connect_seconds=t.connect_seconds, render_seconds=t.render_seconds,
                          prefill_seconds=t.prefill_seconds, decode_seconds=t.decode_seconds),
        retries=router.retries, max_body_bytes=router.max_body_bytes,
        engine=Engine(vllm_version=spec.engine.vllm_version, extension=spec.engine.extension,
                      prefill_tokens_only=prefill_tokens_only,
                      features=EngineFeatures(**engine_args.vllm_features(spec.engine.vllm_version))),
    )
