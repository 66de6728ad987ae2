"""How a model's streams are derendered, decided from the spec (pure): ``status.derender.strategy``.

- ``inline``: decode runs the engine extension (``engine.extension``) and derenders its own stream;
- ``stock-inline``: a stock decode whose vLLM streams ``output_mode: derender`` itself from render's
  ``parse_context`` (0.34 on, the release table's ``stock_streaming_derender``): no derender-tier
  traffic; a request the stock stream cannot answer exactly is chained, as below;
- ``session``: a stock decode, and the render tier runs the engine extension
  (``engine.renderExtension``) on a vLLM whose render tier keeps a stream's parser state in a
  derender session (0.32, 0.33; ``engine_args.derender_sessions``): one call per stream, nothing replayed;
- ``stateless``: a stock decode and no sessions: every generate chunk goes to a ``/derender`` route
  (the render tier's, or decode's own without one) with the ``stream_state`` the sidecar carries.

The sidecar is told only what the render tier may offer (``derender_sessions``); it still asks
each render endpoint at run time (``GET /disagg/v1/capabilities``), so it never uses what is not served.
"""

from __future__ import annotations

import re
from typing import Literal

from disagg_sidecar import vllm_releases

from disagg_operator import engine_args
from disagg_operator.spec import DisaggregatedModelSpec

Strategy = Literal["inline", "stock-inline", "session", "stateless"]
# vLLM's own images, which have no disagg package: vLLM skips a plugin it cannot find without a
# word, so the operator does not ask for one there (models made before engine.renderExtension
# existed have the stock CPU image stored and keep working, stateless).
STOCK_IMAGE = re.compile(r"^(docker[.]io/)?vllm/vllm-openai(-cpu)?([:@].*)?$")


def render_extension(spec: DisaggregatedModelSpec, render_tier: bool) -> bool:
    """The render and derender pools run the engine extension."""
    return render_tier and spec.engine.render_extension and not STOCK_IMAGE.match(spec.engine.cpu_image)


def derender_sessions(spec: DisaggregatedModelSpec, render_tier: bool) -> bool:
    """The render tier offers derender sessions."""
    return render_extension(spec, render_tier) and engine_args.derender_sessions(spec.engine.vllm_version)


def strategy(spec: DisaggregatedModelSpec, render_tier: bool) -> Strategy:
    if spec.engine.extension:
        return "inline"
    if vllm_releases.release(spec.engine.vllm_version).stock_streaming_derender:
        return "stock-inline"
    return "session" if derender_sessions(spec, render_tier) else "stateless"
