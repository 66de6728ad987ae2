"""Sidecars in front of the harness's real vLLM servers, one per decode path (session-scoped).

- ``inline_sidecar``: decode with Disagg's engine extension; chat uses ``output_mode=derender``
  (batch and streaming), completions ``text``;
- ``chained_sidecar``: the same decode engine configured as tokens-only, so every answer goes
  through the derender tier (batch, or per chunk with coalescing);
- ``stock_sidecar``: decode is the coupled server, a stock vLLM without the extension; the sidecar
  learns that from ``/disagg/v1/capabilities`` (404) and chains.

They depend on ``forcer`` so that its tokenizer (a minute of GIL-heavy loading) is loaded before
an in-process sidecar starts serving.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sidecar.support import RunningSidecar, run_sidecar, sidecar_config

TOKENS_ONLY = {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}


@pytest.fixture(scope="session")
def inline_sidecar(engine_set, forcer) -> Iterator[RunningSidecar]:
    with run_sidecar(sidecar_config(engine_set)) as sidecar:
        yield sidecar


@pytest.fixture(scope="session")
def chained_sidecar(engine_set, forcer) -> Iterator[RunningSidecar]:
    config = sidecar_config(engine_set, decode={"capabilities": TOKENS_ONLY})
    with run_sidecar(config) as sidecar:
        yield sidecar


@pytest.fixture(scope="session")
def stock_sidecar(engine_set, forcer) -> Iterator[RunningSidecar]:
    with run_sidecar(sidecar_config(engine_set, decode={"url": engine_set.url("coupled")})) as sidecar:
        yield sidecar


@pytest.fixture(params=["inline", "chained"])
def path_sidecar(request) -> RunningSidecar:
    return request.getfixturevalue(f"{request.param}_sidecar")


# The same three sidecars in front of each vLLM lane's set (``lane_set``), for the parity tests.
@pytest.fixture(scope="session")
def lane_inline_sidecar(lane_set, forcer) -> Iterator[RunningSidecar]:
    with run_sidecar(sidecar_config(lane_set)) as sidecar:
        yield sidecar


@pytest.fixture(scope="session")
def lane_chained_sidecar(lane_set, forcer) -> Iterator[RunningSidecar]:
    with run_sidecar(sidecar_config(lane_set, decode={"capabilities": TOKENS_ONLY})) as sidecar:
        yield sidecar


@pytest.fixture(scope="session")
def lane_stock_sidecar(lane_set, forcer) -> Iterator[RunningSidecar]:
    with run_sidecar(sidecar_config(lane_set, decode={"url": lane_set.url("coupled")})) as sidecar:
        yield sidecar


@pytest.fixture(params=["inline", "chained"])
def lane_path_sidecar(request) -> RunningSidecar:
    return request.getfixturevalue(f"lane_{request.param}_sidecar")
