"""Fixtures for the control-plane tests: a fresh namespace per test."""
from collections.abc import Iterator

import pytest

from tests.harness.cluster import Cluster


@pytest.fixture
def ns(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = cluster.create_namespace(request.node.name.replace("_", "-"))
    yield name
    # The namespace controller finishes the deletion in the background.
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
