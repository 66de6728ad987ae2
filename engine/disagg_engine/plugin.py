"""The ``disagg`` vLLM endpoint plugin (entry point group ``vllm.endpoint_plugins``).

Enabled by naming it in ``VLLM_PLUGINS`` (``disagg engine`` does that). Its routes replace vLLM's
``POST /inference/v1/generate`` and add ``GET /disagg/v1/capabilities``; it also makes sure
``/inference/v1/abort_requests`` exists whenever generate is served (RFC open question 4).
"""

from __future__ import annotations

from typing import Any

from disagg_sidecar import wire

EXTENSION_VERSION = "1"
PLUGIN_NAME = wire.ENGINE_EXTENSION


def capabilities(serving, args) -> dict[str, Any]:
    from disagg_engine.vllm_compat import chat_parser_configured, configured_parsers, vllm_version

    tokenizer = bool(serving is not None and serving.has_tokenizer)
    derender = tokenizer and serving.chat is not None
    modes = ["tokens"] + (["text"] if tokenizer else []) + (["derender"] if derender else [])
    return {
        "extension": PLUGIN_NAME,
        "extension_version": EXTENSION_VERSION,
        "vllm_version": vllm_version(),
        "output_modes": modes,
        "streaming_output_modes": modes,
        "derender_context_forms": ["chat_request", "parse_context"] if derender else [],
        "tokenizer": tokenizer,
        "parser_configured": chat_parser_configured(getattr(serving, "chat", None)),
        **configured_parsers(args),
        "abort_path": wire.ABORT,
    }


class DisaggEndpointPlugin:
    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        from disagg_engine.router import abort_route_missing, router, abort_router

        app.include_router(router)
        if abort_route_missing(app):
            app.include_router(abort_router)

    async def init_state(self, engine_client, state, args) -> None:
        from disagg_engine.serving import DisaggServingTokens
        from disagg_engine.vllm_compat import subclass_serving_tokens

        base = getattr(state, "serving_tokens", None)
        if engine_client is None or base is None:
            state.disagg_serving_tokens = None  # render-only server or scale-out disabled
            return
        serving = subclass_serving_tokens(base, DisaggServingTokens)
        serving.chat = getattr(state, "openai_serving_chat", None)
        serving.live_derender_requests = 0
        state.disagg_serving_tokens = serving
        state.disagg_capabilities = capabilities(serving, args)


def make_plugin() -> DisaggEndpointPlugin:
    return DisaggEndpointPlugin()

