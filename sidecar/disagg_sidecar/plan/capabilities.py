"""What the sidecar may ask its decode engine for (pure): output modes, streaming output modes,
derender context forms, whether a parser is configured.

Three inputs decide it: the configuration (``decode.capabilities``, else derived from
``engine``), what the engine's vLLM does without Disagg's extension (``stock``: the configured
features, narrowed by the release the engine reports at ``GET /version``), and what the engine
serves on ``GET /disagg/v1/capabilities`` (probed by ``app``, kept in ``state``). The
configuration can only be narrowed by what the engine serves, so it can force the chained path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg_sidecar import vllm_releases, wire
from disagg_sidecar.config import Capabilities, Engine, SidecarConfig

_ALL = wire.OUTPUT_MODES
# Disagg's engine extension: every mode, batch and streaming, with either parser context.
EXTENSION = Capabilities(output_modes=_ALL, streaming_output_modes=_ALL,
                         derender_context_forms=("chat_request", "parse_context"), client_streams=wire.CLIENT_STREAM_APIS)
# Stock vLLM 0.33: batch derender on generate, with render's parse_context only; 0.34 streams it too.
STOCK_BATCH_DERENDER = Capabilities(output_modes=_ALL, derender_context_forms=("parse_context",))
STOCK_DERENDER = STOCK_BATCH_DERENDER.model_copy(update={"streaming_output_modes": _ALL})
# Fields of the engine's answer that are gauges, not capabilities (they change between probes).
_GAUGES = ("live_derender_requests",)


def stock(engine: Engine, release: vllm_releases.Release | None = None) -> Capabilities:
    """What the decode engine's vLLM does without the extension: what the configuration says of its
    version, and, once the engine reported its own (``release``), only what that release does."""
    f = engine.features
    batch = (f.generate_output_mode_derender and f.render_parse_context
             and (release is None or release.stock_batch_derender and release.render_parse_context))
    if not batch:
        return Capabilities()
    streaming = f.generate_streaming_derender and (release is None or release.stock_streaming_derender)
    return STOCK_DERENDER if streaming else STOCK_BATCH_DERENDER


def configured(config: SidecarConfig) -> Capabilities:
    """The configuration's capabilities: given, or the extension's, or stock vLLM's."""
    if config.decode.capabilities is not None:
        return config.decode.capabilities
    return EXTENSION if config.engine.extension else stock(config.engine)


def served(answer: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
    """The probe's answer without its gauges (so that only a change of capabilities is news)."""
    if isinstance(answer, dict):
        return {k: v for k, v in answer.items() if k not in _GAUGES}
    return answer


def effective(configured: Capabilities, served: Mapping[str, Any] | str | None,
              stock: Capabilities = Capabilities()) -> Capabilities:
    """What the sidecar may ask the decode engine for: configuration narrowed by what it serves.

    ``served`` is the engine's ``/disagg/v1/capabilities`` answer, "absent" when the engine has
    no extension (then only what stock vLLM of that version does, ``stock``), or None when it
    could not be asked yet.
    """
    if served is None:
        return configured
    if served == "absent":
        served = {"output_modes": list(stock.output_modes), "streaming_output_modes": list(stock.streaming_output_modes),
                  "derender_context_forms": list(stock.derender_context_forms)}
    assert isinstance(served, Mapping)

    def narrow(key: str) -> tuple:
        offered = served.get(key)
        mine = getattr(configured, key)
        return mine if not isinstance(offered, list) else tuple(m for m in mine if m in offered)

    parser = served.get("parser_configured")
    return configured.model_copy(update={
        "output_modes": narrow("output_modes"),
        "streaming_output_modes": narrow("streaming_output_modes"),
        "derender_context_forms": narrow("derender_context_forms"),
        "parser_configured": parser if isinstance(parser, bool) else configured.parser_configured,
        "client_streams": tuple(api for api in configured.client_streams if api in served_client_streams(served)),
    })


def served_client_streams(served: Mapping[str, Any]) -> tuple[str, ...]:
    """The APIs whose client chunks the engine says it writes: a list of them, or ``true``, which
    the first extension to write any said for chat's alone."""
    offered = served.get("client_streams")
    if offered is True:
        return ("chat",)
    return tuple(a for a in offered if isinstance(a, str)) if isinstance(offered, list) else ()


def current(config: SidecarConfig, served: Mapping[str, Any] | str | None,
            release: vllm_releases.Release | None = None) -> Capabilities:
    """The capabilities for the next request, from the configuration and the last probe's answers
    (ignored unless ``decode.probe_capabilities``; ``release``: the engine's reported one)."""
    probed = config.decode.probe_capabilities
    return effective(configured(config), served if probed else None, stock(config.engine, release if probed else None))
