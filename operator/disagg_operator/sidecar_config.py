"""The routing sidecar's configuration file (``/etc/disagg/sidecar.yaml``), as a plain dict.

The operator writes it into the model's ConfigMap; local mode builds the same dict with
``static_endpoints`` (localhost URLs) instead of ``cluster_endpoints`` (Services and discovery).
Shape (version 1)::

    version: 1
    served_model_name: qwen3-8b
    listen: {host: 0.0.0.0, port: 8000}
    decode: {url: http://127.0.0.1:8200}                         # the engine in the same pod
    render:   {mode: remote, url: http://NAME-render.NS.svc:8200} | {mode: local}
    derender: {mode: remote, url: http://NAME-derender.NS.svc:8200} | {mode: local}
    prefill:  {mode: local}                                      # decode prefills (no prefill pool)
            | {mode: remote, discovery: {kind: endpointslices, namespace, service, port_name, port}
                                      | {kind: static, urls: [...]},
               selection: round-robin|random|least-requests, trust_prefiller_header: bool,
               failure_policy: fallback|fail, min_prompt_tokens: N}  # N: the connector's
    kv_connector: NixlConnector | ExampleConnector | null
    timeouts: {connect_seconds, render_seconds, prefill_seconds, decode_seconds}
    retries: 1
    max_body_bytes: 16777216
    engine: {vllm_version: 0.33.0, extension: false, prefill_tokens_only: true,
             features: {generate_output_mode_derender: true, render_hoists_kv_transfer_params: true,
                        render_parse_context: true}}

``mode: local`` means the decode engine does that step itself (it has the tokenizer, the chat
template and the parsers); ``remote`` means the sidecar calls that tier.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg_operator import engine_args
from disagg_operator.spec import DisaggregatedModelSpec

VERSION = 1
LISTEN_HOST = "0.0.0.0"
ENGINE_PORT_NAME = "engine"  # the container port name of every vLLM server (objects/ uses it too)


@dataclass(frozen=True)
class Endpoints:
    """Where the sidecar finds each tier; None: the tier is absent and decode does the step."""

    decode_url: str
    render_url: str | None
    derender_url: str | None
    prefill_discovery: Mapping[str, Any] | None


def service_url(service: str, namespace: str, port: int) -> str:
    return f"http://{service}.{namespace}.svc:{port}"


def cluster_endpoints(
    *, namespace: str, engine_port: int, render_service: str | None, derender_service: str | None,
    prefill_service: str | None,
) -> Endpoints:
    """In Kubernetes: render/derender through their Services, prefill pods from EndpointSlices."""
    return Endpoints(
        decode_url=f"http://127.0.0.1:{engine_port}",
        render_url=service_url(render_service, namespace, engine_port) if render_service else None,
        derender_url=service_url(derender_service, namespace, engine_port) if derender_service else None,
        prefill_discovery=None if prefill_service is None else {
            "kind": "endpointslices", "namespace": namespace, "service": prefill_service,
            "port_name": ENGINE_PORT_NAME, "port": engine_port,
        },
    )


def static_endpoints(
    *, decode_url: str, render_url: str | None, derender_url: str | None, prefill_urls: Sequence[str],
) -> Endpoints:
    """For local processes: fixed URLs (an empty prefill list means decode prefills)."""
    return Endpoints(
        decode_url=decode_url, render_url=render_url, derender_url=derender_url,
        prefill_discovery={"kind": "static", "urls": list(prefill_urls)} if prefill_urls else None,
    )


def _tier(url: str | None) -> dict[str, Any]:
    return {"mode": "remote", "url": url} if url else {"mode": "local"}


def build(
    spec: DisaggregatedModelSpec, *, served_name: str, endpoints: Endpoints, kv_connector: str | None,
    prefill_tokens_only: bool, listen_port: int | None = None, min_prompt_tokens: int = 0,
) -> dict[str, Any]:
    router = spec.router
    if endpoints.prefill_discovery is None:
        prefill: dict[str, Any] = {"mode": "local"}
    else:
        prefill = {
            "mode": "remote",
            "discovery": dict(endpoints.prefill_discovery),
            "selection": router.prefill_selection,
            "trust_prefiller_header": router.trust_prefiller_header,
            "failure_policy": router.prefill_failure_policy,
        }
        if min_prompt_tokens:  # shorter prompts: the KV connector cannot carry them
            prefill["min_prompt_tokens"] = min_prompt_tokens
    return {
        "version": VERSION,
        "served_model_name": served_name,
        "listen": {"host": LISTEN_HOST, "port": listen_port or router.port},
        "decode": {"url": endpoints.decode_url},
        "render": _tier(endpoints.render_url),
        "derender": _tier(endpoints.derender_url),
        "prefill": prefill,
        "kv_connector": kv_connector,
        "timeouts": {
            "connect_seconds": router.timeouts.connect_seconds,
            "render_seconds": router.timeouts.render_seconds,
            "prefill_seconds": router.timeouts.prefill_seconds,
            "decode_seconds": router.timeouts.decode_seconds,
        },
        "retries": router.retries,
        "max_body_bytes": router.max_body_bytes,
        "engine": {
            "vllm_version": spec.engine.vllm_version,
            "extension": spec.engine.extension,
            "prefill_tokens_only": prefill_tokens_only,
            "features": engine_args.vllm_features(spec.engine.vllm_version),
        },
    }
