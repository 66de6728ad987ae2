"""HTTPS to the engines: the CA the upstream session verifies them with, and the one name every
engine certificate is checked against (``tls.server_name``, docs/security.md).

Prefill pods are dialled by the IP addresses their EndpointSlices list and decode on 127.0.0.1, so
the dialled host is not a name a certificate can carry. asyncio hands the dialled host to
``SSLContext.wrap_bio``; ``_OneName`` replaces it there with the configured name, for every
connection of the session, so no call site has to pass it.
"""

from __future__ import annotations

import ssl
from typing import Any

from disagg_sidecar.config import SidecarConfig


class _OneName(ssl.SSLContext):
    server_name: str

    def wrap_bio(self, incoming: Any, outgoing: Any, server_side: bool = False, server_hostname: str | None = None,
                 session: Any = None) -> ssl.SSLObject:
        return super().wrap_bio(incoming, outgoing, server_side, self.server_name, session)


def client_context(config: SidecarConfig) -> ssl.SSLContext | None:
    """The upstream session's context; None without ``tls`` (plain HTTP, or https with system CAs)."""
    tls = config.tls
    if tls is None:
        return None
    context = _OneName(ssl.PROTOCOL_TLS_CLIENT) if tls.server_name else ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if tls.server_name:
        context.server_name = tls.server_name
    context.load_verify_locations(cafile=tls.ca_file)  # PROTOCOL_TLS_CLIENT: verifies chain and name
    return context
