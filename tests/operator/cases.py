"""Invalid DisaggregatedModels, one per validation rule: the table both pydantic (unit tests) and the
API server's CEL (cluster tests) must reject with the rule's message at the given location."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from disagg_operator.rules import RULES
from disagg_operator.spec import API_VERSION, KIND

MESSAGES = {r.id: r.message for r in RULES}
# Why an engine flag is refused, as the extraArgs/engineArgs messages say it.
OWNED = "Disagg sets it from the spec; use the spec fields"
SHARED = "every tier must agree on it; set it in model.engineArgs"
FILE = "it reads flags from a file that these checks never see"


def base(name: str = "m") -> dict[str, Any]:
    """The smallest valid object; every case changes one thing."""
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
            "spec": {"model": {"source": "hf://Qwen/Qwen3-0.6B"}}}


def merged(into: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(into)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass(frozen=True)
class Invalid:
    rule: str  # rules.Rule.id
    spec: dict[str, Any]  # merged into base()["spec"]
    where: str  # where the error is reported (pydantic spelling: list indexes as .N)
    name: str = "m"
    says: str | None = None  # the message, for rules whose message names what broke them
    label: str = ""  # tells apart several cases of one rule

    @property
    def message(self) -> str:
        return self.says or MESSAGES[self.rule]

    @property
    def id(self) -> str:
        return f"{self.rule}-{self.label}" if self.label else self.rule

    def document(self) -> dict[str, Any]:
        doc = base(self.name)
        doc["spec"] = merged(doc["spec"], self.spec)
        return doc


def pools(**pools: Any) -> dict[str, Any]:
    return {"pools": pools}


def model(**fields: Any) -> dict[str, Any]:
    return {"model": fields}


INVALID: tuple[Invalid, ...] = (
    Invalid("name", {}, "metadata.name", name="9-lives"),
    Invalid("prefill-needs-connector", {"kvTransfer": {"connector": "None"}}, "spec.kvTransfer.connector"),
    Invalid("distinct-ports", {"router": {"port": 8200}}, "spec.router.port"),
    Invalid("model.source", model(source="s3://bucket/qwen"), "spec.model.source"),
    Invalid("model.max-model-len", model(maxModelLen=0), "spec.model.maxModelLen"),
    Invalid("model.max-logprobs", model(maxLogprobs=-2), "spec.model.maxLogprobs"),
    Invalid("model.auto-tool-choice-needs-parser", model(enableAutoToolChoice=True), "spec.model.enableAutoToolChoice"),
    Invalid("model.engine-args", model(engineArgs=["--dtype", "bfloat16", "--port=9000"]), "spec.model.engineArgs",
            says=f"model.engineArgs must not set --port: {OWNED}"),
    Invalid("model.engine-args", model(engineArgs=["--conf", "f.yaml"]), "spec.model.engineArgs", label="config",
            says=f"model.engineArgs must not set --conf (an abbreviation of --config): {FILE}"),
    Invalid("chat-template.one-source", model(chatTemplate={}), "spec.model.chatTemplate"),
    Invalid("env.one-value", model(env=[{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]),
            "spec.model.env.0"),
    Invalid("env.no-response-store", model(env=[{"name": "VLLM_ENABLE_RESPONSES_API_STORE", "value": "1"}]),
            "spec.model.env.0.name"),
    Invalid("engine.vllm-version", {"engine": {"vllmVersion": "0.31.2"}}, "spec.engine.vllmVersion"),
    Invalid("engine.port", {"engine": {"port": 80}}, "spec.engine.port"),
    Invalid("kv.connector", {"kvTransfer": {"connector": "LMCacheConnectorV1"}}, "spec.kvTransfer.connector"),
    Invalid("kv.side-channel-port", {"kvTransfer": {"sideChannelPort": 70000}}, "spec.kvTransfer.sideChannelPort"),
    Invalid("pools.decode-replicas", pools(decode={"replicas": 0}), "spec.pools.decode.replicas"),
    Invalid("pools.derender-needs-render", pools(render={"replicas": 0}, derender={"replicas": 1}), "spec.pools.derender"),
    Invalid("GPUPoolSpec.replicas", pools(prefill={"replicas": -1}), "spec.pools.prefill.replicas"),
    Invalid("CPUPoolSpec.replicas", pools(render={"replicas": -2}), "spec.pools.render.replicas"),
    Invalid("GPUPoolSpec.autoscaling-needs-replicas", pools(prefill={"replicas": 0, "autoscaling": {"maxReplicas": 2}}),
            "spec.pools.prefill.autoscaling"),
    Invalid("CPUPoolSpec.autoscaling-needs-replicas", pools(render={"replicas": 0, "autoscaling": {"maxReplicas": 2}}),
            "spec.pools.render.autoscaling"),
    Invalid("GPUPoolSpec.extra-args", pools(decode={"extraArgs": ["--tool-call-parser=hermes"]}),
            "spec.pools.decode.extraArgs", says=f"extraArgs must not set --tool-call-parser: {OWNED}"),
    Invalid("CPUPoolSpec.extra-args", pools(render={"extraArgs": ["--trust_remote_code"]}), "spec.pools.render.extraArgs",
            says=f"extraArgs must not set --trust-remote-code: {SHARED}"),
    # The engine key and TLS flags come from spec.security (docs/security.md, "API keys").
    Invalid("CPUPoolSpec.extra-args", pools(render={"extraArgs": ["--api-key", "k"]}), "spec.pools.render.extraArgs",
            label="api-key", says=f"extraArgs must not set --api-key: {OWNED}"),
    Invalid("GPUPoolSpec.extra-args", pools(decode={"extraArgs": ["--ssl-keyfile=/k"]}), "spec.pools.decode.extraArgs",
            label="tls", says=f"extraArgs must not set --ssl-keyfile: {OWNED}"),
    # Abbreviations argparse would expand, aliases, and --config (docs/security.md, "Engine flags").
    Invalid("CPUPoolSpec.extra-args", pools(derender={"extraArgs": ["--trust-remote"]}), "spec.pools.derender.extraArgs",
            label="abbreviated", says=f"extraArgs must not set --trust-remote (an abbreviation of --trust-remote-code): {SHARED}"),
    Invalid("GPUPoolSpec.extra-args", pools(prefill={"extraArgs": ["--max-num-seqs", "8", "--kv-transfer-conf={}"]}),
            "spec.pools.prefill.extraArgs", label="abbreviated",
            says=f"extraArgs must not set --kv-transfer-conf (an abbreviation of --kv-transfer-config): {OWNED}"),
    Invalid("GPUPoolSpec.extra-args", pools(decode={"extraArgs": ["--tool_call_pars=hermes"]}), "spec.pools.decode.extraArgs",
            label="abbreviated-underscores",
            says=f"extraArgs must not set --tool-call-pars (an abbreviation of --tool-call-parser): {OWNED}"),
    Invalid("GPUPoolSpec.extra-args", pools(decode={"extraArgs": ["-as", "4"]}), "spec.pools.decode.extraArgs",
            label="abbreviated-alias", says=f"extraArgs must not set -as (an abbreviation of -asc): {OWNED}"),
    Invalid("GPUPoolSpec.extra-args", pools(decode={"extraArgs": ["--no-enable-scale-out"]}), "spec.pools.decode.extraArgs",
            label="negated", says=f"extraArgs must not set --no-enable-scale-out: {OWNED}"),
    Invalid("GPUPoolSpec.extra-args", pools(decode={"extraArgs": ["--config", "f.yaml"]}), "spec.pools.decode.extraArgs",
            label="config", says=f"extraArgs must not set --config: {FILE}"),
    Invalid("parallelism.tensor", pools(decode={"parallelism": {"tensor": 0}}), "spec.pools.decode.parallelism.tensor"),
    Invalid("parallelism.data", pools(prefill={"parallelism": {"data": 0}}), "spec.pools.prefill.parallelism.data"),
    Invalid("cpu-pool.renderer-workers", pools(render={"rendererWorkers": 0}), "spec.pools.render.rendererWorkers"),
    Invalid("tracing.sample-ratio", {"monitoring": {"tracing": {"otlpEndpoint": "http://otel.monitoring.svc:4318",
                                                                "sampleRatio": 1.5}}},
            "spec.monitoring.tracing.sampleRatio"),
    Invalid("autoscaling.one-scaler", {**pools(decode={"autoscaling": {"maxReplicas": 2}}), "autoscaling": {
        "prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 2}, "targets": {"ttftSeconds": 1}}}, "spec.autoscaling"),
    Invalid("pool-bounds.min", {"autoscaling": {"prefill": {"minReplicas": 3, "maxReplicas": 2},
                                                "decode": {"maxReplicas": 2}, "targets": {"ttftSeconds": 1}}},
            "spec.autoscaling.prefill.minReplicas"),
    Invalid("ratio.range", {"autoscaling": {"prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 2},
                                            "ratio": {"min": 2, "max": 1}, "targets": {"ttftSeconds": 1}}},
            "spec.autoscaling.ratio"),
    Invalid("targets.some", {"autoscaling": {"prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 2},
                                             "targets": {}}}, "spec.autoscaling.targets"),
    Invalid("targets.positive", {"autoscaling": {"prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 2},
                                                 "targets": {"decodeKvCacheUsage": 1.5}}}, "spec.autoscaling.targets"),
    Invalid("stabilization.range", {"autoscaling": {"prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 2},
                                                    "targets": {"itlSeconds": 0.05},
                                                    "stabilization": {"scaleDownSeconds": -1}}},
            "spec.autoscaling.stabilization"),
    Invalid("autoscaling.interval", {"autoscaling": {"prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 2},
                                                     "targets": {"itlSeconds": 0.05}, "intervalSeconds": 1}},
            "spec.autoscaling.intervalSeconds"),
    Invalid("autoscaling.tolerance", {"autoscaling": {"prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 2},
                                                      "targets": {"itlSeconds": 0.05}, "tolerance": 1.0}},
            "spec.autoscaling.tolerance"),
    Invalid("autoscaling.ratio-feasible", {"autoscaling": {"prefill": {"maxReplicas": 2}, "decode": {"minReplicas": 2, "maxReplicas": 4},
                                                           "ratio": {"min": 1.5}, "targets": {"itlSeconds": 0.05}}},
            "spec.autoscaling.ratio"),
    Invalid("autoscaling.min", pools(render={"autoscaling": {"minReplicas": 0, "maxReplicas": 3}}),
            "spec.pools.render.autoscaling.minReplicas"),
    Invalid("autoscaling.min-le-max", pools(decode={"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}),
            "spec.pools.decode.autoscaling.maxReplicas"),
    Invalid("autoscaling.one-target", pools(render={"autoscaling": {
        "maxReplicas": 4, "targetCPUUtilizationPercentage": 70,
        "metrics": [{"type": "Resource", "resource": {"name": "memory", "target": {"type": "Utilization", "averageUtilization": 80}}}],
    }}), "spec.pools.render.autoscaling"),
    Invalid("autoscaling.cpu-target", pools(render={"autoscaling": {"maxReplicas": 4, "targetCPUUtilizationPercentage": 0}}),
            "spec.pools.render.autoscaling.targetCPUUtilizationPercentage"),
    Invalid("router.port", {"router": {"port": 443}}, "spec.router.port"),
    Invalid("router.retries", {"router": {"retries": 9}}, "spec.router.retries"),
    Invalid("router.max-body-bytes", {"router": {"maxBodyBytes": 10}}, "spec.router.maxBodyBytes"),
    Invalid("router.timeouts", {"router": {"timeouts": {"prefillSeconds": 0}}}, "spec.router.timeouts"),
    Invalid("router.service-port", {"router": {"service": {"port": 0}}}, "spec.router.service.port"),
    Invalid("router.prefill-load-bound", {"router": {"prefillLoadBoundPercent": 99}}, "spec.router.prefillLoadBoundPercent"),
    Invalid("router.session-stream-interval", {"router": {"sessionStreamInterval": 0}}, "spec.router.sessionStreamInterval"),
    Invalid("router.min-prefill-tokens", {"router": {"minPrefillTokens": -1}}, "spec.router.minPrefillTokens"),
    Invalid("endpoint-picker.port", {"router": {"inferencePool": {"enabled": True, "endpointPicker": {
        "name": "epp", "port": 70000}}}}, "spec.router.inferencePool.endpointPicker.port"),
)


# Borderline values both sides must judge alike (accepted: True).
EDGES: tuple[tuple[str, dict[str, Any], bool], ...] = (
    # The sidecar needs an http(s) URL with a port for its OTLP receiver (disagg_sidecar.config.check_url).
    *((f"otlp {v}", {"monitoring": {"tracing": {"otlpEndpoint": v}}}, ok) for v, ok in [
        ("http://otel.monitoring.svc:4318", True), ("https://10.0.0.7:4318/otlp", True),
        ("http://otel.monitoring.svc", False), ("grpc://otel:4317", False), ("http://otel :4318", False)]),
    *((f"sample ratio {v}", {"monitoring": {"tracing": {"otlpEndpoint": "http://otel:4318", "sampleRatio": v}}}, ok)
      for v, ok in [(0, True), (1, True), (0.05, True), (-0.1, False), (1.01, False)]),
    *((f"source {v}", model(source=v), ok) for v, ok in [
        ("hf://Qwen/Qwen3-8B", True), ("hf://gpt2", True), ("pvc://models/qwen3/8b", True), ("pvc://models", True),
        ("/srv/models/qwen3", True), ("~/.cache/disagg/models/tiny-qwen3", True), ("Qwen/Qwen3-8B", False),
        ("hf://", False), ("hf://a/b/c", False), ("pvc://Models", False), ("relative/path", False),
        ("/has space", False), ("~user/x", False)]),
    *((f"vllm {v}", {"engine": {"vllmVersion": v}}, ok) for v, ok in [
        ("0.32.0", True), ("0.33.0", True), ("0.33.0rc1", True), ("0.32.0+cpu", True), ("1.0.0", True),
        ("0.31.9", False), ("0.4.0", False), ("latest", False), ("0.33", False)]),
    *((f"decode args {' '.join(a)}", pools(decode={"extraArgs": a}), ok) for a, ok in [
        (["--max-num-seqs", "64"], True), (["--gpu-memory-utilization=0.85"], True),
        (["--tokenizer-mode", "slow"], False),  # must match across tiers: model.engineArgs only
        (["--kv-transfer-config.kv_role", "kv_producer"], False),  # dotted form of an owned flag
        (["--tensor_parallel_size", "2"], False),  # underscore form
        (["-tp", "2"], False), (["-t", "2"], False), (["-ep"], False), (["--enable-expert"], False),
        (["--dt", "half"], True),  # a unique abbreviation of a flag that is not reserved
        (["--config-format", "hf"], True),  # starts with --config but is another flag
        (["--data-parallel-size-local", "1"], True), (["--", "x"], True), (["-1"], True),
        (["--kv-transfer-conf.kv_role", "kv_producer"], False)]),
    *((f"model args {' '.join(a)}", model(engineArgs=a), ok) for a, ok in [
        (["--config=f.yaml"], False), (["--con", "f.yaml"], False), (["--tokenizer-mode", "slow"], True),
        (["--no-trust-remote-code"], True), (["--served-model"], False), (["--host=::"], False)]),
    ("shared flags in model.engineArgs", model(engineArgs=["--trust-remote-code", "--tokenizer-mode", "auto"]), True),
    ("no prefill, no connector", {"kvTransfer": {"connector": "None"}, "pools": {"prefill": {"replicas": 0}}}, True),
    ("derender pool with render", pools(derender={"replicas": 2}), True),
    *((f"cpu image {image} extension {on}", {"engine": {"cpuImage": image, "renderExtension": on}}, ok)
      for image, on, ok in [
          ("docker.io/vllm/vllm-openai-cpu@sha256:ab", True, True), ("vllm/vllm-openai", True, True),
          ("vllm/vllm-openai-cpu:v0.33.0", False, True), ("registry.example/vllm/vllm-openai-cpu:v0.33.0", True, True),
          ("ghcr.io/disagg/vllm-cpu:v0.32.0", True, True), ("vllm/vllm-openai-cpu-disagg:v1", True, True)]),
    ("autoscaling with metrics", pools(render={"autoscaling": {"maxReplicas": 3, "metrics": [
        {"type": "Resource", "resource": {"name": "memory", "target": {"type": "Utilization", "averageUtilization": 70}}}]}}),
     True),
)
