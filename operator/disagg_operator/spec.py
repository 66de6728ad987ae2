"""The ``disagg.dev/v1alpha1`` ``DisaggregatedModel`` API as pydantic models.

These models are the single definition of the API: the CRD schema is generated from them
(``crd.py``), the operator and ``disagg manifests`` parse custom resources with them, and local
mode reads the same YAML. Field names are camelCase on the wire (aliases) and snake_case in
Python. Cross-field and range checks live in ``rules.py`` so the CRD's CEL rules and these
validators share one table and one set of messages.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from disagg_operator.kv import connector_description
from disagg_operator.scaling_spec import AutoscalingSpec, MonitoringSpec
from disagg_operator.security_spec import NetworkPolicySpec, SecuritySpec
from disagg_operator.spec_base import (  # noqa: F401  (re-exported: the API's building blocks)
    MAX_ARG_LENGTH, MAX_ARGS, Arg, Args, KubeObject, ShortString, WireModel,
)
from disagg_sidecar.connectors import DEFAULT as DEFAULT_CONNECTOR

GROUP = "disagg.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedModel"
PLURAL = "disaggregatedmodels"
SINGULAR = "disaggregatedmodel"
SHORT_NAMES = ("dm",)

DEFAULT_VLLM_VERSION = "0.33.0"
DEFAULT_GPU_IMAGE = f"vllm/vllm-openai:v{DEFAULT_VLLM_VERSION}"
# Disagg's images: the operator/sidecar (Dockerfile) and the CPU engine (images/vllm-cpu.Dockerfile).
IMAGE_REGISTRY = "ghcr.io/disagg"
DEFAULT_CPU_IMAGE = f"{IMAGE_REGISTRY}/vllm-cpu:v{DEFAULT_VLLM_VERSION}"
DEFAULT_SIDECAR_IMAGE = f"{IMAGE_REGISTRY}/disagg:0.1.0"  # the operator image the chart installs (its appVersion)

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
        DEFAULT_VLLM_VERSION, description="vLLM version in the images; decides which features and flags are used."
    )
    extension: bool = Field(
        False, description="Enable Disagg's vLLM endpoint plugin on decode (the GPU image must contain the disagg package): "
        "decode derenders its own stream.")
    render_extension: bool = Field(
        True, description="Enable it on the render and derender pools where cpuImage contains the disagg package (the "
        "default image does; a stock vllm/vllm-openai[-cpu] image does not, and runs without it): on vLLM 0.32 they "
        "keep a stream's parser state in a derender session. Without it, streams through a stock decode are "
        "derendered per chunk (status.derender.strategy: stateless).")
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
        DEFAULT_CONNECTOR, description=connector_description()
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
    max_body_bytes: int = Field(16 * 1024 * 1024, description="Largest accepted request body.")
    session_stream_interval: int | None = Field(
        None, description="Tokens per decode chunk of a stream derendered by a render-tier session (it splits them per "
        "token again, so clients get coupled's chunks, in bursts of this many); unset: the sidecar's 4, 1: none.")
    service: RouterService = Field(default_factory=RouterService)
    resources: KubeObject | None = Field(
        None, description="Sidecar container resources; default requests 100m CPU and 128Mi, limit 512Mi: ~52 MiB "
        "idle + the sidecar's 256 MiB budget for bodies in flight + one request's parse (docs/security.md).")


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
