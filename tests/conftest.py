"""Shared pytest wiring: session-scoped real servers live in tests/harness/."""
pytest_plugins = [
    "tests.harness.cluster",
    "tests.harness.engine",
    "tests.harness.prometheus",
]
