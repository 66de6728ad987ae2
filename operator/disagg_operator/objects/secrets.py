"""The engine API key Secret (``security.engineAPIKey``): written once, with a key made at creation.

The object built here has no data: the key is random, so it is added only when the Secret is
created (``with_new_key``), and an existing Secret is never rewritten (``kinds.Kind.create_only``).
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from disagg_operator import names
from disagg_operator.plan import Plan

KEY_BYTES = 32  # 256 bits


def engine_api_key_secrets(plan: Plan, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    if not plan.spec.security.engine_api_key.enabled:
        return []
    return [{
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": names.metadata(plan.name, plan.namespace, names.engine_api_key_secret(plan.name),
                                   names.SECURITY_COMPONENT, owner),
        "type": "Opaque",
    }]


def new_key() -> str:
    return secrets.token_urlsafe(KEY_BYTES)


def with_new_key(secret: dict[str, Any]) -> dict[str, Any]:
    """``secret`` holding a fresh random key (base64, as a Secret's ``data`` is)."""
    return {**secret, "data": {names.API_KEY_KEY: base64.b64encode(new_key().encode()).decode()}}
