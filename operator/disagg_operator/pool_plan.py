"""What a Plan says about one pool, and the values it is made of (frozen, no Kubernetes objects)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from disagg_operator import engine_args
from disagg_operator.engine_args import Launcher
from disagg_operator.names import Role

MODEL_MOUNT_ROOT = "/models"  # pvc://CLAIM/PATH is mounted at /models/CLAIM
HEALTH_PATH = "/health"
POD_IP: Mapping[str, Any] = {"fieldRef": {"fieldPath": "status.podIP"}}


def config_hash(value: Any) -> str:
    return hashlib.sha256(engine_args.canonical_json(value).encode()).hexdigest()[:16]


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
    name: str  # Deployment name, names.pool_name
    replicas: int
    launcher: Launcher
    image: str
    image_pull_policy: str | None
    gpu: bool
    vllm_args: tuple[str, ...]
    env: tuple[EnvVar, ...]
    port: int
    side_channel_ports: tuple[int, ...]  # the KV connector's, one per data-parallel rank; empty without one
    uses_chat_template: bool
    kv_shared_path: str | None  # the KV connector's shared directory, where this pool has one
    kv_shared_claim: str | None  # the claim mounted there (None: a directory of the pod's own)
    cache_claim: str | None  # mounted as HOME (None: an emptyDir)
    resources: Mapping[str, Any] | None
    node_selector: Mapping[str, str] | None
    tolerations: tuple[Mapping[str, Any], ...] | None
    affinity: Mapping[str, Any] | None
    autoscaling: AutoscalingPlan | None
    startup_seconds: int
    config_hash: str
    health_path: str = HEALTH_PATH
    pod_labels: tuple[tuple[str, str], ...] = ()  # beyond names.labels: an InferencePool's membership
    planned: bool = False  # spec.autoscaling: the operator's planner owns the replica count

    @property
    def external_replicas(self) -> bool:
        """Someone else than the spec sets the count (an HPA, the planner): the Deployment leaves it out."""
        return self.autoscaling is not None or self.planned

    def server_args(self, model: ModelSource, *, model_arg: str | None = None, port: int | None = None,
                    host: str = "0.0.0.0") -> list[str]:
        """The arguments after the launcher; ``model_arg`` replaces the model location (and drops --revision)."""
        return engine_args.server_args(model_arg or model.argument, self.vllm_args,
                                       port=self.port if port is None else port,
                                       revision=model.revision if model_arg is None else None, host=host)

    def argv(self, model: ModelSource, **where: Any) -> list[str]:
        """The full command line (``where``: as for ``server_args``)."""
        return [*engine_args.launcher_argv(self.launcher), *self.server_args(model, **where)]
