"""The ``DisaggregatedModel`` API's security sections: NetworkPolicies and API keys (docs/security.md)."""

from __future__ import annotations

from pydantic import Field

from disagg_operator.spec_base import KubeObject, ShortString, WireModel


class NetworkPolicySpec(WireModel):
    """Per-model NetworkPolicies: engine ports reachable only from this model's own pods."""

    enabled: bool = Field(
        True, description="Write one NetworkPolicy per pool: clients reach only the sidecar port of decode pods; "
        "render, derender and prefill engines accept only this model's decode pods (and, with NIXL, prefill and "
        "decode pods accept each other for KV transfer). Needs a network plugin that enforces NetworkPolicies."
    )
    extra_engine_from: list[KubeObject] = Field(
        default_factory=list, max_length=16,
        description="More sources (NetworkPolicyPeer: podSelector, namespaceSelector, ipBlock) allowed to every "
        "pool's engine port, e.g. a Prometheus scraping vLLM's /metrics; they can call the engines' whole API.",
    )


class EngineAPIKeySpec(WireModel):
    """A key every engine requires (vLLM's VLLM_API_KEY) and the sidecar sends."""

    enabled: bool = Field(
        True, description="Generate a Secret <name>-engine-api-key once (kept across reconciles, deleted with the "
        "model) and give its key to every vLLM container (env VLLM_API_KEY) and to the sidecar. vLLM then refuses "
        "/v1, /inference requests without it; /health and /metrics stay open.")


class SecretKeyRef(WireModel):
    """A key of a Secret in the DisaggregatedModel's namespace."""

    name: ShortString
    key: ShortString = "api-key"


class TLSSpec(WireModel):
    """HTTPS between the sidecar and every engine, with a certificate the user provides."""

    secret_name: ShortString = Field(
        description="A Secret with tls.crt, tls.key and ca.crt (cert-manager's keys), e.g. from a cert-manager "
        "Certificate. tls.crt must carry the DNS name <name>-engine.<namespace>.svc: the sidecar verifies every "
        "engine against that name (prefill pods are dialled by IP). Engines get --ssl-keyfile/--ssl-certfile, "
        "probes use HTTPS, the sidecar verifies with ca.crt. The client port stays HTTP.")


class SecuritySpec(WireModel):
    engine_api_key: EngineAPIKeySpec = Field(default_factory=EngineAPIKeySpec, alias="engineAPIKey")
    client_api_key: SecretKeyRef | None = Field(
        None, alias="clientAPIKey", description="A Secret key clients must send as `Authorization: Bearer` to the "
        "sidecar port (401 otherwise; /health and /metrics stay open). Unset: the client port takes no key.")
    tls: TLSSpec | None = Field(None, description="HTTPS between the sidecar and the engines; unset: plain HTTP.")
