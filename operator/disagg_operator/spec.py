"""The ``disagg.dev/v1alpha1`` ``DisaggregatedModel`` API as pydantic models.

These models are the single definition of the API: the CRD schema is generated from them
(``crd.py``), the operator and ``disagg manifests`` parse custom resources with them, and local
mode reads the same YAML. Field names are camelCase on the wire (aliases) and snake_case in
Python. Cross-field and range checks live in ``rules.py`` so the CRD's CEL rules and these
validators share one table and one set of messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from disagg_operator import rules
from disagg_sidecar import vllm_releases
from disagg_sidecar.connectors import DEFAULT as DEFAULT_CONNECTOR

GROUP = "disagg.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedModel"
PLURAL = "disaggregatedmodels"
SINGULAR = "disaggregatedmodel"
SHORT_NAMES = ("dm",)

DEFAULT_VLLM_VERSION = "0.34.0"
DEFAULT_GPU_IMAGE = f"vllm/vllm-openai:v{DEFAULT_VLLM_VERSION}"
# Disagg's images: the operator/sidecar (Dockerfile) and the CPU engine (images/vllm-cpu.Dockerfile).
IMAGE_REGISTRY = "ghcr.io/disagg"
DEFAULT_CPU_IMAGE = f"{IMAGE_REGISTRY}/vllm-cpu:v{DEFAULT_VLLM_VERSION}"
DEFAULT_SIDECAR_IMAGE = f"{IMAGE_REGISTRY}/disagg:0.1.0"  # the operator image the chart installs (its appVersion)

# --- the base of every API object and the bounded types they share --------------------------

# Bounds that keep CEL cost estimates finite (the API server rejects unbounded list/string rules).
MAX_ARGS = 64
MAX_ARG_LENGTH = 4096

# Kubernetes objects we pass through untouched (resources, affinity, tolerations, valueFrom, ...).
KubeObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
Arg = Annotated[str, StringConstraints(max_length=MAX_ARG_LENGTH)]
Args = Annotated[list[Arg], Field(max_length=MAX_ARGS)]
ShortString = Annotated[str, StringConstraints(max_length=256)]


class WireModel(BaseModel):
    """Base of every API object: camelCase on the wire, unknown fields rejected, rules enforced."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _apply_rules(self) -> WireModel:
        broken = rules.failures(type(self).__name__, self)
        if broken:
            messages = [r.message_for(self) for r in broken]
            raise PydanticCustomError(
                "disagg_rule", "{summary}",
                {"summary": "; ".join(messages), "rules": [r.id for r in broken], "messages": messages},
            )
        return self


# --- model -----------------------------------------------------------------------------------

class EnvVar(WireModel):
    """An environment variable, as in a Kubernetes container (value or valueFrom)."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    value: str | None = None
    value_from: KubeObject | None = Field(None, description="A Kubernetes EnvVarSource (secretKeyRef, fieldRef, ...).")


EnvList = Annotated[
    list[EnvVar],
    Field(max_length=MAX_ARGS, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}),
]


class ConfigMapKeyRef(WireModel):
    """A key of a ConfigMap in the DisaggregatedModel's namespace."""

    name: ShortString
    key: ShortString = "chat-template.jinja"


class ChatTemplate(WireModel):
    """The chat template every tokenizing tier uses: inline Jinja or a ConfigMap key (exactly one)."""

    inline: str | None = Field(None, description="Jinja source of the chat template.")
    config_map_ref: ConfigMapKeyRef | None = Field(None, description="A ConfigMap key holding the template.")


class ModelSpec(WireModel):
    """The model and everything that decides how prompts are rendered and outputs parsed.

    These settings are applied identically to every tier that tokenizes (render, derender, decode)."""

    served_name: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = Field(None, description="Model name clients send; defaults to metadata.name.")
    source: Annotated[str, StringConstraints(max_length=2048)] = Field(
        description="Where the weights are: hf://ORG/NAME (Hugging Face), pvc://CLAIM/PATH (a PersistentVolumeClaim "
        "in the namespace, mounted read-only), an absolute path (inside the image, or on the host in local mode) "
        "or ~/PATH (local mode only)."
    )
    revision: ShortString | None = Field(None, description="Hugging Face revision (branch, tag or commit) for hf:// sources.")
    max_model_len: int | None = Field(None, description="Context length (--max-model-len); vLLM's default when unset.")
    max_logprobs: int = Field(
        20, description="Logprob candidates a client may ask for (logprobs, top_logprobs, prompt_logprobs), as vLLM's "
        "--max-logprobs; -1: the whole vocabulary. Engines run with one more (the sampled token beside a completions "
        "client's top k); the sidecar refuses more.")
    chat_template: ChatTemplate | None = Field(None, description="Overrides the model's own chat template.")
    default_chat_template_kwargs: KubeObject | None = Field(
        None, description="Default chat-template kwargs, e.g. {enable_thinking: false}."
    )
    tool_call_parser: ShortString | None = Field(None, description="vLLM tool-call parser, e.g. hermes.")
    reasoning_parser: ShortString | None = Field(None, description="vLLM reasoning parser, e.g. qwen3.")
    enable_auto_tool_choice: bool = Field(False, description="Allow tool_choice=auto (needs toolCallParser).")
    engine_args: Args = Field(
        default_factory=list,
        description="Extra vLLM flags for every tier that loads the model (render tiers accept every serve flag).",
    )
    env: EnvList = Field(default_factory=list, description="Environment for every vLLM container.")


# --- engine and KV transfer ------------------------------------------------------------------

class EngineSpec(WireModel):
    """vLLM images and version."""

    gpu_image: ShortString = Field(DEFAULT_GPU_IMAGE, description="Image for the prefill and decode engines.")
    cpu_image: ShortString = Field(DEFAULT_CPU_IMAGE, description="Image for the render and derender tiers "
                                   "(default: Disagg's, vLLM's CPU image with the disagg package).")
    vllm_version: Annotated[str, StringConstraints(max_length=64)] = Field(
        DEFAULT_VLLM_VERSION, description=f"vLLM version in the images; decides which features and flags are used. "
        f"Supported: {vllm_releases.names()}; another version (from {vllm_releases.OLDEST.name} on) is deployed "
        "without derender sessions or assumptions about stock vLLM, and status condition VersionSupported says so."
    )
    extension: bool = Field(
        False, description="Enable Disagg's vLLM endpoint plugin on decode (the GPU image must contain the disagg package): "
        "decode derenders its own stream.")
    render_extension: bool = Field(
        True, description="Enable it on the render and derender pools where cpuImage contains the disagg package (the "
        "default image does; a stock vllm/vllm-openai[-cpu] image does not, and runs without it): on "
        f"{vllm_releases.with_feature('derender_sessions')} they keep a stream's parser state in a derender session. "
        "Without it, streams through a stock decode are derendered per chunk (status.derender.strategy: stateless), "
        f"except on {vllm_releases.with_feature('stock_streaming_derender')}, whose decode derenders them (stock-inline).")
    port: int = Field(8200, description="HTTP port of every vLLM server.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="Pull policy of every container (vLLM and sidecar); the cluster default when unset."
    )
    cache_claim: ShortString | None = Field(
        None, description="A ReadWriteMany PersistentVolumeClaim mounted as every vLLM container's HOME (Hugging "
        "Face downloads, vLLM's model-inspection and compile caches, Triton's): kept across restarts and shared by "
        "the model's pods, which all write to it (give each model its own). Unset: an emptyDir per pod.")


class KVTransferSpec(WireModel):
    """How prefill hands KV cache to decode."""

    connector: Annotated[str, StringConstraints(max_length=64)] = Field(
        DEFAULT_CONNECTOR, description=rules.connector_description()
    )
    extra_config: KubeObject | None = Field(None, description="vLLM kv_connector_extra_config.")
    side_channel_port: int = Field(5600, description="NIXL side-channel port (one more per data-parallel rank).")
    shared_storage_claim: ShortString | None = Field(
        None, description="ExampleConnector: a ReadWriteMany PersistentVolumeClaim mounted on prefill and decode "
        "as the connector's shared_storage_path (without it, KV written by prefill is not visible to decode pods)."
    )


# --- pools -----------------------------------------------------------------------------------

class Autoscaling(WireModel):
    """A HorizontalPodAutoscaler for the pool."""

    min_replicas: int = 1
    max_replicas: int
    target_cpu_utilization_percentage: int | None = Field(
        None, alias="targetCPUUtilizationPercentage", description="CPU target; 80 when neither this nor metrics is set."
    )
    metrics: list[KubeObject] | None = Field(None, max_length=16, description="autoscaling/v2 MetricSpec list.")


class Parallelism(WireModel):
    tensor: int = Field(1, description="--tensor-parallel-size")
    data: int = Field(1, description="--data-parallel-size (ranks inside one pod)")
    expert: bool = Field(False, description="--enable-expert-parallel")


class PoolSpec(WireModel):
    """What every pool has: size, placement, role deltas."""

    replicas: int = Field(1, description="Pod count (0 turns the pool off). With autoscaling, the HPA owns the count.")
    resources: KubeObject | None = Field(None, description="Container resources (requests/limits).")
    node_selector: dict[str, str] | None = None
    tolerations: list[KubeObject] | None = Field(None, max_length=MAX_ARGS)
    affinity: KubeObject | None = None
    extra_args: Args = Field(default_factory=list, description="vLLM flags for this pool only.")
    env: EnvList = Field(default_factory=list, description="Environment for this pool's vLLM container.")
    autoscaling: Autoscaling | None = None


class GPUPoolSpec(PoolSpec):
    """A prefill or decode engine pool."""

    parallelism: Parallelism = Field(default_factory=Parallelism)


class CPUPoolSpec(PoolSpec):
    """A render or derender pool (`vllm launch render` on the CPU image)."""

    renderer_workers: int = Field(4, description="--renderer-num-workers: parallel render/derender workers per pod.")


class PoolsSpec(WireModel):
    prefill: GPUPoolSpec = Field(default_factory=GPUPoolSpec, description="Prefill engines (0 replicas: decode prefills).")
    decode: GPUPoolSpec = Field(default_factory=GPUPoolSpec, description="Decode engines, each fronted by the sidecar.")
    render: CPUPoolSpec = Field(default_factory=CPUPoolSpec, description="Render tier (0 replicas: decode renders).")
    derender: CPUPoolSpec | None = Field(None, description="A separate derender pool; unset: the render pool derenders.")


# --- router ----------------------------------------------------------------------------------

class RouterTimeouts(WireModel):
    connect_seconds: int = 5
    render_seconds: int = 30
    prefill_seconds: int = 120
    decode_seconds: int = 3600


class RouterService(WireModel):
    """The client-facing Service `<name>`."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = 8000


class EndpointPicker(WireModel):
    """The endpoint picker Service (llm-d's EPP) the InferencePool names."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=253)]
    port: int = Field(description="The picker's gRPC (ext-proc) port.")
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"


class InferencePoolSpec(WireModel):
    """An InferencePool (inference.networking.k8s.io/v1) of this model's decode and prefill pods (docs/llm-d.md)."""

    enabled: bool = Field(False, description="Write the InferencePool, label decode and prefill pods with "
                          "llm-d.ai/role, and trust the picker's x-prefiller-host-port header.")
    endpoint_picker: EndpointPicker | None = Field(None, description="spec.endpointPickerRef (a Service).")


class RouterSpec(WireModel):
    """The sidecar in every decode pod: routes render → prefill → decode → derender."""

    image: ShortString = DEFAULT_SIDECAR_IMAGE
    port: int = Field(8000, description="Port the sidecar listens on in the decode pod.")
    prefill_selection: Literal["prefix-affinity", "least-requests", "round-robin", "random"] = Field(
        "prefix-affinity", description="prefix-affinity: the prefill pod that last took the prompt's leading KV "
        "blocks, bounded by load (least-requests for legs without prompt tokens).")
    prefill_load_bound_percent: int = Field(
        125, description="prefix-affinity: of each sidecar's recent prefill legs (its last 64), no prefill pod "
        "takes more than this percentage of an even share (125 with 2 pods: at most 62.5% each); a conversation "
        "whose pod is at that cap moves to another.")
    min_prefill_tokens: int = Field(0, description="Shorter prompts skip the prefill leg (decode prefills); "
                                    "the KV connector's own minimum applies when larger.")
    inference_pool: InferencePoolSpec = Field(default_factory=InferencePoolSpec)
    trust_prefiller_header: bool = Field(
        False, description="Honour a client's x-prefiller-host-port header (only for hosts in this model's prefill pool)."
    )
    timeouts: RouterTimeouts = Field(default_factory=RouterTimeouts)
    retries: int = Field(1, description="Retries of idempotent legs (render, derender, prefill before any byte).")
    prefill_failure_policy: Literal["fallback", "fail"] = Field(
        "fallback", description="fallback: decode prefills locally when prefill fails; fail: return an error."
    )
    render_failure_policy: Literal["fail", "decodeRenders"] = Field(
        "fail", description="The render (or derender) pool unavailable: fail: a 503 that says so; decodeRenders: the "
        "decode engine, which has the tokenizer, chat template and parsers, answers the request itself as a coupled "
        "server would (no prefill leg), while the sidecar stays ready (docs/security.md).")
    max_body_bytes: int = Field(16 * 1024 * 1024, description="Largest accepted request body.")
    session_stream_interval: int | None = Field(
        None, description="Tokens per decode chunk of a stream derendered by a render-tier session (it splits them per "
        "token again, so clients get coupled's chunks, in bursts of this many); unset: the sidecar's 4, 1: none.")
    service: RouterService = Field(default_factory=RouterService)
    resources: KubeObject | None = Field(
        None, description="Sidecar container resources; default requests 100m CPU and 128Mi, limit 512Mi: ~52 MiB "
        "idle + the sidecar's 256 MiB budget for bodies in flight + one request's parse (docs/security.md).")


# --- security (docs/security.md) ------------------------------------------------------------

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



# -- spec.monitoring (PodMonitors) and spec.autoscaling (the operator's planner: docs/autoscaling.md) --

class TracingSpec(WireModel):
    """Trace spans of every request and its legs from the decode pods' sidecars (OpenTelemetry, OTLP/HTTP)."""

    otlp_endpoint: Annotated[str, StringConstraints(pattern=r"^https?://[^\s/:]+:[0-9]+(/[^\s]*)?$", max_length=2048)] = \
        Field(alias="otlpEndpoint", description="Base URL of an OTLP/HTTP receiver with its port, e.g. "
              "http://otel-collector.monitoring.svc:4318 (spans go to its /v1/traces). The client's traceparent is "
              "continued; each leg (render, prefill, decode, derender) is a span.")
    sample_ratio: float = Field(1.0, description="Of the traces the sidecar starts itself, the share recorded "
                                "(a client's traceparent keeps its own sampled flag).")


class MonitoringSpec(WireModel):
    """Prometheus Operator monitors for this model's pods."""

    pod_monitors: Literal["auto", "true", "false"] = Field(
        "auto", description="PodMonitors (monitoring.coreos.com/v1) for every pool's vLLM /metrics and the "
        "sidecars' /metrics, with the labels model, pool, role and revision. auto: when the cluster serves the "
        "PodMonitor CRD (checked at each reconcile); true: always (a PodMonitorsReady condition says when the "
        "CRD is missing); false: never.")
    interval: Annotated[str, StringConstraints(pattern=r"^[0-9]+(ms|s|m)$", max_length=16)] = Field(
        "15s", description="Scrape interval of the monitors (Prometheus duration).")
    tracing: TracingSpec | None = Field(None, description="Trace spans from the sidecars; unset: none (the client's "
                                        "trace context still goes to every leg).")


class PoolBounds(WireModel):
    """The replica range the planner keeps one pool in."""

    min_replicas: int = Field(1, description="Never fewer pods (at least 1).")
    max_replicas: int = Field(description="Never more pods.")


class RatioBounds(WireModel):
    """Prefill replicas per decode replica the planner keeps (prefill / decode)."""

    min: float = Field(0.0, description="At least this many prefill pods per decode pod (0: no lower bound).")
    max: float = Field(100.0, description="At most this many prefill pods per decode pod.")


class ScalingTargets(WireModel):
    """What the planner keeps each pool under (unset targets are not used). Prefill scales on the first two,
    decode on the last two; a pool scales up when any of its signals is above its target."""

    ttft_seconds: float | None = Field(
        None, description="Time to first token, 90th percentile over the last interval, from the prefill engines "
        "(vllm:time_to_first_token_seconds; the decode engines' when prefill is off).")
    waiting_per_prefill_pod: float | None = Field(
        None, description="Requests waiting in the prefill engines' queues (vllm:num_requests_waiting), per pod.")
    itl_seconds: float | None = Field(
        None, description="Inter-token latency, 90th percentile over the last interval, from the decode engines "
        "(vllm:inter_token_latency_seconds).")
    decode_kv_cache_usage: float | None = Field(
        None, description="Mean KV-cache usage of the decode engines, 0-1 (vllm:kv_cache_usage_perc).")


class Stabilization(WireModel):
    """How long a recommendation must hold before the planner acts on it (as an HPA's behavior)."""

    scale_up_seconds: int = Field(0, description="Scale up to the lowest recommendation of this window.")
    scale_down_seconds: int = Field(300, description="Scale down to the highest recommendation of this window.")


class PrometheusSource(WireModel):
    """Read the signals from a Prometheus that scrapes this model through its PodMonitors."""

    url: Annotated[str, StringConstraints(pattern=r"^https?://[^\s]+$", max_length=2048)] = Field(
        description="Base URL of the Prometheus HTTP API, e.g. http://prometheus-operated.monitoring.svc:9090.")


class AutoscalingSpec(WireModel):
    """The operator's planner: scales prefill and decode on inference signals within bounds and a ratio."""

    prefill: PoolBounds = Field(description="Bounds of the prefill pool.")
    decode: PoolBounds = Field(description="Bounds of the decode pool.")
    ratio: RatioBounds = Field(default_factory=RatioBounds)
    targets: ScalingTargets = Field(description="At least one target.")
    stabilization: Stabilization = Field(default_factory=Stabilization)
    interval_seconds: int = Field(15, description="How often the planner reads the signals and decides.")
    tolerance: float = Field(0.1, description="Signals within this fraction of their target change nothing.")
    prometheus: PrometheusSource | None = Field(
        None, description="Where the signals come from; unset: the operator scrapes the pods' /metrics itself.")

class DisaggregatedModelSpec(WireModel):
    """A model served in four tiers: render, prefill, decode, derender, plus the routing sidecar."""

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    pools: PoolsSpec = Field(default_factory=PoolsSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    autoscaling: AutoscalingSpec | None = Field(
        None, description="Scale prefill and decode on inference signals (the operator's planner, docs/autoscaling.md); "
        "it then owns both pools' replica counts.")


# --- errors ----------------------------------------------------------------------------------

class SpecError(ValueError):
    """A DisaggregatedModel that cannot be served; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str], subject: str = "DisaggregatedModel"):
        self.problems = problems
        super().__init__(f"invalid {subject}:\n" + "\n".join(f"  - {p}" for p in problems))
