"""Sidecars in front of the harness's real vLLM servers, one per decode path (session-scoped);
``lane_*`` ones once per vLLM lane (``lane_set``), ``inline_sidecar`` and ``chained_sidecar`` on
the main set only.

- ``inline``: decode with Disagg's engine extension; chat uses ``output_mode=derender``
  (batch and streaming), completions ``text``;
- ``chained``: the same decode engine configured as tokens-only, so every answer goes
  through the derender tier (batch, or per chunk with coalescing);
- ``stock``: decode is the coupled server, a stock vLLM without the extension; the sidecar
  learns that from ``/disagg/v1/capabilities`` (404) and chains (on vLLM 0.33 a batch answer is
  the stock engine's own derender).

They depend on ``forcer`` so that its tokenizer (a minute of GIL-heavy loading) is loaded before
an in-process sidecar starts serving.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sidecar.support import CLIENT_MAX_LOGPROBS, RunningSidecar, run_sidecar, sidecar_config

TOKENS_ONLY = {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}
# The operator's default prefill selection (router.prefillSelection): the parity sidecars run it.
DEPLOYED_SELECTION = {"prefill": {"selection": "prefix-affinity"}}


def chained_config(sset, **overrides) -> dict:
    """Decode configured as tokens-only: every answer is made by the derender tier."""
    return sidecar_config(sset, decode={"capabilities": TOKENS_ONLY}, **overrides)


@pytest.fixture(scope="session")
def inline_sidecar(engine_set, forcer) -> Iterator[RunningSidecar]:
    with run_sidecar(sidecar_config(engine_set)) as sidecar:
        yield sidecar


@pytest.fixture(scope="session")
def chained_sidecar(engine_set, forcer) -> Iterator[RunningSidecar]:
    with run_sidecar(chained_config(engine_set)) as sidecar:
        yield sidecar


# One sidecar per decode path in front of each vLLM lane's set (``lane_set``): the parity tests.
@pytest.fixture(scope="session")
def lane_inline_sidecar(lane_set, forcer) -> Iterator[RunningSidecar]:
    with run_sidecar(sidecar_config(lane_set, **DEPLOYED_SELECTION)) as sidecar:
        yield sidecar


@pytest.fixture(scope="session")
def lane_chained_sidecar(lane_set, forcer) -> Iterator[RunningSidecar]:
    with run_sidecar(chained_config(lane_set, **DEPLOYED_SELECTION)) as sidecar:
        yield sidecar


@pytest.fixture(scope="session")
def lane_stock_sidecar(lane_set, forcer) -> Iterator[RunningSidecar]:
    # The coupled server as a stock decode engine: vLLM's default --max-logprobs.
    config = sidecar_config(lane_set, decode={"url": lane_set.url("coupled")}, engine={"max_logprobs": CLIENT_MAX_LOGPROBS},
                            **DEPLOYED_SELECTION)
    with run_sidecar(config) as sidecar:
        yield sidecar


@pytest.fixture(params=["inline", "chained"])
def lane_path_sidecar(request) -> RunningSidecar:
    return request.getfixturevalue(f"lane_{request.param}_sidecar")
