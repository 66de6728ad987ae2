"""The sidecar's configuration file (``disagg sidecar --config FILE``): the only input it reads.

The one definition of that file: the operator builds a ``SidecarConfig`` for the model's
ConfigMap and local mode one per sidecar process, and both write ``dump_config``'s mapping.
Unknown keys are rejected (a typo must not silently fall back to a default). Example::

    version: 1
    served_model_name: qwen3-8b
    listen: {host: 0.0.0.0, port: 8000}
    decode:
      url: http://127.0.0.1:8200         # the engine in the same pod
      capabilities:                      # optional; default: derived from `engine`
        output_modes: [tokens, text, derender]
        streaming_output_modes: [tokens, text, derender]
    render:   {mode: remote, urls: [http://qwen-render.ns.svc:8200]}   # or url: ..., or mode: local
              # failure_policy: fail (503) | decode (the decode engine answers while render is down)
    derender: {mode: remote, url: http://qwen-derender.ns.svc:8200}    # mode: local: decode does it
    prefill:
      mode: remote                       # local: decode prefills itself (no prefill pool)
      discovery: {kind: endpointslices, namespace: ns, service: qwen-prefill, port_name: engine, port: 8200}
               # {kind: static, urls: [http://10.0.0.5:8200]} | {kind: dns, host: qwen-prefill.ns.svc, port: 8200}
               # (endpointslices: in-cluster token by default; `api: {url, token_file, ca_file}` for local use)
      selection: least-requests          # round-robin | random | least-requests | prefix-affinity
      affinity_block_tokens: 16          # prefix-affinity hashes prompts in the engines' KV block size
      affinity_load_bound_percent: 125   # prefix-affinity: of the last affinity_window legs, no endpoint
      affinity_window: 64                #   takes more than 125% of an even share (2 endpoints: 62.5%)
      trust_prefiller_header: true       # honour x-prefiller-host-port, only for current prefill endpoints
      pool_port: 8000                    # an InferencePool's target port: the header names prefill hosts at it
      failure_policy: fallback           # fallback: decode prefills locally; fail: 503
      min_prompt_tokens: 0               # shorter prompts skip the prefill leg (0: never skip)
    kv_connector: NixlConnector          # a name in disagg_sidecar.connectors.REGISTRY
    timeouts: {connect_seconds: 5, render_seconds: 30, prefill_seconds: 120, decode_seconds: 3600, decode_idle_seconds: 300}
    retries: 1
    max_body_bytes: 16777216
    limits: {max_concurrent_requests: 512, deregister_seconds: 5, drain_seconds: 30, coalesce: true, session_stream_interval: 4,
             max_n: 128, max_prompts: 64, max_legs: 256, max_json_depth: 64, header_read_seconds: 10, body_read_seconds: 30}
    engine:                              # the operator fills this from the spec
      vllm_version: 0.33.0
      extension: true                    # decode runs Disagg's engine extension
      prefill_tokens_only: true          # max_logprobs: 21 (the engines' --max-logprobs)
      derender_sessions: false           # the render tier may offer derender sessions (default true)
      features: {generate_output_mode_derender: true, render_parse_context: true}
    auth:                                # optional API keys, files holding one key each
      engine_api_key_file: /etc/disagg/engine-api-key/api-key   # sent to every engine
      client_api_key_file: /etc/disagg/client-api-key/api-key   # required from clients
    tls: {ca_file: /var/run/disagg/tls-ca/ca.crt, server_name: qwen-engine.ns.svc}   # optional: https engines
    metrics: {include_engine: true, engine_timeout_seconds: 1, engine_max_age_seconds: 0.2}  # + the engine's
    tracing: {otlp_endpoint: http://otel-collector.monitoring:4318, sample_ratio: 1.0}  # optional: OTLP spans
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from disagg_sidecar import wire
from disagg_sidecar.connectors import REGISTRY

# What a stock vLLM generate server (no engine extension) answers on /inference/v1/generate.
STOCK_OUTPUT_MODES: tuple[wire.OutputMode, ...] = ("tokens", "text")
CUT_SECONDS = 1.0  # after the drain: what handlers still running get before they are cancelled
# prefix-affinity: consistent hashing with bounded loads' usual factor (1.25): with 2 endpoints,
# at most 62.5% each, over the last 64 prefill legs.
DEFAULT_LOAD_BOUND_PERCENT = 125
DEFAULT_SHARE_WINDOW = 64



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


class Listen(Model):
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)


class Capabilities(Model):
    """What the local decode engine can produce on ``/inference/v1/generate``.

    Same keys as the engine extension's ``GET /disagg/v1/capabilities``. The sidecar uses the
    intersection of this and what the engine serves, so configuration can only narrow it (e.g. to
    force the chained derender path).
    """

    output_modes: tuple[wire.OutputMode, ...] = STOCK_OUTPUT_MODES
    streaming_output_modes: tuple[wire.OutputMode, ...] = STOCK_OUTPUT_MODES
    derender_context_forms: tuple[Literal["chat_request", "parse_context"], ...] = ("chat_request",)
    parser_configured: bool = Field(
        True, description="The engine runs a reasoning/tool parser: chat text then needs derender, not text.")
    client_streams: tuple[wire.ClientStreamApi, ...] = Field(
        (), description="The APIs whose own chunks a decode stream can be asked to write (`client_stream`: "
        "chat from a streamed derender, completions from a streamed text), which the sidecar then relays as "
        "bytes; `true` (the first extension's word) is chat alone, `false` none.")

    @field_validator("client_streams", mode="before")
    @classmethod
    def _client_streams(cls, value: Any) -> Any:
        return (("chat",) if value else ()) if isinstance(value, bool) else value


class Decode(Model):
    url: str = Field(description="The vLLM engine in the same pod (serve --enable-scale-out).")
    capabilities: Capabilities | None = Field(
        None, description="Configured capabilities; None: derived from `engine.extension`.")
    probe_capabilities: bool = Field(True, description="Check them against GET /disagg/v1/capabilities if served.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return check_url(v)


class Tier(Model):
    """Render or derender: ``remote`` (a pool, by URL) or ``local`` (the decode engine does it)."""

    mode: Literal["remote", "local"] = "remote"
    urls: tuple[str, ...] = Field((), description="Endpoints; `url: X` is accepted for one.")

    @model_validator(mode="before")
    @classmethod
    def _one_url(cls, data: object) -> object:
        if isinstance(data, dict) and "url" in data:
            data = dict(data)
            url = data.pop("url")
            data["urls"] = [*([url] if url else []), *(data.get("urls") or [])]
        return data

    @field_validator("urls")
    @classmethod
    def _urls(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_url(u) for u in v)

    @model_validator(mode="after")
    def _remote_needs_urls(self) -> Tier:
        if self.mode == "remote" and not self.urls:
            raise ValueError("a remote tier needs `url` or `urls`")
        return self


class RenderTier(Tier):
    """The render tier, and what a request gets while it is down."""

    failure_policy: Literal["fail", "decode"] = Field(
        "fail", description="The render (or derender) tier unavailable: fail: a 503 saying so; decode: the decode "
        "engine answers the client's request itself on its own OpenAI route, as a coupled server (no prefill leg).")


class Prefill(Model):
    mode: Literal["remote", "local"] = "remote"
    discovery: Discovery | None = Field(None, discriminator="kind")
    selection: Literal["round-robin", "random", "least-requests", "prefix-affinity"] = "least-requests"
    affinity_block_tokens: int = Field(16, ge=1, description="prefix-affinity: tokens per hashed block (the "
                                                             "engines' KV block size, so hashes match their cache).")
    affinity_load_bound_percent: int = Field(DEFAULT_LOAD_BOUND_PERCENT, ge=100, description="prefix-affinity: of the "
        "last `affinity_window` legs, no endpoint takes over this % of an even share (rounded up); its conversations move.")
    affinity_window: int = Field(DEFAULT_SHARE_WINDOW, ge=2, description="prefix-affinity: prefill legs the share "
                                 "bound counts (all legs while fewer were sent).")
    trust_prefiller_header: bool = Field(False, description="Honour x-prefiller-host-port when it names a current "
                                         "prefill endpoint; false: the header is stripped and ignored.")
    pool_port: int | None = Field(None, ge=1, le=65535, description="An InferencePool's target port: its endpoint "
                                  "picker names prefill pods at this port, meaning the prefill engine on that host.")
    failure_policy: Literal["fallback", "fail"] = "fallback"
    tokens_only: bool | None = Field(None, description="Prefill pool runs --tokens-only; None: `engine.prefill_tokens_only`.")
    min_prompt_tokens: int = Field(0, ge=0, description="Prompts shorter than this skip the prefill leg.")
    side_channel_ports: tuple[Annotated[int, Field(ge=1, le=65535)], ...] = Field(
        (5600,), description="The prefill engines' KV side-channel ports (NIXL: one per data-parallel rank, "
        "vLLM's default 5600): a prefill answer's kv_transfer_params naming another port never reach decode.")

    @model_validator(mode="after")
    def _discovery(self) -> Prefill:
        if self.mode == "remote" and self.discovery is None:
            raise ValueError("a remote prefill tier needs `discovery`")
        return self


class Timeouts(Model):
    """Deadlines per leg: each bounds the whole leg (connection, headers, every byte of the answer),
    so an engine that trickles or falls silent holds no client and no slot past it."""

    connect_seconds: float = Field(5, gt=0)
    render_seconds: float = Field(30, gt=0, description="The whole render leg.")
    prefill_seconds: float = Field(120, gt=0, description="The whole prefill leg.")
    decode_seconds: float = Field(3600, gt=0, description="The whole decode leg (a batch answer comes at its end).")
    decode_idle_seconds: float = Field(300, gt=0, description="A streamed decode leg: the longest wait for its "
                                       "headers, its first event and between two reads (a silence after the "
                                       "headers is cut within 1.25x of it).")
    derender_seconds: float | None = Field(None, gt=0, description="The whole derender call; None: `render_seconds`.")


class Limits(Model):
    max_concurrent_requests: int = Field(512, ge=1, description="More in flight: 503 with Retry-After.")
    # A terminating pod leaves its Services' endpoints (and kube-proxy's rules) asynchronously: a closed
    # listener would refuse the connections that keep arriving for a moment after SIGTERM.
    deregister_seconds: float = Field(5, ge=0, description="SIGTERM: keep accepting, readiness off, this long; "
                                                           "then drain. 0 without a Service (local mode).")
    drain_seconds: float = Field(30, ge=0, description="After deregister_seconds: how long in-flight requests may finish.")
    coalesce: bool = Field(True, description="Merge generate chunks that arrive while a derender call is in flight.")
    session_stream_interval: int = Field(4, ge=1, description="Tokens per decode chunk of a session-derendered stream.")
    derender_stream_bytes: int = Field(64 << 20, ge=1 << 20, description="What the stateless derender calls of one "
                                       "chained stream may carry in all (each carries the parser context and the prompt's "
                                       "token ids): a request whose calls would carry more gets more tokens per call.")
    keepalive_seconds: float = Field(4.0, gt=0, lt=5, description="Idle upstream connections; below vLLM's 5 s.")
    health_interval_seconds: float = Field(2.0, gt=0)
    # Bad and slow clients: each limit is refused with an error naming it (docs/security.md).
    max_n: int = Field(128, ge=1, description="`n` per prompt (OpenAI's own maximum).")
    max_prompts: int = Field(64, ge=1, description="Prompts in one completions request.")
    max_legs: int = Field(256, ge=3, description="1 render + per prompt 1 prefill and `n` decode sequences.")
    max_json_depth: int = Field(64, ge=2, le=512)
    header_read_seconds: float = Field(10, gt=0, description="To complete headers; also the idle keep-alive.")
    body_read_seconds: float = Field(30, gt=0, description="From the headers to the whole body: then 408.")
    memory_budget_bytes: int = Field(256 << 20, ge=16 << 20, description="Bodies in the sidecar (4 bytes per "
                                     "body byte) and the upstream answers they hold (budget.py); beyond: 503 + Retry-After.")
    max_connections_per_ip: int = Field(0, ge=0, description="Per client address (429 past it); 0: no cap.")
    max_logprobs: int | None = Field(None, ge=-1, description="Logprobs a client may ask for; None: the engines' limit.")
    max_upstream_connections: int = Field(1024, ge=8, description="Connections to the engines at once, every tier "
                                          "together; more legs wait for one (within their deadline).")
    # Upstream answers (docs/security.md, "Upstream answers"): larger ones are a 502, never held whole.
    render_answer_bytes: int = Field(64 << 20, ge=1 << 16, description="A render (or tokenizer) answer.")
    prefill_answer_bytes: int = Field(4 << 20, ge=1 << 16, description="A prefill answer (one token, KV params).")
    decode_answer_bytes: int = Field(64 << 20, ge=1 << 16, description="A batch decode answer.")
    derender_answer_bytes: int = Field(64 << 20, ge=1 << 16, description="A derender answer.")
    upstream_event_bytes: int = Field(16 << 20, ge=1 << 16, description="One event of an upstream stream.")

    @property
    def stop_seconds(self) -> float:
        """SIGTERM to exit, at the latest: what an engine beside the sidecar has to outlive."""
        return self.deregister_seconds + self.drain_seconds + CUT_SECONDS


class Auth(Model):
    """API keys, each read from a file (a mounted Secret) once at start; docs/security.md."""

    engine_api_key_file: str | None = Field(
        None, description="Sent as `Authorization: Bearer` on every upstream request (the engines' VLLM_API_KEY).")
    client_api_key_file: str | None = Field(
        None, description="Clients must send this key as `Authorization: Bearer`; /health* and /metrics stay open.")


class Exposition(Model):  # what /metrics serves
    include_engine: bool = Field(False, description="Append the decode engine's families that the sidecar does not "
                                 "export itself (docs/llm-d.md); the operator sets it with an InferencePool.")
    engine_timeout_seconds: float = Field(1.0, gt=0, le=30, description="Slower or failed: the sidecar's own only.")
    engine_max_age_seconds: float = Field(0.2, ge=0, le=10, description="Reuse the engine's families this long.")


class TracingConfig(Model):
    """Trace spans of every request and leg, sent to an OTLP/HTTP receiver (``disagg_sidecar.tracing``)."""

    otlp_endpoint: str = Field(description="The receiver's base URL, e.g. http://otel-collector.monitoring:4318 "
                               "(spans go to its /v1/traces, as OTEL_EXPORTER_OTLP_ENDPOINT means).")
    service_name: str = Field("disagg-sidecar", min_length=1, max_length=256)
    resource_attributes: dict[str, str] = Field(default_factory=dict, description="Added to every span's resource "
                                                "(the operator: model, namespace, pool, revision).")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="Of the traces this sidecar starts (a client's "
                                "traceparent keeps its own sampled flag).")
    export_delay_seconds: float = Field(5.0, gt=0, le=60, description="Spans are sent in batches this often.")
    export_timeout_seconds: float = Field(10.0, gt=0, le=60)
    max_queued_spans: int = Field(2048, ge=16, le=1 << 20, description="Spans waiting for export; more are dropped.")

    @field_validator("otlp_endpoint")
    @classmethod
    def _url(cls, v: str) -> str:
        return check_url(v)


class TLS(Model):
    """HTTPS to the engines (their URLs say https://), verified with ``ca_file``."""

    ca_file: str = Field(description="The CA bundle engine certificates are verified with.")
    server_name: str | None = Field(
        None, description="Verify every engine certificate against this name, not the dialled host (prefill pods "
        "are dialled by IP, decode on 127.0.0.1); None: the host of each URL.")


class EngineFeatures(BaseModel):
    """What the engines' vLLM version offers (the operator derives it from the version). Unknown keys
    are ignored: a newer operator may know features this sidecar does not use."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    generate_output_mode_derender: bool = Field(
        False, description="Stock batch output_mode=derender on generate, with render's parse_context (0.33).")
    generate_streaming_derender: bool = Field(
        False, description="... and stream=true: stock vLLM streams output_mode=derender itself (0.34).")
    render_parse_context: bool = False
    derender_finish_reason: bool = Field(
        False, description="Batch /derender reports coupled's finish_reason (0.33); else the sidecar derives it.")


class Engine(Model):
    vllm_version: str | None = None
    extension: bool = Field(False, description="The decode engine runs Disagg's engine extension.")
    prefill_tokens_only: bool = True
    derender_sessions: bool = Field(
        True, description="The derender tier may run derender sessions (the engine extension on a render tier that "
        "has them): a chained chat or completions stream asks its endpoints (GET /disagg/v1/capabilities) and uses one that "
        "offers them. false: never asked, every chained stream is stateless.")
    max_logprobs: int = Field(20, ge=-1, description="The engines' --max-logprobs: completions legs ask for one "
                              "candidate more than the client while it fits (the sampled token's room); -1: any.")
    features: EngineFeatures = Field(default_factory=EngineFeatures)


class SidecarConfig(Model):
    version: Literal[1] = 1
    served_model_name: str | None = None
    listen: Listen = Field(default_factory=Listen)
    decode: Decode
    render: RenderTier = Field(default_factory=lambda: RenderTier(mode="local"))
    derender: Tier | None = Field(None, description="None: the render tier derenders too.")
    prefill: Prefill = Field(default_factory=lambda: Prefill(mode="local"))
    kv_connector: str | None = None
    timeouts: Timeouts = Field(default_factory=Timeouts)
    retries: int = Field(1, ge=0, description="Extra attempts on another endpoint (render, prefill, derender).")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    limits: Limits = Field(default_factory=Limits)
    engine: Engine = Field(default_factory=Engine)
    auth: Auth = Field(default_factory=Auth)
    tls: TLS | None = None
    metrics: Exposition = Field(default_factory=Exposition)
    tracing: TracingConfig | None = Field(None, description="None: no spans (legs carry the client's trace context).")

    @model_validator(mode="after")
    def _connector(self) -> SidecarConfig:
        if self.prefill.mode == "remote":
            if self.kv_connector is None:
                raise ValueError("a remote prefill tier needs `kv_connector`")
            if self.kv_connector not in REGISTRY:
                raise ValueError(f"unknown kv_connector {self.kv_connector!r}; known: {sorted(REGISTRY)}")
        return self

    # -- derived views (what the rest of the sidecar reads) --------------------------------

    @property
    def render_urls(self) -> tuple[str, ...]:
        return self.render.urls if self.render.mode == "remote" else (self.decode.url,)

    @property
    def derender_urls(self) -> tuple[str, ...]:
        tier = self.derender or self.render
        return tier.urls if tier.mode == "remote" else (self.decode.url,)

    @property
    def prefill_tokens_only(self) -> bool:
        return self.engine.prefill_tokens_only if self.prefill.tokens_only is None else self.prefill.tokens_only

    @property
    def derender_timeout(self) -> float:
        return self.timeouts.derender_seconds or self.timeouts.render_seconds


def dump_config(config: SidecarConfig) -> dict[str, Any]:
    """The file's content: what the writer set (defaults stay the sidecar's), as plain JSON types."""
    return config.model_dump(mode="json", exclude_unset=True)


def load_config(path: str | Path) -> SidecarConfig:
    """Read and validate the YAML (or JSON) file; errors name the offending key."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return SidecarConfig.model_validate(data)
