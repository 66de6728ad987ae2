"""How the operator reads the API server's refusals (``disagg_operator.apply``): the Status body's
message and causes, whatever the body is."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from disagg_operator.apply import _error


def refusal(status: int, body: str | bytes | None) -> ApiException:
    exc = ApiException(status=status, reason="Forbidden")
    exc.body = body
    return exc


def status_body(message: str, *causes: str) -> str:
    return json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                       "reason": "Forbidden", "code": 403,
                       "details": {"name": "x", "kind": "deployments",
                                   "causes": [{"reason": c, "message": f"{c} message"} for c in causes]}})


def test_a_creation_in_a_namespace_being_deleted() -> None:
    error = _error(refusal(403, status_body("unable to create new content in namespace n", "NamespaceTerminating")),
                   "apply Deployment n/x")
    assert error.namespace_terminating and error.permanent and error.status == 403
    assert str(error) == "apply Deployment n/x: 403 unable to create new content in namespace n"


@pytest.mark.parametrize("body", [
    status_body('deployments.apps "x" is forbidden: User "u" cannot patch resource'),  # RBAC: no causes
    status_body("refused", "FieldValueInvalid"),
    b"not json", None, "[1, 2]", json.dumps({"details": "not an object", "message": "refused"}),
    json.dumps({"details": {"causes": ["not an object", {"message": "no reason"}]}}),
])
def test_any_other_refusal_is_not_one(body: str | bytes | None) -> None:
    error = _error(refusal(403, body), "apply Deployment n/x")
    assert not error.namespace_terminating and error.status == 403
    assert str(error).startswith("apply Deployment n/x: 403 ")
