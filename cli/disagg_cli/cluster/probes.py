"""Health probes and kubectl calls against a running cluster."""

from __future__ import annotations

import ssl
import subprocess
import urllib.error
import urllib.request

from disagg_cli.cluster.layout import NODES, Cluster


def http_ok(url: str, timeout: float = 2.0, context: ssl.SSLContext | None = None) -> str | None:
    """The body of a 2xx answer, else None."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            return r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def insecure() -> ssl.SSLContext:
    """For /healthz of KCM and the scheduler: self-signed serving certificates."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def api(c: Cluster, path: str, timeout: float = 5.0) -> str | None:
    """GET on the apiserver as the admin (its CA verified, the admin's client certificate)."""
    try:
        ctx = ssl.create_default_context(cafile=str(c.pki / "ca.crt"))
        ctx.load_cert_chain(str(c.pki / "admin.crt"), str(c.pki / "admin.key"))
    except (OSError, ssl.SSLError):
        return None
    return http_ok(f"https://127.0.0.1:{c.ports.api}{path}", timeout, ctx)


def readyz(c: Cluster) -> bool:
    return api(c, "/readyz") == "ok"


def kubectl(c: Cluster, *args: str, input: str | None = None, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    """kubectl as the admin; output captured unless ``stdout``/``stderr`` say otherwise (None: ours)."""
    return subprocess.run([c.exe("kubectl"), f"--kubeconfig={c.kubeconfig}", *args], text=True, input=input,
                          stdin=None if input is not None else subprocess.DEVNULL, stdout=stdout, stderr=stderr)


def nodes_ready(c: Cluster) -> bool:
    ready = '{.status.conditions[?(@.type=="Ready")].status}'
    return all(kubectl(c, "get", "node", n, "-o", f"jsonpath={ready}").stdout == "True" for n in NODES)
