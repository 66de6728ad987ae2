"""The one place vLLM command-line flags and environment variable names are spelled.

Everything here is pure string building; which tier gets which group of flags is decided in
``pools.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from disagg_sidecar import vllm_releases


class Launcher(StrEnum):
    """How a tier's vLLM process is started; the flags after the prefix are the same parser's."""

    SERVE = "serve"  # `vllm serve MODEL ...`: prefill and decode engines
    LAUNCH_RENDER = "launch-render"  # `vllm launch render MODEL ...`: GPU-less render/derender


LAUNCHER_ARGV: Mapping[Launcher, tuple[str, ...]] = {
    Launcher.SERVE: ("vllm", "serve"),
    Launcher.LAUNCH_RENDER: ("vllm", "launch", "render"),
}

# Environment variables read by vLLM (vllm/envs.py); a KV connector's are in its profile.
VLLM_PLUGINS = "VLLM_PLUGINS"
VLLM_API_KEY = "VLLM_API_KEY"  # what vLLM's --api-key defaults to: the key stays out of argv

# security.tls: the user's TLS Secret, mounted in every vLLM container (the sidecar gets ca.crt only).
TLS_DIR = "/var/run/disagg/tls"
TLS_CA_DIR = "/var/run/disagg/tls-ca"
TLS_FLAGS: tuple[str, ...] = ("--ssl-keyfile", f"{TLS_DIR}/tls.key", "--ssl-certfile", f"{TLS_DIR}/tls.crt")

TOKENS_ONLY = "--tokens-only"
ENABLE_SCALE_OUT = "--enable-scale-out"

# Flags Disagg derives from the spec: setting them by hand would defeat the single source of truth.
# Every spelling vLLM's parser accepts for them is listed (aliases, the --no- form of booleans):
# tests/operator/test_vllm_flags.py checks this against vLLM's own parser.
OWNED_FLAGS: tuple[str, ...] = (
    "--host", "--port", "--model", "--served-model-name", "--revision", "--max-model-len", "--max-logprobs",
    "--chat-template", "--default-chat-template-kwargs", "--tool-call-parser", "--reasoning-parser",
    "--enable-auto-tool-choice", "--no-enable-auto-tool-choice", "--kv-transfer-config",
    "--tokens-only", "--no-tokens-only", "--enable-scale-out", "--no-enable-scale-out",
    "--renderer-num-workers", "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp",
    "--enable-expert-parallel", "--no-enable-expert-parallel", "-ep", "--api-server-count", "-asc",
    "--api-key", "--ssl-keyfile", "--ssl-certfile",
)
# Flags that change how prompts are rendered or outputs parsed: every tier must agree, so they
# are accepted in the shared model.engineArgs but not in one pool's extraArgs.
SHARED_ONLY_FLAGS: tuple[str, ...] = (
    "--tokenizer", "--tokenizer-mode", "--tokenizer-revision", "--trust-remote-code", "--no-trust-remote-code",
    "--generation-config", "--chat-template-content-format", "--hf-overrides",
    "--tool-parser-plugin", "--reasoning-parser-plugin", "--skip-tokenizer-init", "--no-skip-tokenizer-init",
)
# `--config FILE` makes vLLM read more flags from a YAML file, which no check here ever sees.
FILE_FLAGS: tuple[str, ...] = ("--config",)
NOT_A_FLAG: tuple[str, ...] = ("", "-", "--")  # a value, or `--` (end of options): prefix of everything


def flag_name(arg: str) -> str:
    """The flag an argument sets, as vLLM's parser sees it (`--a_b.c=1` → `--a-b`).

    Mirrored in CEL by ``_cel_flag`` in rules.py; keep the two in step.
    """
    return arg.split("=")[0].split(".")[0].replace("_", "-")


def forbidden_flag(arg: str, flags: Sequence[str]) -> str | None:
    """The flag of ``flags`` that ``arg`` would set, or None.

    argparse (hence vLLM) takes any unambiguous prefix of an option (`--trust-remote`, `-t` for
    `-tp`), so an argument whose flag is a prefix of a forbidden one is refused too; an ambiguous
    prefix would not start vLLM anyway. The flag itself wins over a longer one it is a prefix of
    (`--tokenizer`, not `--tokenizer-mode`); otherwise the first in ``flags`` order is named.
    Mirrored in CEL by ``_cel_sets`` and ``FlagRule.message_cel`` in rules.py; keep the two in step.
    """
    name = flag_name(arg)
    if name in NOT_A_FLAG:
        return None
    if name in flags:
        return name
    return next((f for f in flags if f.startswith(name)), None)


def launcher_argv(launcher: Launcher) -> list[str]:
    return list(LAUNCHER_ARGV[launcher])


def listen_flags(port: int, host: str = "0.0.0.0") -> list[str]:
    return ["--host", host, "--port", str(port)]


def revision_flags(revision: str | None) -> list[str]:
    return ["--revision", revision] if revision else []


def engine_max_logprobs(client_max: int) -> int:
    """The engines' ``--max-logprobs`` for a client-facing maximum (``model.maxLogprobs``).

    One more than clients may ask for: a completions client asking for ``logprobs: k`` sees the
    sampled token beside the top k (k + 1 candidates), which the sidecar asks a generate engine for
    as ``logprobs: k + 1`` and a derender tier must accept (docs/protocol.md §3). The sidecar
    refuses more than ``client_max`` itself, as a coupled server would. -1 (the vocabulary) stays.
    """
    return client_max + 1 if client_max >= 0 else -1


def model_flags(served_name: str, max_model_len: int | None, max_logprobs: int) -> list[str]:
    """``max_logprobs``: the client-facing maximum (the engines get ``engine_max_logprobs`` of it)."""
    flags = ["--served-model-name", served_name]
    if max_model_len is not None:
        flags += ["--max-model-len", str(max_model_len)]
    # One argument: a separate "-1" would read as an option to some argv readers.
    return flags + [f"--max-logprobs={engine_max_logprobs(max_logprobs)}"]


def chat_template_flags(template_path: str | None, default_kwargs: Mapping[str, Any] | None) -> list[str]:
    """Flags that decide how a request becomes prompt tokens."""
    flags: list[str] = []
    if template_path:
        flags += ["--chat-template", template_path]
    if default_kwargs:
        flags += ["--default-chat-template-kwargs", canonical_json(default_kwargs)]
    return flags


def parser_flags(tool_call_parser: str | None, reasoning_parser: str | None, auto_tool_choice: bool) -> list[str]:
    """Flags that decide how output tokens become reasoning / content / tool calls."""
    flags: list[str] = []
    if reasoning_parser:
        flags += ["--reasoning-parser", reasoning_parser]
    if tool_call_parser:
        flags += ["--tool-call-parser", tool_call_parser]
    if auto_tool_choice:
        flags.append("--enable-auto-tool-choice")
    return flags


def kv_transfer_config(connector: str, extra_config: Mapping[str, Any] | None, kv_role: str,
                       module_path: str | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object; ``kv_role`` is the connector profile's for the pool
    (``disagg_sidecar.connectors``); ``module_path`` names the module holding the connector class
    instead of vLLM's registry."""
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": kv_role}
    if module_path:
        config["kv_connector_module_path"] = module_path
    if extra_config:
        config["kv_connector_extra_config"] = dict(extra_config)
    return config


def kv_transfer_flags(config: Mapping[str, Any]) -> list[str]:
    return ["--kv-transfer-config", canonical_json(config)]


# vLLM's --block-size when none is given: 16 on GPUs (CacheConfig.DEFAULT_BLOCK_SIZE), 128 on CPUs
# (the CPU attention backend's). A pool that requests no GPU resource is taken as CPU: the larger
# block is the safe side for what depends on it (the shortest prompt a KV connector can carry).
DEFAULT_BLOCK_SIZE = {"gpu": 16, "cpu": 128}


def block_size(args: Sequence[str], gpu: bool) -> int:
    """The KV block size an engine with these flags runs with (the last ``--block-size`` wins)."""
    size = DEFAULT_BLOCK_SIZE["gpu" if gpu else "cpu"]
    for i, arg in enumerate(args):
        if flag_name(arg) == "--block-size":
            value = arg.partition("=")[2] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            if value.isdigit() and int(value) > 0:
                size = int(value)
    return size


def requests_gpu(resources: Mapping[str, Any] | None) -> bool:
    """Whether container resources ask for a GPU (``nvidia.com/gpu``, ``amd.com/gpu``, ...)."""
    return any(str(key).endswith("/gpu") for part in ("limits", "requests")
               for key in ((resources or {}).get(part) or {}))


def parallel_flags(tensor: int, data: int, expert: bool) -> list[str]:
    flags: list[str] = []
    if tensor != 1:
        flags += ["--tensor-parallel-size", str(tensor)]
    if data != 1:
        flags += ["--data-parallel-size", str(data)]
    if expert:
        flags.append("--enable-expert-parallel")
    return flags


def renderer_flags(workers: int) -> list[str]:
    return ["--renderer-num-workers", str(workers)]


def server_args(model_arg: str, vllm_args: Sequence[str], *, port: int, revision: str | None = None,
                host: str = "0.0.0.0") -> list[str]:
    """What follows the launcher: model location, revision, listen address, role flags."""
    return [model_arg, *revision_flags(revision), *listen_flags(port, host), *vllm_args]


def vllm_features(version: str) -> dict[str, bool]:
    """What the sidecar may rely on of stock vLLM, by version (``disagg_sidecar.vllm_releases``: a
    version outside its table assumes nothing)."""
    row = vllm_releases.release(version)
    return {
        "generate_output_mode_derender": row.stock_batch_derender,  # /inference/v1/generate output_mode="derender"
        "generate_streaming_derender": row.stock_streaming_derender,  # ... and stream=true (0.34)
        "render_parse_context": row.render_parse_context,
        # Batch /derender answers with the coupled endpoint's finish_reason for the same tokens
        # (0.32's says "stop" where coupled says "tool_calls", and the reverse after a length cut).
        "derender_finish_reason": row.derender_finish_reason,
    }


def derender_sessions(version: str) -> bool:
    """A render tier of this vLLM version with the engine extension runs derender sessions (the table's
    ``derender_sessions``; engine/disagg_engine/vllm_compat.py ``DERENDER_SESSIONS`` reads the same row
    for the running vLLM)."""
    return vllm_releases.release(version).derender_sessions


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no spaces: equal configs give byte-equal flags (and hashes)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
