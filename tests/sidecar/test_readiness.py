"""Readiness from the tiers' probes (pure): which outages make the sidecar unready."""

from __future__ import annotations

import pytest

from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.state import SidecarState

PREFILL = {"mode": "remote", "discovery": {"kind": "static", "urls": ["http://10.0.0.5:8200"]}}


def state(policy: str) -> SidecarState:
    config = SidecarConfig.model_validate({"decode": {"url": "http://127.0.0.1:8200"}, "kv_connector": "NixlConnector",
                                           "prefill": {**PREFILL, "failure_policy": policy}})
    s = SidecarState(config)
    for tier in s.tiers():
        s.record_probe(tier, True)
    return s


@pytest.mark.parametrize("policy, ready", [("fallback", True), ("fail", False)])
def test_a_dead_prefill_pool_degrades_only_when_decode_can_prefill(policy: str, ready: bool) -> None:
    s = state(policy)
    assert "prefill" in s.tiers() and s.not_ready() == [] and s.degraded() == []
    s.record_probe("prefill", False, refused=True)
    assert (s.not_ready() == []) is ready
    assert s.degraded() == (["prefill unreachable"] if ready else [])
    assert s.not_ready() == ([] if ready else ["prefill unreachable"])


def test_a_dead_decode_engine_is_unready_under_either_policy() -> None:
    for policy in ("fallback", "fail"):
        s = state(policy)
        s.record_probe("decode", False, refused=True)
        assert s.not_ready() == ["decode unreachable"]
