"""Validation rules, each written once: where it applies, its CEL expression, its message, its Python check.

``crd.py`` puts every rule into the CRD as ``x-kubernetes-validations`` on the schema node of its
target model, and ``spec.py`` runs the same rules as pydantic validators, so ``kubectl apply`` and
``disagg manifests``/local mode reject a bad spec with the same words.

Conventions that keep the two sides equal:
- A rule's ``target`` is the pydantic model class name whose schema node carries it (``self`` in CEL
  is that object); ``ROOT`` is the whole DisaggregatedModel object (for metadata.name).
- The API server applies schema defaults before CEL runs, and pydantic applies the same defaults,
  so a rule may read a defaulted field without ``has()``. Optional fields (no default) need ``has()``
  in CEL and ``is None`` in Python.
- Rules never depend on list order or on anything outside their target.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from disagg_operator import engine_args
from disagg_operator.rule import Rule
from disagg_operator.scaling_rules import SCALING_RULES
from disagg_sidecar import vllm_releases
from disagg_sidecar.connectors import DEFAULT as DEFAULT_CONNECTOR, REGISTRY as KV_CONNECTORS

ROOT = "DisaggregatedModel"

# Oldest vLLM whose scale-out API (launch render, --tokens-only, --enable-scale-out gating,
# --renderer-num-workers) matches what the plan emits: the oldest release in the table. Newer versions
# outside the table are accepted and reported (status condition VersionSupported, ``status.py``).
MIN_VLLM = vllm_releases.minor_tuple(vllm_releases.OLDEST.name)

MAX_NAME_LENGTH = 54  # "<name>-derender" must still be a 63-character DNS label

NAME_RE = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
SOURCE_RE = (
    r"^(hf://([A-Za-z0-9][-A-Za-z0-9._]*/)?[A-Za-z0-9][-A-Za-z0-9._]*"
    r"|pvc://[a-z0-9]([-.a-z0-9]*[a-z0-9])?(/[^ ]*)?"
    r"|~?/[^ ]*)$"  # ~/PATH: local mode expands it (a Kubernetes pod has no home of yours)
)
VERSION_RE = r"^[0-9]+[.][0-9]+[.][0-9]+([-+.a-z][-+.a-z0-9]*)?$"

# vLLM's switch for its in-memory Responses store (docs/protocol.md, "Other APIs").
RESPONSE_STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"

NO_CONNECTOR = "None"  # kvTransfer.connector's value that turns KV transfer off


def connector_choices() -> tuple[str, ...]:
    """What kvTransfer.connector accepts: every registered connector, or None."""
    return (*KV_CONNECTORS, NO_CONNECTOR)


def connector_description() -> str:
    """The CRD's words for kvTransfer.connector, e.g. "A (default), B (shared storage) or None."."""
    named = [f"{c.name}{' (default)' if c.name == DEFAULT_CONNECTOR else ''}{f' ({c.summary})' if c.summary else ''}"
             for c in KV_CONNECTORS.values()]
    return f"{', '.join(named)} or {NO_CONNECTOR}."


# --- helpers that spell one idea in both languages ---------------------------------------------

def _port_rule(rule_id: str, target: str, field: str, label: str, low: int, why: str = "") -> Rule:
    """``target``'s ``field`` (camelCase) is a port number from ``low`` to 65535."""
    attr = re.sub(r"([A-Z])", r"_\1", field).lower()
    return Rule(rule_id, target, f"self.{field} >= {low} && self.{field} <= 65535",
                f"{label} must be between {low} and 65535{why}", lambda v: low <= getattr(v, attr) <= 65535, f".{field}")


def _at_least_one(rule_id: str, target: str, field: str, attr: str, label: str) -> Rule:
    return Rule(rule_id, target, f"self.{field} >= 1", f"{label} must be at least 1",
                lambda value: getattr(value, attr) >= 1, f".{field}")


def _re(pattern: str, value: str) -> bool:
    # CEL's matches() searches; every pattern here is anchored, so search == fullmatch.
    return re.search(pattern, value) is not None


def _version_ok(version: str) -> bool:
    if not _re(VERSION_RE, version):
        return False
    major, minor = (int(p) for p in version.split(".")[:2])
    return major > 0 or minor >= MIN_VLLM[1]


# --- lists of vLLM arguments (model.engineArgs, pools.*.extraArgs) ----------------------------
# An argument is refused when vLLM's parser would read it as a reserved flag: the flag itself, an
# alias or --no- form (listed in engine_args), or an abbreviation argparse expands (``--trust-remote``,
# ``-t`` for ``-tp``); and ``--config``. The API server's message names the argument and the flag,
# through a CEL messageExpression that ``explain`` spells again in Python.

_OWNED_REASON = "Disagg sets it from the spec; use the spec fields"
_SHARED_REASON = "every tier must agree on it; set it in model.engineArgs"
_FILE_REASON = "it reads flags from a file that these checks never see"


def cel_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _cel_flag(arg: str) -> str:
    # engine_args.flag_name(): text before '=', before '.', with '_' read as '-'.
    return f"{arg}.split('=')[0].split('.')[0].replace('_', '-')"


def _cel_sets(flag: str, flags: Sequence[str]) -> str:
    # engine_args.forbidden_flag(...) is not None, given the flag's name: the flag, or a prefix of it
    # argparse would expand.
    return f"!({flag} in {cel_list(engine_args.NOT_A_FLAG)}) && {cel_list(flags)}.exists(b, b.startsWith({flag}))"


@dataclass(frozen=True)
class FlagRule:
    """A list of vLLM args that must not set (or alias, or abbreviate) any of ``flags``."""

    field: str  # camelCase field of the target
    label: str  # how messages name the field
    flags: tuple[str, ...]

    # The flag names are mapped once (`map`), not per reserved flag. `[x].map(v, ...)` names a value
    # for reuse: cel.bind compiles in rules but not where the API server checks schema defaults.
    def _flag_names(self) -> str:
        return f"self.{self.field}.map(a, {_cel_flag('a')})"

    def cel(self) -> str:
        # An unset list has no schema default (to keep stored objects small), hence has().
        return f"!has(self.{self.field}) || !{self._flag_names()}.exists(f, {_cel_sets('f', self.flags)})"

    def message_cel(self) -> str:
        flags = cel_list(self.flags)
        return (
            f"{self._flag_names()}.filter(f, {_cel_sets('f', self.flags)})"
            f".map(f, [f in {flags} ? f : {flags}.filter(b, b.startsWith(f))[0]].map(m, "
            f"'{self.label} must not set ' + f + (f == m ? '' : ' (an abbreviation of ' + m + ')') + ': ' + "
            f"(m in {cel_list(engine_args.FILE_FLAGS)} ? '{_FILE_REASON}' : "
            f"m in {cel_list(engine_args.SHARED_ONLY_FLAGS)} ? '{_SHARED_REASON}' : '{_OWNED_REASON}'))[0])[0]"
        )

    def valid(self, args: Iterable[str]) -> bool:
        return all(engine_args.forbidden_flag(a, self.flags) is None for a in args)

    def explain(self, args: Iterable[str]) -> str:
        arg, matched = next((a, m) for a in args if (m := engine_args.forbidden_flag(a, self.flags)))
        name = engine_args.flag_name(arg)
        reason = (_FILE_REASON if matched in engine_args.FILE_FLAGS
                  else _SHARED_REASON if matched in engine_args.SHARED_ONLY_FLAGS else _OWNED_REASON)
        return f"{self.label} must not set {name}{'' if name == matched else f' (an abbreviation of {matched})'}: {reason}"


_MODEL_ARGS = FlagRule("engineArgs", "model.engineArgs", engine_args.OWNED_FLAGS + engine_args.FILE_FLAGS)
_POOL_ARGS = FlagRule(
    "extraArgs", "extraArgs", engine_args.OWNED_FLAGS + engine_args.SHARED_ONLY_FLAGS + engine_args.FILE_FLAGS)
_POOL_TARGETS = ("GPUPoolSpec", "CPUPoolSpec")


def _pool_rules(target: str) -> list[Rule]:
    return [
        Rule(
            f"{target}.replicas", target, "self.replicas >= 0",
            "replicas must be 0 or more (0 turns the pool off)",
            lambda p: p.replicas >= 0, ".replicas",
        ),
        Rule(
            f"{target}.autoscaling-needs-replicas", target, "!has(self.autoscaling) || self.replicas >= 1",
            "autoscaling needs replicas of at least 1: a pool with 0 replicas is off",
            lambda p: p.autoscaling is None or p.replicas >= 1, ".autoscaling",
        ),
        Rule(
            f"{target}.extra-args", target, _POOL_ARGS.cel(),
            "extraArgs must not set, alias or abbreviate a flag Disagg derives from the spec or that every tier "
            "must share (use the spec fields or model.engineArgs), nor --config",
            lambda p: _POOL_ARGS.valid(p.extra_args), ".extraArgs",
            _POOL_ARGS.message_cel(), lambda p: _POOL_ARGS.explain(p.extra_args),
        ),
    ]


RULES: tuple[Rule, ...] = (
    # --- the object ------------------------------------------------------------------------------
    Rule(
        "name", ROOT,
        f"self.metadata.name.matches('{NAME_RE}') && size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        f"metadata.name must be a DNS label of at most {MAX_NAME_LENGTH} characters (lowercase letters, "
        "digits, '-', starting with a letter): it prefixes the names of Services such as <name>-derender",
        lambda name: _re(NAME_RE, name) and len(name) <= MAX_NAME_LENGTH,
    ),
    # --- spec: cross-field -----------------------------------------------------------------------
    Rule(
        "prefill-needs-connector", "DisaggregatedModelSpec",
        f"self.pools.prefill.replicas == 0 || self.kvTransfer.connector != '{NO_CONNECTOR}'",
        f"pools.prefill.replicas > 0 needs a KV connector: set kvTransfer.connector to {' or '.join(KV_CONNECTORS)}, "
        "or set pools.prefill.replicas to 0 to prefill on decode",
        lambda s: s.pools.prefill.replicas == 0 or s.kv_transfer.connector != NO_CONNECTOR,
        ".kvTransfer.connector",
    ),
    Rule(
        "distinct-ports", "DisaggregatedModelSpec",
        "self.router.port != self.engine.port && self.router.port != self.kvTransfer.sideChannelPort "
        "&& self.engine.port != self.kvTransfer.sideChannelPort",
        "router.port, engine.port and kvTransfer.sideChannelPort must all differ: they share the decode pod's network",
        lambda s: len({s.router.port, s.engine.port, s.kv_transfer.side_channel_port}) == 3,
        ".router.port",
    ),
    # --- model -----------------------------------------------------------------------------------
    Rule(
        "model.source", "ModelSpec", f"self.source.matches('{SOURCE_RE}')",
        "model.source must be hf://[ORG/]NAME, pvc://CLAIM[/PATH], an absolute path or ~/PATH (local mode)",
        lambda m: _re(SOURCE_RE, m.source), ".source",
    ),
    Rule(
        "model.max-model-len", "ModelSpec", "!has(self.maxModelLen) || self.maxModelLen > 0",
        "model.maxModelLen must be greater than 0",
        lambda m: m.max_model_len is None or m.max_model_len > 0, ".maxModelLen",
    ),
    Rule(
        "model.max-logprobs", "ModelSpec", "!has(self.maxLogprobs) || self.maxLogprobs >= -1",
        "model.maxLogprobs must be -1 (the whole vocabulary) or at least 0",
        lambda m: m.max_logprobs >= -1, ".maxLogprobs",
    ),
    Rule(
        "model.auto-tool-choice-needs-parser", "ModelSpec",
        "!self.enableAutoToolChoice || has(self.toolCallParser)",
        "model.enableAutoToolChoice needs model.toolCallParser (vLLM refuses to start without it)",
        lambda m: not m.enable_auto_tool_choice or m.tool_call_parser is not None, ".enableAutoToolChoice",
    ),
    Rule(
        "model.engine-args", "ModelSpec", _MODEL_ARGS.cel(),
        "model.engineArgs must not set, alias or abbreviate a flag Disagg derives from the spec "
        "(use the spec fields), nor --config",
        lambda m: _MODEL_ARGS.valid(m.engine_args), ".engineArgs",
        _MODEL_ARGS.message_cel(), lambda m: _MODEL_ARGS.explain(m.engine_args),
    ),
    Rule(
        "chat-template.one-source", "ChatTemplate", "has(self.inline) != has(self.configMapRef)",
        "model.chatTemplate needs exactly one of inline or configMapRef",
        lambda t: (t.inline is None) != (t.config_map_ref is None),
    ),
    Rule(
        "env.one-value", "EnvVar", "!(has(self.value) && has(self.valueFrom))",
        "an env entry sets value or valueFrom, not both",
        lambda e: not (e.value is not None and e.value_from is not None),
    ),
    Rule(
        "env.no-response-store", "EnvVar", f"self.name != '{RESPONSE_STORE_ENV}'",
        f"{RESPONSE_STORE_ENV} is not supported: vLLM keeps stored responses in one engine's memory, and a "
        "follow-up may reach another decode pod; Disagg serves the Responses API without the store (clients send "
        "the conversation as input items)",
        lambda e: e.name != RESPONSE_STORE_ENV, ".name",
    ),
    # --- engine ----------------------------------------------------------------------------------
    Rule(
        "engine.vllm-version", "EngineSpec",
        f"self.vllmVersion.matches('{VERSION_RE}') && (int(self.vllmVersion.split('.')[0]) > 0 "
        f"|| int(self.vllmVersion.split('.')[1]) >= {MIN_VLLM[1]})",
        f"engine.vllmVersion must be a version MAJOR.MINOR.PATCH, {MIN_VLLM[0]}.{MIN_VLLM[1]}.0 or newer",
        lambda e: _version_ok(e.vllm_version), ".vllmVersion",
    ),
    _port_rule("engine.port", "EngineSpec", "port", "engine.port", 1024, " (render pods run as non-root)"),
    # --- KV transfer -----------------------------------------------------------------------------
    Rule(
        # The CRD lists the connectors registered when it is generated; Python reads the registry now.
        "kv.connector", "KVTransferSpec", f"self.connector in {cel_list(connector_choices())}",
        f"kvTransfer.connector must be one of {', '.join(connector_choices())}",
        lambda k: k.connector in connector_choices(), ".connector",
    ),
    _port_rule("kv.side-channel-port", "KVTransferSpec", "sideChannelPort", "kvTransfer.sideChannelPort", 1024),
    # --- pools -----------------------------------------------------------------------------------
    Rule(
        "pools.decode-replicas", "PoolsSpec", "self.decode.replicas >= 1",
        "pools.decode.replicas must be at least 1: decode serves every request",
        lambda p: p.decode.replicas >= 1, ".decode.replicas",
    ),
    Rule(
        "pools.derender-needs-render", "PoolsSpec", "!has(self.derender) || self.render.replicas >= 1",
        "a separate derender pool needs the render tier (pools.render.replicas of at least 1); "
        "remove pools.derender to let decode detokenize",
        lambda p: p.derender is None or p.render.replicas >= 1, ".derender",
    ),
    *(rule for target in _POOL_TARGETS for rule in _pool_rules(target)),
    _at_least_one("parallelism.tensor", "Parallelism", "tensor", "tensor", "parallelism.tensor"),
    _at_least_one("parallelism.data", "Parallelism", "data", "data", "parallelism.data"),
    _at_least_one("cpu-pool.renderer-workers", "CPUPoolSpec", "rendererWorkers", "renderer_workers", "rendererWorkers"),
    _at_least_one("autoscaling.min", "Autoscaling", "minReplicas", "min_replicas", "autoscaling.minReplicas"),
    Rule(
        "autoscaling.min-le-max", "Autoscaling", "self.minReplicas <= self.maxReplicas",
        "autoscaling.minReplicas must not be greater than autoscaling.maxReplicas",
        lambda a: a.min_replicas <= a.max_replicas, ".maxReplicas",
    ),
    Rule(
        "autoscaling.one-target", "Autoscaling",
        "!(has(self.targetCPUUtilizationPercentage) && has(self.metrics))",
        "autoscaling sets targetCPUUtilizationPercentage or metrics, not both",
        lambda a: not (a.target_cpu_utilization_percentage is not None and a.metrics is not None),
    ),
    Rule(
        "autoscaling.cpu-target", "Autoscaling",
        "!has(self.targetCPUUtilizationPercentage) || self.targetCPUUtilizationPercentage > 0",
        "autoscaling.targetCPUUtilizationPercentage must be greater than 0",
        lambda a: a.target_cpu_utilization_percentage is None or a.target_cpu_utilization_percentage > 0,
        ".targetCPUUtilizationPercentage",
    ),
    *SCALING_RULES,  # monitoring and the planner (scaling_rules.py)
    # --- router ----------------------------------------------------------------------------------
    _port_rule("router.port", "RouterSpec", "port", "router.port", 1024, " (the sidecar runs as non-root)"),
    Rule(
        "router.retries", "RouterSpec", "self.retries >= 0 && self.retries <= 5",
        "router.retries must be between 0 and 5", lambda r: 0 <= r.retries <= 5, ".retries",
    ),
    Rule(
        "router.max-body-bytes", "RouterSpec", "self.maxBodyBytes >= 1024",
        "router.maxBodyBytes must be at least 1024", lambda r: r.max_body_bytes >= 1024, ".maxBodyBytes",
    ),
    Rule(
        "router.timeouts", "RouterTimeouts",
        "self.connectSeconds > 0 && self.renderSeconds > 0 && self.prefillSeconds > 0 && self.decodeSeconds > 0",
        "router.timeouts must all be greater than 0 seconds",
        lambda t: min(t.connect_seconds, t.render_seconds, t.prefill_seconds, t.decode_seconds) > 0,
    ),
    Rule(
        "router.prefill-load-bound", "RouterSpec", "self.prefillLoadBoundPercent >= 100",
        "router.prefillLoadBoundPercent must be at least 100 (an even share)",
        lambda r: r.prefill_load_bound_percent >= 100, ".prefillLoadBoundPercent",
    ),
    Rule(
        "router.session-stream-interval", "RouterSpec", "!has(self.sessionStreamInterval) || self.sessionStreamInterval >= 1",
        "router.sessionStreamInterval must be at least 1",
        lambda r: r.session_stream_interval is None or r.session_stream_interval >= 1, ".sessionStreamInterval",
    ),
    Rule(
        "router.min-prefill-tokens", "RouterSpec", "self.minPrefillTokens >= 0",
        "router.minPrefillTokens must not be negative", lambda r: r.min_prefill_tokens >= 0, ".minPrefillTokens",
    ),
    _port_rule("endpoint-picker.port", "EndpointPicker", "port", "router.inferencePool.endpointPicker.port", 1),
    _port_rule("router.service-port", "RouterService", "port", "router.service.port", 1),
)


def rules_for(target: str) -> tuple[Rule, ...]:
    return tuple(r for r in RULES if r.target == target)


def failures(target: str, value: Any) -> list[Rule]:
    """The rules of ``target`` that ``value`` breaks."""
    return [r for r in rules_for(target) if not r.check(value)]


def cel_validations(target: str) -> list[dict[str, str]]:
    """``x-kubernetes-validations`` entries for a schema node."""
    out = []
    for r in rules_for(target):
        entry = {"rule": r.cel, "message": r.message}
        if r.message_cel:
            entry["messageExpression"] = r.message_cel
        if r.field_path:
            entry["fieldPath"] = r.field_path
        out.append(entry)
    return out
