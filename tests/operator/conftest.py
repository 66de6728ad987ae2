"""Fixtures for the operator's cluster tests: the CRD installed, a running `disagg operator`, a namespace.

Only tests marked ``cluster`` use them; the unit tests here need nothing but Python.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.operator import OperatorProcess

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "disagg.dev_disaggregatedmodels.yaml"


@pytest.fixture(scope="session")
def crd_installed(cluster):  # type: ignore[no-untyped-def]
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.wait_established("disaggregatedmodels.disagg.dev")
    return CRD


@pytest.fixture(scope="module")
def operator(cluster, crd_installed, tmp_path_factory) -> Iterator[OperatorProcess]:  # type: ignore[no-untyped-def]
    yield from running_operator(cluster, tmp_path_factory)


def running_operator(cluster, tmp_path_factory, args: list[str] | None = None) -> Iterator[OperatorProcess]:  # type: ignore[no-untyped-def]
    """A started operator, alive, stopped when the generator is closed (for module fixtures)."""
    process = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator"), args=args or [])
    process.start()
    try:
        cluster.wait_for(process.alive, "the operator's liveness endpoint", timeout=60)
        yield process
    finally:
        process.stop()


@pytest.fixture
def ns(cluster, request: pytest.FixtureRequest) -> Iterator[str]:  # type: ignore[no-untyped-def]
    name = cluster.create_namespace(re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:30].strip("-"))
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
