"""The operator's cluster fixtures (a running ``disagg operator``, a fresh namespace) for the scale test."""

from tests.operator.conftest import crd_installed, ns, operator  # noqa: F401  (fixtures)
