"""The configuration of prefill discovery (``prefill.discovery`` in the sidecar's file), and URL checks.

Three kinds, told apart by ``kind``: ``static`` URLs, ``dns`` (every A/AAAA record of a headless
Service), ``endpointslices`` (list + watch a Service's EndpointSlices; what the operator writes).
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

# Where a pod's projected service-account token and CA bundle are mounted (the operator mounts them there).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class Model(BaseModel):
    """Base of every configuration model: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"{url!r}: expected http(s)://host:port")
    return url.rstrip("/")


class _Kind(Model):
    """A discovery kind: ``kind`` is always written, also when left at its default (it tells them apart)."""

    @model_serializer(mode="wrap")
    def _with_kind(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {"kind": getattr(self, "kind"), **handler(self)}


class StaticDiscovery(_Kind):
    kind: Literal["static"] = "static"
    urls: tuple[str, ...] = Field(min_length=1)

    @field_validator("urls")
    @classmethod
    def _urls(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_url(u) for u in v)


class DNSDiscovery(_Kind):
    """A headless Service: every A/AAAA record is one prefill pod."""

    kind: Literal["dns"] = "dns"
    host: str
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    refresh_seconds: float = Field(5.0, gt=0)


class KubernetesAPI(Model):
    """How the sidecar reaches the API server; the defaults are the pod's own (in-cluster) identity."""

    url: str | None = Field(None, description="https://host:port; None: KUBERNETES_SERVICE_HOST/_PORT.")
    token_file: str = Field(f"{SERVICE_ACCOUNT_DIR}/token",
                            description="Bearer token, re-read for every request (projected tokens rotate).")
    ca_file: str | None = Field(f"{SERVICE_ACCOUNT_DIR}/ca.crt",
                                description="CA bundle of the API server; None: the system trust store.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else check_url(v)


class EndpointSliceDiscovery(_Kind):
    """What the operator writes: list + watch the EndpointSlices of a (headless) Service.

    Endpoints are the ready endpoints' addresses with the slice port named ``port_name`` (or the
    slice's only port; with several unnamed-matching ports, the one numbered ``port``).
    """

    kind: Literal["endpointslices"] = "endpointslices"
    namespace: str
    service: str
    port: int | None = Field(None, ge=1, le=65535, description="Disambiguates when `port_name` is unset.")
    port_name: str | None = None
    scheme: Literal["http", "https"] = "http"
    api: KubernetesAPI = Field(default_factory=KubernetesAPI)
    watch_seconds: int = Field(300, ge=1, description="Server-side timeout of one watch request; then re-watch.")
    backoff_seconds: float = Field(0.5, gt=0, description="First retry delay after an error; doubles.")
    max_backoff_seconds: float = Field(30.0, gt=0)


Discovery = StaticDiscovery | DNSDiscovery | EndpointSliceDiscovery
