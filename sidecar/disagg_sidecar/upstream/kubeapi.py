"""The few Kubernetes API calls the sidecar makes, on aiohttp (no client library: the sidecar stays light).

Credentials are the pod's projected ServiceAccount token + CA (in-cluster) or, for local runs and
tests, an explicit ``api: {url, token_file, ca_file}`` in the sidecar config.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from disagg_sidecar.config import KubernetesAPI

MAX_LINE_BYTES = 16 * 1024 * 1024  # one watch event; a slice holds at most 1000 endpoints


class APIError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"{status}: {body[:200]}")
        self.status, self.body = status, body


@dataclass(frozen=True)
class Access:
    base_url: str
    token_file: Path
    ca_file: Path | None


def resolve_access(api: KubernetesAPI, env: Mapping[str, str]) -> Access:
    """The API server's URL: configured, or the in-cluster one from the Service env variables."""
    url = api.url
    if url is None:
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ValueError("no API server: set prefill.discovery.api.url, or run in a pod "
                             "(KUBERNETES_SERVICE_HOST/PORT)")
        url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    return Access(url.rstrip("/"), Path(api.token_file), Path(api.ca_file) if api.ca_file else None)


def ssl_context(access: Access) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(access.ca_file) if access.ca_file else None)


def headers(access: Access) -> dict[str, str]:
    # Read per request: the kubelet rotates projected tokens in place.
    token = access.token_file.read_text().strip()
    return {"Authorization": f"Bearer {token}", "Accept": "application/json"}


async def get_json(session: aiohttp.ClientSession, access: Access, path: str,
                   timeout: aiohttp.ClientTimeout) -> dict[str, Any]:
    async with session.get(access.base_url + path, headers=headers(access), timeout=timeout,
                           allow_redirects=False) as resp:
        if resp.status != 200:
            raise APIError(resp.status, await resp.text())
        return await resp.json(content_type=None)


async def watch(session: aiohttp.ClientSession, access: Access, path: str,
                timeout: aiohttp.ClientTimeout) -> AsyncIterator[dict[str, Any]]:
    """The events of one watch request, until the server ends it."""
    async with session.get(access.base_url + path, headers=headers(access), timeout=timeout,
                           allow_redirects=False) as resp:
        if resp.status != 200:
            raise APIError(resp.status, await resp.text())
        async for line in _lines(resp.content):
            yield json.loads(line)


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    # Own splitting: StreamReader.readline caps lines at its buffer limit, and events can be larger.
    buffer = b""
    async for chunk in stream.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
        if len(buffer) > MAX_LINE_BYTES:
            raise ValueError(f"watch event larger than {MAX_LINE_BYTES} bytes")
    if buffer.strip():
        yield buffer
