"""The ``disagg`` vLLM endpoint plugin (entry point group ``vllm.endpoint_plugins``).

Enabled by naming it in ``VLLM_PLUGINS`` (``disagg engine`` does that). On a generate server its
routes replace vLLM's ``POST /inference/v1/generate`` and it makes sure
``/inference/v1/abort_requests`` exists whenever generate is served (docs/protocol.md §2). On a
render server (``launch render``, which loads endpoint plugins too) it runs derender sessions
(``sessions.py``). Both report ``GET /disagg/v1/capabilities`` (``capabilities.py``).
"""

from __future__ import annotations

from disagg_engine.capabilities import PLUGIN_NAME

__all__ = ["PLUGIN_NAME", "DisaggEndpointPlugin", "make_plugin"]


class DisaggEndpointPlugin:
    name = PLUGIN_NAME
    required_tasks = ("generate", "render")

    def attach_router(self, app) -> None:
        from disagg_engine.router import abort_route_missing, router, abort_router

        app.include_router(router)
        if abort_route_missing(app):
            app.include_router(abort_router)

    async def init_state(self, engine_client, state, args) -> None:
        from disagg_engine.capabilities import generate_capabilities, render_capabilities
        from disagg_engine.serving import DisaggServingTokens
        from disagg_engine.vllm_compat import subclass_serving_tokens

        state.disagg_sessions = None
        state.disagg_serving_tokens = None
        base = getattr(state, "serving_tokens", None)
        if engine_client is None and getattr(state, "online_renderer", None) is not None:
            from disagg_engine.vllm_compat import DERENDER_SESSIONS, render_tier_chat, render_tier_completion

            if DERENDER_SESSIONS:
                from disagg_engine.sessions import Sessions

                state.disagg_sessions = Sessions(render_tier_chat(state, args), render_tier_completion(state, args))
                state.disagg_capabilities = render_capabilities(state.disagg_sessions, args)
            return
        if engine_client is None or base is None:
            return  # scale-out disabled
        serving = subclass_serving_tokens(base, DisaggServingTokens)
        serving.chat = getattr(state, "openai_serving_chat", None)
        serving.completion = getattr(state, "openai_serving_completion", None)
        serving.live_derender_requests = 0
        state.disagg_serving_tokens = serving
        state.disagg_capabilities = generate_capabilities(serving, args)


def make_plugin() -> DisaggEndpointPlugin:
    return DisaggEndpointPlugin()
