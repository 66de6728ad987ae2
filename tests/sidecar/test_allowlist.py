"""``x-prefiller-host-port``: exactly one host:port that is a current prefill endpoint (pure)."""

from __future__ import annotations

import pytest

from disagg_sidecar.edge.allowlist import HostPort, parse_host_port, select_prefill
from disagg_sidecar.errors import SidecarError

ENDPOINTS = ("http://10.0.0.5:8200", "http://prefill-1.ns.svc:8200", "http://[fd00::7]:8200")


@pytest.mark.parametrize("value, expected", [
    ("10.0.0.5:8200", HostPort("10.0.0.5", 8200)),
    ("prefill-1.ns.svc:8200", HostPort("prefill-1.ns.svc", 8200)),
    ("PREFILL-1.NS.SVC.:8200", HostPort("prefill-1.ns.svc", 8200)),
    ("[fd00::7]:8200", HostPort("fd00::7", 8200)),
])
def test_valid(value: str, expected: HostPort) -> None:
    assert parse_host_port(value) == expected
    assert select_prefill([value], ENDPOINTS) is not None


@pytest.mark.parametrize("value", [
    "",  # empty
    "10.0.0.5",  # no port
    "10.0.0.5:",  # empty port
    ":8200",  # no host
    "10.0.0.5:0",  # port 0
    "10.0.0.5:65536",  # port out of range
    "10.0.0.5:82a0",  # port not a number
    "10.0.0.5:+8200",  # signed port
    "http://10.0.0.5:8200",  # a URL, not host:port
    "10.0.0.5:8200/v1",  # path
    "user@10.0.0.5:8200",  # userinfo
    "10.0.0.5:8200,10.0.0.6:8200",  # a list in one value
    "10.0.0.5:8200 10.0.0.6:8200",  # a list separated by space
    " 10.0.0.5:8200",  # leading whitespace
    "10.0.0.5:8200\r\nX-Evil: 1",  # header injection
    "fd00::7:8200",  # IPv6 without brackets
    "[fd00::7]8200",  # bracket without colon
    "[10.0.0.5]:8200",  # brackets around IPv4
    "[fd00::zz]:8200",  # invalid IPv6
    "-bad-.ns:8200",  # invalid label
    "a" * 64 + ".ns:8200",  # label too long
    "a.." + "b:8200",  # empty label
    "10.0.0.5:8200:8200",  # two ports
    "x" * 300,  # absurdly long
])
def test_malformed_is_400(value: str) -> None:
    assert parse_host_port(value) is None
    with pytest.raises(SidecarError) as err:
        select_prefill([value], ENDPOINTS)
    assert err.value.status == 400
    assert b'"code": 400' in err.value.body and b"x-prefiller-host-port" in err.value.body


@pytest.mark.parametrize("value", [
    "10.0.0.6:8200",  # another host
    "10.0.0.5:8201",  # the right host, another port
    "127.0.0.1:8200",  # loopback
    "169.254.169.254:80",  # cloud metadata
    "prefill-1.ns.svc.cluster.local:8200",  # same pod, different spelling: not what discovery said
    "[fd00::8]:8200",
    "localhost:8200",
])
def test_off_list_is_403(value: str) -> None:
    with pytest.raises(SidecarError) as err:
        select_prefill([value], ENDPOINTS)
    assert err.value.status == 403
    assert b"PermissionDeniedError" in err.value.body


def test_repeated_header_is_400() -> None:
    with pytest.raises(SidecarError) as err:
        select_prefill(["10.0.0.5:8200", "10.0.0.5:8200"], ENDPOINTS)
    assert err.value.status == 400


def test_no_header_means_no_choice() -> None:
    assert select_prefill([], ENDPOINTS) is None


def test_no_prefill_endpoints_rejects_every_target() -> None:
    with pytest.raises(SidecarError) as err:
        select_prefill(["10.0.0.5:8200"], ())
    assert err.value.status == 403


def test_selects_the_matching_url() -> None:
    assert select_prefill(["[FD00::7]:8200"], ENDPOINTS) == "http://[fd00::7]:8200"
    assert select_prefill(["prefill-1.ns.svc:8200"], ENDPOINTS) == "http://prefill-1.ns.svc:8200"


def test_an_inference_pool_port_names_the_prefill_engine_on_that_host() -> None:
    # llm-d's endpoint picker names every pod of an InferencePool at the pool's target port (the sidecar's).
    assert select_prefill(["10.0.0.5:8000"], ENDPOINTS, pool_port=8000) == "http://10.0.0.5:8200"
    assert select_prefill(["[fd00::7]:8000"], ENDPOINTS, pool_port=8000) == "http://[fd00::7]:8200"
    for value, pool_port in (("10.0.0.5:8000", None), ("10.0.0.5:8001", 8000), ("10.0.0.6:8000", 8000)):
        with pytest.raises(SidecarError) as err:
            select_prefill([value], ENDPOINTS, pool_port=pool_port)
        assert err.value.status == 403, value
