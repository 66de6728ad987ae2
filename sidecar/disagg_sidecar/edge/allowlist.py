"""``x-prefiller-host-port``: which prefill endpoint a scheduler (llm-d's EPP) asks for.

The header names a host the sidecar would connect to, so it is an SSRF vector: it is honoured
only if it is exactly one ``host:port`` that is a current prefill endpoint. Everything is decided
here, before any leg is sent; a rejected header never causes a connection attempt.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from disagg_sidecar import wire
from disagg_sidecar.errors import SidecarError

# RFC 1123 labels; no scheme, path, userinfo, whitespace or list separators.
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOSTNAME = re.compile(rf"^{_LABEL}(\.{_LABEL})*\.?$")
_PORT = re.compile(r"^[0-9]{1,5}$")
_MAX_LEN = 261  # 253 (name) + ':' + 5 (port) + brackets


@dataclass(frozen=True)
class HostPort:
    host: str  # lower-case; IPv6 without brackets
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_host_port(value: str) -> HostPort | None:
    """``host:port`` or ``[v6]:port``; None when malformed."""
    if not value or len(value) > _MAX_LEN or value != value.strip():
        return None
    if value.startswith("["):
        close = value.find("]")
        if close < 0 or value[close + 1:close + 2] != ":":
            return None
        host, port = value[1:close], value[close + 2:]
        try:
            if ipaddress.ip_address(host).version != 6:
                return None
        except ValueError:
            return None
    else:
        host, sep, port = value.rpartition(":")
        if not sep or ":" in host:
            return None
        if not _HOSTNAME.match(host):
            return None
    if not _PORT.match(port) or not 1 <= int(port) <= 65535:
        return None
    return HostPort(host.lower().rstrip("."), int(port))


def url_host_port(url: str) -> HostPort:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    return HostPort(parts.hostname.lower().rstrip("."), parts.port)


def select_prefill(values: Sequence[str], endpoints: Iterable[str], pool_port: int | None = None) -> str | None:
    """The prefill URL the header names, None without a header; raises the 400/403 to answer.

    ``values`` are all occurrences of the header in the request. ``pool_port`` is the InferencePool's
    target port: an endpoint picker names every pod of the pool at that one port, while a prefill
    engine listens on its own, so a header at ``pool_port`` names the prefill endpoint on that host.
    """
    if not values:
        return None
    if len(values) > 1:
        raise SidecarError(400, f"{wire.PREFILLER_HOST_PORT} must appear once (got {len(values)})",
                           type_="BadRequestError", param=wire.PREFILLER_HOST_PORT)
    target = parse_host_port(values[0])
    if target is None:
        raise SidecarError(400, f"{wire.PREFILLER_HOST_PORT} must be exactly one host:port",
                           type_="BadRequestError", param=wire.PREFILLER_HOST_PORT)
    for url in endpoints:
        endpoint = url_host_port(url)
        if endpoint == target or (target.port == pool_port and endpoint.host == target.host):
            return url
    raise SidecarError(403, f"{wire.PREFILLER_HOST_PORT} {target} is not a prefill endpoint of this model",
                       type_="PermissionDeniedError", param=wire.PREFILLER_HOST_PORT)
