"""What the engine extension reports at ``GET /disagg/v1/capabilities``, per server role:

- a generate server (``serve --enable-scale-out``): the output modes, context forms and parsers
  of ``/inference/v1/generate`` (``generate_capabilities``);
- a render server (``launch render``): the derender sessions it runs (``render_capabilities``),
  with the live session count (``live_derender_sessions``) added per request.
"""

from __future__ import annotations

from typing import Any

from disagg_sidecar import vllm_releases, wire

EXTENSION_VERSION = "1"
PLUGIN_NAME = wire.ENGINE_EXTENSION
ABORT_PATH = wire.ABORT


def _common() -> dict[str, Any]:
    from disagg_engine.vllm_compat import vllm_version

    return {"extension": PLUGIN_NAME, "extension_version": EXTENSION_VERSION, "vllm_version": vllm_version(),
            **release_report(vllm_version())}


def release_report(version: str) -> dict[str, Any]:
    """What the running vLLM offers without the extension, from the release table (``vllm_release``:
    its row, None outside the table, where every offer is false)."""
    row = vllm_releases.known(version)
    return {"vllm_release": row.name if row else None, "vllm_offers": vllm_releases.features(version),
            "stream_state_key": vllm_releases.release(version).stream_state_key}


def generate_capabilities(serving, args) -> dict[str, Any]:
    from disagg_engine.vllm_compat import chat_parser_configured, configured_parsers

    tokenizer = bool(serving is not None and serving.has_tokenizer)
    derender = tokenizer and serving.chat is not None
    modes = ["tokens"] + (["text"] if tokenizer else []) + (["derender"] if derender else [])
    return {
        **_common(),
        "role": "generate",
        "output_modes": modes,
        "streaming_output_modes": modes,
        "derender_context_forms": ["chat_request", "parse_context"] if derender else [],
        # The APIs whose client chunks a stream can write (``ClientStream``): chat's from a streamed
        # derender, completions' from a streamed text. The first version said ``true`` for chat alone.
        "client_streams": (["chat"] if derender else [])
        + (["completions"] if tokenizer and getattr(serving, "completion", None) is not None else []),
        "tokenizer": tokenizer,
        "parser_configured": chat_parser_configured(getattr(serving, "chat", None)),
        **configured_parsers(args),
        "abort_path": ABORT_PATH,
    }


def render_capabilities(sessions, args) -> dict[str, Any]:
    from disagg_engine.vllm_compat import configured_parsers

    return {**_common(), "role": "render", "derender_sessions": sessions.capability(), **configured_parsers(args)}
