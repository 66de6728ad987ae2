"""spec → the sidecar's configuration (``disagg_sidecar.config.SidecarConfig``, its one definition).

The operator's ConfigMap and local mode differ only in ``Endpoints``: Services and EndpointSlice
discovery in a cluster (``cluster_endpoints``), fixed loopback URLs locally (``static_endpoints``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from disagg_operator import engine_args, names
from disagg_operator.spec import DisaggregatedModelSpec
from disagg_sidecar.config import (
    TLS, Auth, Decode, Engine, EngineFeatures, EndpointSliceDiscovery, Exposition, Limits, Listen, Prefill,
    RenderTier, SidecarConfig, StaticDiscovery, Tier, Timeouts, TracingConfig,
)
from disagg_sidecar.config import Discovery


# Where decode pods mount the API key Secrets for the sidecar (outside the config's read-only mount).
KEYS_DIR = "/var/run/disagg"
ENGINE_KEY_DIR = f"{KEYS_DIR}/engine-api-key"
CLIENT_KEY_DIR = f"{KEYS_DIR}/client-api-key"


def auth(spec: DisaggregatedModelSpec) -> Auth:
    """The sidecar's key files in a decode pod: each Secret's key is mounted as ``<dir>/api-key``."""
    security = spec.security
    files = {"engine_api_key_file": f"{ENGINE_KEY_DIR}/{names.API_KEY_KEY}" if security.engine_api_key.enabled else None,
             "client_api_key_file": f"{CLIENT_KEY_DIR}/{names.API_KEY_KEY}" if security.client_api_key else None}
    return Auth(**{k: v for k, v in files.items() if v})  # unset stays unset: the file keeps the sidecar's defaults


def tracing(spec: DisaggregatedModelSpec, attributes: Mapping[str, str]) -> TracingConfig:
    """``monitoring.tracing`` for the decode pods' sidecars: their spans say which pool (and model,
    namespace, KV revision: ``attributes``) they come from."""
    assert spec.monitoring.tracing is not None
    return TracingConfig(otlp_endpoint=spec.monitoring.tracing.otlp_endpoint,
                         sample_ratio=spec.monitoring.tracing.sample_ratio,
                         resource_attributes={"disagg.pool": "decode", **attributes})


@dataclass(frozen=True)
class Endpoints:
    """Where the sidecar finds each tier; None: the tier is absent and decode does the step."""

    decode_url: str
    render_url: str | None
    derender_url: str | None
    prefill_discovery: Discovery | None
    tls: TLS | None = None


def cluster_endpoints(
    *, namespace: str, engine_port: int, render_service: str | None, derender_service: str | None,
    prefill_service: str | None, tls_name: str | None = None,
) -> Endpoints:
    """In Kubernetes: render/derender through their Services, prefill pods from EndpointSlices;
    ``tls_name``: engines serve HTTPS with certificates for that name (security.tls)."""
    scheme = "https" if tls_name else "http"

    def url(service: str | None) -> str | None:
        return names.service_url(service, namespace, engine_port, scheme) if service else None

    return Endpoints(
        decode_url=f"{scheme}://127.0.0.1:{engine_port}", render_url=url(render_service),
        derender_url=url(derender_service),
        prefill_discovery=None if prefill_service is None else EndpointSliceDiscovery(
            namespace=namespace, service=prefill_service, port_name=names.ENGINE_PORT, port=engine_port,
            **({"scheme": scheme} if tls_name else {})),  # unset stays unset: no new config, no roll
        tls=TLS(ca_file=f"{engine_args.TLS_CA_DIR}/ca.crt", server_name=tls_name) if tls_name else None,
    )


def static_endpoints(
    *, decode_url: str, render_url: str | None, derender_url: str | None, prefill_urls: Sequence[str],
) -> Endpoints:
    """For local processes: fixed URLs (an empty prefill list means decode prefills)."""
    return Endpoints(decode_url=decode_url, render_url=render_url, derender_url=derender_url,
                     prefill_discovery=StaticDiscovery(urls=tuple(prefill_urls)) if prefill_urls else None)


def _tier(url: str | None) -> Tier:
    return Tier(mode="remote", url=url) if url else Tier(mode="local")


def _render_tier(url: str | None, policy: str) -> RenderTier:
    """The render tier; its failure policy written only when the pool exists and it is not the default
    (unset stays unset: no new config, no roll)."""
    if not url:
        return RenderTier(mode="local")
    return RenderTier(mode="remote", url=url, **({"failure_policy": "decode"} if policy == "decodeRenders" else {}))


def build(
    spec: DisaggregatedModelSpec, *, served_name: str, endpoints: Endpoints, kv_connector: str | None,
    prefill_tokens_only: bool, listen: Listen, derender_sessions: bool, min_prompt_tokens: int = 0,
    block_tokens: int = 16, side_channel_ports: tuple[int, ...] = (), trace_attributes: Mapping[str, str] = {},
) -> SidecarConfig:
    """``derender_sessions``: the render tier may offer them (``derender.derender_sessions``);
    ``min_prompt_tokens``: the shortest prompt the KV connector carries; ``block_tokens``: the
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
            # What the prefill engines' kv_transfer_params may name (the sidecar's default: vLLM's 5600 alone).
            **({"side_channel_ports": side_channel_ports}
               if side_channel_ports and side_channel_ports != Prefill.model_fields["side_channel_ports"].default else {}),
        )
    t = router.timeouts
    keys = auth(spec)
    return SidecarConfig(
        **({"auth": keys} if keys.model_fields_set else {}), **({"tls": endpoints.tls} if endpoints.tls else {}),
        **({"tracing": tracing(spec, trace_attributes)} if spec.monitoring.tracing else {}),
        # The pool's endpoint picker scrapes the sidecar's port for vLLM's metrics (docs/llm-d.md); without a
        # pool Prometheus scrapes the engine itself, and a second copy of its series would count twice.
        **({"metrics": Exposition(include_engine=True)} if pool else {}),
        version=1, served_model_name=served_name, listen=listen, decode=Decode(url=endpoints.decode_url),
        render=_render_tier(endpoints.render_url, router.render_failure_policy),
        derender=_tier(endpoints.derender_url), prefill=prefill,
        kv_connector=kv_connector,
        timeouts=Timeouts(connect_seconds=t.connect_seconds, render_seconds=t.render_seconds,
                          prefill_seconds=t.prefill_seconds, decode_seconds=t.decode_seconds),
        retries=router.retries, max_body_bytes=router.max_body_bytes,
        # The engines run with one logprob candidate more than clients may ask for (engine_args.model_flags).
        limits=Limits(max_logprobs=spec.model.max_logprobs, **({"session_stream_interval": router.session_stream_interval}
                                                                if router.session_stream_interval else {})),
        engine=Engine(vllm_version=spec.engine.vllm_version, extension=spec.engine.extension,
                      prefill_tokens_only=prefill_tokens_only, derender_sessions=derender_sessions,
                      max_logprobs=engine_args.engine_max_logprobs(spec.model.max_logprobs),
                      features=EngineFeatures(**engine_args.vllm_features(spec.engine.vllm_version))),
    )
